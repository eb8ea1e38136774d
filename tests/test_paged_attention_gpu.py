"""Tests of the Mosaic GPU paged decode kernel (``pallas_kernels/paged_attention/kernel_gpu.py``).

CPU CI: a few tiny cases run in the Mosaic GPU interpreter, every kernel variant is
cross-lowered for CUDA, and ``unsupported_reason`` / argument checks are exercised.
GPU (``pytest -m gpu`` on an sm90+ GPU): the compiled kernel against the f64 dense reference
over page sizes, GQA ratios, head dims, dtypes, lengths 0, 1, C-1, C, C+1 and 32k, with
randomly permuted tables and NaN-poisoned free pages and last-page tails.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import dense_attention, make_paged_kv
from _tolerances import assert_close
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import kernel_gpu


def _run_case(
    rng,
    lengths,
    *,
    K,
    G,
    H,
    C,
    dtype=jnp.bfloat16,
    interpret=False,
    num_layers=None,
    layer=None,
    soft_cap=None,
    window=None,
    sm_scale=None,
    out_of_range_tail=False,
    q_scale=1.0,
    **tuning,
):
    kv = make_paged_kv(
        rng, lengths, num_kv_heads=K, head_dim=H, page_size=C, dtype=dtype,
        num_layers=num_layers, out_of_range_tail=out_of_range_tail,
    )  # fmt: skip
    q = np.asarray(
        jnp.asarray(q_scale * rng.standard_normal((len(lengths), K * G, H)), dtype).astype(
            jnp.float32
        )
    )
    scale = 1.0 / math.sqrt(H) if sm_scale is None else sm_scale
    with _merge_handover_ordered():
        out = kernel_gpu.paged_attention_pallas_gpu(
            jnp.asarray(q, dtype),
            kv.k_pages,
            kv.v_pages,
            kv.block_tables,
            kv.lengths,
            sm_scale=scale,
            logits_soft_cap=soft_cap,
            sliding_window=window,
            layer=layer,
            interpret=interpret,
            **tuning,
        )
    assert out.shape == q.shape and out.dtype == jnp.dtype(dtype)
    k_dense = kv.k_dense if num_layers is None else kv.k_dense[int(layer)]
    v_dense = kv.v_dense if num_layers is None else kv.v_dense[int(layer)]
    ref = dense_attention(
        q,
        k_dense,
        v_dense,
        kv.lengths,
        sm_scale=scale,
        logits_soft_cap=soft_cap,
        sliding_window=window,
    )
    assert_close(out, ref, dtype, err_msg=f"{lengths=} {K=} {G=} {H=} {C=} {tuning=}")
    empty = np.asarray(kv.lengths) == 0
    assert np.all(np.asarray(out.astype(jnp.float32))[empty] == 0.0)
    if isinstance(interpret, plgpu.InterpretGPUParams) and interpret.detect_races:
        _assert_no_races()


# The interpreter's race detector sees SMEM written while a TMA copy still reads it (e.g. the
# persistent kernel's P / output tiles without their read waits), which values alone miss.
RACE_CHECKED = plgpu.InterpretGPUParams(detect_races=True)


# Cases ``make test`` (CPU CI) leaves out and ``make test-all`` runs (``tests/conftest.py``
# marks them slow by these ids): extra cases of the opt-in paths (the balanced, persistent and
# producer kernels, K rings, L2 prefetches, the heads-outer grid, the TMA staging ring of small
# pages, per-thread copies of 8+ token pages) beyond one or two each, and boundaries that other
# cases repeat. Every default path keeps all its cases; the GPU suite runs every case.
SLOW_CASES = {
    # tcgen05's staging ring of small pages (the slowest to interpret and to lower; CI runs the
    # other tcgen05 cases, per-thread copies of small pages among them)
    "test_interpret_tcgen05[2-{'lengths': [130, 0, 77], 'G': 4, 'page_copy': 'tma'}]",
    "test_tcgen05_lowers_for_sm100[C2-W128-page_copytma]",
    *(
        f"test_interpret_tcgen05[{case}]"
        for case in (
            "16-{'lengths': [5, 700, 0, 129, 300, 1, 900, 64], 'longest_first': True, "
            "'order_method': 'kernel'}",
            "32-{'lengths': [5, 400, 0, 129], 'G': 8, 'k_stages': 3, 'early_k': True, "
            "'races': True}",
            "64-{'lengths': [1000, 3, 513, 129], 'num_splits': 4, 'min_split_tiles': 2}",
        )
    ),
    # fixed_max's other cases (CI runs swap, the sharp-logit spike, f16, the exact 64-row spike)
    *(
        f"test_interpret_fixed_max[{i}]"
        for i in (
            "64-rows-split2", "window-cap-split3", "negative-scale-st1", "spike-64-rows-split2",
            "exact",
        )
    ),
    # The floor's other four cases (CI runs M1-xla, M2-window-cap-xla, M4-bad-ids-kernel and
    # M8-layer-kernel: each merge, each floor)
    *(
        f"test_interpret_min_split_tiles[{i}]"
        for i in ("M1-kernel", "M2-window-cap-kernel", "M4-bad-ids-xla", "M8-layer-xla")
    ),
    *(
        f"test_interpret_matches_reference[{i}]"
        for i in (
            "C16-split2-longest-first-heads-outer", "C16-T64-st2-l2-prefetch3-bad-ids",
            "C16-T64-st1-early-k", "C16-T64-st1-k2-early-k-split2",
        )
    ),
    *(
        f"test_interpret_persistent_matches_reference[{i}]"
        for i in (
            "ctas3", "split3-st3", "longest", "partial-prefetch", "C128-T64-window",
            "split2-st4-bad-ids", "st1-split2-cap-window",
        )
    ),
    *(
        f"test_interpret_producer_matches_reference[{i}]"
        for i in ("C16-T64-st2", "C128-T128-default-stages-layer")
    ),
    *(
        f"test_interpret_k_ring_matches_reference[{i}]"
        for i in ("st1-k3", "st3-k2-early", "st2-k3-early-prefetch-window")
    ),
    "test_interpret_small_pages_match_reference[C2-split2-64-rows]",
    "test_interpret_small_pages_match_reference[C2-k-ring-early-k]",
    "test_kernel_order_is_the_sorted_order[12-128]",
    "test_kernel_order_is_the_sorted_order[128-64]",
    "test_interpret_plain_order_indices[False-True]",
    "test_interpret_plain_order_indices[True-False]",
    "test_interpret_plain_order_indices[True-True]",
    "test_interpret_kernel_order_window_splits_heads_outer",
    *(
        f"test_interpret_balanced_matches_reference[{i}]"
        for i in (
            "4-pieces", "20-pieces", "empty-shares-cap-window", "G24-cut", "C128-G3-window",
            "H128-G8-bad-ids",
        )
    ),
    *(
        f"test_cross_lowers_for_cuda[{i}]"
        for i in (
            "balancedTrue-H64-C8-K4-dtype<class 'jax.numpy.float16'>-L3",
            "balancedTrue-B7-N2-K2-H64",
            "balancedTrue-logits_soft_cap30.0-sliding_window100-C128",
            "balancedTrue-N48-K8",
            "balancedTrue-H256-C256",
            "balancedTrue-B300-num_ctas1000",
            "balancedTrue-B66-W160",
            "balancedTrue-N512-K8-H64",
            "C1-W256-H64-K4-dtype<class 'jax.numpy.float16'>-L3-page_copytma",
            "C1-W128-N64-K8-l2_prefetch1-page_copytma",
            "C2-W64-B40-longest_firstTrue-k_stages3-early_kTrue-page_copytma",
            "persistentTrue-num_splits4-logits_soft_cap30.0-sliding_window100-C64",
            "persistentTrue-H64-C8-K4-dtype<class 'jax.numpy.float16'>-L3-num_ctas5",
            "persistentTrue-H256-C256-num_splits2",
            "persistentTrue-num_splits2-C8",
            "producerTrue-num_stages6",
            "producerTrue-H64-C8-K4-dtype<class 'jax.numpy.float16'>-L3",
            "producerTrue-H256-C256-num_splits2-logits_soft_cap30.0-sliding_window100",
            "producerTrue-N64-K8-C32-num_stages1-longest_firstFalse",
            "k_stages3-early_kTrue",
            "H64-C8-K4-k_stages3-early_kTrue-L3",
            "H256-C256-num_splits2-k_stages3-early_kTrue",
            "C8-H64-K4-page_copycp_async-swap_abFalse",
        )
    ),
}  # fmt: skip


@contextlib.contextmanager
def _merge_handover_ordered():
    """The in-kernel split merge's loads of other CTAs' partials are ordered on hardware by
    an acquire-release counter (``_merge_gpu.arrive``), which the interpreter does not run (it
    runs the grid in order, so the last split merges): its race detector would report each
    partial the merging CTA loads. Those reads, and only those, skip the check; every SMEM
    access, and every other GMEM one, is still checked."""
    from jax._src import source_info_util  # private, as below: jax 0.11.2's detector
    from jax._src.pallas.mosaic_gpu.interpret import race_detection_state as races
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    gmem = shared_memory.get_memory_space_idx(plgpu.GMEM)
    cls = races.GPURaceDetectionState
    check_read = cls.check_read

    def checked(self, thread, clock, buffer_key, rnge, source_info=None):
        # The frame is looked up only for GMEM reads (summarize walks the traceback).
        if (
            buffer_key.memory_space_id == gmem
            and source_info is not None
            and "(_merge_split.<locals>.load_piece)" in source_info_util.summarize(source_info)
        ):
            return None
        return check_read(self, thread, clock, buffer_key, rnge, source_info)

    cls.check_read = checked
    try:
        yield
    finally:
        cls.check_read = check_read


def _assert_no_races():
    # Private: jax 0.11.2 keeps the last interpreted kernel's race report here.
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    assert not gpu_callbacks.get_races().races_found, "the race detector found an SMEM race"


# --------------------------------------------------------------------------- CPU: interpreter


@pytest.mark.parametrize(
    "C,splits,extra",
    [
        (16, 1, {"out_of_range_tail": True}),  # unused table slots: ids < 0 or >= P
        (16, 1, {"out_of_range_tail": True, "swap_ab": False}),  # 64 query rows without splits
        (16, 2, {"longest_first": True}),  # the (sequence, split, head) grid, permuted
        (16, 2, {"swap_ab": False}),  # 64 query rows with splits: f32 partials
        (16, 2, {"longest_first": True, "heads_inner": False}),  # the previous grid order
        (16, 2, {"longest_first": True, "slot_lengths": True}),  # lengths in slot order
        (8, 3, {"soft_cap": 20.0, "window": 37, "block_kv": 64}),
        (128, 2, {"num_layers": 2, "layer": jnp.int32(1)}),
        # L2 prefetches are no-ops in the interpreter; their table lookups still run
        (16, 2, {"block_kv": 64, "num_stages": 2, "l2_prefetch": 3, "out_of_range_tail": True}),
        # K refilled after Q K^T (early_k) and a K ring deeper than V's: the rings wrap at
        # different tiles (the longest case, 150 tokens, is 3 tiles of 64; the K ring wraps
        # only in the first; test_interpret_k_ring_matches_reference runs 10-tile sequences)
        (16, 1, {"block_kv": 64, "num_stages": 1, "early_k": True, "swap_ab": False}),
        (16, 2, {"block_kv": 64, "num_stages": 1, "k_stages": 2, "early_k": True}),
        (8, 1, {"block_kv": 64, "num_stages": 2, "k_stages": 3, "out_of_range_tail": True}),
        # A negative scale keeps the scale out of exp2 (max(s) * scale != max(s * scale))
        (16, 2, {"sm_scale": -0.2, "block_kv": 64}),
        (16, 3, {"deferred_sum": False, "soft_cap": 20.0, "window": 37}),  # a sum every tile
    ],
    ids=[
        "C16-T128-bad-ids",
        "C16-T128-bad-ids-64-rows",
        "C16-split2-longest-first",
        "C16-split2-64-rows",
        "C16-split2-longest-first-heads-outer",
        "C16-split2-longest-first-slot-lengths",
        "C8-T64-split3-cap-window",
        "C128-T128-split2-layer",
        "C16-T64-st2-l2-prefetch3-bad-ids",
        "C16-T64-st1-early-k",
        "C16-T64-st1-k2-early-k-split2",
        "C8-T64-st2-k3-bad-ids",
        "C16-T64-split2-negative-scale",
        "C16-split3-sum-per-tile-cap-window",
    ],
)
def test_interpret_matches_reference(C, splits, extra):
    rng = np.random.default_rng(C)
    lengths = [0, 1, C - 1, C, C + 1, 150]
    _run_case(rng, lengths, K=2, G=2, H=64, C=C, interpret=RACE_CHECKED, num_splits=splits, **extra)


@pytest.mark.parametrize(
    "C,lengths,extra",
    [
        (16, [0, 1, 17, 300], {"block_kv": 64, "num_stages": 2}),  # 5 tiles: the ring wraps
        (
            8,
            [0, 1, 9, 150, 300],
            {"block_kv": 64, "num_stages": 1, "num_splits": 2, "soft_cap": 20.0, "window": 100},
        ),  # every tile a refill
        (128, [0, 1, 129, 1000], {"num_layers": 2, "layer": jnp.int32(1)}),  # 4 stages, 8 tiles
    ],
    ids=["C16-T64-st2", "C8-T64-st1-split2-cap-window", "C128-T128-default-stages-layer"],
)
def test_interpret_producer_matches_reference(C, lengths, extra):
    # Two warpgroups run as two interpreter threads. The ragged kernel's two-warpgroup variants
    # hung now and then in the interpreter on a 2-core machine; these three passed 20 times
    # by hand there (also two processes at once), 2-4 s each.
    rng = np.random.default_rng(C + 1)
    _run_case(rng, lengths, K=2, G=2, H=64, C=C, interpret=True, producer=True, **extra)


@pytest.mark.parametrize(
    "C,lengths,extra",
    [
        (16, [0, 1, 15, 16, 17, 150], dict(num_ctas=3)),
        (16, [0, 1, 15, 16, 17, 150, 300], dict(num_splits=2, num_stages=2, num_ctas=5)),
        (
            8,
            [0, 1, 9, 150, 300],
            dict(block_kv=64, num_stages=1, num_splits=2, soft_cap=20.0, window=100, num_ctas=4),
        ),
        (16, [3, 200, 0, 64, 65, 130], dict(num_splits=3, num_stages=3, block_kv=64, num_ctas=7)),
        # One CTA runs every unit: 4-deep ring over units of 0-7 tiles, empty units between.
        (16, [300, 1, 2, 0, 0, 0, 400, 5], dict(num_stages=4, block_kv=64, num_ctas=1)),
        (32, [40, 500, 7, 0, 260], dict(longest_first=True, num_splits=2, num_ctas=3)),
        # Units of 2-5 tiles after one another on a 4-deep ring: partial prefetches.
        (16, [100, 300, 150, 250, 20, 200, 0, 64], dict(block_kv=64, num_stages=4, num_ctas=1)),
        # Pages larger than the tile, a window smaller than a tile; bad unused table ids.
        (128, [0, 1, 300, 129, 64], dict(block_kv=64, num_ctas=1, window=50)),
        (16, [0, 1, 17, 300, 129], dict(num_splits=2, num_stages=4, num_ctas=1, oor=True)),
    ],
    ids=[
        "ctas3",
        "split2-ctas5",
        "st1-split2-cap-window",
        "split3-st3",
        "one-cta",
        "longest",
        "partial-prefetch",
        "C128-T64-window",
        "split2-st4-bad-ids",
    ],
)
def test_interpret_persistent_matches_reference(C, lengths, extra):
    # Fewer CTAs than units, so each CTA's ring runs on across units (the prefetch of the
    # next unit's tiles and Q, the output copies left in flight), with the race detector on.
    rng = np.random.default_rng(C + len(lengths))
    extra = dict(extra)
    oor = extra.pop("oor", False)
    _run_case(
        rng, lengths, K=2, G=2, H=64, C=C, interpret=RACE_CHECKED, persistent=True,
        out_of_range_tail=oor, **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        dict(num_stages=2, k_stages=3, early_k=True),
        dict(num_stages=1, k_stages=3),
        dict(num_stages=3, k_stages=2, early_k=True),  # K shallower than V
        dict(num_stages=2, k_stages=3, early_k=True, l2_prefetch=2, window=200),
    ],
    ids=["st2-k3-early", "st1-k3", "st3-k2-early", "st2-k3-early-prefetch-window"],
)
def test_interpret_k_ring_matches_reference(extra):
    # Up to 10 tiles of 64 per sequence: both rings wrap several times out of step.
    rng = np.random.default_rng(70 + len(extra))
    _run_case(rng, [0, 1, 63, 64, 65, 640, 300], K=2, G=2, H=64, C=16, block_kv=64,
              interpret=RACE_CHECKED, **extra)  # fmt: skip


@pytest.mark.parametrize(
    "C,G,lengths,extra",
    [
        (16, 2, [0, 1, 15, 16, 17, 150], dict()),
        (16, 2, [0, 1, 15, 16, 17, 150, 300], dict(num_splits=2, block_kv=64)),
        (8, 4, [0, 1, 9, 150, 300], dict(num_splits=3, soft_cap=20.0, window=100, block_kv=64)),
        (16, 3, [5, 200, 0, 64], dict(longest_first=True)),  # G=3: 16 query columns
        (32, 1, [0, 33, 400, 7], dict(num_splits=2, longest_first=True, out_of_range_tail=True)),
        (16, 8, [130, 0, 64, 1], dict(block_kv=64, num_stages=1, k_stages=2, early_k=True)),
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
        "C16-G8-k-ring",
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
    _run_case(rng, lengths, K=2, G=G, H=64, C=C, interpret=RACE_CHECKED, swap_ab=True, **extra)


@pytest.mark.parametrize(
    "C,extra",
    [
        (1, dict(out_of_range_tail=True)),  # one-row copies; unused table slots out of range
        (2, dict(num_splits=2, swap_ab=False)),  # the 64-row tile, f32 partials
        (4, dict(num_splits=3, soft_cap=20.0, window=37)),
        (2, dict(num_stages=1, k_stages=2, early_k=True, longest_first=True, num_splits=2)),
    ],
    ids=["C1-bad-ids", "C2-split2-64-rows", "C4-split3-cap-window", "C2-k-ring-early-k"],
)
def test_interpret_small_pages_match_reference(C, extra):
    # Pages below 8 tokens: each page's copy lands in the untiled staging ring (a TMA copy into
    # the (8, 64)-tiled ring must start on an 8-row boundary) and each tile is re-laid into the
    # tiled wgmma tiles before it is read; lengths 0, 1, C-1, C, C+1 and 150 (3 tiles of 64).
    rng = np.random.default_rng(90 + C)
    lengths = [0, 1, max(C - 1, 0), C, C + 1, 150]
    _run_case(
        rng, lengths, K=2, G=2, H=64, C=C, interpret=RACE_CHECKED, block_kv=64, **extra
    )  # fmt: skip


_KM, _MM, _BOTH = ("kernel",), ("mosaic",), ("kernel", "mosaic")
_MERGE_CASES = [  # (id, C, G, lengths, options, merges)
    ("C16-G2-split2", 16, 2, [0, 1, 15, 16, 17, 150], dict(num_splits=2), _BOTH),
    # Splits past a sequence's end (no tile: lse -inf, zero partials), soft cap and window.
    ("C8-G4-split5-cap-window", 8, 4, [0, 1, 9, 150, 300],
     dict(num_splits=5, soft_cap=20.0, window=100), _BOTH),
    # 18 splits: two rounds of the in-kernel merge (16 pieces, then 2), in a 5-D pool.
    ("C16-G1-split18-layer", 16, 1, [1200, 0, 65],
     dict(num_splits=18, num_layers=2, layer=jnp.int32(1)), _BOTH),
    ("C16-G3-split3", 16, 3, [5, 200, 0, 64], dict(num_splits=3, longest_first=True), _KM),
    ("C4-G2-split2", 4, 2, [0, 3, 5, 150], dict(num_splits=2), _KM),  # staging ring
    ("C16-G2-split3-heads-outer", 16, 2, [300, 0, 17, 150],
     dict(num_splits=3, heads_inner=False), _KM),  # grid (head, split, seq)
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
    # split_merge="kernel" (opt-in, and split_tail's): the pair's last split CTA
    # merges the partials in the kernel (the interpreter runs the grid in order: the last
    # split); race-checked but for the handover of the partials (``_merge_handover_ordered``).
    # "mosaic" (the default at 2-32): a second Mosaic GPU kernel merges every pair's partials,
    # one CTA a pair; both kernels race-checked.
    rng = np.random.default_rng((70 if merge == "kernel" else 170) + C + G)
    extra = dict(extra)
    K = extra.pop("K", 2)
    _run_case(
        rng, lengths, K=K, G=G, H=64, C=C, interpret=RACE_CHECKED, swap_ab=True,
        split_merge=merge, block_kv=64, **extra,
    )  # fmt: skip


def _skip_unless_swap_ab_lowers():
    if not kernel_gpu.swap_ab_lowers():
        pytest.skip(f"swap_ab does not lower on jax {jax.__version__} (swap_ab_lowers)")


def test_kernel_merge_default_and_lowering():
    # The second kernel by default with 2-32 splits and swap_ab; "xla" otherwise; the in-kernel
    # merge opt-in (and with split_tail). Lowered: the arrival atomics are in the kernel exactly
    # when it merges, and no XLA merge follows it then.
    assert kernel_gpu.default_split_merge(2, True) == "mosaic"
    assert kernel_gpu.default_split_merge(16, True) == "mosaic"
    assert kernel_gpu.default_split_merge(32, True) == "mosaic"
    assert kernel_gpu.default_split_merge(33, True) == "xla"  # two rounds: slower
    assert kernel_gpu.default_split_merge(32, False) == "xla"
    assert kernel_gpu.default_split_merge(1, True) == "xla"
    assert kernel_gpu.default_split_merge(4, False) == "xla"
    assert kernel_gpu.default_split_merge(4, True, producer=True) == "xla"
    assert kernel_gpu.default_split_merge(4, True, persistent=True) == "xla"
    _skip_unless_swap_ab_lowers()
    args = (
        jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 40, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 40, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 8), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    for merge in (None, "kernel", "xla", "mosaic"):
        f = functools.partial(
            kernel_gpu.paged_attention_pallas_gpu, sm_scale=0.1, num_splits=3, split_merge=merge
        )
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        in_kernel = merge == "kernel"
        assert ("atom.acq_rel.gpu.global.add.u32" in text) == in_kernel, merge
        assert bool(re.search(r"_km(_[a-z0-9]+)*_mosaic_gpu", text)) == in_kernel, merge
        # The XLA merge: a max over the splits of the lse, then exp2 and the weighted sum.
        assert ("stablehlo.exponential" in text) == (merge == "xla"), merge
        # "mosaic" (the default): a second Mosaic GPU kernel, one CTA a (sequence, KV head) pair
        assert ("paged_decode_merge_S3_" in text) == (merge in (None, "mosaic")), merge
    # split_tail merges its tail's splits in the kernel, by default too
    f = functools.partial(
        kernel_gpu.paged_attention_pallas_gpu, sm_scale=0.1, num_splits=3, split_tail=2
    )
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "atom.acq_rel.gpu.global.add.u32" in text and "paged_decode_merge_" not in text


@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("G", [4, 16])
def test_split_merge_fits_in_the_loops_smem(monkeypatch, H, stages, G):
    # The merge's scope (output and lse tiles, merge buffers, barriers) never needs more SMEM
    # than the loop's scope it follows, so merging in the kernel costs no occupancy.
    _skip_unless_swap_ab_lowers()
    seen = []
    monkeypatch.setattr(kernel_gpu, "_paged_attention", lambda cfg, *a: seen.append(cfg))
    q = jnp.zeros((4, 8 * G, H), jnp.bfloat16)
    pages = jnp.zeros((8, 40, 16, H), jnp.bfloat16)
    bt, ln = jnp.zeros((4, 8), jnp.int32), jnp.ones((4,), jnp.int32)
    kernel_gpu.paged_attention_pallas_gpu(
        q, pages, pages, bt, ln, sm_scale=0.1, num_splits=40, num_stages=stages,
        swap_ab=True, split_merge="kernel",
    )  # fmt: skip
    (cfg,) = seen
    assert cfg.kernel_merge
    R = cfg.q_rows
    loop = kernel_gpu._smem_bytes(H, cfg.block_kv, stages, qcols=R)
    nb = kernel_gpu._split_merge_batch(cfg)
    merge = R * H * 2 + 64 * R * 4 + 1024 + nb * kernel_gpu._merge_piece_bytes(H, R)
    assert 1 <= nb <= 16 and merge <= loop, (nb, merge, loop)


def test_swap_ab_default():
    # On at H = 64 / 128 and 8 query columns, with or without splits, where it was measured.
    assert kernel_gpu.default_swap_ab(1, 128, 8)
    assert kernel_gpu.default_swap_ab(1, 64, 8)
    assert kernel_gpu.default_swap_ab(2, 128, 8)  # with splits too (partials as rows)
    assert not kernel_gpu.default_swap_ab(1, 256, 8)  # not timed
    assert not kernel_gpu.default_swap_ab(1, 128, 16)
    assert not kernel_gpu.default_swap_ab(1, 128, 8, producer=True)
    assert not kernel_gpu.default_swap_ab(1, 128, 8, persistent=True)


@pytest.mark.parametrize(
    "num_seqs,num_q_heads,num_kv_heads,qcols",
    [(5, 32, 8, 8), (3, 32, 32, 8), (2, 64, 8, 8), (4, 48, 8, 16), (4, 6, 2, 16), (9, 24, 8, 16)],
)
def test_qcols_cover_every_heads_rows(num_seqs, num_q_heads, num_kv_heads, qcols):
    assert kernel_gpu._qcols(num_seqs, num_q_heads, num_kv_heads) == qcols
    G = num_q_heads // num_kv_heads
    for b in range(num_seqs):
        for h in range(num_kv_heads):
            qrow = b * num_q_heads + h * G
            assert qrow - qrow // 8 * 8 + G <= qcols  # the G rows lie in the loaded block


@pytest.mark.parametrize("order_method", kernel_gpu.ORDER_METHODS)
def test_interpret_order_methods(order_method):
    # Every way of computing the longest-first order gives the same schedule and output
    # (8 sequences: the in-kernel count takes multiples of 4).
    rng = np.random.default_rng(71)
    _run_case(rng, [5, 200, 0, 64, 130, 17, 64, 3], K=2, G=2, H=64, C=16, interpret=RACE_CHECKED,
              longest_first=True, order_method=order_method)  # fmt: skip


@pytest.mark.parametrize("merge", ["kernel", "xla", "mosaic"])
@pytest.mark.parametrize(
    "min_tiles,extra",
    [
        (1, {}),  # every split reads (the old rule)
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
    _run_case(rng, lengths, K=2, G=2, H=64, C=16, interpret=RACE_CHECKED, num_splits=4,
              block_kv=64, min_split_tiles=min_tiles, split_merge=merge, **extra)  # fmt: skip


@pytest.mark.parametrize(
    "head,extra",
    [
        (3, dict()),  # 3 in batch order, then the other 5 longest first
        (8, dict()),  # every one in batch order: no count at all
        (5, dict(num_splits=2, split_tail=2, split_merge="kernel", window=300)),
    ],
    ids=["H3", "H8", "H5-tail-window"],
)
def test_interpret_order_head(head, extra):
    # The first ``order_head`` slots take sequences 0 .. head-1 without counting the order,
    # the later ones the rest longest first: every sequence read once, by the right CTAs.
    rng = np.random.default_rng(head + 51)
    lengths = [700, 1, 0, 64 * 9 + 3, 15, 150, 17, 300]
    _run_case(rng, lengths, K=2, G=2, H=64, C=16, interpret=RACE_CHECKED, block_kv=64,
              longest_first=True, order_method="kernel", order_head=head, **extra)  # fmt: skip


@pytest.mark.parametrize(
    "tail,extra",
    [
        # 8 sequences, the last 3 of the dispatch order split in 2 (11 sequence slots): the
        # shortest three with the order (0, 1 and 15 tokens: a tile or none, split 1 empty) ...
        (3, dict(num_splits=2, longest_first=True)),
        # ... or, without it, the last three of the batch: 17, 150 and 579 tokens
        (3, dict(num_splits=3, window=300, soft_cap=20.0)),
        (8, dict(num_splits=4, min_split_tiles=2, longest_first=True)),  # every one: all splits
        (1, dict(num_splits=2, num_layers=2, layer=jnp.int32(1), out_of_range_tail=True)),
    ],
    ids=["T3-order", "T3-window-cap", "T8-floor", "T1-layer-bad-ids"],
)
def test_interpret_split_tail(tail, extra):
    # Only the last ``tail`` sequences of the dispatch order are split (merged in the kernel);
    # the others are read whole by one CTA and written straight out.
    rng = np.random.default_rng(tail + 41)
    lengths = [0, 1, 15, 700, 64 * 9 + 3, 17, 150, 64 * 9 + 3]
    _run_case(rng, lengths, K=2, G=2, H=64, C=16, interpret=RACE_CHECKED, block_kv=64,
              split_tail=tail, split_merge="kernel", **extra)  # fmt: skip


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
        # The running max (the default before, and at f16)
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
    _run_case(rng, [0, 1, 15, 16, 17, 63, 64, 65, 640, 300], K=2, G=2, H=64, C=16, block_kv=64,
              interpret=RACE_CHECKED, **extra)  # fmt: skip


def test_default_fixed_max():
    assert kernel_gpu.default_fixed_max(jnp.bfloat16)
    assert not kernel_gpu.default_fixed_max(jnp.float16)  # 15 doublings: redone more often
    assert not kernel_gpu.default_fixed_max(jnp.bfloat16, producer=True)
    assert not kernel_gpu.default_fixed_max(jnp.bfloat16, persistent=True)
    assert not kernel_gpu.default_fixed_max(jnp.bfloat16, balanced=True)


def test_interpret_fixed_max_redo_is_needed(monkeypatch):
    # The spike case's logits overflow against the first tile's max: without the check and
    # the exact second pass the output is wrong (so the case above exercises the redo).
    from pallas_kernels.paged_attention import _gpu_tile

    monkeypatch.setattr(_gpu_tile, "_past_headroom", lambda *a: jnp.bool_(False))
    rng = np.random.default_rng(100 + 1)
    with pytest.raises(AssertionError):
        _run_case(rng, [0, 1, 15, 16, 17, 63, 64, 65, 640, 300], K=2, G=2, H=64, C=16,
                  block_kv=64, interpret=True, fixed_max=True, q_scale=100.0)  # fmt: skip


def test_default_min_split_tiles():
    assert kernel_gpu.default_min_split_tiles(32, 8, 1) == 1  # no splits: nothing to floor
    assert kernel_gpu.default_min_split_tiles(8, 8, 8) == 1  # few pairs: every split reads
    assert kernel_gpu.default_min_split_tiles(32, 8, 2) == 8  # about one wave of pairs
    assert kernel_gpu.default_min_split_tiles(63, 8, 4) == 8
    assert kernel_gpu.default_min_split_tiles(64, 8, 2) == 1  # two waves (explicit splits)
    # The quick table's B=32 / 2k (1k-3k tokens: 16-48 tiles) keeps two splits a sequence.
    assert min(1024 // 64 // 8, 2) == 2


def _kernel_order_of(lengths, block_kv=64, slots=None):
    """(sequence << 16 | low 16 bits of its length) that ``_kernel_order`` finds for each grid
    slot (or for ``slots`` only), read back through a one-warpgroup kernel in the interpreter."""
    B = lengths.shape[0]
    slots = np.arange(B, dtype=np.int32) if slots is None else np.asarray(slots, np.int32)
    cfg = kernel_gpu._Config(
        num_seqs=B, num_q_heads=8, num_kv_heads=1, num_pages=1, page_size=16, head_dim=128,
        dtype=jnp.dtype(jnp.bfloat16), sm_scale=1.0, logits_soft_cap=None, sliding_window=None,
        block_kv=block_kv, num_stages=2, k_stages=2, early_k=False, slot_lengths=False,
        swap_ab=True, deferred_sum=True, num_splits=1, producer=False, longest_first=True,
        order_method="kernel", heads_inner=True, persistent=False, num_ctas=0, l2_prefetch=0,
        interpret=RACE_CHECKED,
    )  # fmt: skip
    row = plgpu.Layout.WG_STRIDED((128,), vec_size=1)

    def body(len_ref, slot_ref, out_ref):
        i = jax.lax.axis_index("b")
        b, length = kernel_gpu._kernel_order(cfg, len_ref, slot_ref[i])

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
    keys = np.asarray(kernel_gpu._longest_first_order(jnp.asarray(lengths), block_kv, True, "sort"))
    seqs = (keys & 0xFFFF)[slots]
    np.testing.assert_array_equal(got >> 16, seqs)
    np.testing.assert_array_equal(got & 0xFFFF, lengths[seqs] & 0xFFFF)  # its own length too
    _assert_no_races()


@pytest.mark.parametrize("slot_lengths", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_interpret_plain_order_indices(monkeypatch, persistent, slot_lengths):
    # Past 2**16 sequences the order holds plain indices; shrink the bound to exercise that
    # decode branch on a small batch.
    from pallas_kernels.paged_attention import _gpu_config, _gpu_tile

    for module in (kernel_gpu, _gpu_config, _gpu_tile):  # each reads its own import of it
        monkeypatch.setattr(module, "_ORDER_BITS", 2)
    assert not kernel_gpu._packed_order(6)
    rng = np.random.default_rng(60 + persistent)
    extra = dict(persistent=True, num_ctas=3) if persistent else {}
    _run_case(rng, [5, 200, 0, 64, 130, 17], K=2, G=2, H=64, C=16, interpret=RACE_CHECKED,
              longest_first=True, num_splits=2, slot_lengths=slot_lengths, **extra)  # fmt: skip


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
    ref = dense_attention(
        np.asarray(q.astype(jnp.float32)), kv.k_dense[1], kv.v_dense[1], kv.lengths
    )
    assert_close(out, ref, jnp.bfloat16)


# --------------------------------------------------------------------------- CPU: cross-lowering


@pytest.mark.parametrize(
    "K,G,H,C,lengths,extra",
    [
        # 28 stream tiles on 5 CTAs (6 each): pairs cut in two, whole pairs, an empty sequence.
        (2, 2, 64, 16, [0, 1, 15, 16, 17, 150, 300, 64], dict(num_ctas=5)),
        # Pairs of 15 tiles over shares of 5: 4 pieces each; B % 4 != 0 (lengths padded).
        (2, 2, 64, 16, [40, 900, 3], dict(num_ctas=7)),
        # One pair of 40 tiles in 20 pieces: two rounds of the merge's 16 buffers.
        (1, 4, 64, 32, [2560], dict(num_ctas=20)),
        # More CTAs than tiles (16 tiles, 24 empty shares); soft cap and a window (tiles
        # before it unread).
        (2, 1, 64, 8, [0, 1, 9, 150, 300], dict(num_ctas=40, soft_cap=20.0, window=100)),
        # 24 query columns (G=24): lse rows 96 bytes apart in the merge's SMEM; cut pairs.
        (1, 24, 64, 16, [300, 200], dict(num_ctas=3)),
        # Pages larger than the tile, 16 query columns (G=3), a window smaller than a tile.
        (2, 3, 64, 128, [0, 1, 300, 129, 64], dict(num_ctas=4, window=50)),
        # Head dim 128 at T=64, 8 heads a KV head, out-of-range ids in unused table entries.
        (2, 8, 128, 16, [200, 0, 64, 65, 1], dict(num_ctas=3, oor=True)),
        # One CTA: every pair whole, nothing to merge; SMEM reuse across segments race-checked.
        (2, 2, 64, 16, [0, 1, 17, 300, 129], dict(num_ctas=1, races=True)),
    ],
    ids=["ctas5", "4-pieces", "20-pieces", "empty-shares-cap-window", "G24-cut", "C128-G3-window",
         "H128-G8-bad-ids", "one-cta"],
)  # fmt: skip
def test_interpret_balanced_matches_reference(K, G, H, C, lengths, extra):
    # Shares of the tile stream cut pairs; the CTA holding a pair's last piece merges the
    # partials. The interpreter runs the CTAs one after the other in index order, and has no
    # semaphores (the kernel skips them there): its race detector would report every partial
    # a later CTA reads, so it checks only the one-CTA case (no partials).
    rng = np.random.default_rng(90 + C + G)
    extra = dict(extra)
    oor = extra.pop("oor", False)
    interpret = RACE_CHECKED if extra.pop("races", False) else True
    block_kv = 128 if H == 64 and C == 128 else 64
    _run_case(
        rng, lengths, K=K, G=G, H=H, C=C, interpret=interpret, balanced=True,
        block_kv=block_kv, out_of_range_tail=oor, **extra,
    )  # fmt: skip


_VARIANTS = [
    dict(),  # no splits at B=4: swap_ab (queries as 8 wgmma columns), 2 stages
    dict(swap_ab=False),  # the 64-row tile
    dict(swap_ab=False, H=64, C=8, K=4, dtype=jnp.float16, L=3),
    dict(swap_ab=False, N=8, K=8, C=32, block_kv=128),  # G = 1, T = 128
    dict(num_splits=4, logits_soft_cap=30.0, sliding_window=100),
    dict(H=256, C=256, num_splits=2),
    dict(H=64, C=8, K=4, dtype=jnp.float16, L=3),  # H=64: T=128 by default
    dict(H=64, C=64, block_kv=64, num_splits=3),
    dict(N=8, K=8, C=32, block_kv=128),  # G = 1, T = 128
    dict(N=64, K=8, C=64, num_stages=2, longest_first=False),  # G = 8
    dict(B=7, N=2, K=2, H=64, num_splits=3),  # B*N = 14 rows: q padded to 8 (H200 run 1)
    dict(B=40, num_splits=2, longest_first=True),  # (off by default: 128-token tables)
    dict(B=40, heads_inner=False, longest_first=True),  # the previous, head-major grid
    dict(B=40, longest_first=True, slot_lengths=True),  # lengths permuted into slot order
    dict(B=40, longest_first=True, order_method="rank"),  # the order by counting, no sort
    dict(B=40, longest_first=True, order_method="sort"),
    dict(B=40, longest_first=True, order_method="kernel"),  # each CTA counts its place
    dict(B=132, longest_first=True),  # the in-kernel count with two keys a thread
    dict(B=40, longest_first=True, num_splits=3, swap_ab=False),  # the 64-row tile
    # Scores as K Q^T (swap_ab): queries as a wgmma N of 8 / 16 columns
    dict(swap_ab=True),
    dict(swap_ab=True, num_splits=4, logits_soft_cap=30.0, sliding_window=100),
    dict(swap_ab=True, H=64, C=8, K=4, dtype=jnp.float16, L=3),  # T=128
    dict(swap_ab=True, H=256, C=256, num_splits=2),
    dict(swap_ab=True, N=64, K=8, C=64),  # G=8
    dict(swap_ab=True, N=8, K=8, C=32, block_kv=128),  # G=1, T=128
    dict(swap_ab=True, B=40, num_splits=2, longest_first=True),
    dict(swap_ab=True, N=48, K=8),  # G=6: 16 query columns
    dict(swap_ab=True, num_stages=2, k_stages=3, early_k=True),
    dict(swap_ab=True, deferred_sum=False),  # the sum over keys reduced in every tile
    dict(swap_ab=False, deferred_sum=True),  # ignored without swap_ab
    dict(swap_ab=True, N=64, K=4, num_splits=1, deferred_sum=True),  # 16 columns, asked for
    # (profile_dir is not here: its trace leaves through a host callback, which lowers only
    # for the backend in hand; it ran on the H200, benchmarks/profile_decode_timeline.py.)
    dict(swap_ab=True, deferred_sum=False, num_splits=3, logits_soft_cap=30.0),
    dict(swap_ab=True, H=256, C=256, num_splits=1),  # O^T [256, 8] stored transposed
    dict(swap_ab=True, N=64, K=4, num_splits=1),  # G=16: 16 query columns
    dict(swap_ab=True, N=64, K=1, H=64, num_splits=1),  # G=64: 64 columns
    dict(swap_ab=True, N=64, K=4, num_splits=3, sliding_window=100),
    dict(N=64, K=4),  # G=16 without splits: 16 columns, so the 64-row tile by default
    dict(l2_prefetch=2),  # cp.async.bulk.prefetch of the tiles past the ring
    dict(l2_prefetch=1, num_splits=3, C=64, H=64, block_kv=64, sliding_window=100),
    # K refilled after Q K^T; a K ring deeper than V's (105 KB at H=128: 2 CTAs per SM)
    dict(early_k=True),
    dict(k_stages=3, early_k=True),
    dict(k_stages=3, num_splits=4, C=64, logits_soft_cap=30.0, sliding_window=100),
    dict(H=64, C=8, K=4, k_stages=3, early_k=True, L=3),  # T=128, 16 copies per K+V tile
    dict(H=256, C=256, num_splits=2, k_stages=3, early_k=True),
    # Persistent CTAs (the ring runs on across work units):
    dict(persistent=True),
    dict(persistent=True, num_splits=4, logits_soft_cap=30.0, sliding_window=100, C=64),
    dict(persistent=True, H=64, C=8, K=4, dtype=jnp.float16, L=3, num_ctas=5),  # T=128
    dict(persistent=True, H=256, C=256, num_splits=2),  # one CTA per SM (SMEM)
    dict(persistent=True, B=40, N=64, K=8, num_stages=3, num_ctas=7, longest_first=True),  # G=8
    dict(persistent=True, num_splits=2, C=8),
    # The producer warpgroup (two warpgroups, setmaxnreg, K/V-consumed barriers):
    dict(producer=True),  # 4 stages by default
    dict(producer=True, num_stages=6),  # the deepest that fits at H=128
    dict(producer=True, num_splits=4, C=64),  # split: f32 partials aliasing the ring
    dict(producer=True, H=64, C=8, K=4, dtype=jnp.float16, L=3),  # T=128, 8 copies per tile
    dict(producer=True, H=256, C=256, num_splits=2, logits_soft_cap=30.0, sliding_window=100),
    dict(producer=True, N=64, K=8, C=32, num_stages=1, longest_first=False),  # G=8, 1 stage
    # Balanced shares of the tile stream (semaphores, the in-kernel merge):
    dict(balanced=True),  # 3 CTAs per SM by SMEM: 396
    dict(balanced=True, H=64, C=8, K=4, dtype=jnp.float16, L=3),  # T=128
    dict(balanced=True, B=7, N=2, K=2, H=64),  # lengths padded to 8 for the TMA copy
    dict(balanced=True, logits_soft_cap=30.0, sliding_window=100, C=128),  # C > T
    dict(balanced=True, N=48, K=8),  # G=6: 16 query columns
    dict(balanced=True, H=256, C=256),
    dict(balanced=True, B=300, num_ctas=1000),  # lengths in two TMA copies, 3 keys a thread
    # 2560-token tables at 66 x 8 pairs: longest first would be on by default, and is off.
    dict(balanced=True, B=66, W=160),
    dict(balanced=True, N=192, K=8),  # G=24: 24 query columns, lse rows 96 bytes apart
    dict(balanced=True, N=512, K=8, H=64),  # G=64: a merge round of fewer pieces (SMEM)
    # Pages below 8 tokens, by default copied by every thread (cp.async pieces into the ring)
    dict(C=1, W=128),
    dict(C=2, W=64, swap_ab=False),  # the 64-row tile
    dict(C=4, W=32, num_splits=3, logits_soft_cap=30.0, sliding_window=100),
    dict(C=1, W=256, H=64, K=4, dtype=jnp.float16, L=3),  # T=128: 16-row passes
    dict(C=4, W=32, H=256, num_splits=2),  # 32 pieces a row: 4-row passes
    dict(C=2, W=64, B=40, longest_first=True, N=64),  # G=8, the in-kernel order
    # ... or by TMA into an untiled staging ring, re-laid into tiled tiles
    dict(C=1, W=128, page_copy="tma"),  # 64 one-row copies per K and per V tile
    dict(C=2, W=64, swap_ab=False, page_copy="tma"),
    dict(C=1, W=256, H=64, K=4, dtype=jnp.float16, L=3, page_copy="tma"),  # T=128
    dict(C=4, W=32, H=256, num_splits=2, page_copy="tma"),  # 1 stage (SMEM)
    dict(C=2, W=64, B=40, longest_first=True, k_stages=3, early_k=True, page_copy="tma"),
    dict(C=1, W=128, N=64, K=8, l2_prefetch=1, page_copy="tma"),  # G=8
    # Pages of 8+ tokens copied per thread too (opt-in)
    dict(page_copy="cp_async"),
    dict(C=128, page_copy="cp_async", num_splits=2, sliding_window=100),  # C > T
    dict(C=8, H=64, K=4, page_copy="cp_async", swap_ab=False),
    # Split partials merged by XLA instead of the kernel's last split CTA
    dict(num_splits=3, split_merge="xla"),
    dict(num_splits=40, B=1, H=64, C=8, K=4),  # XLA by default past 16 splits
    dict(num_splits=40, B=1, H=64, C=8, K=4, split_merge="kernel"),  # rounds of 16, 16, 8
    # ... or by a second Mosaic GPU kernel (one CTA a pair)
    dict(num_splits=40, B=1, H=64, C=8, K=4, split_merge="mosaic"),  # rounds of 32 and 8
    # Head dim 64 with odd G (16 query columns): one row more loaded, 2 and 3 values a thread
    dict(H=64, N=24, K=8, num_splits=3, split_merge="mosaic", swap_ab=True),
    dict(H=64, N=40, K=8, num_splits=3, split_merge="mosaic", swap_ab=True),
    # 3 partial rows in all, 4 loaded a piece: padded
    dict(B=1, N=3, K=1, H=64, num_splits=4, split_merge="mosaic", swap_ab=True),
    dict(num_splits=4, split_merge="mosaic", logits_soft_cap=30.0, sliding_window=100),
    dict(num_splits=3, split_merge="mosaic", N=64, K=8),  # G=8 fills the query columns
    dict(out_blocks=True, num_splits=3, split_merge="mosaic"),
    dict(B=1, W=2048),  # B=1 / 32k: 32 splits, the second kernel by default
    # G=16 at head dim 256: rounds of 4 splits (32 live f32 a thread a split)
    dict(B=1, N=128, K=8, H=256, C=256, num_splits=32, split_merge="mosaic", swap_ab=True),
    # With Pallas's automatic warpgroup barriers (off by default: the kernel places its own)
    dict(auto_barriers=True),
    dict(auto_barriers=True, B=40, num_splits=3, longest_first=True, sliding_window=100),
    dict(auto_barriers=True, C=8, H=64, K=4, early_k=True, k_stages=3, swap_ab=False),  # T=128
    dict(auto_barriers=True, C=1, W=128),  # per-thread cp.async copies
    # Splits that keep min_split_tiles tiles each, decided on the device (default 4 here)
    dict(num_splits=4, min_split_tiles=1),  # every split reads, as before
    dict(num_splits=4, min_split_tiles=16, split_merge="xla"),
    dict(num_splits=3, C=64, min_split_tiles=2, sliding_window=100, logits_soft_cap=30.0),
    dict(B=40, W=192),  # one wave of pairs: 2 splits by the table, a floor of 8 by default
    # The first tile's max as every tile's reference, checked once a unit (fixed_max)
    dict(fixed_max=True),
    dict(fixed_max=True, swap_ab=False, num_splits=3, split_merge="xla"),  # the 64-row tile
    dict(fixed_max=True, num_splits=4, logits_soft_cap=30.0, sliding_window=100, C=64),
    dict(fixed_max=True, H=64, C=8, K=4, dtype=jnp.float16, L=3),  # T=128
    dict(fixed_max=True, H=256, C=256, num_splits=2, early_k=True, k_stages=3),
    dict(fixed_max=True, C=1, W=128),  # per-thread cp.async copies
    dict(fixed_max=True, C=2, W=64, page_copy="tma"),  # the staging ring
    dict(fixed_max=True, B=40, W=192, auto_barriers=True, longest_first=True),
    dict(fixed_max=False),  # the running max in every tile (bf16's default before)
    # swap_ab's output as whole qcols-row blocks gathered by XLA (JAX >= 0.12's default)
    dict(out_blocks=True),
    dict(out_blocks=True, num_splits=4, logits_soft_cap=30.0, sliding_window=100),
    dict(out_blocks=True, N=48, K=8, C=1, W=128),  # 16 columns, per-thread copies
    dict(out_blocks=True, H=256, C=256, num_splits=2, swap_ab=True),
    dict(fixed_max=False, num_splits=4, logits_soft_cap=30.0, sliding_window=100, C=64),
    # Only the last split_tail sequences of the dispatch order split (merged in the kernel)
    dict(num_splits=2, split_tail=3, split_merge="kernel", longest_first=True),
    dict(B=40, W=192, num_splits=3, split_tail=16, split_merge="kernel", min_split_tiles=4),
    dict(num_splits=2, split_tail=4, split_merge="kernel", H=64, K=4, C=64, sliding_window=100),
    # The first order_head sequences in batch order, the rest counted longest first
    dict(B=40, W=192, order_head=12, longest_first=True),
    dict(B=128, order_head=48, longest_first=True, order_method="kernel"),
]


def variant_call(variant):
    """(f, argument shapes, tuning knobs, B, N, K, H, C, W) of a cross-lowering variant: its
    shape keys (B, N, K, H, C, W, dtype, L) with their defaults, the rest passed as knobs. Also
    used by ``tools/lowered_ir.py``."""
    v = dict(variant)
    B, N, K = v.pop("B", 4), v.pop("N", 32), v.pop("K", 8)
    H, C, W = v.pop("H", 128), v.pop("C", 16), v.pop("W", 8)
    dtype, L = v.pop("dtype", jnp.bfloat16), v.pop("L", None)
    pool = (K, 40, C, H) if L is None else (L, K, 40, C, H)
    args = (
        jax.ShapeDtypeStruct((B, N, H), dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct((B, W), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )

    def f(q, k, vp, bt, ln, layer):
        return kernel_gpu.paged_attention_pallas_gpu(
            q, k, vp, bt, ln, sm_scale=0.125, layer=None if L is None else layer, **v
        )

    return f, args, v, B, N, K, H, C, W


def _fills(B, N, K, knobs) -> bool:
    """Whether a unit's G heads fill its ``qcols``-row tile (G == qcols): the direct store is
    then the whole tile, which lowers on any JAX."""
    return kernel_gpu._qcols(B, N, K, knobs.get("mma") == "tcgen05") == N // K


def _needs_swap_ab(knobs, fills: bool = False) -> bool:
    """Knobs that need ``swap_ab``'s direct store (``balanced``, the kernel merge; or the direct
    store asked for where G does not fill the tile): refused where it does not lower
    (``swap_ab_lowers``), where ``swap_ab`` itself stores whole blocks (``out_blocks``)."""
    return bool(
        knobs.get("balanced")
        or knobs.get("split_merge") == "kernel"
        or (knobs.get("swap_ab") and knobs.get("out_blocks") is False and not fills)
    )


def variant_id(variant) -> str:
    return "-".join(f"{k}{variant[k]}" for k in variant)


@pytest.mark.parametrize("variant", _VARIANTS, ids=variant_id)
def test_cross_lowers_for_cuda(variant):
    f, args, v, B, N, K, H, C, W = variant_call(variant)
    fills = _fills(B, N, K, v)
    if _needs_swap_ab(v, fills) and not kernel_gpu.swap_ab_lowers():
        # Refused at once, with the reason, instead of minutes of layout search (a kernel merge
        # asked for alone: swap_ab is off by default there, which the merge needs).
        with pytest.raises(ValueError, match=r"does not lower on jax|merges swap_ab partials"):
            jax.eval_shape(f, *args)
        return
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text.lower()
    # The longest-first order is computed exactly when it is on (a sort, or the counting form's
    # reductions over [B, B]).
    lf = v.get("longest_first")
    if v.get("balanced"):
        lf = False
    elif lf is None:
        T0 = v.get("block_kv", kernel_gpu.default_block_kv(H))
        s0 = v.get("num_splits") or kernel_gpu.default_num_splits(B, K, W * C, T0)
        lf = kernel_gpu.default_longest_first(B, K, 1 if v.get("split_tail") else s0, W * C)
    method = v.get("order_method") or kernel_gpu.default_order_method(
        B, bool(v.get("producer")), bool(v.get("persistent")), bool(v.get("slot_lengths"))
    )
    assert ("stablehlo.sort" in text) == (lf and method == "sort"), (lf, method)
    assert (f"tensor<{B}x{B}xi1>" in text) == (lf and method == "rank"), (lf, method)
    names = set(re.findall(r"paged_decode_mgpu\w*_mosaic_gpu", text))
    assert any("_ko_" in name for name in names) == (lf and method == "kernel"), (lf, method)
    # The L2 prefetches are in the kernel exactly when asked for.
    assert ("cp.async.bulk.prefetch" in text) == bool(v.get("l2_prefetch"))
    # swap_ab (the kernel name ends in _sw<qcols>): as asked, else as default_swap_ab says.
    T = v.get("block_kv", kernel_gpu.default_block_kv(H))
    splits = v.get("num_splits") or kernel_gpu.default_num_splits(B, K, W * C, T)
    default_swap = kernel_gpu.default_swap_ab(
        splits,
        H,
        kernel_gpu._qcols(B, N, K),
        bool(v.get("producer")),
        bool(v.get("persistent")),
    ) and (kernel_gpu.swap_ab_lowers() or v.get("split_merge") != "kernel" or splits == 1)
    swap = v.get("swap_ab", default_swap) or bool(v.get("balanced"))
    assert names and all(("_sw" in name) == swap for name in names), names
    # Whole output blocks (_ob): with swap_ab where its direct store does not lower (and G does
    # not fill the block: then the direct store is the whole block), or asked.
    lowers = kernel_gpu.swap_ab_lowers()
    blocks = swap and v.get("out_blocks", not lowers and not fills)
    assert all(("_ob" in name) == bool(blocks) for name in names), names
    assert all(("_bal" in name) == bool(v.get("balanced")) for name in names), names
    # deferred_sum (name part _ds): with swap_ab only; by default at 8 query columns.
    qcols = kernel_gpu._qcols(B, N, K)
    deferred = swap and v.get("deferred_sum", kernel_gpu.default_deferred_sum(qcols))
    assert all(("_ds" in name) == bool(deferred) for name in names), names
    # Pages below 8 tokens: per-thread cp.async pieces (_cpa) unless TMA is asked for (_stg).
    page_copy = v.get("page_copy") or ("cp_async" if C < 8 else "tma")
    copy = "_cpa" if page_copy == "cp_async" else "_stg" if C < 8 else ""
    assert all(
        ("_cpa" in name, "_stg" in name) == ("_cpa" in copy, "_stg" in copy) for name in names
    )
    # ... and the per-thread copies are in the kernel exactly then.
    assert ("nvvm.cp.async.shared.global" in text) == (copy == "_cpa")
    assert ("nvvm.cp.async.wait.group" in text) == (copy == "_cpa")
    # Splits with swap_ab are merged by a second kernel by default, and in the kernel (arrival
    # atomics, name part _km) with split_tail or when asked; the balanced kernel merges itself.
    tcgen05 = v.get("mma") == "tcgen05"
    merge = v.get("split_merge") or (
        "xla"
        if tcgen05
        else "kernel"
        if v.get("split_tail") and lowers and not blocks
        else kernel_gpu.default_split_merge(
            splits, swap, bool(v.get("producer")), bool(v.get("persistent"))
        )
    )
    if v.get("balanced"):
        splits = 1
    # A second Mosaic GPU kernel merges (and no XLA exp2 of the lse) exactly then.
    second = merge == "mosaic" and splits > 1
    assert ("paged_decode_merge_S" in text) == second
    if second:
        assert "stablehlo.exponential" not in text
    in_kernel = merge == "kernel" and splits > 1 and not v.get("balanced")
    assert ("atom.acq_rel.gpu.global.add.u32" in text) == in_kernel
    assert ("st.relaxed.gpu.global.u32" in text) == in_kernel  # the counter's reset
    if in_kernel:  # the async-proxy fences around the arrival (the balanced kernel has them too)
        assert "fence.proxy.async.global" in text
    assert all(("_km" in name) == in_kernel for name in names), names
    tail = v.get("split_tail", 0)
    assert all((f"_tail{tail}_" in name) == bool(tail) for name in names), names
    head = v.get("order_head", 0)
    assert all((f"_oh{head}_" in name) == bool(head) for name in names), names


# --------------------------------------------------------------------------- CPU: checks


def _shapes(dtype=jnp.bfloat16, N=32, K=8, C=16, H=128):
    return (
        jax.ShapeDtypeStruct((2, N, H), dtype),
        jax.ShapeDtypeStruct((K, 10, C, H), dtype),
        jax.ShapeDtypeStruct((K, 10, C, H), dtype),
        jax.ShapeDtypeStruct((2, 4), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dtype=jnp.float32), "bfloat16"),
        (dict(C=3), "page_size=3"),
        (dict(C=24), "page_size=24"),
        (dict(H=96), "head_dim=96"),
        (dict(N=120, K=2), "group size G=60"),
    ],
)
def test_unsupported_reason_names_the_problem(kw, match):
    reason = kernel_gpu.unsupported_reason(*_shapes(**kw), check_backend=False)
    assert reason is not None and match in reason


@pytest.mark.parametrize(
    "kw", [dict(), dict(C=8, H=64), dict(C=256, H=256, N=8, K=8), dict(C=1), dict(C=2), dict(C=4)]
)
def test_unsupported_reason_accepts_supported(kw):
    assert kernel_gpu.unsupported_reason(*_shapes(**kw), check_backend=False) is None


def test_unsupported_reason_needs_a_hopper_gpu_off_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("only meaningful without a GPU")  # on a GPU the backend check passes
    assert "compute capability 9.x" in kernel_gpu.unsupported_reason(*_shapes())


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_kv=32), "block_kv=32"),
        (dict(num_splits=0), "num_splits=0"),
        (dict(num_stages=9), "num_stages=9"),
        (dict(num_stages=7, producer=True), "num_stages=7"),  # 249 KB at H=128
        (dict(dtype=jnp.float32), "cannot run this call"),
        (dict(num_ctas=8), "needs persistent=True or balanced=True"),
        (dict(num_ctas=0, persistent=True), "num_ctas=0"),
        (dict(producer=True, persistent=True), "cannot be combined"),
        (dict(l2_prefetch=-1), "l2_prefetch=-1"),
        (dict(l2_prefetch=17), "l2_prefetch=17"),
        (dict(l2_prefetch=2, persistent=True), "l2_prefetch=2"),
        (dict(l2_prefetch=1, producer=True), "l2_prefetch=1"),
        (dict(l2_prefetch=True), "not a bool"),
        (dict(num_splits=2.5), "num_splits=2.5 must be an integer"),
        (dict(num_stages="2"), "num_stages='2' must be an integer"),
        (dict(k_stages=0), "k_stages=0"),
        (dict(k_stages=12), "k_stages=12"),  # 249 KB at H=128
        (dict(k_stages=3, persistent=True), "need producer=False and persistent=False"),
        (dict(early_k=True, producer=True), "need producer=False and persistent=False"),
        (dict(k_stages=1.5), "k_stages=1.5 must be an integer"),
        (dict(swap_ab=True, producer=True), "swap_ab=True needs producer=False"),
        (dict(swap_ab=True, persistent=True), "swap_ab=True needs producer=False"),
        (dict(order_method="bitonic"), "order_method='bitonic' must be one of"),
        # Two sequences: the in-kernel count's TMA copy takes multiples of 4 (checked where
        # the order is on; with it off any method is accepted: test_kernel_order_only_if_on).
        (
            dict(order_method="kernel", longest_first=True),
            'order_method="kernel" needs a multiple of 4',
        ),
        (dict(balanced=True, num_splits=2), "cannot take {'num_splits': 2}"),
        (dict(balanced=True, producer=True), "cannot take {'producer': True}"),
        (dict(balanced=True, persistent=True), "cannot take {'persistent': True}"),
        (dict(balanced=True, swap_ab=False), "cannot take {'swap_ab': False}"),
        (dict(balanced=True, profile_dir="/tmp/p"), "cannot take {'profile_dir': '/tmp/p'}"),
        (dict(balanced=True, num_splits=True), "num_splits=True must be an integer"),
        (dict(balanced=True, longest_first=True), "cannot take {'longest_first': True}"),
        (dict(balanced=True, l2_prefetch=1, early_k=True), "'l2_prefetch': 1, 'early_k': True"),
        (dict(balanced=True, num_ctas=0), "num_ctas=0"),
        (dict(balanced=True, num_ctas=70000), "num_ctas=70000 must be at most 65535"),
        # Pages below 8 tokens run only in the default kernel
        (dict(C=4, producer=True), "page_size=4 with page_copy='cp_async' runs only in the"),
        (dict(page_copy="cp_async", persistent=True), "page_size=16 with page_copy='cp_async'"),
        (dict(C=2, persistent=True), "page_size=2 .* persistent=True"),
        (dict(C=1, balanced=True), "page_size=1 .* balanced=True"),
        (dict(C=1, num_stages=7), "num_stages=7 and k_stages=7 must be >= 1 and fit"),
        (dict(C=1, num_stages=6, page_copy="tma"), "num_stages=6 and k_stages=6"),
        (dict(C=1, page_copy="gather4"), "page_copy='gather4' must be one of"),
        (dict(split_merge="host"), "split_merge='host' must be one of"),
        (dict(split_merge="kernel", num_splits=2, swap_ab=False), 'split_merge="kernel" merges'),
        (dict(split_merge="mosaic", num_splits=2, swap_ab=False), 'split_merge="mosaic" merges'),
        (dict(C=2, early_k=True), r"cannot take l2_prefetch=0, early_k=True"),
        (dict(C=4, k_stages=3), r"k_stages=3 != num_stages=2 \(page_copy=\"tma\" can\)"),
        (dict(C=1, l2_prefetch=1), "cannot take l2_prefetch=1"),
        (dict(C=1, page_copy="cp_async", interpret=True), "runs only on a GPU"),
        (dict(auto_barriers=False, producer=True), "auto_barriers=False places its barriers"),
        (dict(auto_barriers=False, balanced=True), "cannot take producer=False, persisten"),
        (dict(C=4, auto_barriers=False, page_copy="tma"), "pages of 4 tokens with page_copy"),
        (dict(min_split_tiles=0), "min_split_tiles=0 must be >= 1"),
        (dict(min_split_tiles=2.5), "min_split_tiles=2.5 must be an integer"),
        (dict(fixed_max=True, producer=True), "fixed_max=True runs in the default kernel"),
        (dict(fixed_max=True, persistent=True), "fixed_max=True .* persistent=True"),
        (dict(fixed_max=True, balanced=True), "fixed_max=True .* balanced=True"),
        (
            dict(split_tail=1),
            r"split_tail=1 must be in \[0, B=2\] and needs num_splits >= 2 \(got 1",
        ),
        (dict(split_tail=3, num_splits=2), r"split_tail=3 must be in \[0, B=2\]"),
        (dict(split_tail=-1, num_splits=2), r"split_tail=-1 must be in"),
        (dict(split_tail=1, num_splits=2, split_merge="xla"), r"with swap_ab \(got 'xla'"),
        (dict(split_tail=1, num_splits=2, heads_inner=False), r"heads_inner=True \(got False\)"),
        (dict(split_tail=2.5), "split_tail=2.5 must be an integer"),
        (dict(order_head=1), r"order_head=1 must be in \[0, B=2\] and needs the longest-first"),
        (dict(order_head=3, longest_first=True), r"order_head=3 must be in \[0, B=2\]"),
    ],
)
def test_bad_arguments_raise(kw, match):
    dtype = kw.pop("dtype", jnp.bfloat16)
    shapes = _shapes(dtype=dtype, **({"C": kw.pop("C")} if "C" in kw else {}))
    q, k, v, bt, ln = (jnp.zeros(s.shape, s.dtype) for s in shapes)
    with pytest.raises(ValueError, match=match):
        kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1, **kw)


def test_kernel_order_only_if_on():
    # "kernel"'s own limits apply where the order is on: with it off (as by default on this
    # tiny grid) any sequence count and variant is accepted; with it on, producer, persistent
    # and slot_lengths are refused by name.
    q = jnp.zeros((4, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 8, 16, 64), jnp.bfloat16)
    bt, ln = jnp.zeros((4, 2), jnp.int32), jnp.ones((4,), jnp.int32)
    for kw in (dict(), dict(slot_lengths=True), dict(producer=True)):
        out = kernel_gpu.paged_attention_pallas_gpu(
            q[:2], kv, kv, bt[:2], ln[:2], sm_scale=0.1, order_method="kernel",
            longest_first=False, interpret=True, **kw,
        )  # fmt: skip
        assert out.shape == (2, 8, 64)
    for kw, why in (
        (dict(producer=True), "producer=True or persistent=True"),
        (dict(persistent=True), "producer=True or persistent=True"),
        (dict(slot_lengths=True), "slot_lengths=True"),
    ):
        with pytest.raises(ValueError, match=f'order_method="kernel" .*{re.escape(why)}'):
            kernel_gpu.paged_attention_pallas_gpu(
                q, kv, kv, bt, ln, sm_scale=0.1, order_method="kernel", longest_first=True,
                **kw,
            )  # fmt: skip


def test_interpret_kernel_order_window_splits_heads_outer():
    # The in-kernel order with a window (tiles counted from the window start), splits and the
    # previous head-major grid: every unit still maps to one (sequence, split, head).
    rng = np.random.default_rng(73)
    _run_case(rng, [5, 200, 0, 64, 130, 17, 64, 3], K=2, G=2, H=64, C=8, interpret=RACE_CHECKED,
              longest_first=True, order_method="kernel", window=37, num_splits=2,
              heads_inner=False)  # fmt: skip


def test_rank_order_bounded_by_batch():
    B, limit = 1025, kernel_gpu._RANK_ORDER_MAX_SEQS
    q = jnp.zeros((B, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
    bt, ln = jnp.zeros((B, 2), jnp.int32), jnp.ones((B,), jnp.int32)
    with pytest.raises(ValueError, match=f"at most {limit} sequences, got {B}"):
        kernel_gpu.paged_attention_pallas_gpu(q, kv, kv, bt, ln, sm_scale=0.1, order_method="rank")
    with pytest.raises(ValueError, match=f"at most {limit} sequences"):
        kernel_gpu._longest_first_order(ln, 64, True, "rank")
    with pytest.raises(ValueError, match="must be one of"):
        kernel_gpu._longest_first_order(ln, 64, True, "radix")
    with pytest.raises(ValueError, match="needs packed keys"):
        kernel_gpu._longest_first_order(ln, 64, False, "rank")
    # Checked before the early return of an empty table.
    empty = jnp.zeros((2, 0), jnp.int32)
    with pytest.raises(ValueError, match="order_method='bitonic'"):
        kernel_gpu.paged_attention_pallas_gpu(
            q[:2], kv, kv, empty, ln[:2] * 0, sm_scale=0.1, order_method="bitonic"
        )


def test_rank_order_is_int32_under_x64():
    lengths = jnp.asarray([5, 300, 0, 64], jnp.int32)
    with jax.enable_x64(True):
        out = kernel_gpu._longest_first_order(lengths, 64, True, "rank")
        ref = kernel_gpu._longest_first_order(lengths, 64, True, "sort")
    assert out.dtype == ref.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_empty_batch_returns_empty():
    q = jnp.zeros((0, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
    bt, ln = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32)
    for persistent in (False, True):
        out = kernel_gpu.paged_attention_pallas_gpu(
            q, kv, kv, bt, ln, sm_scale=0.1, persistent=persistent, interpret=True
        )
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
    assert out.shape == q.shape and not np.any(np.asarray(out.astype(jnp.float32)))
    bt = jnp.asarray([[0, 1, 2], [3, 1, 0]], jnp.int32)
    v = kv * jnp.arange(1, 5, dtype=jnp.bfloat16)[None, :, None, None]  # page p holds p + 1
    out = kernel_gpu.paged_attention_pallas_gpu(
        q, kv, v, bt, jnp.asarray([-200, 20], jnp.int32), sm_scale=0.1, num_splits=2,
        block_kv=64, interpret=RACE_CHECKED,
    )  # fmt: skip
    out = np.asarray(out.astype(jnp.float32))
    assert not np.any(out[0])
    # Equal scores: the mean of V over 20 tokens, 16 from page 3 (value 4) and 4 from page 1 (2).
    np.testing.assert_allclose(out[1], (16 * 4 + 4 * 2) / 20, rtol=1e-2)


def test_five_d_pool_needs_layer():
    q = jnp.zeros((1, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 2, 4, 16, 64), jnp.bfloat16)
    bt, ln = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="layer must be given"):
        kernel_gpu.paged_attention_pallas_gpu(q, kv, kv, bt, ln, sm_scale=0.1)


@pytest.mark.parametrize("B", [1, 7, 300, 1024, 65536])
def test_longest_first_order_packed_keys(B):
    rng = np.random.default_rng(B)
    lengths = rng.integers(0, 5000, size=B).astype(np.int32)
    lengths[: B // 3] = 64 * 40  # ties sort by slot
    if B > 1:
        lengths[-1] = 2**31 - 1  # past the 0x7FFF-tile cap
    if B > 7:
        lengths[1:4] = [-1, -65, -(2**31)]  # invalid lengths sort last, with the empty ones
    assert kernel_gpu._packed_order(B)
    keys = np.asarray(kernel_gpu._longest_first_order(jnp.asarray(lengths), 64, True))
    order = keys & 0xFFFF
    tiles = np.minimum(-(-np.maximum(lengths, 0).astype(np.int64) // 64), 0x7FFF)
    np.testing.assert_array_equal(order, np.argsort(-tiles, kind="stable"))
    if B <= kernel_gpu._RANK_ORDER_MAX_SEQS:  # counting gives the sort's array exactly
        rank = kernel_gpu._longest_first_order(jnp.asarray(lengths), 64, True, "rank")
        np.testing.assert_array_equal(np.asarray(rank), keys)
    plain = np.asarray(kernel_gpu._longest_first_order(jnp.asarray(lengths), 64, False))
    np.testing.assert_array_equal(np.sort(plain), np.arange(B))
    assert np.all(np.diff(np.maximum(lengths[plain], 0).astype(np.int64)) <= 0)


def test_default_tuning_from_static_shapes():
    # Many programs: no split. Few programs, long context: split, bounded by tiles per split.
    assert kernel_gpu.default_num_splits(128, 8, 3072, 64) == 1
    assert kernel_gpu.default_num_splits(1, 8, 49152, 64) == 32  # one sequence: one wave
    assert kernel_gpu.default_num_splits(2, 8, 49152, 64) == 16  # two: one wave too
    assert kernel_gpu.default_num_splits(4, 8, 49152, 64) == 16  # four: two waves
    assert kernel_gpu.default_num_splits(1, 32, 49152, 64) == 8
    assert kernel_gpu.default_num_splits(1, 2, 49152, 64) == 64  # capped
    assert kernel_gpu.default_num_splits(8, 8, 1024, 64) == 4
    assert kernel_gpu.default_num_splits(1, 1, 64, 64) == 1
    assert kernel_gpu.default_num_splits(8, 8, 49152, 64) == 8  # ~512 CTAs
    # About one wave of programs: split only long sequences (>= 32 tiles a split, 2 splits from
    # 48-tile tables), and those splits run longest first.
    assert kernel_gpu.default_num_splits(32, 8, 2048, 64) == 1
    assert kernel_gpu.default_num_splits(32, 8, 3008, 64) == 1  # 47 tiles
    assert kernel_gpu.default_num_splits(32, 8, 3072, 64) == 2
    assert kernel_gpu.default_num_splits(48, 8, 3072, 64) == 2
    assert kernel_gpu.default_num_splits(32, 8, 6144, 64) == 3
    assert kernel_gpu.default_num_splits(32, 8, 12288, 64) == 4
    assert kernel_gpu.default_longest_first(32, 8, 2, 3072)
    assert kernel_gpu.default_longest_first(48, 8, 2, 3072)
    assert kernel_gpu.default_longest_first(32, 8, 3, 6144)
    assert kernel_gpu.default_num_splits(64, 8, 6144, 64) == 1  # two waves: never
    # Longest first once the grid is more than one wave (2 x 132 CTAs), never for B = 1.
    assert kernel_gpu.default_longest_first(128, 8, 1)
    assert kernel_gpu.default_longest_first(8, 8, 16)
    assert not kernel_gpu.default_longest_first(1, 8, 64)
    assert not kernel_gpu.default_longest_first(32, 8, 1)  # 256 CTAs: one wave
    # Given the table's reach: only units that can exceed 2048 tokens are ordered.
    assert kernel_gpu.default_longest_first(128, 8, 1, 4096)
    assert not kernel_gpu.default_longest_first(256, 8, 1, 2048)
    assert kernel_gpu.default_longest_first(8, 8, 8, 49152)  # 6144 tokens per split
    assert not kernel_gpu.default_longest_first(8, 8, 8, 16384)  # 2048 per split
    assert not kernel_gpu.default_longest_first(32, 8, 1, 1 << 20)  # one wave
    assert kernel_gpu.default_order_method(1024) == "rank"
    assert kernel_gpu.default_order_method(1025) == "sort"
    # Each CTA counts its own place (no XLA kernel) for multiples of 4 up to 256 sequences.
    assert kernel_gpu.default_order_method(128) == "kernel"
    assert kernel_gpu.default_order_method(256) == "kernel"
    assert kernel_gpu.default_order_method(4) == "kernel"
    assert kernel_gpu.default_order_method(130) == "rank"
    assert kernel_gpu.default_order_method(260) == "rank"
    assert kernel_gpu.default_order_method(128, producer=True) == "rank"
    assert kernel_gpu.default_order_method(128, persistent=True) == "rank"
    assert kernel_gpu.default_order_method(128, slot_lengths=True) == "rank"
    assert kernel_gpu.default_deferred_sum()
    # The kernel's own barriers in the default body; Pallas's in the other bodies.
    assert not kernel_gpu.default_auto_barriers()
    assert kernel_gpu.default_auto_barriers(producer=True)
    assert kernel_gpu.default_auto_barriers(persistent=True)
    assert kernel_gpu.default_auto_barriers(balanced=True)
    assert kernel_gpu.default_auto_barriers(staged=True)
    # Two CTAs per SM: the ring fits in ~113 KB.
    for H in (64, 128, 256):
        stages = kernel_gpu.default_num_stages(H)
        assert stages >= 2
        assert kernel_gpu._smem_bytes(H, 64, stages) <= 113 * 1024 or stages == 2
    # The persistent kernel's output tiles share P's SMEM: two CTAs per SM at H=128, split too.
    assert kernel_gpu.default_num_stages(128, 64, persistent=True) == 2
    # swap_ab: 2 stages, 68 KB at H=128: three CTAs per SM by SMEM (3 x (68 + 1) <= 228 KB).
    assert kernel_gpu.default_num_stages(128, 64, qcols=8) == 2
    assert kernel_gpu._smem_bytes(128, 64, 2, qcols=8) <= 75 * 1024
    assert kernel_gpu._smem_bytes(128, 64, 2, persistent=True, split=True) <= 113 * 1024
    # The producer variant runs one CTA per SM (registers): 4 stages where one CTA's SMEM fits.
    for H, stages in ((64, 4), (128, 4), (256, 2)):
        T = kernel_gpu.default_block_kv(H)
        assert kernel_gpu.default_num_stages(H, T, producer=True) == stages
        assert kernel_gpu._smem_bytes(H, T, stages, producer=True) <= kernel_gpu._SMEM_BYTES


# --------------------------------------------------------------------------- GPU

GPU_PRODUCT = [
    (C, G, H, dtype)
    for C in (1, 2, 4, 8, 16, 32, 64, 128, 256)
    for G in (1, 4, 8)
    for H in (64, 128, 256)
    for dtype in ("bfloat16", "float16")
    if (C + G + H) % 3 == 0 or (C == 16 and dtype == "bfloat16")  # a spread, not the full cube
]


@pytest.mark.gpu
@pytest.mark.parametrize("C,G,H,dtype", GPU_PRODUCT, ids=str)
def test_gpu_matches_reference(C, G, H, dtype):
    rng = np.random.default_rng(C * 1000 + G * 10 + H)
    lengths = [0, 1, C - 1, C, C + 1, 2 * C + 5, int(rng.integers(300, 1500))]
    _run_case(rng, lengths, K=2, G=G, H=H, C=C, dtype=jnp.dtype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("splits,swap_ab", [(1, None), (4, None), (16, None), (4, False)])
def test_gpu_long_32k(splits, swap_ab):
    # swap_ab=False: the 64-row tile with splits and f32 partials (swap_ab is the default).
    rng = np.random.default_rng(splits)
    _run_case(rng, [32768, 1, 20001], K=2, G=4, H=128, C=16, num_splits=splits, swap_ab=swap_ab)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [
        dict(soft_cap=30.0),
        dict(window=100),
        dict(window=1),
        dict(window=700, soft_cap=50.0, num_splits=3),
        dict(num_layers=3, layer=jnp.int32(2)),
        dict(num_layers=2, layer=1, block_kv=128),
        dict(sm_scale=0.3, num_stages=2, longest_first=True),
        dict(longest_first=True, slot_lengths=True, num_splits=2),
        dict(swap_ab=False, num_splits=1),  # the 64-row tile without splits
        dict(swap_ab=False, num_splits=1, num_layers=2, layer=1, block_kv=128),
        dict(sm_scale=-0.05, num_splits=2),  # the scale stays out of exp2
        dict(num_splits=2, longest_first=True, heads_inner=False),
        dict(out_of_range_tail=True, num_splits=2),
        dict(l2_prefetch=2, num_splits=2, out_of_range_tail=True),
        dict(deferred_sum=False, num_splits=1, window=700),  # the sum over keys every tile
        dict(deferred_sum=False, num_splits=3, soft_cap=50.0),
        dict(l2_prefetch=4, window=700, soft_cap=50.0),
        dict(early_k=True),
        dict(early_k=True, k_stages=3, out_of_range_tail=True),
        dict(k_stages=3, num_splits=3, window=700, soft_cap=50.0),
        dict(early_k=True, k_stages=3, num_stages=1, block_kv=128, num_layers=2, layer=1),
    ],
    ids=str,
)
def test_gpu_options(extra):
    rng = np.random.default_rng(7)
    lengths = [0, 1, 15, 16, 17, 99, 1000, 2500]
    _run_case(rng, lengths, K=4, G=4, H=128, C=16, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "C,G,H,extra",
    [
        (16, 4, 128, dict()),
        (16, 4, 128, dict(num_splits=4)),
        (16, 1, 128, dict(num_splits=2, out_of_range_tail=True)),
        (8, 8, 64, dict()),  # T=128
        (64, 4, 256, dict(num_splits=3)),
        (16, 4, 128, dict(window=700, soft_cap=50.0, num_splits=3)),
        (32, 6, 128, dict(num_stages=2)),  # G=6: 16 query columns
        (16, 4, 128, dict(num_stages=2, k_stages=3, early_k=True, dtype="float16")),
        (16, 4, 128, dict(longest_first=True, num_layers=2, layer=1)),
        # Without splits (these 8-sequence batches split by default): O^T stored transposed
        (16, 4, 128, dict(num_splits=1)),
        (16, 1, 128, dict(num_splits=1, out_of_range_tail=True)),
        (8, 8, 64, dict(num_splits=1)),  # T=128
        (64, 4, 256, dict(num_splits=1)),
        (16, 4, 128, dict(num_splits=1, window=700, soft_cap=50.0)),
        (32, 6, 128, dict(num_splits=1)),  # 16 query columns
        (16, 16, 128, dict(num_splits=1)),  # G=16: 16 query columns
        (16, 4, 128, dict(num_splits=1, block_kv=128, sm_scale=-0.05)),
        (16, 4, 128, dict(num_splits=1, num_stages=2, k_stages=3, early_k=True, dtype="float16")),
    ],
    ids=str,
)
def test_gpu_swap_ab(C, G, H, extra):
    rng = np.random.default_rng(C + G + H)
    extra = dict(extra)
    dtype = jnp.dtype(extra.pop("dtype", "bfloat16"))
    lengths = [0, 1, C - 1, C, C + 1, 99, 1000, 2500]
    _run_case(rng, lengths, K=4, G=G, H=H, C=C, dtype=dtype, swap_ab=True, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 8])
def test_gpu_swap_ab_long_and_many(splits):
    rng = np.random.default_rng(90 + splits)
    _run_case(rng, [32768, 1, 20001], K=2, G=4, H=128, C=16, num_splits=splits, swap_ab=True)
    lengths = rng.integers(0, 3000, size=96)
    _run_case(rng, lengths, K=8, G=4, H=128, C=16, swap_ab=True)


def _page_case(rng, C, extra):
    """(lengths, keyword arguments of ``_run_case``) of a case given by its page size and a dict
    that may set ``dtype``, ``H``, ``G`` and ``lengths`` (default 0, 1, C-1, C, C+1, 99, 1000,
    2500; ``"many"``: 96 random lengths below 3000) besides kernel options."""
    extra = dict(extra)
    kw = dict(dtype=jnp.dtype(extra.pop("dtype", "bfloat16")), H=extra.pop("H", 128))
    kw["G"] = extra.pop("G", 4)
    lengths = extra.pop("lengths", [0, 1, max(C - 1, 0), C, C + 1, 99, 1000, 2500])
    if isinstance(lengths, str) and lengths == "many":
        lengths = rng.integers(0, 3000, size=96)
    return lengths, {**kw, **extra}


# Cases that a tuning knob's GPU test runs first (``_page_case``), before its own.
_KNOB_CASES = [
    (16, dict()),
    (16, dict(lengths="many")),  # 96 x 8 pairs, longest first (the in-kernel order)
    (16, dict(lengths=[32768, 1, 20001])),  # splits merged in the kernel
    (64, dict(window=700, soft_cap=50.0, num_splits=3)),
    (8, dict(H=64, G=1, num_splits=1)),  # T=128, 16 copies a tile
]


_SMALL_PAGE_CASES = [
    (1, dict(lengths=[32768, 1, 20001])),  # 32k one-token pages, splits by default
    (2, dict(lengths=[32768, 0, 3], num_splits=1)),
    (4, dict(window=700, soft_cap=50.0, num_splits=3)),
    (1, dict(swap_ab=False, num_splits=1, out_of_range_tail=True)),  # the 64-row tile
    (2, dict(num_layers=2, layer=1, block_kv=128, G=8)),
    (4, dict(num_stages=3, dtype="float16")),
    (1, dict(H=64, G=1)),  # T=128
    (4, dict(H=256, num_splits=2)),
    (2, dict(sm_scale=-0.05, num_stages=1)),
    (1, dict(lengths="many", longest_first=True)),  # 96 sequences, the in-kernel order
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "C,extra",
    _SMALL_PAGE_CASES
    + [(C, dict(e, page_copy="tma")) for C, e in _SMALL_PAGE_CASES]
    + [
        (4, dict(num_stages=2, k_stages=3, early_k=True, page_copy="tma")),
        (2, dict(l2_prefetch=2, page_copy="tma")),
        # Pages of 8+ tokens copied per thread too (opt-in)
        (16, dict(page_copy="cp_async", lengths=[32768, 1, 20001])),
        (8, dict(page_copy="cp_async", H=64, window=700, soft_cap=50.0)),
        (128, dict(page_copy="cp_async", swap_ab=False, num_splits=3)),  # C > T
        (256, dict(page_copy="cp_async", H=256, G=8)),
    ],
    ids=str,
)
def test_gpu_small_pages(C, extra):
    # Pages of 1, 2 and 4 tokens: per-thread cp.async pieces into the tiled ring (default), or
    # TMA into an untiled staging ring re-laid in SMEM (``_relayout``); NaN-poisoned free pages
    # and tails, permuted tables.
    rng = np.random.default_rng(C * 7 + len(extra))
    lengths, extra = _page_case(rng, C, extra)
    _run_case(rng, lengths, K=4, C=C, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "C,extra",
    [
        *_KNOB_CASES,
        (256, dict(H=256, G=8, num_splits=2, early_k=True, k_stages=3)),
        (128, dict(swap_ab=False, num_splits=3, split_merge="xla")),  # the 64-row tile, C > T
        (2, dict(lengths=[32768, 0, 3], num_splits=1)),  # per-thread cp.async copies
        (32, dict(num_layers=2, layer=1, dtype="float16", G=6)),  # 16 query columns
        (16, dict(sm_scale=-0.05, auto_barriers=True)),  # the scale applied per score
        # Logits 100x sharper: units whose later scores overflow against the first tile's max
        # are read again with the running max.
        (16, dict(q_scale=100.0, lengths=[32768, 1, 20001, 700])),
        (16, dict(q_scale=100.0, swap_ab=False, num_splits=2)),
        (16, dict(q_scale=3.0, dtype="float16", lengths="many")),
        # The running max in every tile (bf16's default before fixed_max)
        (16, dict(fixed_max=False, lengths="many")),
        (16, dict(fixed_max=False, q_scale=100.0, lengths=[32768, 1, 20001, 700])),
        (64, dict(fixed_max=False, window=700, soft_cap=50.0, num_splits=3)),
    ],
    ids=str,
)
def test_gpu_fixed_max(C, extra):
    # Each case twice, NaN-poisoned free pages.
    rng = np.random.default_rng(C + 11 * len(extra))
    lengths, extra = _page_case(rng, C, {"fixed_max": True, **extra})
    for _ in range(2):
        _run_case(rng, lengths, K=8, C=C, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["kernel", "xla"])
@pytest.mark.parametrize(
    "lengths,extra",
    [
        ([32768], dict(K=8)),  # one sequence: 32 splits by default, merge rounds of 16
        ([32768, 1, 20001], dict(num_splits=64)),  # 64 splits (4 rounds), most of them empty
        ("many", dict(num_splits=3)),  # 96 x 4 pairs of 3 splits: 1152 CTAs, several waves
        ([0, 1, 15, 16, 17, 99, 1000, 2500], dict(G=1, H=64, dtype="float16", num_splits=5)),
        ([0, 1, 17, 5000, 2500], dict(window=700, soft_cap=50.0, num_splits=4, G=8)),
        ([0, 1, 3, 4, 5, 3000], dict(C=1, num_splits=4)),  # one-token pages (cp.async)
        ([9000, 1, 300], dict(num_layers=2, layer=1, num_splits=7, longest_first=True)),
        ([9000, 0, 3000, 64], dict(num_splits=6, heads_inner=False)),  # grid (head, split, seq)
    ],
    ids=str,
)
def test_gpu_split_merge(lengths, extra, merge):
    # Split partials merged by the last split CTA of each pair (arrival counters, acquire-
    # release) or by XLA; each case twice (JAX zeroes the counters before every launch; the
    # kernel resets each one it finished too).
    rng = np.random.default_rng(len(extra) + len(lengths))
    extra = dict(extra)
    dtype = jnp.dtype(extra.pop("dtype", "bfloat16"))
    K, G, H, C = extra.pop("K", 4), extra.pop("G", 4), extra.pop("H", 128), extra.pop("C", 16)
    if lengths == "many":
        lengths = rng.integers(0, 3000, size=96)
    for _ in range(2):
        _run_case(rng, lengths, K=K, G=G, H=H, C=C, dtype=dtype, split_merge=merge, **extra)


@pytest.mark.gpu
def test_gpu_many_sequences_default_tuning():
    # 96 sequences of up to 3000 tokens: longest first, counted in each CTA (order "kernel").
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 3000, size=96)
    _run_case(rng, lengths, K=8, G=4, H=128, C=16)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [32, 48])
def test_gpu_one_wave_default_tuning(B):
    # About one wave of (sequence, KV head) pairs with 48+ tile tables: by default 2 splits,
    # longest first (counted in each CTA), merged by the second kernel; lengths 0, 1, C-1, C,
    # C+1.
    rng = np.random.default_rng(12 + B)
    lengths = rng.integers(1000, 3072, size=B)
    lengths[:6] = [0, 1, 15, 16, 17, 3072]
    width = 3072 // 16  # make_paged_kv's table: as wide as the longest sequence needs
    assert kernel_gpu.default_num_splits(B, 8, width * 16, 64) == 2
    assert kernel_gpu.default_longest_first(B, 8, 2, width * 16)
    assert kernel_gpu.default_split_merge(2, True) == "mosaic"
    _run_case(rng, lengths, K=8, G=4, H=128, C=16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "C,extra",
    [
        *_KNOB_CASES,
        (256, dict(H=256, G=8, num_splits=2)),
        (128, dict(swap_ab=False, num_splits=3, split_merge="xla")),  # the 64-row tile, C > T
        (16, dict(early_k=True, k_stages=3, out_of_range_tail=True)),
        (32, dict(num_layers=2, layer=1, dtype="float16", G=6)),  # 16 query columns
        (2, dict(lengths=[32768, 0, 3], num_splits=1)),  # per-thread cp.async copies
    ],
    ids=str,
)
@pytest.mark.parametrize("auto_barriers", [False, True])
def test_gpu_auto_barriers(C, extra, auto_barriers):
    # False (the default): no barrier before each page copy or around each SMEM store, only the
    # kernel's own (a tile's slot refilled after every warp's P @ V; the output tiles, which
    # reuse the ring; Q after the order's SMEM); True: Pallas's automatic ones. Each case
    # twice, NaN-poisoned free pages.
    rng = np.random.default_rng(C + len(extra))
    lengths, extra = _page_case(rng, C, extra)
    for _ in range(2):
        _run_case(rng, lengths, K=8, C=C, auto_barriers=auto_barriers, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["kernel", "xla"])
@pytest.mark.parametrize(
    "lengths,extra",
    [
        # Mixed lengths in a 32k-wide table: 8 splits by the width; a sequence of t tiles is
        # read by clip(t // 4, 1, 8) of them (the short ones by one, written straight out).
        ([32768, 0, 1, 15, 16, 17, 100, 600, 1000, 3000], dict(min_split_tiles=4)),
        # About one wave of pairs (32 x 8) in an 8k table: 4 splits, a floor of 8 by default
        ("wave", dict()),
        ([32768, 1, 63, 64, 65, 255, 257, 5000], dict(min_split_tiles=16, G=8)),
        ([20000, 1, 17, 700, 2600], dict(window=700, soft_cap=50.0, C=64)),
        ("many", dict(num_splits=3, min_split_tiles=8)),  # 96 x 8 pairs: several waves
        # 16 query columns (swap_ab asked for: the default there is the 64-row tile, which
        # the kernel merge does not take)
        ([9000, 1, 300, 64], dict(num_layers=2, layer=1, dtype="float16", G=6, swap_ab=True)),
    ],
    ids=str,
)
def test_gpu_min_split_tiles(lengths, extra, merge):
    # Splits that keep min_split_tiles tiles each, from each sequence's length on the device:
    # the splits past them store nothing and (merged in the kernel) never arrive. Each case
    # twice (the arrival counters back at zero), NaN-poisoned free pages.
    rng = np.random.default_rng(len(lengths) + len(extra))
    extra = dict(extra)
    C = extra.pop("C", 16)
    if lengths == "wave":
        lengths = rng.integers(0, 1200, size=32)
        lengths[:6] = [8192, 0, 1, 511, 512, 513]
        assert kernel_gpu.default_num_splits(32, 8, 8192, 64) == 4
        assert kernel_gpu.default_min_split_tiles(32, 8, 4) == 8
    lengths, extra = _page_case(rng, C, dict(extra, lengths=lengths))
    for _ in range(2):
        _run_case(rng, lengths, K=8, C=C, split_merge=merge, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,extra",
    [
        (128, dict(order_head=48)),  # about the first wave at 8 KV heads unordered
        (256, dict(order_head=100, window=700, soft_cap=30.0)),
        (40, dict(order_head=12, num_splits=2, split_tail=8, split_merge="kernel")),
        (64, dict(order_head=64, G=8, dtype="float16")),  # all in batch order
    ],
    ids=str,
)
def test_gpu_order_head(B, extra):
    # The first order_head slots in batch order without counting, the rest longest first
    # (counted in each CTA); each case twice, NaN-poisoned free pages, lengths 0, 1, C-1, C,
    # C+1 among random ones up to 3k.
    rng = np.random.default_rng(B + 7)
    lengths = rng.integers(0, 3000, size=B)
    lengths[:5] = [0, 1, 15, 16, 17]
    lengths, extra = _page_case(rng, 16, dict(extra, lengths=lengths))
    for _ in range(2):
        _run_case(rng, lengths, K=8, C=16, longest_first=True, order_method="kernel", **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,extra",
    [
        (1, dict(num_splits=32)),  # B=1 at 32k: 32 splits, one merge round of 32
        (2, dict(num_splits=16, window=5000, soft_cap=30.0)),
        (8, dict(num_splits=8, G=8, dtype="float16")),  # G fills the 8 query columns
        (4, dict(num_splits=40, H=64, K=4, C=64, num_layers=2, layer=1, min_split_tiles=2)),
        (16, dict(num_splits=4, H=256, C=32, swap_ab=True)),
        # Whole output blocks (jax >= 0.12's swap_ab form), forced on jax 0.11.2: B=1 at 32
        # splits, and odd G at head dim 64 (a piece loads G + 1 rows)
        (1, dict(num_splits=32, out_blocks=True)),
        (3, dict(num_splits=20, H=64, G=5, swap_ab=True, out_blocks=True, window=9000)),
        (2, dict(num_splits=24, H=64, G=3, K=4, swap_ab=True)),  # odd G, direct stores
        (2, dict(num_splits=17, G=16, K=2, swap_ab=True)),  # 16 query columns
    ],
    ids=str,
)
def test_gpu_mosaic_merge(B, extra):
    # split_merge="mosaic": the splits' partials merged by a second Mosaic GPU kernel (one CTA
    # a pair). Each case twice, NaN-poisoned free pages, lengths 0, 1, C-1, C, C+1 and up to
    # 32k (splits past a short sequence's end: lse -inf, zero partials).
    rng = np.random.default_rng(B + 300)
    extra = dict(extra)
    C, K = extra.pop("C", 16), extra.pop("K", 8)
    lengths = rng.integers(0, 32768, size=max(B, 1))
    lengths[: min(B, 5)] = [32768, 0, C - 1, C, C + 1][: min(B, 5)]
    extra.setdefault("G", 4)
    extra.setdefault("H", 128)
    lengths, extra = _page_case(rng, C, dict(extra, lengths=lengths))
    for _ in range(2):
        _run_case(rng, lengths, K=K, C=C, split_merge="mosaic", **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,extra",
    [
        (128, dict(split_tail=32)),  # in-kernel order: the 32 shortest sequences split
        (128, dict(split_tail=128, min_split_tiles=8)),  # every one, with the floor
        (256, dict(split_tail=50, num_splits=3, longest_first=False)),  # the batch's last 50
        (64, dict(split_tail=16, window=700, soft_cap=30.0, G=8)),
        (96, dict(split_tail=24, H=64, K=4, C=64, dtype="float16", num_layers=2, layer=1)),
        (40, dict(split_tail=1, num_splits=4, order_method="sort", longest_first=True)),
    ],
    ids=str,
)
def test_gpu_split_tail(B, extra):
    # Only the last split_tail sequences of the dispatch order are split, merged in the kernel;
    # the rest are read whole. Each case twice (the arrival counters back at zero),
    # NaN-poisoned free pages, lengths 0, 1, C-1, C, C+1 and up to 3k.
    rng = np.random.default_rng(B + len(extra))
    extra = dict(extra)
    C, K = extra.pop("C", 16), extra.pop("K", 8)
    lengths = rng.integers(0, 3000, size=B)
    lengths[:5] = [0, 1, C - 1, C, C + 1]
    lengths[-3:] = [2 * C - 1, 1, 0]  # the batch's last (the tail without the order)
    extra.setdefault("num_splits", 2)
    extra.setdefault("G", 4)
    extra.setdefault("H", 128)
    lengths, extra = _page_case(rng, C, dict(extra, lengths=lengths))
    for _ in range(2):
        _run_case(rng, lengths, K=K, C=C, split_merge="kernel", **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,extra",
    [
        (132, dict()),  # two keys a thread
        (256, dict(soft_cap=30.0)),
        (40, dict(num_splits=3, window=700)),
        (64, dict(order_method="rank")),  # the XLA forms, for comparison
        (64, dict(order_method="sort", swap_ab=False)),
    ],
    ids=str,
)
def test_gpu_kernel_order(B, extra):
    rng = np.random.default_rng(B)
    lengths = rng.integers(0, 2500, size=B)
    lengths[:5] = [0, 1, 15, 16, 17]
    _run_case(rng, lengths, K=8, G=4, H=128, C=16, longest_first=True, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths,C,H,extra",
    [
        ("many", 16, 128, dict()),  # 96 x 8 units on 264 CTAs, longest first
        ("many", 64, 128, dict(num_splits=3, num_ctas=50)),
        ("many", 8, 64, dict(num_ctas=17)),  # T=128
        ("many", 256, 256, dict(num_splits=2)),  # one CTA per SM
        ("edge", 16, 128, dict(num_ctas=5, soft_cap=30.0, window=100)),
        ("edge", 32, 128, dict(num_ctas=3, num_stages=1, num_splits=4)),
        ("edge", 16, 128, dict(num_ctas=1, out_of_range_tail=True)),
        ("long", 16, 128, dict(num_splits=16)),
        ("long", 16, 128, dict(num_splits=1, num_ctas=2)),
        ("many", 16, 128, dict(num_ctas=40)),
        ("edge", 8, 128, dict(num_ctas=3, num_splits=2)),
    ],
    ids=str,
)
def test_gpu_persistent(lengths, C, H, extra):
    rng = np.random.default_rng(C + H + len(extra))
    if lengths == "many":
        lengths, K = rng.integers(0, 3000, size=96), 8
    elif lengths == "edge":
        lengths, K = [0, 1, C - 1, C, C + 1, 99, 1000, 2500, 0, 7], 4
    else:
        lengths, K = [32768, 1, 20001, 0], 2
    _run_case(rng, lengths, K=K, G=4, H=H, C=C, persistent=True, **extra)


# Last in the file: the warp-specialized variant (a hang here would not hide earlier results).
@pytest.mark.gpu
@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize(
    "H,extra",
    [
        (128, dict(num_splits=1)),  # default ring: 4 stages
        (128, dict(num_splits=1, num_stages=6)),  # the deepest that fits
        (128, dict(num_splits=4)),
        (128, dict(num_splits=1, num_stages=2)),  # the ring wraps every other tile
        (128, dict(num_splits=2, num_stages=1)),
        (128, dict(num_splits=3, window=700, soft_cap=50.0)),
        (64, dict(num_splits=1)),  # T=128
        (256, dict(num_splits=2)),  # 2 stages
    ],
    ids=str,
)
def test_gpu_producer_warpgroup(C, H, extra):
    rng = np.random.default_rng(C + H)
    lengths = [0, 1, C - 1, C, C + 1, 99, 1000, 2500]
    _run_case(rng, lengths, K=4, G=4, H=H, C=C, producer=True, **extra)


# After the producer tests: a semaphore wait that never ends would hang here, last.
@pytest.mark.gpu
@pytest.mark.parametrize(
    "lengths,C,G,H,extra",
    [
        ("many", 16, 4, 128, dict()),  # 96 x 8 pairs on 396 CTAs (3 per SM)
        ("many", 64, 4, 128, dict(num_ctas=50)),
        ("many", 8, 4, 64, dict()),  # T=128
        ("many", 256, 4, 256, dict()),  # one CTA per SM by SMEM: 132
        ("many", 16, 1, 128, dict(dtype=jnp.float16)),
        ("many", 32, 8, 128, dict(soft_cap=30.0, window=700)),
        ("edge", 16, 4, 128, dict(num_ctas=5, soft_cap=30.0, window=100)),  # no pair cut
        ("many", 16, 24, 128, dict()),  # 24 query columns: lse rows 96 bytes apart
        ("edge", 32, 4, 128, dict(num_ctas=3)),
        ("edge", 16, 4, 128, dict(num_ctas=1, out_of_range_tail=True)),
        ("edge", 128, 4, 128, dict()),  # more CTAs than tiles: empty shares
        ("long", 16, 4, 128, dict()),  # 32k: about 100 pieces a pair, 7 merge rounds
        ("long", 16, 4, 128, dict(num_ctas=7)),
        ("one", 16, 4, 128, dict()),  # B=1, 8 KV heads at 32k
    ],
    ids=str,
)
def test_gpu_balanced(lengths, C, G, H, extra):
    rng = np.random.default_rng(C + G + H + len(extra))
    K = 8
    if lengths == "many":
        lengths = rng.integers(0, 3000, size=96)
        lengths[:6] = [0, 1, C - 1, C, C + 1, 0]
    elif lengths == "edge":
        lengths, K = [0, 1, C - 1, C, C + 1, 99, 1000, 2500, 0, 7], 4
    elif lengths == "long":
        lengths, K = [32768, 1, 20001, 0], 2
    else:
        lengths = [32768]
    # Twice: the semaphores are back at zero after a call.
    for _ in range(2):
        _run_case(rng, lengths, K=K, G=G, H=H, C=C, balanced=True, **extra)


def test_balanced_smem_overflow_is_a_clear_error():
    # 24000 lengths at head dim 256: the lengths' SMEM (twice 94 KB) and the 128 KB ring.
    B, K, H = 24000, 8, 256
    args = (
        jax.ShapeDtypeStruct((B, 8, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((K, 10, 16, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((K, 10, 16, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((B, 4), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32),
    )
    f = functools.partial(kernel_gpu.paged_attention_pallas_gpu, sm_scale=0.1, balanced=True)
    with pytest.raises(ValueError, match=r"balanced=True needs \d+ bytes of SMEM"):
        jax.eval_shape(f, *args)


def test_swap_ab_lowers_gate(monkeypatch):
    # jax 0.12's Mosaic GPU layout inference exhausts its search on swap_ab's direct store (G
    # rows copied from a dynamic offset of the transposed output tile): there swap_ab stores
    # whole blocks (out_blocks) and the kernel merge and the balanced kernel are refused.
    from pallas_kernels.paged_attention import _gpu_config

    assert _gpu_config.swap_ab_lowers("0.11.2")
    assert not _gpu_config.swap_ab_lowers("0.12.0.1")
    assert not _gpu_config.swap_ab_lowers("1.0.0")
    monkeypatch.setattr(jax, "__version__", "0.12.0.1")
    seen = []
    monkeypatch.setattr(kernel_gpu, "_paged_attention", lambda cfg, *a: seen.append(cfg))
    shapes = _shapes()
    q, k, v, bt, ln = (jnp.zeros(s.shape, s.dtype) for s in shapes)
    kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1)
    kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1, num_splits=3)
    kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1, interpret=True)
    got = [(c.swap_ab, c.out_blocks, c.kernel_merge) for c in seen]
    assert got == [(True, True, False), (True, True, False), (True, False, False)], got
    monkeypatch.undo()
    monkeypatch.setattr(jax, "__version__", "0.12.0.1")
    for kw in (
        dict(balanced=True), dict(swap_ab=True, num_splits=2, split_merge="kernel"),
        dict(swap_ab=True, out_blocks=False),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=r"does not lower on jax 0\.12\.0\.1"):
            kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1, **kw)
    # The interpreter does not lower it: the direct store still runs there.
    out = kernel_gpu.paged_attention_pallas_gpu(
        q, k, v, bt, ln, sm_scale=0.1, swap_ab=True, interpret=True
    )
    assert out.shape == q.shape
    # G = 8 fills the 8-column tile: its direct store is the whole tile, which 0.12 lowers, so
    # no whole blocks and no gather; splits merge by XLA, the kernel merge is still refused.
    q8 = jnp.zeros((2, 64, 128), jnp.bfloat16)
    seen.clear()
    monkeypatch.setattr(kernel_gpu, "_paged_attention", lambda cfg, *a: seen.append(cfg))
    for kw in (dict(), dict(num_splits=3), dict(swap_ab=True, out_blocks=False)):
        kernel_gpu.paged_attention_pallas_gpu(q8, k, v, bt, ln, sm_scale=0.1, **kw)
    got = [(c.swap_ab, c.out_blocks, c.kernel_merge, c.qcols, c.group) for c in seen]
    assert got == [(True, False, False, 8, 8)] * 3, got
    with pytest.raises(ValueError, match=r"does not lower on jax 0\.12\.0\.1"):
        kernel_gpu.paged_attention_pallas_gpu(
            q8, k, v, bt, ln, sm_scale=0.1, num_splits=2, split_merge="kernel", swap_ab=True
        )


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
    lengths, extra = _page_case(rng, C, extra)
    _run_case(rng, lengths, K=2, C=C, interpret=interpret, swap_ab=True, out_blocks=True, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "C,extra",
    [
        *_KNOB_CASES,
        (32, dict(num_layers=2, layer=1, dtype="float16", G=6)),  # 16 query columns
        (1, dict(lengths=[32768, 1, 20001])),  # per-thread cp.async copies, splits
        (256, dict(H=256, G=8, num_splits=2, swap_ab=True)),
    ],
    ids=str,
)
def test_gpu_out_blocks(C, extra):
    # Each case twice, NaN-poisoned free pages; the splits merged by XLA.
    rng = np.random.default_rng(C + 17 * len(extra))
    lengths, extra = _page_case(rng, C, {"out_blocks": True, "swap_ab": True, **extra})
    for _ in range(2):
        _run_case(rng, lengths, K=8, C=C, **extra)


def test_out_blocks_arguments():
    q, k, v, bt, ln = (jnp.zeros(s.shape, s.dtype) for s in _shapes())
    for kw in (dict(balanced=True), dict(num_splits=2, split_merge="kernel", swap_ab=True)):
        with pytest.raises(ValueError, match="out_blocks=True cannot take balanced="):
            kernel_gpu.paged_attention_pallas_gpu(
                q, k, v, bt, ln, sm_scale=0.1, out_blocks=True, **kw
            )


# --------------------------------------------------------------------------- tcgen05 (Blackwell)
# No Blackwell GPU here: the tcgen05 kernel is checked in the Mosaic GPU interpreter (which
# runs its MMAs, TMEM and tensor-core barriers) and lowered for sm100 on the CPU; its GPU test
# runs only on a Blackwell GPU.

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
    # (make test-all only:) the in-kernel longest-first order, a deeper K ring refilled after
    # Q K^T, and splits with a floor of tiles each
    (
        16,
        dict(lengths=[5, 700, 0, 129, 300, 1, 900, 64], longest_first=True, order_method="kernel"),
    ),
    (32, dict(lengths=[5, 400, 0, 129], G=8, k_stages=3, early_k=True, races=True)),
    (64, dict(lengths=[1000, 3, 513, 129], num_splits=4, min_split_tiles=2)),
]


@pytest.mark.parametrize("C,extra", _TC05_CASES, ids=str)
def test_interpret_tcgen05(C, extra):
    rng = np.random.default_rng(C + 7 * len(extra))
    extra = dict(extra)
    interpret = RACE_CHECKED if extra.pop("races", False) else True
    lengths, extra = _page_case(rng, C, extra)
    _run_case(rng, lengths, K=2, C=C, interpret=interpret, mma="tcgen05", **extra)


def test_interpret_tcgen05_products_are_used(monkeypatch):
    # The tcgen05 products are what the interpreter runs: one made 1.5x too large fails.
    from pallas_kernels.paged_attention import _gpu_tile

    real = _gpu_tile._tc_product
    calls = []

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_gpu_tile, "_tc_product", spy)
    rng = np.random.default_rng(5)
    case = dict(K=2, G=4, H=128, C=16, interpret=True, mma="tcgen05", fixed_max=False)
    _run_case(rng, [5, 200, 0, 129], **case)
    assert len(calls) == 2  # Q K^T and P @ V, traced once each
    monkeypatch.setattr(_gpu_tile, "_tc_product", lambda *args: 1.5 * real(*args))
    with pytest.raises(AssertionError):  # (another batch size: traced anew)
        _run_case(rng, [5, 200, 0], **case)


@pytest.fixture
def sm100(monkeypatch):
    """Lowering targets sm100: Mosaic GPU infers the architecture from the default device, and
    a CPU host has none (it lowers for sm90)."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    monkeypatch.setattr(mgpu_utils, "_infer_arch", lambda: (10, 0))


_TC05_VARIANTS = [
    dict(),
    dict(num_splits=4, logits_soft_cap=30.0, sliding_window=100),
    dict(C=1, W=256),  # per-thread cp.async copies
    dict(C=2, W=128, page_copy="tma"),  # the staging ring (Pallas's automatic barriers)
    dict(C=256, W=2, num_splits=2),  # C > T
    dict(N=64, K=8, C=64),  # G=8
    dict(N=8, K=8, C=32),  # G=1
    dict(dtype=jnp.float16, L=3, C=8, W=32),  # the running max (f16's default)
    dict(fixed_max=False),
    dict(B=40, longest_first=True, order_method="kernel"),
    dict(k_stages=3, early_k=True),
    dict(l2_prefetch=2),
    dict(auto_barriers=True),
    dict(N=64, K=4, deferred_sum=True),  # G=16: 16 query columns, sums deferred
    dict(N=192, K=8, num_splits=3),  # G=24: 32 query columns
    dict(H=256, C=256, W=2),  # two P @ V products of 128 head-dim rows; 1 stage (SMEM)
    dict(H=256, num_splits=2, out_blocks=True, logits_soft_cap=30.0),
]


@pytest.mark.parametrize("variant", _TC05_VARIANTS, ids=variant_id)
def test_tcgen05_lowers_for_sm100(sm100, variant):
    f, args, _, B, N, K, *_ = variant_call({"mma": "tcgen05", **variant})
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # tcgen05 MMAs, TMEM loads and their waits, the fences around P's barrier; no wgmma. (The
    # kernel is serialized bytecode whose strings appear once: presence, not counts.)
    for part in (
        "tcgen05.mma.cta_group::1.kind::f16", "tcgen05.commit", "tcgen05.ld.sync",
        "tcgen05.wait::ld", "tcgen05_fence<before>", "tcgen05_fence<after>",
    ):  # fmt: skip
        assert part in text, part
    assert "wgmma" not in text
    names = set(re.findall(r"paged_decode_mgpu\w*_mosaic_gpu", text))
    qcols = kernel_gpu._qcols(B, N, K, True)
    assert names and all(
        "_T128_" in n and f"_sw{qcols}" in n and n.endswith("_tc05_mosaic_gpu") for n in names
    ), names


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(mma="hmma"), "mma='hmma' must be one of"),
        (dict(mma="tcgen05", block_kv=64), 'mma="tcgen05" needs block_kv=128'),
        (dict(mma="tcgen05", H=64), r"head dim in \(128, 256\) \(got 64\)"),
        (dict(mma="tcgen05", swap_ab=False), "runs the swap_ab form only"),
        (dict(mma="tcgen05", producer=True), 'mma="tcgen05" runs in the default kernel'),
        (dict(mma="tcgen05", persistent=True), r"persistent=True"),
        (dict(mma="tcgen05", balanced=True), r"balanced=True"),
        (dict(mma="tcgen05", split_merge="kernel", num_splits=2), "merges splits in XLA"),
        (dict(mma="tcgen05", split_merge="mosaic", num_splits=2), "merges splits in XLA"),
    ],
)
def test_tcgen05_bad_arguments_raise(kw, match):
    H = kw.pop("H", 128)
    shapes = _shapes(H=H, C=16)
    q, k, v, bt, ln = (jnp.zeros(s.shape, s.dtype) for s in shapes)
    with pytest.raises(ValueError, match=match):
        kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1, **kw)


def test_tcgen05_defaults_on_blackwell(monkeypatch):
    # default_mma and unsupported_reason on a Blackwell GPU (sm100 / sm103), a consumer
    # Blackwell (sm120: no tcgen05, no wgmma) and a Hopper, faked.
    from pallas_kernels import _backend

    for cc, mma in (((10, 0), "tcgen05"), ((10, 3), "tcgen05"), ((9, 0), "wgmma")):
        monkeypatch.setattr(_backend, "gpu_compute_capability", lambda cc=cc: cc)
        assert kernel_gpu.default_mma() == mma
        assert kernel_gpu.default_mma(interpret=True) == "wgmma"
        assert kernel_gpu.unsupported_reason(*_shapes()) is None
        reason = kernel_gpu.unsupported_reason(*_shapes(H=64, C=8))
        assert (reason is None) == (mma == "wgmma"), reason
        if mma == "tcgen05":
            assert "on Blackwell (tcgen05) head_dim=64" in reason
    monkeypatch.setattr(_backend, "gpu_compute_capability", lambda: (12, 0))
    assert kernel_gpu.default_mma() == "wgmma"
    reason = kernel_gpu.unsupported_reason(*_shapes())
    assert "compute capability 9.x or 10.x or 11.x (got (12, 0))" in reason
    # On Blackwell the kernel takes mma="tcgen05" and T=128 by default, and auto dispatch picks
    # it (at head dim 128, where this JAX lowers it).
    monkeypatch.setattr(_backend, "gpu_compute_capability", lambda: (10, 0))
    monkeypatch.setattr(_backend, "default_platform", lambda: "gpu")
    from jpaged import _attention
    from pallas_kernels.paged_attention import dispatch

    for H, C in ((128, 16), (64, 8)):
        resolved = _attention._resolve(
            "paged_attention", dispatch, None, None, _shapes(H=H, C=C), {}
        )
        want = "pallas_gpu" if H == 128 else "xla"
        assert resolved == want, (H, resolved)
    seen = []
    monkeypatch.setattr(kernel_gpu, "_paged_attention", lambda cfg, *a: seen.append(cfg))
    q, k, v, bt, ln = (jnp.zeros(s.shape, s.dtype) for s in _shapes())
    kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1)
    (cfg,) = seen
    assert (cfg.mma, cfg.block_kv, cfg.swap_ab, cfg.qcols) == ("tcgen05", 128, True, 16)
    assert not cfg.kernel_merge and not cfg.producer and cfg.fixed_max
    assert cfg.out_blocks == (not kernel_gpu.swap_ab_lowers() and cfg.qcols != cfg.group)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "C,extra",
    [
        *_KNOB_CASES[:4],
        (1, dict(lengths=[32768, 1, 20001])),  # per-thread cp.async copies
        (128, dict(dtype="float16", G=8, num_layers=2, layer=1)),
        (16, dict(q_scale=100.0, lengths=[32768, 1, 20001, 700])),  # fixed_max's redo
        (16, dict(fixed_max=False, G=1, lengths="many")),
        (256, dict(G=6, window=700, soft_cap=50.0, num_splits=2)),  # 16 query columns
        (256, dict(H=256, G=8, num_splits=2)),  # two P @ V products a tile
        (16, dict(H=256, G=4, lengths="many")),
    ],
    ids=str,
)
def test_gpu_tcgen05(C, extra):
    from pallas_kernels import _backend

    cc = _backend.gpu_compute_capability()
    if cc is None or cc[0] not in kernel_gpu.TCGEN05_MAJORS:
        pytest.skip(f"tcgen05 needs a Blackwell GPU (sm100 / sm103; this one is {cc})")
    rng = np.random.default_rng(C + 13 * len(extra))
    lengths, extra = _page_case(rng, C, {"mma": "tcgen05", **extra})
    for _ in range(2):
        _run_case(rng, lengths, K=8, C=C, **extra)
