"""The Mosaic GPU decode kernel (``pallas_kernels/paged_attention/kernel_gpu.py``) compiled and run
on an sm90+ GPU (``pytest -m gpu``; skipped elsewhere) against the f64 dense reference over page
sizes, GQA ratios, head dims, dtypes, lengths 0, 1, C-1, C, C+1 and 32k, with randomly permuted
tables and NaN-poisoned free pages and last-page tails.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _decode_gpu_cases import KNOB_CASES, page_case, run_case

from pallas_kernels.paged_attention import tuning_gpu

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
    run_case(rng, lengths, K=2, G=G, H=H, C=C, dtype=jnp.dtype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("splits,swap_ab", [(1, None), (4, None), (16, None), (4, False)])
def test_gpu_long_32k(splits, swap_ab):
    # swap_ab=False: the 64-row tile with splits and f32 partials (swap_ab is the default).
    rng = np.random.default_rng(splits)
    run_case(rng, [32768, 1, 20001], K=2, G=4, H=128, C=16, num_splits=splits, swap_ab=swap_ab)


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
        dict(swap_ab=False, num_splits=1),  # the 64-row tile without splits
        dict(swap_ab=False, num_splits=1, num_layers=2, layer=1, block_kv=128),
        dict(sm_scale=-0.05, num_splits=2),  # the scale stays out of exp2
        dict(out_of_range_tail=True, num_splits=2),
    ],
    ids=str,
)
def test_gpu_options(extra):
    rng = np.random.default_rng(7)
    lengths = [0, 1, 15, 16, 17, 99, 1000, 2500]
    run_case(rng, lengths, K=4, G=4, H=128, C=16, **extra)


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
    ],
    ids=str,
)
def test_gpu_swap_ab(C, G, H, extra):
    rng = np.random.default_rng(C + G + H)
    extra = dict(extra)
    dtype = jnp.dtype(extra.pop("dtype", "bfloat16"))
    lengths = [0, 1, C - 1, C, C + 1, 99, 1000, 2500]
    run_case(rng, lengths, K=4, G=G, H=H, C=C, dtype=dtype, swap_ab=True, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 8])
def test_gpu_swap_ab_long_and_many(splits):
    rng = np.random.default_rng(90 + splits)
    run_case(rng, [32768, 1, 20001], K=2, G=4, H=128, C=16, num_splits=splits, swap_ab=True)
    lengths = rng.integers(0, 3000, size=96)
    run_case(rng, lengths, K=8, G=4, H=128, C=16, swap_ab=True)


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
    lengths, extra = page_case(rng, C, extra)
    run_case(rng, lengths, K=4, C=C, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "C,extra",
    [
        *KNOB_CASES,
        (128, dict(swap_ab=False, num_splits=3, split_merge="xla")),  # the 64-row tile, C > T
        (2, dict(lengths=[32768, 0, 3], num_splits=1)),  # per-thread cp.async copies
        (32, dict(num_layers=2, layer=1, dtype="float16", G=6)),  # 16 query columns
        (16, dict(sm_scale=-0.05)),  # the scale applied per score
        # Logits 100x sharper: units whose later scores overflow against the first tile's max
        # are read again with the running max.
        (16, dict(q_scale=100.0, lengths=[32768, 1, 20001, 700])),
        (16, dict(q_scale=100.0, swap_ab=False, num_splits=2)),
        (16, dict(q_scale=3.0, dtype="float16", lengths="many")),
        # The running max in every tile (f16's default)
        (16, dict(fixed_max=False, lengths="many")),
        (16, dict(fixed_max=False, q_scale=100.0, lengths=[32768, 1, 20001, 700])),
        (64, dict(fixed_max=False, window=700, soft_cap=50.0, num_splits=3)),
    ],
    ids=str,
)
def test_gpu_fixed_max(C, extra):
    # Each case twice, NaN-poisoned free pages.
    rng = np.random.default_rng(C + 11 * len(extra))
    lengths, extra = page_case(rng, C, {"fixed_max": True, **extra})
    for _ in range(2):
        run_case(rng, lengths, K=8, C=C, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["mosaic", "xla"])
@pytest.mark.parametrize(
    "lengths,extra",
    [
        ([32768], dict(K=8)),  # one sequence: 32 splits by default
        ([32768, 1, 20001], dict(num_splits=40)),  # 40 splits (2 rounds), most of them empty
        ("many", dict(num_splits=3)),  # 96 x 4 pairs of 3 splits: 1152 CTAs, several waves
        ([0, 1, 15, 16, 17, 99, 1000, 2500], dict(G=1, H=64, dtype="float16", num_splits=5)),
        ([0, 1, 17, 5000, 2500], dict(window=700, soft_cap=50.0, num_splits=4, G=8)),
        ([0, 1, 3, 4, 5, 3000], dict(C=1, num_splits=4)),  # one-token pages (cp.async)
        ([9000, 1, 300], dict(num_layers=2, layer=1, num_splits=7, longest_first=True)),
    ],
    ids=str,
)
def test_gpu_split_merge(lengths, extra, merge):
    # Split partials merged by the second Mosaic GPU kernel or by XLA; each case twice.
    rng = np.random.default_rng(len(extra) + len(lengths))
    extra = dict(extra)
    dtype = jnp.dtype(extra.pop("dtype", "bfloat16"))
    K, G, H, C = extra.pop("K", 4), extra.pop("G", 4), extra.pop("H", 128), extra.pop("C", 16)
    if lengths == "many":
        lengths = rng.integers(0, 3000, size=96)
    for _ in range(2):
        run_case(rng, lengths, K=K, G=G, H=H, C=C, dtype=dtype, split_merge=merge, **extra)


@pytest.mark.gpu
def test_gpu_many_sequences_default_tuning():
    # 96 sequences of up to 3000 tokens: longest first, counted in each CTA (order "kernel").
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 3000, size=96)
    run_case(rng, lengths, K=8, G=4, H=128, C=16)


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
    assert tuning_gpu.default_num_splits(B, 8, width * 16, 64) == 2
    assert tuning_gpu.default_longest_first(B, 8, 2, width * 16)
    assert tuning_gpu.default_split_merge(2, True) == "mosaic"
    run_case(rng, lengths, K=8, G=4, H=128, C=16)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["mosaic", "xla"])
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
        # 16 query columns (swap_ab asked for: the default there is the 64-row tile)
        ([9000, 1, 300, 64], dict(num_layers=2, layer=1, dtype="float16", G=6, swap_ab=True)),
    ],
    ids=str,
)
def test_gpu_min_split_tiles(lengths, extra, merge):
    # Splits that keep min_split_tiles tiles each, from each sequence's length on the device:
    # the splits past them store empty partials. Each case twice, NaN-poisoned free pages.
    rng = np.random.default_rng(len(lengths) + len(extra))
    extra = dict(extra)
    C = extra.pop("C", 16)
    if lengths == "wave":
        lengths = rng.integers(0, 1200, size=32)
        lengths[:6] = [8192, 0, 1, 511, 512, 513]
        assert tuning_gpu.default_num_splits(32, 8, 8192, 64) == 4
        assert tuning_gpu.default_min_split_tiles(32, 8, 4) == 8
    lengths, extra = page_case(rng, C, dict(extra, lengths=lengths))
    for _ in range(2):
        run_case(rng, lengths, K=8, C=C, split_merge=merge, **extra)


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
    lengths, extra = page_case(rng, C, dict(extra, lengths=lengths))
    for _ in range(2):
        run_case(rng, lengths, K=K, C=C, split_merge="mosaic", **extra)


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
    run_case(rng, lengths, K=8, G=4, H=128, C=16, longest_first=True, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "C,extra",
    [
        *KNOB_CASES,
        (32, dict(num_layers=2, layer=1, dtype="float16", G=6)),  # 16 query columns
        (1, dict(lengths=[32768, 1, 20001])),  # per-thread cp.async copies, splits
        (256, dict(H=256, G=8, num_splits=2, swap_ab=True)),
    ],
    ids=str,
)
def test_gpu_out_blocks(C, extra):
    # Each case twice, NaN-poisoned free pages; the splits merged by XLA.
    rng = np.random.default_rng(C + 17 * len(extra))
    lengths, extra = page_case(rng, C, {"out_blocks": True, "swap_ab": True, **extra})
    for _ in range(2):
        run_case(rng, lengths, K=8, C=C, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "C,extra",
    [
        *KNOB_CASES[:4],
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
    if cc is None or cc[0] not in tuning_gpu.TCGEN05_MAJORS:
        pytest.skip(f"tcgen05 needs a Blackwell GPU (sm100 / sm103; this one is {cc})")
    rng = np.random.default_rng(C + 13 * len(extra))
    lengths, extra = page_case(rng, C, {"mma": "tcgen05", **extra})
    for _ in range(2):
        run_case(rng, lengths, K=8, C=C, **extra)
