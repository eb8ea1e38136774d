"""The Mosaic GPU decode kernel (``pallas_kernels/paged_attention/kernel_gpu.py``) lowered for
CUDA on the CPU: every variant of the default kernel (``_VARIANTS``: the device code each option
selects, read off the lowered program and the kernel's name) and the tcgen05 kernel lowered for
sm100. ``tools/lowered_ir.py`` fingerprints ``_VARIANTS``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from _decode_gpu_cases import fills, shapes, skip_unless_swap_ab_lowers, variant_call, variant_id

from pallas_kernels.paged_attention import _gpu_sizes, kernel_gpu, tuning_gpu

# Cases ``make test`` (CPU CI) leaves out and ``make test-all`` runs: the slowest lowerings whose
# paths other variants cover (one-token pages by TMA, tcgen05's staging ring).
SLOW_CASES = {
    "test_tcgen05_lowers_for_sm100[C2-W128-page_copytma]",
    "test_cross_lowers_for_cuda[C1-W256-H64-K4-dtype<class 'jax.numpy.float16'>-L3-page_copytma]",
    # one-token pages by TMA at head dim 128 (the staging ring's other TMA cases stay: C=2 with
    # the 64-row tile, C=4 at head dim 256; the interpreter runs one-token pages), and the
    # staging ring under fixed_max (fixed_max's other variants stay)
    "test_cross_lowers_for_cuda[C1-W128-page_copytma]",
    "test_cross_lowers_for_cuda[fixed_maxTrue-C2-W64-page_copytma]",
    # Variants whose every option resolves to another variant's kernel (the same _Config and
    # shapes: swap_ab and fixed_max are the defaults there, as is the merge kernel at 4 splits):
    # "", num_splits4-logits_soft_cap30.0-sliding_window100, H256-C256-num_splits2,
    # H64-C8-K4-...-L3, N8-K8-C32-block_kv128, N64-K8-C64-num_stages2-longest_firstFalse,
    # B40-num_splits2-longest_firstTrue and C1-W128 stay
    *(
        f"test_cross_lowers_for_cuda[{i}]"
        for i in (
            "swap_abTrue", "fixed_maxTrue",
            "swap_abTrue-num_splits4-logits_soft_cap30.0-sliding_window100",
            "num_splits4-split_mergemosaic-logits_soft_cap30.0-sliding_window100",
            "swap_abTrue-H256-C256-num_splits2",
            "swap_abTrue-H64-C8-K4-dtype<class 'jax.numpy.float16'>-L3",
            "swap_abTrue-N8-K8-C32-block_kv128", "swap_abTrue-N64-K8-C64",
            "swap_abTrue-B40-num_splits2-longest_firstTrue", "fixed_maxTrue-C1-W128",
        )
    ),
    # The merge kernel's rounds at head dim 256 (rounds: num_splits40-...-split_mergemosaic;
    # head dim 256 merged by the kernel: H256-C256-num_splits2); XLA's merge of 40 splits (the
    # XLA merge: num_splits3-split_mergexla, ...-min_split_tiles16-split_mergexla; the default
    # past 32 splits: test_paged_attention_gpu_config); the default and both merges at 3
    # splits (each variant checks its merge against default_split_merge); tcgen05's in-kernel
    # order (wgmma's: B40-...-order_methodkernel, B132-longest_firstTrue; tcgen05's other
    # variants)
    "test_cross_lowers_for_cuda[B1-N128-K8-H256-C256-num_splits32-split_mergemosaic-swap_abTrue]",
    "test_cross_lowers_for_cuda[num_splits40-B1-H64-C8-K4]",
    "test_split_merge_lowering",
    "test_tcgen05_lowers_for_sm100[B40-longest_firstTrue-order_methodkernel]",
    # Near repeats: a floor of 1 (the default here: num_splits4-logits_soft_cap30.0-sliding_
    # window100 has it), fixed_max and the running max with 4 splits, cap and window at C=64
    # (fixed_max: the bf16 default of that case and of num_splits3-C64-min_split_tiles2-...;
    # the running max: fixed_maxFalse), fixed_max at f16 (fixed_maxTrue-swap_abFalse-...;
    # f16: H64-C8-K4-...-L3), whole blocks with 4 splits, cap and window
    # (out_blocksTrue-num_splits3-split_mergemosaic, out_blocksTrue), per-thread copies of
    # 8-token pages into the 64-row tile (C2-W64-swap_abFalse, page_copycp_async), tcgen05's
    # running max at bf16 (its f16 variant runs the running max)
    *(
        f"test_cross_lowers_for_cuda[{i}]"
        for i in (
            "num_splits4-min_split_tiles1",
            "fixed_maxTrue-num_splits4-logits_soft_cap30.0-sliding_window100-C64",
            "fixed_maxFalse-num_splits4-logits_soft_cap30.0-sliding_window100-C64",
            "fixed_maxTrue-H64-C8-K4-dtype<class 'jax.numpy.float16'>-L3",
            "out_blocksTrue-num_splits4-logits_soft_cap30.0-sliding_window100",
            "C8-H64-K4-page_copycp_async-swap_abFalse",
        )
    ),
    "test_tcgen05_lowers_for_sm100[fixed_maxFalse]",
    # Combinations whose options each stay in CI in another variant: the 64-row tile at head
    # dim 64 / f16 / a 5-D pool and at G=1 with 128-key tiles (swap_abFalse; H64-C8-K4-...-L3,
    # N8-K8-C32-block_kv128); longest first with 2 splits (B40-...-order_methodkernel and the
    # 64-row tile's B40-longest_firstTrue-num_splits3-swap_abFalse); G=16 with 3 splits and a
    # window (swap_abTrue-N64-K4-num_splits1, num_splits4-logits_soft_cap30.0-...); 4-token
    # pages with splits, cap and window (C4-W32-H256-num_splits2, C1-W128); small pages in
    # the in-kernel order at G=8 (C2-W64-swap_abFalse, B40-...-order_methodkernel); per-thread
    # copies of 128-token pages (page_copycp_async; C > T: H256-C256-num_splits2); the merge
    # kernel at G=5 (G=3: H64-N24-K8-...); the floor of 2 (floors: num_splits4-
    # min_split_tiles16-split_mergexla, B40-W192's 8); whole blocks of 16 columns at 1-token
    # pages and at head dim 256 (out_blocksTrue, out_blocksTrue-num_splits3-split_mergemosaic;
    # 16 columns: swap_abTrue-N48-K8; tcgen05's H256-num_splits2-out_blocksTrue-...); tcgen05
    # at C > T, G=8 and G=1 (tcgen05's other variants; C > T, G=8, G=1 under wgmma)
    *(
        f"test_cross_lowers_for_cuda[{i}]"
        for i in (
            "swap_abFalse-H64-C8-K4-dtype<class 'jax.numpy.float16'>-L3",
            "swap_abFalse-N8-K8-C32-block_kv128",
            "B40-num_splits2-longest_firstTrue",
            "swap_abTrue-N64-K4-num_splits3-sliding_window100",
            "C4-W32-num_splits3-logits_soft_cap30.0-sliding_window100",
            "C2-W64-B40-longest_firstTrue-N64",
            "C128-page_copycp_async-num_splits2-sliding_window100",
            "H64-N40-K8-num_splits3-split_mergemosaic-swap_abTrue",
            "num_splits3-C64-min_split_tiles2-sliding_window100-logits_soft_cap30.0",
            "out_blocksTrue-N48-K8-C1-W128",
            "out_blocksTrue-H256-C256-num_splits2-swap_abTrue",
        )
    ),
    *(
        f"test_tcgen05_lowers_for_sm100[{i}]"
        for i in ("C256-W2-num_splits2", "N64-K8-C64", "N8-K8-C32")
    ),
    # The TMA staging ring feeding the 64-row tile (the ring: C4-W32-H256-num_splits2-
    # page_copytma; 2-token pages into the 64-row tile: C2-W64-swap_abFalse)
    "test_cross_lowers_for_cuda[C2-W64-swap_abFalse-page_copytma]",
}  # fmt: skip


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
    dict(B=7, N=2, K=2, H=64, num_splits=3),  # B*N = 14 rows: q padded to 8
    dict(B=40, num_splits=2, longest_first=True),  # (off by default: 128-token tables)
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
    # (profile_dir is not here: its trace leaves through a host callback, which lowers only
    # for the backend in hand; it ran on the H200, benchmarks/profile_decode_timeline.py.)
    dict(swap_ab=True, H=256, C=256, num_splits=1),  # O^T [256, 8] stored transposed
    dict(swap_ab=True, N=64, K=4, num_splits=1),  # G=16: 16 query columns
    dict(swap_ab=True, N=64, K=1, H=64, num_splits=1),  # G=64: 64 columns
    dict(swap_ab=True, N=64, K=4, num_splits=3, sliding_window=100),
    dict(N=64, K=4),  # G=16 without splits: 16 columns, so the 64-row tile by default
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
    # Pages of 8+ tokens copied per thread too (opt-in)
    dict(page_copy="cp_async"),
    dict(C=128, page_copy="cp_async", num_splits=2, sliding_window=100),  # C > T
    dict(C=8, H=64, K=4, page_copy="cp_async", swap_ab=False),
    # Split partials merged by XLA instead of the second kernel
    dict(num_splits=3, split_merge="xla"),
    dict(num_splits=40, B=1, H=64, C=8, K=4),  # XLA by default past 32 splits
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
    dict(fixed_max=True, C=1, W=128),  # per-thread cp.async copies
    dict(fixed_max=True, C=2, W=64, page_copy="tma"),  # the staging ring
    dict(fixed_max=False),  # the running max in every tile (f16's default)
    # swap_ab's output as whole qcols-row blocks gathered by XLA (JAX >= 0.12's default)
    dict(out_blocks=True),
    dict(out_blocks=True, num_splits=4, logits_soft_cap=30.0, sliding_window=100),
    dict(out_blocks=True, N=48, K=8, C=1, W=128),  # 16 columns, per-thread copies
    dict(out_blocks=True, H=256, C=256, num_splits=2, swap_ab=True),
    dict(fixed_max=False, num_splits=4, logits_soft_cap=30.0, sliding_window=100, C=64),
]


def _has_exp(text: str) -> bool:
    """Whether the lowered module (outside the kernels) takes an exponential: the XLA split
    merge's ``exp2``, a ``stablehlo.exp2`` from JAX 0.12 on, ``exponential`` of x ln 2 before."""
    return "stablehlo.exp2 " in text or "stablehlo.exponential " in text


@pytest.mark.parametrize("variant", _VARIANTS, ids=variant_id)
def test_cross_lowers_for_cuda(variant):
    f, args, v, B, N, K, H, C, W = variant_call(variant)
    fill = fills(B, N, K, v)
    direct = v.get("swap_ab") and v.get("out_blocks") is False and not fill
    if direct and not kernel_gpu.swap_ab_lowers():  # refused at once, not minutes of search
        with pytest.raises(ValueError, match=r"does not lower on jax"):
            jax.eval_shape(f, *args)
        return
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text.lower()
    # The longest-first order is computed exactly when it is on (a sort, or the counting form's
    # reductions over [B, B], or counted in the kernel: name part _ko).
    T = v.get("block_kv", tuning_gpu.default_block_kv(H))
    splits = v.get("num_splits") or tuning_gpu.default_num_splits(B, K, W * C, T)
    lf = v.get("longest_first")
    if lf is None:
        lf = tuning_gpu.default_longest_first(B, K, splits, W * C)
    method = v.get("order_method") or tuning_gpu.default_order_method(B)
    assert ("stablehlo.sort" in text) == (lf and method == "sort"), (lf, method)
    assert (f"tensor<{B}x{B}xi1>" in text) == (lf and method == "rank"), (lf, method)
    names = set(re.findall(r"paged_decode_mgpu\w*_mosaic_gpu", text))
    assert any("_ko_" in name for name in names) == (lf and method == "kernel"), (lf, method)
    # swap_ab (the kernel name ends in _sw<qcols>): as asked, else as default_swap_ab says.
    qcols = _gpu_sizes.qcols(B, N, K)
    swap = v.get("swap_ab", tuning_gpu.default_swap_ab(H, qcols))
    assert names and all(("_sw" in name) == swap for name in names), names
    # Whole output blocks (_ob): with swap_ab where its direct store does not lower (and G does
    # not fill the block: then the direct store is the whole block), or asked.
    lowers = kernel_gpu.swap_ab_lowers()
    blocks = swap and v.get("out_blocks", not lowers and not fill)
    assert all(("_ob" in name) == bool(blocks) for name in names), names
    # deferred_sum (name part _ds): with swap_ab at 8 query columns.
    deferred = swap and tuning_gpu.default_deferred_sum(qcols)
    assert all(("_ds" in name) == bool(deferred) for name in names), names
    # Pages below 8 tokens: per-thread cp.async pieces (_cpa) unless TMA is asked for (_stg,
    # with Pallas's automatic barriers: _ab).
    page_copy = v.get("page_copy") or ("cp_async" if C < 8 else "tma")
    copy = "_cpa" if page_copy == "cp_async" else "_stg" if C < 8 else ""
    assert all(
        ("_cpa" in name, "_stg" in name) == ("_cpa" in copy, "_stg" in copy) for name in names
    )
    assert all(("_ab" in name) == (copy == "_stg") for name in names), names
    # ... and the per-thread copies are in the kernel exactly then.
    assert ("nvvm.cp.async.shared.global" in text) == (copy == "_cpa")
    assert ("nvvm.cp.async.wait.group" in text) == (copy == "_cpa")
    # fixed_max (_fm): asked, else at bf16.
    dtype = variant.get("dtype", jnp.bfloat16)  # (a shape key: not among the knobs v)
    fixed = v.get("fixed_max", tuning_gpu.default_fixed_max(dtype))
    assert all(("_fm" in name) == bool(fixed) for name in names), names
    # Splits with swap_ab are merged by a second kernel by default (up to 32), else by XLA.
    merge = v.get("split_merge") or tuning_gpu.default_split_merge(splits, swap)
    second = merge == "mosaic" and splits > 1
    assert ("paged_decode_merge_S" in text) == second
    assert _has_exp(text) == (merge == "xla" and splits > 1)
    # No in-kernel merge, L2 prefetch or automatic barriers outside the staging ring.
    for part in ("atom.acq_rel.gpu.global.add.u32", "cp.async.bulk.prefetch", "_km_", "_ws_"):
        assert part not in text, part


def test_split_merge_lowering():
    # The second kernel by default with 2-32 splits and swap_ab; "xla" otherwise.
    skip_unless_swap_ab_lowers()
    args = (
        jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 40, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 40, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 8), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    for merge in (None, "xla", "mosaic"):
        f = functools.partial(
            kernel_gpu.paged_attention_pallas_gpu, sm_scale=0.1, num_splits=3, split_merge=merge
        )
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        # The XLA merge: a max over the splits of the lse, then exp2 and the weighted sum.
        assert _has_exp(text) == (merge == "xla"), merge
        # "mosaic" (the default): a second Mosaic GPU kernel, one CTA a (sequence, KV head) pair
        assert ("paged_decode_merge_S3_" in text) == (merge in (None, "mosaic")), merge


def test_swap_ab_lowers_gate(monkeypatch):
    # jax 0.12's Mosaic GPU layout inference exhausts its search on swap_ab's direct store (G
    # rows copied from a dynamic offset of the transposed output tile): there swap_ab stores
    # whole blocks (out_blocks), and the direct store asked for is refused.
    from pallas_kernels.paged_attention import _gpu_config

    assert _gpu_config.swap_ab_lowers("0.11.2")
    assert not _gpu_config.swap_ab_lowers("0.12.0.1")
    assert not _gpu_config.swap_ab_lowers("1.0.0")
    monkeypatch.setattr(jax, "__version__", "0.12.0.1")
    seen = []
    monkeypatch.setattr(kernel_gpu, "_paged_attention", lambda cfg, *a: seen.append(cfg))
    args = shapes()
    q, k, v, bt, ln = (jnp.zeros(s.shape, s.dtype) for s in args)
    kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1)
    kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1, num_splits=3)
    kernel_gpu.paged_attention_pallas_gpu(q, k, v, bt, ln, sm_scale=0.1, interpret=True)
    got = [(c.swap_ab, c.out_blocks) for c in seen]
    assert got == [(True, True), (True, True), (True, False)], got
    monkeypatch.undo()
    monkeypatch.setattr(jax, "__version__", "0.12.0.1")
    with pytest.raises(ValueError, match=r"does not lower on jax 0\.12\.0\.1"):
        kernel_gpu.paged_attention_pallas_gpu(
            q, k, v, bt, ln, sm_scale=0.1, swap_ab=True, out_blocks=False
        )
    # The interpreter does not lower it: the direct store still runs there.
    out = kernel_gpu.paged_attention_pallas_gpu(
        q, k, v, bt, ln, sm_scale=0.1, swap_ab=True, interpret=True
    )
    assert out.shape == q.shape
    # G = 8 fills the 8-column tile: its direct store is the whole tile, which 0.12 lowers, so
    # no whole blocks and no gather.
    q8 = jnp.zeros((2, 64, 128), jnp.bfloat16)
    seen.clear()
    monkeypatch.setattr(kernel_gpu, "_paged_attention", lambda cfg, *a: seen.append(cfg))
    for kw in (dict(), dict(num_splits=3), dict(swap_ab=True, out_blocks=False)):
        kernel_gpu.paged_attention_pallas_gpu(q8, k, v, bt, ln, sm_scale=0.1, **kw)
    got = [(c.swap_ab, c.out_blocks, c.qcols, c.group) for c in seen]
    assert got == [(True, False, 8, 8)] * 3, got


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
    qcols = _gpu_sizes.qcols(B, N, K, True)
    assert names and all(
        "_T128_" in n and f"_sw{qcols}" in n and n.endswith("_tc05_mosaic_gpu") for n in names
    ), names
