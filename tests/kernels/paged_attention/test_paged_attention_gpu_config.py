"""The Mosaic GPU decode kernel's static side, no kernel run: the defaults of ``tuning_gpu``
and its ``TUNING`` table, ``unsupported_reason``, the argument checks of ``make_config``, and the
longest-first order computed by XLA.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decode_gpu_cases import shapes

from pallas_kernels import _backend
from pallas_kernels.paged_attention import _gpu_order, _gpu_sizes, kernel_gpu, tuning_gpu


def test_swap_ab_default():
    # On at H = 64 / 128 and 8 query columns, with or without splits, where it was measured.
    assert tuning_gpu.default_swap_ab(128, 8)
    assert tuning_gpu.default_swap_ab(64, 8)
    assert tuning_gpu.default_swap_ab(256, 8)  # timed at B=32, N=16, K=8, 4k: 1.74x
    assert not tuning_gpu.default_swap_ab(128, 16)


def test_split_merge_default():
    # The second kernel with 2-32 swap_ab splits (one round); XLA past them and without swap_ab.
    assert tuning_gpu.default_split_merge(2, True) == "mosaic"
    assert tuning_gpu.default_split_merge(16, True) == "mosaic"
    assert tuning_gpu.default_split_merge(32, True) == "mosaic"
    assert tuning_gpu.default_split_merge(33, True) == "xla"  # two rounds: slower
    assert tuning_gpu.default_split_merge(32, False) == "xla"
    assert tuning_gpu.default_split_merge(1, True) == "xla"
    assert tuning_gpu.default_split_merge(4, False) == "xla"


@pytest.mark.parametrize(
    "num_seqs,num_q_heads,num_kv_heads,qcols",
    [(5, 32, 8, 8), (3, 32, 32, 8), (2, 64, 8, 8), (4, 48, 8, 16), (4, 6, 2, 16), (9, 24, 8, 16)],
)
def test_qcols_cover_every_heads_rows(num_seqs, num_q_heads, num_kv_heads, qcols):
    assert _gpu_sizes.qcols(num_seqs, num_q_heads, num_kv_heads) == qcols
    G = num_q_heads // num_kv_heads
    for b in range(num_seqs):
        for h in range(num_kv_heads):
            qrow = b * num_q_heads + h * G
            assert qrow - qrow // 8 * 8 + G <= qcols  # the G rows lie in the loaded block


def test_default_fixed_max():
    assert tuning_gpu.default_fixed_max(jnp.bfloat16)
    assert not tuning_gpu.default_fixed_max(jnp.float16)  # 15 doublings: redone more often


def test_default_min_split_tiles():
    assert tuning_gpu.default_min_split_tiles(32, 8, 1) == 1  # no splits: nothing to floor
    assert tuning_gpu.default_min_split_tiles(8, 8, 8) == 1  # few pairs: every split reads
    assert tuning_gpu.default_min_split_tiles(32, 8, 2) == 8  # about one wave of pairs
    assert tuning_gpu.default_min_split_tiles(63, 8, 4) == 8
    assert tuning_gpu.default_min_split_tiles(64, 8, 2) == 1  # two waves (explicit splits)
    # The quick table's B=32 / 2k (1k-3k tokens in a 3k table: 16-48 tiles of 64) keeps two
    # splits for its shortest sequence: clip(16 // floor, 1, splits) of them read.
    splits = tuning_gpu.default_num_splits(32, 8, 3072, 64)
    floor = tuning_gpu.default_min_split_tiles(32, 8, splits)
    assert (splits, floor) == (2, 8)
    assert np.clip(1024 // 64 // floor, 1, splits) == 2


def test_tuning_table_names_every_default():
    # Each rule in tuning_gpu has its measurement: device, JAX version, date and commit.
    rules = {name for name in dir(tuning_gpu) if name.startswith("default_")}
    assert rules == set(tuning_gpu.TUNING)
    for name, entry in tuning_gpu.TUNING.items():
        assert entry.rule and entry.evidence and entry.device and entry.jax, name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry.date), (name, entry.date)
        assert re.fullmatch(r"[0-9a-f]{7,40}", entry.commit), (name, entry.commit)


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
    reason = kernel_gpu.unsupported_reason(*shapes(**kw), check_backend=False)
    assert reason is not None and match in reason


@pytest.mark.parametrize(
    "kw", [dict(), dict(C=8, H=64), dict(C=256, H=256, N=8, K=8), dict(C=1), dict(C=2), dict(C=4)]
)
def test_unsupported_reason_accepts_supported(kw):
    assert kernel_gpu.unsupported_reason(*shapes(**kw), check_backend=False) is None


@pytest.mark.parametrize("capability", [None, (8, 0), (7, 5)])
def test_unsupported_reason_needs_a_hopper_gpu(capability, monkeypatch):
    # No GPU, or one older than Hopper: whatever the machine running the test has.
    monkeypatch.setattr(_backend, "gpu_compute_capability", lambda: capability)
    assert "compute capability 9.x" in kernel_gpu.unsupported_reason(*shapes())


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_kv=32), "block_kv=32"),
        (dict(num_splits=0), "num_splits=0"),
        (dict(num_stages=9), "num_stages=9"),
        (dict(dtype=jnp.float32), "cannot run this call"),
        (dict(num_splits=2.5), "num_splits=2.5 must be an integer"),
        (dict(num_stages="2"), "num_stages='2' must be an integer"),
        (dict(order_method="bitonic"), "order_method='bitonic' must be one of"),
        # Two sequences: the in-kernel count's TMA copy takes multiples of 4 (checked where
        # the order is on; with it off any method is accepted: test_kernel_order_only_if_on).
        (
            dict(order_method="kernel", longest_first=True),
            'order_method="kernel" needs a multiple of 4',
        ),
        (dict(C=1, page_copy="gather4"), "page_copy='gather4' must be one of"),
        (dict(C=1, num_stages=7), r"needs \d+ bytes of SMEM, .*num_stages=7"),
        (dict(C=1, num_stages=6, page_copy="tma"), r"needs \d+ bytes of SMEM, .*num_stages=6"),
        (dict(num_stages=0), "num_stages=0 must be >= 1"),
        (dict(split_merge="kernel", num_splits=2), "split_merge='kernel' must be one of"),
        (dict(producer=True), "unexpected keyword argument 'producer'"),
        (dict(split_merge="host"), "split_merge='host' must be one of"),
        (dict(split_merge="mosaic", num_splits=2, swap_ab=False), 'split_merge="mosaic" merges'),
        (dict(C=1, page_copy="cp_async", interpret=True), "runs only on a GPU"),
        (dict(min_split_tiles=0), "min_split_tiles=0 must be >= 1"),
        (dict(min_split_tiles=2.5), "min_split_tiles=2.5 must be an integer"),
    ],
)
def test_bad_arguments_raise(kw, match):
    dtype = kw.pop("dtype", jnp.bfloat16)
    args = shapes(dtype=dtype, **({"C": kw.pop("C")} if "C" in kw else {}))
    q, k, v, bt, ln = (jnp.zeros(s.shape, s.dtype) for s in args)
    with pytest.raises((ValueError, TypeError), match=match):
        kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1, **kw)


def test_kernel_order_only_if_on():
    # "kernel"'s own limits apply where the order is on: with it off (as by default on this
    # tiny grid) any sequence count is accepted.
    q = jnp.zeros((4, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 8, 16, 64), jnp.bfloat16)
    bt, ln = jnp.zeros((4, 2), jnp.int32), jnp.ones((4,), jnp.int32)
    seen = []
    f = kernel_gpu.paged_attention_pallas_gpu
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_gpu, "_paged_attention", lambda cfg, *a: seen.append(cfg))
        f(q[:2], kv, kv, bt[:2], ln[:2], sm_scale=0.1, order_method="kernel", longest_first=False)
    assert [c.longest_first for c in seen] == [False]
    with pytest.raises(ValueError, match='order_method="kernel" needs a multiple of 4'):
        f(q[:2], kv, kv, bt[:2], ln[:2], sm_scale=0.1, order_method="kernel", longest_first=True)


def test_rank_order_bounded_by_batch():
    B, limit = 1025, _gpu_order.RANK_ORDER_MAX_SEQS
    q = jnp.zeros((B, 8, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
    bt, ln = jnp.zeros((B, 2), jnp.int32), jnp.ones((B,), jnp.int32)
    with pytest.raises(ValueError, match=f"at most {limit} sequences, got {B}"):
        kernel_gpu.paged_attention_pallas_gpu(q, kv, kv, bt, ln, sm_scale=0.1, order_method="rank")
    with pytest.raises(ValueError, match=f"at most {limit} sequences"):
        _gpu_order.longest_first_order(ln, 64, True, "rank")
    with pytest.raises(ValueError, match="must be one of"):
        _gpu_order.longest_first_order(ln, 64, True, "radix")
    with pytest.raises(ValueError, match="needs packed keys"):
        _gpu_order.longest_first_order(ln, 64, False, "rank")
    # Checked before the early return of an empty table.
    empty = jnp.zeros((2, 0), jnp.int32)
    with pytest.raises(ValueError, match="order_method='bitonic'"):
        kernel_gpu.paged_attention_pallas_gpu(
            q[:2], kv, kv, empty, ln[:2] * 0, sm_scale=0.1, order_method="bitonic"
        )


def test_rank_order_is_int32_under_x64():
    lengths = jnp.asarray([5, 300, 0, 64], jnp.int32)
    with jax.enable_x64(True):
        out = _gpu_order.longest_first_order(lengths, 64, True, "rank")
        ref = _gpu_order.longest_first_order(lengths, 64, True, "sort")
    assert out.dtype == ref.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


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
    assert _gpu_order.packed_order(B)
    keys = np.asarray(_gpu_order.longest_first_order(jnp.asarray(lengths), 64, True))
    order = keys & 0xFFFF
    tiles = np.minimum(-(-np.maximum(lengths, 0).astype(np.int64) // 64), 0x7FFF)
    np.testing.assert_array_equal(order, np.argsort(-tiles, kind="stable"))
    if B <= _gpu_order.RANK_ORDER_MAX_SEQS:  # counting gives the sort's array exactly
        rank = _gpu_order.longest_first_order(jnp.asarray(lengths), 64, True, "rank")
        np.testing.assert_array_equal(np.asarray(rank), keys)
    plain = np.asarray(_gpu_order.longest_first_order(jnp.asarray(lengths), 64, False))
    np.testing.assert_array_equal(np.sort(plain), np.arange(B))
    assert np.all(np.diff(np.maximum(lengths[plain], 0).astype(np.int64)) <= 0)


def test_default_tuning_from_static_shapes():
    # Many programs: no split. Few programs, long context: split, bounded by tiles per split.
    assert tuning_gpu.default_num_splits(128, 8, 3072, 64) == 1
    assert tuning_gpu.default_num_splits(1, 8, 49152, 64) == 32  # one sequence: one wave
    assert tuning_gpu.default_num_splits(2, 8, 49152, 64) == 16  # two: one wave too
    assert tuning_gpu.default_num_splits(4, 8, 49152, 64) == 16  # four: two waves
    assert tuning_gpu.default_num_splits(1, 32, 49152, 64) == 8
    assert tuning_gpu.default_num_splits(1, 2, 49152, 64) == 64  # capped
    assert tuning_gpu.default_num_splits(8, 8, 1024, 64) == 4
    assert tuning_gpu.default_num_splits(1, 1, 64, 64) == 1
    assert tuning_gpu.default_num_splits(8, 8, 49152, 64) == 8  # ~512 CTAs
    # About one wave of programs: split only long sequences (>= 32 tiles a split, 2 splits from
    # 48-tile tables), and those splits run longest first.
    assert tuning_gpu.default_num_splits(32, 8, 2048, 64) == 1
    assert tuning_gpu.default_num_splits(32, 8, 3008, 64) == 1  # 47 tiles
    assert tuning_gpu.default_num_splits(32, 8, 3072, 64) == 2
    assert tuning_gpu.default_num_splits(48, 8, 3072, 64) == 2
    assert tuning_gpu.default_num_splits(32, 8, 6144, 64) == 3
    assert tuning_gpu.default_num_splits(32, 8, 12288, 64) == 4
    assert tuning_gpu.default_longest_first(32, 8, 2, 3072)
    assert tuning_gpu.default_longest_first(48, 8, 2, 3072)
    assert tuning_gpu.default_longest_first(32, 8, 3, 6144)
    assert tuning_gpu.default_num_splits(64, 8, 6144, 64) == 1  # two waves: never
    # Longest first once the grid is more than one wave (2 x 132 CTAs), never for B = 1.
    assert tuning_gpu.default_longest_first(128, 8, 1)
    assert tuning_gpu.default_longest_first(8, 8, 16)
    assert not tuning_gpu.default_longest_first(1, 8, 64)
    assert not tuning_gpu.default_longest_first(32, 8, 1)  # 256 CTAs: one wave
    # Given the table's reach: only units that can exceed 2048 tokens are ordered.
    assert tuning_gpu.default_longest_first(128, 8, 1, 4096)
    assert not tuning_gpu.default_longest_first(256, 8, 1, 2048)
    assert tuning_gpu.default_longest_first(8, 8, 8, 49152)  # 6144 tokens per split
    assert not tuning_gpu.default_longest_first(8, 8, 8, 16384)  # 2048 per split
    assert not tuning_gpu.default_longest_first(32, 8, 1, 1 << 20)  # one wave
    assert tuning_gpu.default_order_method(1024) == "rank"
    assert tuning_gpu.default_order_method(1025) == "sort"
    # Each CTA counts its own place (no XLA kernel) for multiples of 4 up to 256 sequences.
    assert tuning_gpu.default_order_method(128) == "kernel"
    assert tuning_gpu.default_order_method(256) == "kernel"
    assert tuning_gpu.default_order_method(4) == "kernel"
    assert tuning_gpu.default_order_method(130) == "rank"
    assert tuning_gpu.default_order_method(260) == "rank"
    assert tuning_gpu.default_deferred_sum()
    # The kernel's own barriers; Pallas's only for the small pages' staging ring.
    assert not tuning_gpu.default_auto_barriers()
    assert tuning_gpu.default_auto_barriers(staged=True)
    # Two CTAs per SM: the ring fits in ~113 KB.
    for H in (64, 128, 256):
        stages = tuning_gpu.default_num_stages(H)
        assert stages >= 2
        assert _gpu_sizes.smem_bytes(H, 64, stages) <= 113 * 1024 or stages == 2
    # swap_ab: 2 stages, 68 KB at H=128: three CTAs per SM by SMEM (3 x (68 + 1) <= 228 KB).
    assert tuning_gpu.default_num_stages(128, 64, qcols=8) == 2
    assert _gpu_sizes.smem_bytes(128, 64, 2, qcols=8) <= 75 * 1024


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(mma="hmma"), "mma='hmma' must be one of"),
        (dict(mma="tcgen05", block_kv=64), 'mma="tcgen05" needs block_kv=128'),
        (dict(mma="tcgen05", H=64), r"head dim in \(128, 256\) \(got 64\)"),
        (dict(mma="tcgen05", swap_ab=False), "runs the swap_ab form only"),
        (dict(mma="tcgen05", split_merge="mosaic", num_splits=2), "merges splits in XLA"),
    ],
)
def test_tcgen05_bad_arguments_raise(kw, match):
    H = kw.pop("H", 128)
    args = shapes(H=H, C=16)
    q, k, v, bt, ln = (jnp.zeros(s.shape, s.dtype) for s in args)
    with pytest.raises(ValueError, match=match):
        kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1, **kw)


def test_tcgen05_defaults_on_blackwell(monkeypatch):
    # default_mma and unsupported_reason on a Blackwell GPU (sm100 / sm103), a consumer
    # Blackwell (sm120: no tcgen05, no wgmma) and a Hopper, faked.
    from pallas_kernels import _backend

    for cc, mma in (((10, 0), "tcgen05"), ((10, 3), "tcgen05"), ((9, 0), "wgmma")):
        monkeypatch.setattr(_backend, "gpu_compute_capability", lambda cc=cc: cc)
        assert tuning_gpu.default_mma() == mma
        assert tuning_gpu.default_mma(interpret=True) == "wgmma"
        assert kernel_gpu.unsupported_reason(*shapes()) is None
        reason = kernel_gpu.unsupported_reason(*shapes(H=64, C=8))
        assert (reason is None) == (mma == "wgmma"), reason
        if mma == "tcgen05":
            assert "on Blackwell (tcgen05) head_dim=64" in reason
    monkeypatch.setattr(_backend, "gpu_compute_capability", lambda: (12, 0))
    assert tuning_gpu.default_mma() == "wgmma"
    reason = kernel_gpu.unsupported_reason(*shapes())
    assert "compute capability 9.x or 10.x or 11.x (got (12, 0))" in reason
    # On Blackwell the kernel takes mma="tcgen05" and T=128 by default, and auto dispatch picks
    # it (at head dim 128, where this JAX lowers it).
    monkeypatch.setattr(_backend, "gpu_compute_capability", lambda: (10, 0))
    monkeypatch.setattr(_backend, "default_platform", lambda: "gpu")
    from jpaged import _attention
    from pallas_kernels.paged_attention import dispatch

    for H, C in ((128, 16), (64, 8)):
        resolved = _attention._resolve(
            "paged_attention", dispatch, None, None, shapes(H=H, C=C), {}
        )
        want = "pallas_gpu" if H == 128 else "xla"
        assert resolved == want, (H, resolved)
    seen = []
    monkeypatch.setattr(kernel_gpu, "_paged_attention", lambda cfg, *a: seen.append(cfg))
    q, k, v, bt, ln = (jnp.zeros(s.shape, s.dtype) for s in shapes())
    kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1)
    (cfg,) = seen
    assert (cfg.mma, cfg.block_kv, cfg.swap_ab, cfg.qcols) == ("tcgen05", 128, True, 16)
    assert cfg.fixed_max
    assert cfg.out_blocks == (not kernel_gpu.swap_ab_lowers() and cfg.qcols != cfg.group)
