"""Tests of the Mosaic GPU ragged kernel (``pallas_kernels/ragged_paged_attention/kernel_gpu.py``).

CPU CI: tiny cases in the Mosaic GPU interpreter, every kernel variant cross-lowered for CUDA,
``unsupported_reason`` and argument checks. GPU (``pytest -m gpu`` on sm90+): the compiled
kernel against the f64 dense oracle for decode-only, prefill-only, mixed, chunked batches over
page sizes, GQA ratios, head dims and dtypes, with permuted tables and NaN-poisoned pages.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ragged_inputs import dense_ragged_attention, make_ragged_case, sds_case
from _tolerances import assert_close

from pallas_kernels.ragged_paged_attention import _gpu_order, kernel_gpu

# Cases ``make test`` (CPU CI) leaves out and ``make test-all`` runs (``tests/conftest.py``):
# the order's plain indices (past 2**16 sequences; 13-23 s interpreted) and the basic split case
# the other split cases cover.
SLOW_CASES = {
    "test_interpret_longest_first_order[plain_indices]",
    "test_interpret_kv_splits[G4-C16-S3]",
    # Repeats of other cases' paths: window and cap through XLA's gathers (window and cap:
    # matches_oracle[direct_io-G3-C8-window-cap]; the gathers: gather_io-G4-C16,
    # gather_io-G1-C128-noncausal-layer), G=4 in place (longest_first_order[packed_keys] and
    # kv_splits[G4-S7-negscale]: G=4, C=16, direct_io), G=1 non-causal in place
    # (kv_splits[G1-C128-noncausal-layer-S2]), splits under window and cap (splits:
    # kv_splits[G1-C128-noncausal-layer-S2], [G4-S7-negscale]; window and cap without)
    "test_interpret_matches_oracle[gather_io-G3-C8-window-cap]",
    "test_interpret_matches_oracle[direct_io-G4-C16]",
    "test_interpret_matches_oracle[direct_io-G1-C128-noncausal-layer]",
    "test_interpret_kv_splits[G3-C8-window-cap-S4]",
    # Variants whose options are all the defaults there (the same _Config and shapes as the
    # default variant "", as H256-C256-N8-K8 and as H64-C8-K4-...-L3)
    *(
        f"test_cross_lowers_for_cuda[{i}]"
        for i in (
            "num_wgs2-block_kv128-num_stages2", "num_wgs2-producerTrue", "fa3True",
            "fa3True-H256-C256-N8-K8", "fa3True-H64-C8-K4-dtype<class 'jax.numpy.float16'>-L3",
        )
    ),
    # Near repeats of the FA3 body (the default): window and cap (sliding_window100-logits_soft_
    # cap30.0), non-causal with one warpgroup (causalFalse, num_wgs1), G=5's padded rows
    # (N40-K8-num_stages2-tile_orderindex), G=6 paired (paired: pairedTrue and its other
    # variants; padded rows: N40-K8-num_stages2-tile_orderindex's G=5, fa3True-N24-K8's G=3)
    *(
        f"test_cross_lowers_for_cuda[{i}]"
        for i in (
            "fa3True-sliding_window50-logits_soft_cap30.0", "fa3True-num_wgs1-causalFalse",
            "fa3True-N40-K8-num_stages3-block_kv64", "pairedTrue-N48-K8-C128-tile_orderindex",
        )
    ),
}  # fmt: skip


def _run(case, dtype, *, interpret=False, layer=None, sm_scale=None, **opts_and_tuning):
    knobs = (
        "block_kv", "num_stages", "num_wgs", "producer", "fa3", "direct_io", "tile_order", "paired",
        "kv_splits",
    )  # fmt: skip
    tuning = {k: opts_and_tuning.pop(k) for k in knobs if k in opts_and_tuning}
    opts = opts_and_tuning
    H = case.args[0].shape[-1]
    scale = 1.0 / math.sqrt(H) if sm_scale is None else sm_scale
    out = kernel_gpu.ragged_paged_attention_pallas_gpu(
        *case.args, sm_scale=scale, layer=layer, interpret=interpret, **opts, **tuning
    )
    assert out.shape == case.args[0].shape and out.dtype == jnp.dtype(dtype)
    lyr = None if layer is None else int(layer)
    ref = dense_ragged_attention(case, sm_scale=scale, layer=lyr, **opts)
    assert_close(out, ref, dtype, err_msg=f"{opts} {tuning}")
    return np.asarray(out, np.float32)


def _units(case, **tuning):
    """Work units the kernel runs for ``case`` (query tiles x splits, before pairing)."""
    from pallas_kernels.ragged_paged_attention import schedule

    cfg, _ = kernel_gpu.make_config(*case.args, sm_scale=0.1, **tuning)
    T, B = case.args[0].shape[0], case.args[3].shape[0]
    tiles = schedule.num_tiles_bound(T, B, cfg.block_q) + (2 if cfg.kv_splits == 1 else 0)
    return tiles * cfg.kv_splits


# --------------------------------------------------------------------------- CPU: interpreter


@pytest.mark.parametrize(
    ("N", "C", "extra"),
    [
        (8, 16, {"num_wgs": 1}),  # G = 4: 16 tokens per warpgroup
        (6, 8, {"sliding_window": 9, "logits_soft_cap": 3.0}),  # G = 3: padded rows
        (2, 128, {"causal": False, "num_layers": 2, "layer": jnp.int32(1)}),  # G = 1, C > T
    ],
    ids=["G4-C16", "G3-C8-window-cap", "G1-C128-noncausal-layer"],
)
@pytest.mark.parametrize("direct_io", [False, True], ids=["gather_io", "direct_io"])
def test_interpret_matches_oracle(N, C, extra, direct_io):
    # One warpgroup only: num_wgs=2 and producer=True (1 or 2 compute warpgroups) also matched
    # the oracle in the interpreter when run by hand, but the interpreter runs warpgroups as
    # threads that block in host callbacks and it hung now and then on a 2-core machine. Those
    # variants are cross-lowered here and run on the GPU.
    rng = np.random.default_rng(C + N)
    _interpret_case(rng, N, C, extra, last_kv=90, last_q=40, direct_io=direct_io)


def _interpret_case(rng, N, C, extra, *, last_kv, last_q, **options):
    """Five sequences (kv lengths 0, 1, C-1, C+1, last_kv; query lengths 0, 1, 3, C+1, last_q)
    through the interpreter against the oracle; the padding rows must be zeros."""
    extra = dict(extra)
    L = extra.pop("num_layers", None)
    case = make_ragged_case(
        rng, (0, 1, C - 1, C + 1, last_kv), (0, 1, 3, C + 1, last_q), num_q_heads=N,
        num_kv_heads=2, head_dim=64, page_size=C, dtype=jnp.bfloat16, num_layers=L,
    )  # fmt: skip
    out = _run(case, jnp.bfloat16, interpret=True, **options, **extra)
    assert np.all(out[sum(case.q_lens) :] == 0.0)  # padding rows


@pytest.mark.parametrize(
    ("N", "C", "extra"),
    [
        (8, 16, {"kv_splits": 3}),  # causal prefill rows that see nothing in a whole split
        (6, 8, {"kv_splits": 4, "sliding_window": 9, "logits_soft_cap": 3.0}),
        (2, 128, {"kv_splits": 2, "causal": False, "num_layers": 2, "layer": jnp.int32(1)}),
        (8, 16, {"kv_splits": 7, "sm_scale": -0.2}),  # more splits than some tiles have
    ],
    ids=["G4-C16-S3", "G3-C8-window-cap-S4", "G1-C128-noncausal-layer-S2", "G4-S7-negscale"],
)
def test_interpret_kv_splits(N, C, extra):
    # Split-KV: each (tile, split) unit stores a normalised partial and its LSE in place
    # (direct_io), merged in XLA; padding rows are written by no unit: the merge zeroes them.
    rng = np.random.default_rng(C + N + 1)
    _interpret_case(rng, N, C, extra, last_kv=150, last_q=60, direct_io=True, num_wgs=1)


@pytest.mark.parametrize("packed", [True, False], ids=["packed_keys", "plain_indices"])
def test_interpret_longest_first_order(monkeypatch, packed):
    # tile_order="longest_first" (the default only for decode-heavy batches, which the cases
    # above are not): the kernel decodes packed keys, or reads plain indices past
    # ``_ORDER_MAX_LEN`` entries (shrunk here to exercise that branch on a small batch).
    rng = np.random.default_rng(70 + packed)
    if packed:
        extra = {"num_wgs": 1}
    else:
        monkeypatch.setattr(_gpu_order, "_ORDER_MAX_LEN", 4)
        jax.clear_caches()  # no trace of the same config from the packed bound
        extra = {"num_wgs": 1, "kv_splits": 2, "sliding_window": 9}
    cfg, _ = kernel_gpu.make_config(*sds_case(60, 6, 8, N=8, K=2, H=64), sm_scale=0.1,
                                    tile_order="longest_first")  # fmt: skip
    assert (_gpu_order._order_index_bits(cfg, 9) is not None) == packed  # the cases: 9-11 tiles
    _interpret_case(rng, 8, 16, extra, last_kv=120, last_q=40, direct_io=True,
                    tile_order="longest_first")  # fmt: skip
    if not packed:
        jax.clear_caches()  # nor a trace of the plain one left for later tests


def _old_longest_first(work, real):
    """The order before packed keys: a stable argsort of -work, empty tiles last (int64)."""
    return np.argsort(-np.where(real, np.asarray(work, np.int64), -1), kind="stable")


@pytest.mark.parametrize("NT", [1, 5, 300, 65535, 65536])
def test_longest_first_order_packed_keys(NT):
    rng = np.random.default_rng(NT)
    bits = max(1, (NT - 1).bit_length())
    top = 2 ** (31 - bits) - 2  # work past it ties
    work = rng.integers(1, 3000, size=NT)
    work[: NT // 3] = 700  # ties go in index order
    real = rng.random(NT) < 0.8  # empty tiles (any work) last, in index order
    if NT > 7:
        work[1:5] = [0, -1, top, top - 1]  # edges: still told apart from each other
    keys = np.asarray(_gpu_order._longest_first_order(jnp.asarray(work, jnp.int32),
                                                      jnp.asarray(real), bits))  # fmt: skip
    assert keys.dtype == np.int32 and np.all(keys >= 0)
    np.testing.assert_array_equal(keys & (2**bits - 1), _old_longest_first(work, real))
    # Huge work (past top, up to int32 max) ties at top, in index order.
    if NT > 7:
        work[5:8] = [2**31 - 1, top + 1, 2**30]
        keys = _gpu_order._longest_first_order(
            jnp.asarray(work, jnp.int32), jnp.asarray(real), bits
        )
        order = np.asarray(keys) & (2**bits - 1)
        np.testing.assert_array_equal(order, _old_longest_first(np.minimum(work, top), real))
    plain = _gpu_order._longest_first_order(jnp.asarray(work, jnp.int32), jnp.asarray(real), None)
    np.testing.assert_array_equal(np.asarray(plain), _old_longest_first(work, real))


@pytest.mark.parametrize("sentinel", [False, True])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, None), (True, 5)])
def test_tile_order_decodes_to_the_argsort(sentinel, causal, window):
    # _tile_order on a real schedule: the packed entries decode (as the kernel does, with the
    # bits of the order's length) to the old argsort, and the paired sentinel to NT.
    from pallas_kernels.ragged_paged_attention import schedule

    kv_lens = jnp.asarray([40, 1, 0, 300, 17, 300, 9], jnp.int32)
    q_lens = np.asarray([5, 1, 0, 33, 17, 2, 9])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    ts = schedule.tile_schedule(kv_lens, cu, jnp.int32(6), num_tokens=80, block_q=8,
                                extra_tiles=2, token_rows=False)  # fmt: skip
    NT = ts.seq.shape[0]
    cfg, _ = kernel_gpu.make_config(*sds_case(80, 7, 40, N=8, K=2, H=64), sm_scale=0.1,
                                    tile_order="longest_first")  # fmt: skip
    cfg = dataclasses.replace(cfg, causal=causal, sliding_window=window)
    order = np.asarray(_gpu_order._tile_order(cfg, ts, B=7, sentinel=sentinel))
    assert order.shape == (NT + sentinel,)
    bits = _gpu_order._order_index_bits(cfg, order.shape[0])
    assert bits is not None
    tiles = order & (2**bits - 1)
    work = np.minimum(ts.kv_len, ts.pos0 + ts.q_rows) if causal else np.asarray(ts.kv_len)
    if window is not None:
        work = work - np.maximum(np.asarray(ts.pos0) - window + 1, 0)
    np.testing.assert_array_equal(tiles[:NT], _old_longest_first(work, np.asarray(ts.q_rows) > 0))
    if sentinel:
        assert tiles[NT] == NT
    for other in ("index", "by_sequence"):  # plain indices, untouched by the packing
        c = dataclasses.replace(cfg, tile_order=other)
        assert _gpu_order._order_index_bits(c, NT) is None
        assert sorted(np.asarray(_gpu_order._tile_order(c, ts, B=7))) == list(range(NT))


# --------------------------------------------------------------------------- CPU: cross-lowering

_VARIANTS = [
    {},
    {"num_wgs": 1},
    {"num_wgs": 2, "block_kv": 128, "num_stages": 2},
    {"num_wgs": 2, "producer": True},
    {"num_wgs": 1, "producer": True, "sliding_window": 50, "num_stages": 3},
    {"causal": False},
    {"sliding_window": 100, "logits_soft_cap": 30.0},
    {"H": 256, "C": 256, "N": 8, "K": 8},
    {"H": 64, "C": 8, "K": 4, "dtype": jnp.float16, "L": 3},
    {"N": 8, "K": 8, "C": 32, "block_kv": 128},  # G = 1, 64 tokens per tile
    {"N": 40, "K": 8, "num_stages": 2, "tile_order": "index"},  # G = 5: padded rows
    # the FA3-style body (GPU only: the interpreter has no register wgmma operands)
    {"fa3": True},
    {"fa3": True, "num_wgs": 1, "causal": False},
    {"fa3": True, "sliding_window": 50, "logits_soft_cap": 30.0},
    {"fa3": True, "H": 256, "C": 256, "N": 8, "K": 8},
    {"fa3": True, "H": 64, "C": 8, "K": 4, "dtype": jnp.float16, "L": 3},
    {"fa3": True, "N": 40, "K": 8, "num_stages": 3, "block_kv": 64},
    {"fa3": True, "N": 24, "K": 8},  # G = 3: 16 tokens per warpgroup in place
    {"fa3": True, "direct_io": False},  # Q / O through XLA gathers
    {"fa3": True, "N": 64, "K": 4},  # G = 16: in place unsupported, gathers
    {"fa3": False, "direct_io": True},
    {"fa3": True, "C": 192},  # 192-key pages keep 64-key tiles
    {"fa3": True, "H": 256, "num_wgs": 1},  # decode-heavy at 256: Q / O gathered (see tuning)
    {"fa3": False, "H": 256, "num_wgs": 1},
    # paired: one query tile (own K/V ring) per compute warpgroup, for decode-like batches
    {"paired": True},
    {"paired": True, "causal": False, "sliding_window": 50, "logits_soft_cap": 30.0},
    {"paired": True, "H": 64, "C": 8, "K": 4, "dtype": jnp.float16, "L": 3},  # 128-key tiles
    {"paired": True, "N": 48, "K": 8, "C": 128, "tile_order": "index"},  # G = 6
    # split-KV: partials and LSE in place, merged in XLA
    {"kv_splits": 4},
    {"paired": True, "T": 84},  # 9 + 2 tiles: an odd unit count, so one inert padded unit
    {"kv_splits": 3, "paired": True, "sliding_window": 50, "T": 84},  # 27 units: inert one
    {"paired": True, "T": 84, "tile_order": "longest_first"},  # packed keys and the sentinel
    {"kv_splits": 2, "num_wgs": 1, "causal": False, "H": 64, "L": 3},
    {"kv_splits": 5, "fa3": False, "direct_io": True, "logits_soft_cap": 30.0},
]


@pytest.mark.parametrize("variant", _VARIANTS, ids=lambda v: "-".join(f"{k}{v[k]}" for k in v))
def test_cross_lowers_for_cuda(variant):
    v = dict(variant)
    B, T, W = 4, v.pop("T", 100), 8
    N, K, H, C = v.pop("N", 32), v.pop("K", 8), v.pop("H", 128), v.pop("C", 16)
    dtype, L = v.pop("dtype", jnp.bfloat16), v.pop("L", None)
    pool = (K, 40, C, H) if L is None else (L, K, 40, C, H)
    sds = jax.ShapeDtypeStruct
    args = (
        sds((T, N, H), dtype), sds(pool, dtype), sds(pool, dtype), sds((B, W), jnp.int32),
        sds((B,), jnp.int32), sds((B + 1,), jnp.int32), sds((), jnp.int32), sds((), jnp.int32),
    )  # fmt: skip

    def f(q, k, vp, bt, kl, cu, ns, layer):
        return kernel_gpu.ragged_paged_attention_pallas_gpu(
            q, k, vp, bt, kl, cu, ns, sm_scale=0.125, layer=None if L is None else layer, **v
        )

    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text().lower()


# --------------------------------------------------------------------------- GPU

GPU_PRODUCT = [
    (C, G, H, dtype)
    for C in (8, 16, 64, 128)
    for G in (1, 4, 8)
    for H in (64, 128, 256)
    for dtype in (jnp.bfloat16, jnp.float16)
    # a spread over every value of each axis, not the full cube (device time is scarce)
    if (C + G + H + (dtype == jnp.bfloat16)) % 5 == 0 or (C, H, dtype) == (16, 128, jnp.bfloat16)
]


@pytest.mark.gpu
@pytest.mark.parametrize("fa3", [False, True], ids=["smem", "fa3"])
@pytest.mark.parametrize(("C", "G", "H", "dtype"), GPU_PRODUCT, ids=str)
def test_gpu_mixed_batch(C, G, H, dtype, fa3):
    rng = np.random.default_rng(C * 1000 + G * 10 + H)
    kv_lens = (0, 1, C - 1, C, C + 1, 2 * C + 5, int(rng.integers(300, 1500)), 1000)
    q_lens = (0, 1, 1, C, 1, 7, 1, 1000)  # decodes, a short chunk, a 1000-token prefill
    case = make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=2 * G, num_kv_heads=2, head_dim=H, page_size=C,
        dtype=dtype,
    )  # fmt: skip
    _run(case, dtype, fa3=fa3)


@pytest.mark.gpu
@pytest.mark.parametrize("fa3", [False, True], ids=["smem", "fa3"])
@pytest.mark.parametrize("wgs", [1, 2], ids=["wgs1", "wgs2"])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_gpu_decode_only_and_prefill_only(kind, wgs, fa3):
    rng = np.random.default_rng(3)
    if kind == "decode":
        kv_lens = tuple(int(x) for x in rng.integers(1, 3000, size=64))
        q_lens = (1,) * 64
    else:
        kv_lens = q_lens = (1536, 513, 64, 1)
    case = make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16
    )
    # paired=False: two warpgroups sharing one tile (paired mode has its own tests)
    _run(case, jnp.bfloat16, num_wgs=wgs, fa3=fa3, paired=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fa3", [False, True], ids=["smem", "fa3"])
def test_gpu_chunked_prefill_equals_one_prefill(fa3):
    rng = np.random.default_rng(4)
    n = 700
    case = make_ragged_case(
        rng, (n,), (n,), num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16,
        extra_rows=0, extra_seqs=0,
    )  # fmt: skip
    q, kp, vp, bt, _, _, _ = case.args
    f = jax.jit(
        lambda q, kl, cu: kernel_gpu.ragged_paged_attention_pallas_gpu(
            q, kp, vp, bt, kl, cu, jnp.int32(1), sm_scale=0.1, fa3=fa3
        )
    )
    full = np.asarray(f(q, np.array([n], np.int32), np.array([0, n], np.int32)), np.float32)
    pieces, T_chunk = [], 300
    for lo, hi in ((0, 250), (250, 530), (530, 700)):
        q_chunk = np.zeros((T_chunk, *q.shape[1:]), q.dtype)
        q_chunk[: hi - lo] = q[lo:hi]
        out = f(q_chunk, np.array([hi], np.int32), np.array([0, hi - lo], np.int32))
        pieces.append(np.asarray(out, np.float32)[: hi - lo])
    # Same tiles, same key order within a tile: only the tile split of the query rows differs.
    assert_close(np.concatenate(pieces), full, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [
        {"causal": False},
        {"sliding_window": 100},
        {"sliding_window": 1},
        {"sliding_window": 700, "logits_soft_cap": 50.0},
        {"num_layers": 3, "layer": jnp.int32(2)},
        {"block_kv": 128},
        {"num_wgs": 1},
        {"num_wgs": 2, "block_kv": 128, "num_stages": 2},
        {"num_stages": 2, "tile_order": "index", "sm_scale": 0.3},
        {"tile_order": "longest_first"},
        {"tile_order": "by_sequence"},
        {"num_stages": 3, "block_kv": 64, "sm_scale": -0.2},
        {"direct_io": False},
        {"direct_io": True, "num_q_heads": 24},  # G = 6: 8 tokens per warpgroup in place
    ],
    ids=str,
)
@pytest.mark.parametrize("fa3", [False, True], ids=["smem", "fa3"])
def test_gpu_options(extra, fa3):
    rng = np.random.default_rng(7)
    extra = dict(extra)
    L = extra.pop("num_layers", None)
    N = extra.pop("num_q_heads", 16)
    case = make_ragged_case(
        rng, (0, 1, 15, 16, 17, 99, 1000, 2500), (0, 1, 1, 16, 5, 99, 1, 1200),
        num_q_heads=N, num_kv_heads=4, head_dim=128, dtype=jnp.bfloat16, num_layers=L,
    )  # fmt: skip
    _run(case, jnp.bfloat16, fa3=fa3, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("q_lens", [(1,), (3,), (1, 2), (5, 11)], ids=str)
def test_gpu_batches_smaller_than_a_tile(q_lens, G):
    # T below one warpgroup's tokens (64 at G = 1): the in-place Q / O boxes reach past T.
    rng = np.random.default_rng(sum(q_lens) + G)
    kv_lens = tuple(q + 20 for q in q_lens)
    case = make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=2 * G, num_kv_heads=2, head_dim=128,
        dtype=jnp.bfloat16, extra_rows=1, extra_seqs=0,
    )  # fmt: skip
    _run(case, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [
        {"expect_odd": True},  # 64 decodes: 67 units, the last CTA's second unit is inert
        {"page_size": 8, "sliding_window": 200, "logits_soft_cap": 30.0},
        {"page_size": 128, "causal": False, "num_layers": 2, "layer": jnp.int32(1)},
        {"num_q_heads": 48, "tile_order": "index"},  # G = 6: 8 tokens per warpgroup
        {"head_dim": 64, "dtype": jnp.float16},  # 128-key tiles
        {"q_len": 3},  # multi-token decode (speculative): 3 tokens per sequence
        {"mixed": True},  # decodes beside a 700-token prefill, forced paired
        {"kv_splits": 5, "expect_odd": True},  # split-KV: 325 units
        {"kv_splits": 8, "sliding_window": 1000, "mixed": True},
    ],
    ids=str,
)
def test_gpu_paired(extra):
    extra = dict(extra)
    rng = np.random.default_rng(11)
    B = extra.pop("num_seqs", 64)
    q_len = extra.pop("q_len", 1)
    kv_lens = [0, 1, 15, 16, 17] + [int(x) for x in rng.integers(1, 3000, size=B - 5)]
    q_lens = [min(q_len, k) for k in kv_lens]
    if extra.pop("mixed", False):
        kv_lens[-1] = q_lens[-1] = 700
    dtype = extra.pop("dtype", jnp.bfloat16)
    expect_odd = extra.pop("expect_odd", False)
    case = make_ragged_case(
        rng, tuple(kv_lens), tuple(q_lens), num_q_heads=extra.pop("num_q_heads", 32),
        num_kv_heads=8, head_dim=extra.pop("head_dim", 128), dtype=dtype,
        page_size=extra.pop("page_size", 16), num_layers=extra.pop("num_layers", None),
    )  # fmt: skip
    if expect_odd:
        tuning = {k: extra[k] for k in ("kv_splits",) if k in extra}
        assert _units(case, paired=True, **tuning) % 2 == 1
    _run(case, dtype, paired=True, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [
        {},  # the default split count (a small batch at long context)
        {"kv_splits": 3, "num_wgs": 1},
        {"kv_splits": 16, "num_wgs": 2, "paired": False},  # a prefill chunk split 16 ways
        {"kv_splits": 4, "sliding_window": 700, "logits_soft_cap": 30.0, "causal": True},
        {"kv_splits": 6, "causal": False, "num_layers": 2, "layer": jnp.int32(1)},
        {"kv_splits": 2, "fa3": False, "direct_io": True, "num_wgs": 2},
    ],
    ids=str,
)
def test_gpu_kv_splits(extra):
    extra = dict(extra)
    rng = np.random.default_rng(12)
    kv_lens = (0, 1, 16, 17, 9000, 20000, 1000, 4100)
    q_lens = (0, 1, 16, 1, 1, 1, 1, 300)  # long decodes beside a late prefill chunk
    case = make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=16, num_kv_heads=4, head_dim=128,
        dtype=jnp.bfloat16, num_layers=extra.pop("num_layers", None),
    )  # fmt: skip
    if not extra:  # the wrapper's own choice splits this batch
        cfg, _ = kernel_gpu.make_config(*case.args, sm_scale=0.1)
        assert cfg.kv_splits > 1
    _run(case, jnp.bfloat16, **extra)


@pytest.mark.gpu
def test_gpu_auto_dispatch_picks_the_kernel():
    rng = np.random.default_rng(8)
    case = make_ragged_case(
        rng, (30, 200), (30, 1), num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16
    )
    assert kernel_gpu.unsupported_reason(*case.args) is None
    import jpaged  # here, not at module level: the kernel tests above need only the kernel

    out = jpaged.ragged_paged_attention(*case.args)
    assert_close(out, dense_ragged_attention(case), jnp.bfloat16)


# Last in the file: the warp-specialized variant (a hang here would not hide earlier results).
@pytest.mark.gpu
@pytest.mark.parametrize("wgs", [1, 2], ids=["wgs1", "wgs2"])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 300, "logits_soft_cap": 30.0}], ids=str)
def test_gpu_producer_warpgroup(wgs, opts):
    rng = np.random.default_rng(9)
    case = make_ragged_case(
        rng, (0, 1, 15, 16, 17, 99, 1000, 2500), (0, 1, 1, 16, 5, 99, 1, 1200),
        num_q_heads=16, num_kv_heads=4, head_dim=128, dtype=jnp.bfloat16,
    )  # fmt: skip
    _run(case, jnp.bfloat16, num_wgs=wgs, producer=True, **opts)
