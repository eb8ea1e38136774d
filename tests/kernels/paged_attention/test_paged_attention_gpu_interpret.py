"""The Mosaic GPU decode kernel (``pallas_kernels/paged_attention/kernel_gpu.py``) run in the
Mosaic GPU interpreter on the CPU against the f64 dense reference: tiny cases over page sizes,
GQA ratios, splits and their merges, the longest-first orders, ``fixed_max``, whole output
blocks and the tcgen05 products, with NaN-poisoned free pages, permuted tables and the race
detector on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decode_gpu_cases import RACE_CHECKED, assert_no_races, page_case, run_case
from _paged_inputs import dense_attention, make_paged_kv
from _tolerances import assert_close
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import _gpu_bodies, _gpu_config, _gpu_order, kernel_gpu

# Cases ``make test`` (CPU CI) leaves out and ``make test-all`` runs (``tests/conftest.py``
# marks them slow by these ids): boundaries that other cases repeat. Every default path keeps
# cases in CI; the GPU suite runs every case.
SLOW_CASES = {
    # tcgen05's staging ring of small pages (the slowest to interpret; CI runs the other
    # tcgen05 cases, per-thread copies of small pages among them)
    "test_interpret_tcgen05[2-{'lengths': [130, 0, 77], 'G': 4, 'page_copy': 'tma'}]",
    *(
        f"test_interpret_tcgen05[{case}]"
        for case in (
            "16-{'lengths': [5, 700, 0, 129, 300, 1, 900, 64], 'longest_first': True, "
            "'order_method': 'kernel'}",
            "64-{'lengths': [1000, 3, 513, 129], 'num_splits': 4, 'min_split_tiles': 2}",
        )
    ),
    # fixed_max's other cases (CI runs the sharp-logit spike, f16, the exact 64-row spike)
    *(
        f"test_interpret_fixed_max[{i}]"
        for i in (
            "64-rows-split2", "window-cap-split3", "negative-scale-st1", "spike-64-rows-split2",
            "exact",
        )
    ),
    # The floor's other cases (CI runs M2-window-cap-mosaic; floor 1 is every split's default)
    *(
        f"test_interpret_min_split_tiles[{i}]"
        for i in ("M1-mosaic", "M2-window-cap-xla", "M4-bad-ids-mosaic", "M8-layer-xla")
    ),
    "test_interpret_small_pages_match_reference[C2-split2-64-rows]",
    # Repeats of paths other default cases take: the 64-row tile's f32 split partials
    # (fixed_max[exact-64-rows-split2-spike]), the negative scale (swap_ab's
    # C32-G4-negative-scale-window), swap_ab with 2 splits and the merge kernel
    # (swap_ab[C32-G1-split2]), G=16 with splits (swap_ab[C16-G16] and splits of
    # every G), small pages with splits, cap and window (split_merge[xla-C4-G2-split2], cap and
    # window at C=8: swap_ab[C8-G4-split3-cap-window]), the XLA merge of 18 splits (the XLA
    # merge's other cases), the floor of 8 tiles (the floor of 2 stays)
    "test_interpret_matches_reference[C16-split2-64-rows]",
    "test_interpret_matches_reference[C16-T64-split2-negative-scale]",
    "test_interpret_swap_ab_matches_reference[C16-G2-split2]",
    "test_interpret_swap_ab_matches_reference[C16-G16-split2]",
    "test_interpret_small_pages_match_reference[C4-split3-cap-window]",
    "test_interpret_split_merge_matches_reference[xla-C16-G1-split18-layer]",
    "test_interpret_min_split_tiles[M8-layer-mosaic]",
    "test_kernel_order_is_the_sorted_order[12-128]",
    "test_kernel_order_is_the_sorted_order[128-64]",
    "test_interpret_kernel_order_window_splits",
    # Repeats that keep `make test` within its time (each property stays in CI by the case
    # named): bad ids with the 64-row tile (C16-T128-bad-ids; the 64-row tile without splits:
    # C16-T64-st1-64-rows); longest first with splits (split_merge[xla-C16-G3-split3],
    # swap_ab[C32-G1-split2]); cap and window with 3 splits at C=8
    # (swap_ab[C8-G4-split3-cap-window]); one stage with splits and bad ids (C16-T64-st1-64-rows,
    # swap_ab[C16-G8-st1], C16-T128-bad-ids)
    "test_interpret_matches_reference[C16-T128-bad-ids-64-rows]",
    "test_interpret_matches_reference[C16-split2-longest-first]",
    "test_interpret_matches_reference[C8-T64-split3-cap-window]",
    "test_interpret_matches_reference[C8-T64-st1-split2-bad-ids]",
    # G=3's 16 columns, longest first (split_merge[xla-C16-G3-split3]: the same lengths, G and
    # order, with splits)
    "test_interpret_swap_ab_matches_reference[C16-G3-longest]",
    # Each merge's 2 splits, and XLA's of 5 with cap and window (the XLA merge:
    # xla-C16-G3-split3, xla-C4-G2-split2, whose short sequences leave splits empty; the merge
    # kernel: mosaic-C16-G3-K1-B1, -C16-G2-split3-out-blocks, -C16-G3-split40 and the default
    # merge of swap_ab[C32-G1-split2] and swap_ab[C8-G4-split3-cap-window]); 18 splits of a 5-D
    # pool (rounds: mosaic-C16-G3-split40; a 5-D pool: matches_reference[C128-T128-split2-
    # layer]); G=8 merged by the kernel (G=8: swap_ab[C16-G8-st1]; its merge lowered:
    # test_paged_attention_gpu_lowering's num_splits3-split_mergemosaic-N64-K8)
    "test_interpret_split_merge_matches_reference[xla-C16-G2-split2]",
    "test_interpret_split_merge_matches_reference[xla-C8-G4-split5-cap-window]",
    "test_interpret_split_merge_matches_reference[mosaic-C16-G2-split2]",
    "test_interpret_split_merge_matches_reference[mosaic-C16-G1-split18-layer]",
    "test_interpret_split_merge_matches_reference[mosaic-C16-G8-split3]",
    # Each order method is taken by other cases: "rank" by default at 6 sequences
    # (small_pages[C2-st1-longest-split2]), "kernel" at 4 (swap_ab[C32-G1-split2],
    # split_merge[xla-C16-G3-split3]), "sort" of plain indices (plain_order_indices); the packed
    # keys "sort" gives are kernel_order_is_the_sorted_order's reference, and the kernel reads
    # them as it reads rank's
    "test_interpret_order_methods[sort]",
    "test_interpret_order_methods[rank]",
    "test_interpret_order_methods[kernel]",
    # Floors 1 and 4 under the XLA merge (floor 1 is every split case's default; a floor above
    # 1 stays: min_split_tiles[M2-window-cap-mosaic]; the XLA merge of empty splits:
    # split_merge[xla-C4-G2-split2])
    "test_interpret_min_split_tiles[M1-xla]",
    "test_interpret_min_split_tiles[M4-bad-ids-xla]",
    # fixed_max[swap] is bf16's default path (every bf16 swap_ab case); the check that the
    # spike case needs the redo (fixed_max[spike] itself stays)
    "test_interpret_fixed_max[swap]",
    "test_interpret_fixed_max_redo_is_needed",
    # Whole output blocks with splits (split_merge[mosaic-C16-G2-split3-out-blocks]), window
    # and cap, a floor of tiles (out_blocks[16-...G: 4] without, min_split_tiles[M2-window-cap-
    # mosaic]), under tcgen05 (tcgen05's cases; its whole blocks lowered:
    # test_paged_attention_gpu_lowering's tcgen05 H256-...-out_blocksTrue)
    "test_interpret_out_blocks[32-{'lengths': [5, 200, 0, 127, 513], 'G': 3, 'num_splits': 3, "
    "'races': True}]",
    "test_interpret_out_blocks[8-{'lengths': [260, 3, 77], 'G': 6, 'H': 64, 'window': 100, "
    "'soft_cap': 20.0}]",
    "test_interpret_out_blocks[16-{'lengths': [1000, 3, 513, 129], 'G': 4, 'num_splits': 4, "
    "'min_split_tiles': 2}]",
    "test_interpret_out_blocks[64-{'lengths': [260, 3, 513, 64], 'G': 4, 'mma': 'tcgen05', "
    "'num_splits': 2}]",
    # tcgen05 with window, cap and 3 splits (tcgen05 splits: [32-...G: 8...] and [32-...H: 256];
    # window and cap: the wgmma cases), at f16 (f16: fixed_max[f16-spike]; the running max
    # under tcgen05: [256-...'fixed_max': False...])
    "test_interpret_tcgen05[64-{'lengths': [260, 3, 513, 64], 'G': 2, 'window': 100, "
    "'soft_cap': 20.0, 'num_splits': 3}]",
    "test_interpret_tcgen05[16-{'lengths': [300, 40, 129], 'G': 6, 'dtype': 'float16'}]",
    # tcgen05's splits at G=8 with the race detector and its redo of a sharp unit (tcgen05's
    # splits: [32-...'H': 256...]; the redo: fixed_max[spike] under wgmma)
    "test_interpret_tcgen05[32-{'lengths': [5, 200, 0, 127, 513], 'G': 8, 'num_splits': 2, "
    "'races': True}]",
    "test_interpret_tcgen05[128-{'lengths': [300, 40, 1000], 'G': 4, 'q_scale': 100.0}]",
    # The merge kernel's 5 splits under cap and window (3 splits under both, merged by the
    # kernel by default: swap_ab[C8-G4-split3-cap-window]); the in-kernel order's two keys a
    # thread (lowered: test_paged_attention_gpu_lowering's B132-longest_firstTrue)
    "test_interpret_split_merge_matches_reference[mosaic-C8-G4-split5-cap-window]",
    "test_kernel_order_is_the_sorted_order[132-64]",
    # One-token pages (64 one-row copies a tile; the largest program to interpret here): pages
    # below 8 tokens copied by every thread into the ring stay in CI at 2 tokens
    # (small_pages[C2-st1-longest-split2]), one-token pages' device code in the lowering
    # (test_paged_attention_gpu_lowering's C1-W128), out-of-range table entries at 16 tokens
    # (matches_reference[C16-T128-bad-ids])
    "test_interpret_small_pages_match_reference[C1-bad-ids]",
}  # fmt: skip


@pytest.mark.parametrize(
    "C,splits,extra",
    [
        (16, 1, {"out_of_range_tail": True}),  # unused table slots: ids < 0 or >= P
        (16, 1, {"out_of_range_tail": True, "swap_ab": False}),  # 64 query rows without splits
        (16, 2, {"longest_first": True}),  # the (sequence, split, head) grid, permuted
        (16, 2, {"swap_ab": False}),  # 64 query rows with splits: f32 partials
        (8, 3, {"soft_cap": 20.0, "window": 37, "block_kv": 64}),
        (128, 2, {"num_layers": 2, "layer": jnp.int32(1)}),
        # one-stage rings (every tile a refill), 64-row tile and swap_ab
        (16, 1, {"block_kv": 64, "num_stages": 1, "swap_ab": False}),
        (8, 2, {"block_kv": 64, "num_stages": 1, "out_of_range_tail": True}),
        # A negative scale keeps the scale out of exp2 (max(s) * scale != max(s * scale))
        (16, 2, {"sm_scale": -0.2, "block_kv": 64}),
    ],
    ids=[
        "C16-T128-bad-ids",
        "C16-T128-bad-ids-64-rows",
        "C16-split2-longest-first",
        "C16-split2-64-rows",
        "C8-T64-split3-cap-window",
        "C128-T128-split2-layer",
        "C16-T64-st1-64-rows",
        "C8-T64-st1-split2-bad-ids",
        "C16-T64-split2-negative-scale",
    ],
)
def test_interpret_matches_reference(C, splits, extra):
    rng = np.random.default_rng(C)
    lengths = [0, 1, C - 1, C, C + 1, 150]
    run_case(rng, lengths, K=2, G=2, H=64, C=C, interpret=RACE_CHECKED, num_splits=splits, **extra)


@pytest.mark.parametrize(
    "C,G,lengths,extra",
    [
        (16, 2, [0, 1, 15, 16, 17, 150], dict()),
        (16, 2, [0, 1, 15, 16, 17, 150, 300], dict(num_splits=2, block_kv=64)),
        (8, 4, [0, 1, 9, 150, 300], dict(num_splits=3, soft_cap=20.0, window=100, block_kv=64)),
        (16, 3, [5, 200, 0, 64], dict(longest_first=True)),  # G=3: 16 query columns
        (32, 1, [0, 33, 400, 7], dict(num_splits=2, longest_first=True, out_of_range_tail=True)),
        (16, 8, [130, 0, 64, 1], dict(block_kv=64, num_stages=1)),
        (16, 16, [0, 1, 17, 300], dict(num_splits=1)),  # G=16: 16 query columns
        (16, 16, [0, 1, 17, 300], dict(num_splits=2)),
        (32, 4, [0, 33, 400], dict(num_splits=1, sm_scale=-0.2, window=100)),
    ],
    ids=[
        "C16-G2",
        "C16-G2-split2",
        "C8-G4-split3-cap-window",
        "C16-G3-longest",
        "C32-G1-split2",
        "C16-G8-st1",
        "C16-G16",
        "C16-G16-split2",
        "C32-G4-negative-scale-window",
    ],
)
def test_interpret_swap_ab_matches_reference(C, G, lengths, extra):
    # Scores as K Q^T: the queries are a wgmma N of 8 or 16 columns, P^T and O^T are stored
    # through transposed views (split partials in q.dtype; their lse per (sequence, KV head)
    # slot, gathered by the merge).
    rng = np.random.default_rng(80 + C + G)
    run_case(rng, lengths, K=2, G=G, H=64, C=C, interpret=RACE_CHECKED, swap_ab=True, **extra)


@pytest.mark.parametrize(
    "C,extra",
    [
        (1, dict(out_of_range_tail=True)),  # one-row copies; unused table slots out of range
        (2, dict(num_splits=2, swap_ab=False)),  # the 64-row tile, f32 partials
        (4, dict(num_splits=3, soft_cap=20.0, window=37)),
        (2, dict(num_stages=1, longest_first=True, num_splits=2)),
    ],
    ids=["C1-bad-ids", "C2-split2-64-rows", "C4-split3-cap-window", "C2-st1-longest-split2"],
)
def test_interpret_small_pages_match_reference(C, extra):
    # Pages below 8 tokens: each page's copy lands in the untiled staging ring (a TMA copy into
    # the (8, 64)-tiled ring must start on an 8-row boundary) and each tile is re-laid into the
    # tiled wgmma tiles before it is read; lengths 0, 1, C-1, C, C+1 and 150 (3 tiles of 64).
    rng = np.random.default_rng(90 + C)
    lengths = [0, 1, max(C - 1, 0), C, C + 1, 150]
    run_case(
        rng, lengths, K=2, G=2, H=64, C=C, interpret=RACE_CHECKED, block_kv=64, **extra
    )  # fmt: skip


_XLA, _MM, _BOTH = ("xla",), ("mosaic",), ("xla", "mosaic")
_MERGE_CASES = [  # (id, C, G, lengths, options, merges)
    ("C16-G2-split2", 16, 2, [0, 1, 15, 16, 17, 150], dict(num_splits=2), _BOTH),
    # Splits past a sequence's end (no tile: lse -inf, zero partials), soft cap and window.
    ("C8-G4-split5-cap-window", 8, 4, [0, 1, 9, 150, 300],
     dict(num_splits=5, soft_cap=20.0, window=100), _BOTH),
    # 18 splits in a 5-D pool.
    ("C16-G1-split18-layer", 16, 1, [1200, 0, 65],
     dict(num_splits=18, num_layers=2, layer=jnp.int32(1)), _BOTH),
    ("C16-G3-split3", 16, 3, [5, 200, 0, 64], dict(num_splits=3, longest_first=True), _XLA),
    ("C4-G2-split2", 4, 2, [0, 3, 5, 150], dict(num_splits=2), _XLA),  # staging ring
    ("C16-G8-split3", 16, 8, [300, 0, 17, 150], dict(num_splits=3), _MM),  # G fills 8 columns
    ("C16-G2-split3-out-blocks", 16, 2, [5, 200, 0, 64],
     dict(num_splits=3, out_blocks=True), _MM),  # whole-block partials
    # G=3 at head dim 64 (16 query columns): a fourth row loaded (whole 128-element rows), 40
    # splits in rounds of 32 and 8
    ("C16-G3-split40", 16, 3, [2600, 1, 700], dict(num_splits=40), _MM),
    # One sequence, one KV head, G=3: fewer partial rows (3) than a piece loads (4)
    ("C16-G3-K1-B1", 16, 3, [700], dict(num_splits=4, K=1), _MM),
]  # fmt: skip


@pytest.mark.parametrize(
    "merge,C,G,lengths,extra",
    [
        pytest.param(m, C, G, lengths, extra, id=f"{m}-{name}")
        for name, C, G, lengths, extra, merges in _MERGE_CASES
        for m in merges
    ],
)
def test_interpret_split_merge_matches_reference(merge, C, G, lengths, extra):
    # "mosaic" (the default at 2-32): a second Mosaic GPU kernel merges every pair's partials,
    # one CTA a pair; both kernels race-checked. "xla": the epilogue.
    rng = np.random.default_rng((70 if merge == "xla" else 170) + C + G)
    extra = dict(extra)
    K = extra.pop("K", 2)
    run_case(
        rng, lengths, K=K, G=G, H=64, C=C, interpret=RACE_CHECKED, swap_ab=True,
        split_merge=merge, block_kv=64, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("order_method", _gpu_order.ORDER_METHODS)
def test_interpret_order_methods(order_method):
    # Every way of computing the longest-first order gives the same schedule and output
    # (8 sequences: the in-kernel count takes multiples of 4).
    rng = np.random.default_rng(71)
    run_case(rng, [5, 200, 0, 64, 130, 17, 64, 3], K=2, G=2, H=64, C=16, interpret=RACE_CHECKED,
              longest_first=True, order_method=order_method)  # fmt: skip


@pytest.mark.parametrize("merge", ["xla", "mosaic"])
@pytest.mark.parametrize(
    "min_tiles,extra",
    [
        (1, {}),  # every split reads
        (2, {"window": 300, "soft_cap": 20.0}),  # the window's tiles are what is split
        (4, {"out_of_range_tail": True}),
        (8, {"num_layers": 2, "layer": jnp.int32(1)}),
    ],
    ids=["M1", "M2-window-cap", "M4-bad-ids", "M8-layer"],
)
def test_interpret_min_split_tiles(min_tiles, extra, merge):
    # 4 splits of 64-token tiles; a sequence of t tiles is read by clip(t // M, 1, 4) equal
    # splits: 0, 1, 15-17 tokens (one tile: alone, written straight out), 150 (3 tiles), 700
    # (11), 579 (10: the last of 4 equal splits of 3 is empty at M <= 2).
    rng = np.random.default_rng(min_tiles + 31)
    lengths = [0, 1, 15, 16, 17, 150, 700, 64 * 9 + 3]
    run_case(rng, lengths, K=2, G=2, H=64, C=16, interpret=RACE_CHECKED, num_splits=4,
              block_kv=64, min_split_tiles=min_tiles, split_merge=merge, **extra)  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        dict(),  # swap_ab: the first tile's max, no reduction across warps after it
        dict(swap_ab=False, num_splits=2),  # the 64-row tile, split (lse from the reference)
        dict(window=200, soft_cap=20.0, num_splits=3),  # the window's first tile
        dict(sm_scale=-0.2, num_stages=1),  # the scale applied per score
        # Logits 100x sharper: later tiles' scores rise far past the first tile's max, the
        # probabilities overflow, and those units are read again with the running max.
        dict(q_scale=100.0),
        dict(q_scale=100.0, swap_ab=False, num_splits=2),
        dict(q_scale=3.0, dtype=jnp.float16),  # f16 P: 15 doublings of headroom
        # The running max (f16's default)
        dict(fixed_max=False),
        dict(fixed_max=False, swap_ab=False, num_splits=2, q_scale=100.0),
    ],
    ids=[
        "swap",
        "64-rows-split2",
        "window-cap-split3",
        "negative-scale-st1",
        "spike",
        "spike-64-rows-split2",
        "f16-spike",
        "exact",
        "exact-64-rows-split2-spike",
    ],
)
def test_interpret_fixed_max(extra):
    rng = np.random.default_rng(100 + len(extra))
    extra = {"fixed_max": True, **extra}
    run_case(rng, [0, 1, 15, 16, 17, 63, 64, 65, 640, 300], K=2, G=2, H=64, C=16, block_kv=64,
              interpret=RACE_CHECKED, **extra)  # fmt: skip


def test_interpret_fixed_max_redo_is_needed(monkeypatch):
    # The spike case's logits overflow against the first tile's max: without the check and
    # the exact second pass the output is wrong (so the case above exercises the redo).
    from pallas_kernels.paged_attention import _gpu_tile

    monkeypatch.setattr(_gpu_tile, "_past_headroom", lambda *a: jnp.bool_(False))
    rng = np.random.default_rng(100 + 1)
    with pytest.raises(AssertionError):
        run_case(rng, [0, 1, 15, 16, 17, 63, 64, 65, 640, 300], K=2, G=2, H=64, C=16,
                  block_kv=64, interpret=True, fixed_max=True, q_scale=100.0)  # fmt: skip


def _kernel_order_of(lengths, block_kv=64, slots=None):
    """(sequence << 16 | low 16 bits of its length) that ``_kernel_order`` finds for each grid
    slot (or for ``slots`` only), read back through a one-warpgroup kernel in the interpreter."""
    B = lengths.shape[0]
    slots = np.arange(B, dtype=np.int32) if slots is None else np.asarray(slots, np.int32)
    cfg = _gpu_config._Config(
        num_seqs=B, num_q_heads=8, num_kv_heads=1, num_pages=1, page_size=16, head_dim=128,
        dtype=jnp.dtype(jnp.bfloat16), sm_scale=1.0, logits_soft_cap=None, sliding_window=None,
        block_kv=block_kv, num_stages=2, swap_ab=True, deferred_sum=True, num_splits=1,
        longest_first=True, order_method="kernel", interpret=RACE_CHECKED,
    )  # fmt: skip
    row = plgpu.Layout.WG_STRIDED((128,), vec_size=1)

    def body(len_ref, slot_ref, out_ref):
        i = jax.lax.axis_index("b")
        b, length = _gpu_bodies._kernel_order(cfg, len_ref, slot_ref[i])

        def store(o_smem):
            o_smem[...] = plgpu.layout_cast(jnp.zeros((128,), jnp.int32), row) + (
                b << 16 | (length & 0xFFFF)
            )
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[i])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((128,), jnp.int32))

    n = len(slots)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n, 128), jnp.int32), grid=(n,), grid_names=("b",),
        interpret=cfg.interpret,
    )  # fmt: skip
    return np.asarray(kernel(jnp.asarray(lengths), jnp.asarray(slots)))[:, 0]


@pytest.mark.parametrize("B,block_kv", [(4, 64), (12, 128), (128, 64), (132, 64)])
def test_kernel_order_is_the_sorted_order(B, block_kv):
    # The order each CTA counts for itself (order_method="kernel") is the sort's: ties (equal
    # tiles) in slot order, lengths <= 0 last, lengths past the 0x7FFF-tile cap tied; 132
    # sequences take two keys a thread. Past 64 sequences the interpreter runs a spread of the
    # slots (the first, the middle and the last 8: ties, the cap, lengths <= 0), not all.
    rng = np.random.default_rng(B)
    lengths = rng.integers(0, 3000, size=B).astype(np.int32)
    lengths[: B // 3] = lengths[B // 3]
    lengths[1:3] = [-5, 0]
    lengths[-1] = 2**31 - 1
    slots = np.arange(B)
    if B > 64:
        slots = np.unique(np.r_[slots[:8], slots[B // 2 - 4 : B // 2 + 4], slots[-8:]])
    got = _kernel_order_of(lengths, block_kv, slots)
    keys = np.asarray(_gpu_order.longest_first_order(jnp.asarray(lengths), block_kv, True, "sort"))
    seqs = (keys & 0xFFFF)[slots]
    np.testing.assert_array_equal(got >> 16, seqs)
    np.testing.assert_array_equal(got & 0xFFFF, lengths[seqs] & 0xFFFF)  # its own length too
    assert_no_races()


def test_interpret_plain_order_indices(monkeypatch):
    # Past 2**16 sequences the order holds plain indices; shrink the bound to exercise that
    # decode branch on a small batch.
    from pallas_kernels.paged_attention import _gpu_tile

    for module in (_gpu_order, _gpu_tile):  # each reads its own import of it
        monkeypatch.setattr(module, "ORDER_BITS", 2)
    assert not _gpu_order.packed_order(6)
    rng = np.random.default_rng(60)
    run_case(rng, [5, 200, 0, 64, 130, 17], K=2, G=2, H=64, C=16, interpret=RACE_CHECKED,
             longest_first=True, num_splits=2)  # fmt: skip


def test_interpret_kernel_order_window_splits():
    # The in-kernel order with a window (tiles counted from the window start) and splits: every
    # unit still maps to one (sequence, split, head).
    rng = np.random.default_rng(73)
    run_case(rng, [5, 200, 0, 64, 130, 17, 64, 3], K=2, G=2, H=64, C=8, interpret=RACE_CHECKED,
              longest_first=True, order_method="kernel", window=37, num_splits=2)  # fmt: skip


def test_interpret_through_public_dispatch():
    import jpaged

    rng = np.random.default_rng(5)
    kv = make_paged_kv(
        rng, [0, 5, 40], num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
        num_layers=2,
    )  # fmt: skip
    q = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.bfloat16)
    out = jpaged.paged_attention(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, layer=1,
        implementation="pallas_gpu", interpret=True,
    )  # fmt: skip
    ref = dense_attention(np.asarray(q, np.float32), kv.k_dense[1], kv.v_dense[1], kv.lengths)
    assert_close(out, ref, jnp.bfloat16)


def test_empty_batch_returns_empty():
    q = jnp.zeros((0, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
    bt, ln = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32)
    out = kernel_gpu.paged_attention_pallas_gpu(q, kv, kv, bt, ln, sm_scale=0.1, interpret=True)
    assert out.shape == (0, 8, 64) and out.dtype == jnp.bfloat16


def test_empty_table_and_negative_lengths_give_zeros():
    # W = 0 (no page to read): zeros without a launch. Lengths < 0 count as 0: no table read
    # goes negative (the prologue reads its lookups before it knows a unit has no tile).
    q = jnp.ones((2, 4, 64), jnp.bfloat16)
    kv = jnp.ones((2, 4, 16, 64), jnp.bfloat16)
    out = kernel_gpu.paged_attention_pallas_gpu(
        q, kv, kv, jnp.zeros((2, 0), jnp.int32), jnp.zeros((2,), jnp.int32), sm_scale=0.1,
        interpret=True,
    )  # fmt: skip
    assert out.shape == q.shape and not np.any(np.asarray(out, np.float32))
    bt = jnp.asarray([[0, 1, 2], [3, 1, 0]], jnp.int32)
    v = kv * jnp.arange(1, 5, dtype=jnp.bfloat16)[None, :, None, None]  # page p holds p + 1
    out = kernel_gpu.paged_attention_pallas_gpu(
        q, kv, v, bt, jnp.asarray([-200, 20], jnp.int32), sm_scale=0.1, num_splits=2,
        block_kv=64, interpret=RACE_CHECKED,
    )  # fmt: skip
    out = np.asarray(out, np.float32)
    assert not np.any(out[0])
    # Equal scores: the mean of V over 20 tokens, 16 from page 3 (value 4) and 4 from page 1 (2).
    np.testing.assert_allclose(out[1], (16 * 4 + 4 * 2) / 20, rtol=1e-2)


@pytest.mark.parametrize(
    "C,extra",
    [
        (16, dict(lengths=[0, 1, 15, 16, 17, 300, 64, 700], G=4)),
        (32, dict(lengths=[5, 200, 0, 127, 513], G=3, num_splits=3, races=True)),  # 8 columns
        (8, dict(lengths=[260, 3, 77], G=6, H=64, window=100, soft_cap=20.0)),  # 16 columns
        (64, dict(lengths=[260, 3, 513, 64], G=4, mma="tcgen05", num_splits=2)),
        # splits past a short sequence's floor read nothing and store an empty partial
        (16, dict(lengths=[1000, 3, 513, 129], G=4, num_splits=4, min_split_tiles=2)),
    ],
    ids=str,
)
def test_interpret_out_blocks(C, extra):
    # swap_ab's output and split partials as whole qcols-row blocks, gathered by XLA.
    rng = np.random.default_rng(C + 5 * len(extra))
    extra = dict(extra)
    interpret = RACE_CHECKED if extra.pop("races", False) else True
    lengths, extra = page_case(rng, C, extra)
    run_case(rng, lengths, K=2, C=C, interpret=interpret, swap_ab=True, out_blocks=True, **extra)


_TC05_CASES = [
    # lengths 0, 1, T-1, T, T+1 and longer, 16-token pages, G=4 (16 query columns)
    (16, dict(lengths=[0, 1, 127, 128, 129, 300, 17, 700], G=4)),
    (32, dict(lengths=[5, 200, 0, 127, 513], G=8, num_splits=2, races=True)),  # XLA merge
    (64, dict(lengths=[260, 3, 513, 64], G=2, window=100, soft_cap=20.0, num_splits=3)),
    # 100x sharper logits: the unit is read again with the running max (fixed_max's redo)
    (128, dict(lengths=[300, 40, 1000], G=4, q_scale=100.0)),
    (16, dict(lengths=[300, 40, 129], G=6, dtype="float16")),  # the running max (f16)
    (256, dict(lengths=[600, 2, 257], G=1, fixed_max=False, num_layers=2, layer=1)),
    (2, dict(lengths=[130, 0, 77], G=4, page_copy="tma")),  # the staging ring of small pages
    # head dim 256: P @ V as two products of 128 head-dim rows, split partials too
    (32, dict(lengths=[5, 200, 0, 127, 513], G=8, H=256, num_splits=2)),
    # (make test-all only:) the in-kernel longest-first order, and splits with a floor of
    # tiles each
    (
        16,
        dict(lengths=[5, 700, 0, 129, 300, 1, 900, 64], longest_first=True, order_method="kernel"),
    ),
    (64, dict(lengths=[1000, 3, 513, 129], num_splits=4, min_split_tiles=2)),
]


@pytest.mark.parametrize("C,extra", _TC05_CASES, ids=str)
def test_interpret_tcgen05(C, extra):
    rng = np.random.default_rng(C + 7 * len(extra))
    extra = dict(extra)
    interpret = RACE_CHECKED if extra.pop("races", False) else True
    lengths, extra = page_case(rng, C, extra)
    run_case(rng, lengths, K=2, C=C, interpret=interpret, mma="tcgen05", **extra)


def test_interpret_tcgen05_products_are_used(monkeypatch):
    # The tcgen05 products are what the interpreter runs: one made 1.5x too large fails.
    from pallas_kernels.paged_attention import _gpu_tcgen05

    real = _gpu_tcgen05._tc_product
    calls = []

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_gpu_tcgen05, "_tc_product", spy)
    rng = np.random.default_rng(5)
    case = dict(K=2, G=4, H=128, C=16, interpret=True, mma="tcgen05", fixed_max=False)
    run_case(rng, [5, 200, 0, 129], **case)
    assert len(calls) == 2  # Q K^T and P @ V, traced once each
    monkeypatch.setattr(_gpu_tcgen05, "_tc_product", lambda *args: 1.5 * real(*args))
    with pytest.raises(AssertionError):  # (another batch size: traced anew)
        run_case(rng, [5, 200, 0], **case)
