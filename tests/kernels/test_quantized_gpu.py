"""Quantized pages in the Mosaic GPU decode and ragged kernels: in the Mosaic GPU interpreter on
the CPU (each granularity in CI, dtypes rotating; the product, mixed key / value granularities,
splits and a 5-D pool slow), cross-lowered for sm90 (one variant a mode in CI), and compiled and
run on an sm90 GPU (``pytest -m gpu``), always against the f64 oracle on the dequantized values
with permuted tables and poisoned free pages, tails and scales."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import make_paged_kv
from _quantized_cases import (
    DTYPES,
    GRANULARITIES,
    assert_matches,
    decode_case,
    decode_oracle,
    quantize_pool,
    ragged_case,
    ragged_oracle,
)
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._gpu import quant as gpu_quant
from pallas_kernels.paged_attention import kernel_gpu, paged_attention_xla
from pallas_kernels.ragged_paged_attention import kernel_gpu as ragged_gpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_xla

C = 16
PRODUCT = [(d, g) for d in DTYPES for g in GRANULARITIES]
# CI: per head (per tensor runs the same kernel: it is broadcast to per head), page and token,
# dtypes rotating; the decode kernel's page mode also in the mixed-modes case.
_CI = {("float8_e4m3fn", "head"), ("float8_e5m2", "page"), ("int8", "token")}
_DECODE_CI = {("float8_e4m3fn", "head"), ("int8", "token")}
_MODES = [  # (id, key granularity, value granularity, knobs)
    ("page-token-split2", "page", "token", dict(num_splits=2)),
    ("token-head-64rows", "token", "head", dict(swap_ab=False)),
    ("head-page-64rows-split3", "head", "page", dict(swap_ab=False, num_splits=3)),
    ("token-page-T128-st1", "token", "page", dict(block_kv=128, num_stages=1)),
    ("token-token-smem-k", "token", "token", dict(k_registers=False)),  # K through SMEM on a GPU
]
SLOW_CASES = {
    f"test_decode_gpu_interpret[{d}-{g}]" for d, g in PRODUCT if (d, g) not in _DECODE_CI
} | {f"test_ragged_gpu_interpret[{d}-{g}]" for d, g in PRODUCT if (d, g) not in _CI}
SLOW_CASES |= {f"test_decode_gpu_interpret_modes[{m[0]}]" for m in _MODES[1:]}
SLOW_CASES |= {"test_decode_gpu_interpret_layered", "test_ragged_gpu_interpret_two_warpgroups"}
SLOW_CASES |= {f"test_quantized_cross_lowers[{v}]" for v in ("ragged-page", "decode-H256-token")}
# The scale copies of each op at one scale mode (CI: decode with key and value scales per
# token, ragged with per-token keys and per-head values: each op, one and two per-token
# copies); the decode kernel's int8 pages per token (per token: head_dim_256_default and
# modes[page-token-split2]'s values; int8 pages: ragged_gpu_interpret[int8-token], through the
# same dequantization, and the lowering decode-head-64rows)
SLOW_CASES |= {
    f"test_scale_copies_promise_in_bounds_on_the_k_barrier[{v}]"
    for v in ("token-head-decode", "token-token-ragged", "page-token-ragged", "page-token-decode")
}
SLOW_CASES |= {"test_decode_gpu_interpret[int8-token]"}


def _decode(q, kv, *, interpret, layer=None, **knobs):
    return kernel_gpu.paged_attention_pallas_gpu(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=0.125, layer=layer,
        k_scale=kv.k_scale, v_scale=kv.v_scale, interpret=interpret, **knobs,
    )  # fmt: skip


@pytest.mark.parametrize("dtype,granularity", PRODUCT)
def test_decode_gpu_interpret(dtype, granularity):
    rng = np.random.default_rng(51 + len(dtype) + len(granularity))
    q, kv = decode_case(
        rng, [0, 1, C - 1, C, C + 1, 150], C=C, dtype=dtype, granularity=granularity
    )
    out = _decode(q, kv, interpret=True)
    assert out.dtype == jnp.bfloat16
    assert_matches(out, decode_oracle(q, kv, sm_scale=0.125), f"{dtype} {granularity}")
    assert np.all(np.asarray(out, np.float32)[0] == 0.0)  # length 0


@pytest.mark.parametrize("kg,vg,knobs", [m[1:] for m in _MODES], ids=[m[0] for m in _MODES])
def test_decode_gpu_interpret_modes(kg, vg, knobs):
    # Key and value scales of different modes, with splits, the 64-row tile, 128-key tiles
    # (8 pages a tile) and a one-stage ring; an f16 query (the products run in bf16).
    rng = np.random.default_rng(52)
    q, kv = decode_case(
        rng, [0, 1, C - 1, C, C + 1, 300], C=C, dtype="float8_e4m3fn", granularity=kg,
        v_granularity=vg, q_dtype=jnp.float16,
    )  # fmt: skip
    out = _decode(q, kv, interpret=True, **knobs)
    assert out.dtype == jnp.float16
    assert_matches(out, decode_oracle(q, kv, sm_scale=0.125), f"{kg} {vg} {knobs}")


def test_decode_gpu_interpret_head_dim_256_default():
    # Head dim 256 at G=2 runs the K Q^T tiles by default (8 query columns), fp8 per token.
    rng = np.random.default_rng(53)
    q, kv = decode_case(
        rng, [0, 1, C - 1, C, C + 1, 150], C=C, H=256, dtype="float8_e4m3fn", granularity="token"
    )
    cfg, _ = kernel_gpu.make_config(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=0.125,
        k_scale=kv.k_scale, v_scale=kv.v_scale, interpret=True,
    )  # fmt: skip
    assert cfg.swap_ab
    out = _decode(q, kv, interpret=True)
    assert_matches(out, decode_oracle(q, kv, sm_scale=0.125), "fp8 token H=256")
    assert np.all(np.asarray(out, np.float32)[0] == 0.0)  # length 0


def test_decode_gpu_interpret_layered():
    # A 5-D pool, scales with their L axis, a traced layer, pages larger than a tile.
    rng = np.random.default_rng(53)
    q, kv = decode_case(
        rng, [0, 1, 127, 128, 129, 300], C=128, dtype="int8", granularity="token",
        v_granularity="page", num_layers=2,
    )  # fmt: skip
    out = _decode(q, kv, interpret=True, layer=jnp.int32(1))
    assert_matches(out, decode_oracle(q, kv, layer=1, sm_scale=0.125))


@pytest.mark.parametrize("dtype,granularity", PRODUCT)
def test_ragged_gpu_interpret(dtype, granularity):
    rng = np.random.default_rng(55 + len(dtype) + len(granularity))
    case, ks, vs = ragged_case(
        rng, [C - 1, 1, C + 1, 150], [3, 1, C + 1, 20], C=C, dtype=dtype, granularity=granularity
    )
    out = ragged_gpu.ragged_paged_attention_pallas_gpu(
        *case.args, sm_scale=0.125, k_scale=ks, v_scale=vs, interpret=True
    )
    assert_matches(out, ragged_oracle(case, sm_scale=0.125), f"{dtype} {granularity}")


def test_ragged_gpu_interpret_two_warpgroups():
    # Two warpgroups share the ring, each dequantizing into its own tile; a 5-D pool.
    rng = np.random.default_rng(56)
    case, ks, vs = ragged_case(
        rng, [C + 1, 150], [C + 1, 70], C=C, dtype="float8_e4m3fn", granularity="page",
        num_layers=2,
    )  # fmt: skip
    out = ragged_gpu.ragged_paged_attention_pallas_gpu(
        *case.args, sm_scale=0.125, k_scale=ks, v_scale=vs, layer=1, interpret=True, num_wgs=2
    )
    assert_matches(out, ragged_oracle(case, sm_scale=0.125, layer=1))


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_ragged_gpu_producer_warpgroup(interpret):
    # A producer warpgroup issues the page copies and the per-token scale copies.
    rng = np.random.default_rng(57)
    case, ks, vs = ragged_case(
        rng, [C - 1, 1, C + 1, 150], [3, 1, C + 1, 20], C=C, dtype="float8_e4m3fn",
        granularity="token",
    )  # fmt: skip
    out = ragged_gpu.ragged_paged_attention_pallas_gpu(
        *case.args, sm_scale=0.125, k_scale=ks, v_scale=vs, interpret=interpret, producer=True
    )
    assert_matches(out, ragged_oracle(case, sm_scale=0.125), "producer")


def test_quantized_configs():
    # The kernels' choices for quantized pages: wgmma with bf16 products, TMA page copies, the
    # ragged kernel's SMEM-operand body; what they decline, with the reason.
    pages = jax.ShapeDtypeStruct((8, 40, 16, 128), jnp.float8_e4m3fn)
    q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
    tables, lengths = jax.ShapeDtypeStruct((4, 8), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)
    scales = dict(k_scale=jnp.ones((8, 40, 16)), v_scale=jnp.ones(()))
    cfg, _ = kernel_gpu.make_config(q, pages, pages, tables, lengths, sm_scale=0.1, **scales)
    assert cfg.quantized and cfg.dtype == jnp.bfloat16 and cfg.kv_dtype == jnp.float8_e4m3fn
    assert (cfg.k_scales, cfg.v_scales, cfg.page_copy) == ("token", "head", "tma")
    with pytest.raises(ValueError, match="copied by TMA"):
        kernel_gpu.make_config(
            q, pages, pages, tables, lengths, sm_scale=0.1, page_copy="cp_async", **scales
        )
    # K tiles become the scores' register operand on a GPU; the interpreter's wgmma reads SMEM.
    assert cfg.swap_ab and cfg.k_registers
    icfg, _ = kernel_gpu.make_config(
        q, pages, pages, tables, lengths, sm_scale=0.1, interpret=True, **scales
    )
    assert not icfg.k_registers
    with pytest.raises(ValueError, match="k_registers=True runs only on a GPU"):
        kernel_gpu.make_config(
            q, pages, pages, tables, lengths, sm_scale=0.1, interpret=True, k_registers=True,
            **scales,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs quantized pages and swap_ab=True"):
        kernel_gpu.make_config(
            q, pages, pages, tables, lengths, sm_scale=0.1, swap_ab=False, k_registers=True,
            **scales,
        )  # fmt: skip
    bf16 = jax.ShapeDtypeStruct((8, 40, 16, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs quantized pages"):
        kernel_gpu.make_config(q, bf16, bf16, tables, lengths, sm_scale=0.1, k_registers=True)
    small = jax.ShapeDtypeStruct((8, 40, 4, 128), jnp.int8)
    reason = kernel_gpu.unsupported_reason(q, small, small, tables, lengths, check_backend=False)
    assert "multiple of 8 with quantized pages" in reason
    rq = jax.ShapeDtypeStruct((20, 32, 128), jnp.bfloat16)
    ragged_args = (rq, pages, pages, tables, lengths, jax.ShapeDtypeStruct((5,), jnp.int32),
                   jax.ShapeDtypeStruct((), jnp.int32))  # fmt: skip
    rcfg, _ = ragged_gpu.make_config(*ragged_args, sm_scale=0.1, **scales)
    assert rcfg.quantized and not rcfg.fa3
    with pytest.raises(ValueError, match="fa3=True does not take quantized pages"):
        ragged_gpu.make_config(*ragged_args, sm_scale=0.1, fa3=True, **scales)


_LOWERINGS = {  # id: (op, H, key mode, value mode, pool dtype, knobs)
    "decode-token-page": ("decode", 128, "token", "page", jnp.float8_e4m3fn, {}),
    "decode-head-64rows": ("decode", 128, "head", "head", jnp.int8, dict(swap_ab=False)),
    "decode-page-split": ("decode", 64, "page", "token", jnp.float8_e5m2, dict(num_splits=3)),
    "decode-H256-token": ("decode", 256, "token", "token", jnp.float8_e4m3fn, {}),
    "ragged-token": ("ragged", 128, "token", "head", jnp.float8_e4m3fn, {}),
    "ragged-page": ("ragged", 128, "page", "page", jnp.int8, dict(num_wgs=2)),
}


def _scale_shape(mode, K, P, C):
    return {"head": (K, 1, 1), "page": (K, P, 1), "token": (K, P, C)}[mode]


def _lower_for_sm90(op, H, km, vm, dtype, knobs) -> str:
    """The kernel traced and lowered for CUDA (text) on a [8, 40, 16, H] pool of ``dtype``."""
    K, P = 8, 40
    pool = jax.ShapeDtypeStruct((K, P, C, H), dtype)
    ks = jax.ShapeDtypeStruct(_scale_shape(km, K, P, C), jnp.float32)
    vs = jax.ShapeDtypeStruct(_scale_shape(vm, K, P, C), jnp.float32)
    tables, lens = jax.ShapeDtypeStruct((4, 8), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)
    if op == "decode":
        q = jax.ShapeDtypeStruct((4, 32, H), jnp.bfloat16)

        def f(q, k, v, t, n, ks, vs):
            return kernel_gpu.paged_attention_pallas_gpu(
                q, k, v, t, n, sm_scale=0.1, k_scale=ks, v_scale=vs, **knobs
            )

        args = (q, pool, pool, tables, lens, ks, vs)
    else:
        q = jax.ShapeDtypeStruct((40, 32, H), jnp.bfloat16)

        def f(q, k, v, t, n, cu, ns, ks, vs):
            return ragged_gpu.ragged_paged_attention_pallas_gpu(
                q, k, v, t, n, cu, ns, sm_scale=0.1, k_scale=ks, v_scale=vs, **knobs
            )

        args = (q, pool, pool, tables, lens, jax.ShapeDtypeStruct((5,), jnp.int32),
                jax.ShapeDtypeStruct((), jnp.int32), ks, vs)  # fmt: skip
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("variant", list(_LOWERINGS))
def test_quantized_cross_lowers(variant):
    op, H, km, vm, dtype, knobs = _LOWERINGS[variant]
    text = _lower_for_sm90(op, H, km, vm, dtype, knobs)
    name = jnp.dtype(dtype).name
    assert f"_{name}_k{km[0]}v{vm[0]}" in text  # the quantized kernel, by its name


@pytest.mark.parametrize("op", ["decode", "ragged"])
@pytest.mark.parametrize("km,vm", [("token", "token"), ("token", "head"), ("page", "token")])
def test_scale_copies_promise_in_bounds_on_the_k_barrier(op, km, vm, monkeypatch):
    # Traced for sm90: every per-token scale copy promises in-bounds reads (a bulk copy: a
    # tensor-map TMA copy to the ring's 32-byte multiples faults on hardware), and key and value
    # scales alike arrive on the K pages' barrier (the value scales multiply P before the V
    # tile is waited for), as many as the barriers' arrival counts say.
    calls = []
    copy = plgpu.copy_gmem_to_smem

    def record(src, dst, barrier=None, **kw):
        calls.append((jnp.dtype(src.dtype), barrier, kw.get("oob_mode")))
        return copy(src, dst, barrier, **kw)

    monkeypatch.setattr(plgpu, "copy_gmem_to_smem", record)
    jax.clear_caches()  # trace the kernel body again even if another test lowered it
    _lower_for_sm90(op, 128, km, vm, jnp.float8_e4m3fn, {})
    assert calls, "the kernel body was not traced"
    per_barrier = collections.defaultdict(collections.Counter)
    for d, barrier, mode in calls:
        if d == jnp.float32:
            assert mode == plgpu.OOBFillMode.PROMISE_IN_BOUNDS
        if d.itemsize == 1 or d == jnp.float32:
            per_barrier[id(getattr(barrier, "ref", barrier))][d.itemsize] += 1
    pages = sorted((c[1], c[4]) for c in per_barrier.values() if c[1])
    tokens = [km, vm].count("token")
    assert len(pages) == 2 and pages[0][0] == pages[1][0]  # K's and V's page copies
    assert pages == [(pages[0][0], 0), (pages[0][0], tokens * pages[0][0])]


@pytest.mark.parametrize("k_registers", [True, False])
def test_k_tiles_reach_the_scores_in_registers(k_registers, monkeypatch):
    # Traced for sm90: with k_registers every tile's 8-bit K is converted into registers (the
    # scores' wgmma A operand) and only V goes through the bf16 SMEM tile; without it, both.
    calls = collections.Counter()
    for name in ("tile_operand", "dequantize_tile"):
        original = getattr(gpu_quant, name)

        def record(*args, _name=name, _original=original, **kw):
            calls[_name] += 1
            return _original(*args, **kw)

        monkeypatch.setattr(gpu_quant, name, record)
    jax.clear_caches()  # trace the kernel body again even if another test lowered it
    _lower_for_sm90(
        "decode", 128, "token", "token", jnp.float8_e4m3fn, dict(k_registers=k_registers)
    )
    assert calls["dequantize_tile"] > 0, "the kernel body was not traced"
    if k_registers:  # once per traced tile body; V's dequantization traces two branches
        assert calls["tile_operand"] > 0 and calls["dequantize_tile"] == 2 * calls["tile_operand"]
    else:
        assert calls["tile_operand"] == 0


GPU_PRODUCT = [
    (d, g, C_, H)
    for d in DTYPES
    for g in GRANULARITIES
    for C_, H in ((16, 128), (64, 64), (32, 256))
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,granularity,C,H", GPU_PRODUCT, ids=str)
def test_decode_gpu(dtype, granularity, C, H):
    rng = np.random.default_rng(C + H + len(dtype) + len(granularity))
    lengths = [0, 1, C - 1, C, C + 1, 2 * C + 5, int(rng.integers(300, 3000)), 32768 // 8]
    q, kv = decode_case(rng, lengths, K=2, G=4, H=H, C=C, dtype=dtype, granularity=granularity)
    assert_matches(_decode(q, kv, interpret=False), decode_oracle(q, kv, sm_scale=0.125))


@pytest.mark.gpu
@pytest.mark.parametrize("kg,vg,knobs", [m[1:] for m in _MODES], ids=[m[0] for m in _MODES])
def test_decode_gpu_modes(kg, vg, knobs):
    rng = np.random.default_rng(57)
    q, kv = decode_case(
        rng, [0, 1, 15, 16, 17, 999, 4000], K=4, G=8, H=128, dtype="float8_e4m3fn",
        granularity=kg, v_granularity=vg, num_layers=2,
    )  # fmt: skip
    out = _decode(q, kv, interpret=False, layer=1, **knobs)
    assert_matches(out, decode_oracle(q, kv, layer=1, sm_scale=0.125))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,granularity", PRODUCT)
def test_ragged_gpu(dtype, granularity):
    rng = np.random.default_rng(58 + len(dtype) + len(granularity))
    case, ks, vs = ragged_case(
        rng, [C - 1, 1, C + 1, 1500, 700], [3, 1, C + 1, 400, 1], K=2, G=4, H=128, C=C,
        dtype=dtype, granularity=granularity,
    )  # fmt: skip
    out = ragged_gpu.ragged_paged_attention_pallas_gpu(
        *case.args, sm_scale=0.125, k_scale=ks, v_scale=vs
    )
    assert_matches(out, ragged_oracle(case, sm_scale=0.125), f"{dtype} {granularity}")


def _xla_agrees(out, ref, what: str) -> None:
    out, ref = (np.asarray(x, np.float32) for x in (out, ref))
    assert np.isfinite(out).all(), f"{what}: {np.size(out) - np.isfinite(out).sum()} non-finite"
    err = np.max(np.abs(out - ref)) / max(1e-6, float(np.max(np.abs(ref))))
    assert err < 2e-2, f"{what}: max error {err:.3g} of the largest output vs the XLA path"


def _busy_pool(rng, lengths, dtype):
    """(k_pages, v_pages, tables, lengths, k_scale, v_scale): a permuted, poisoned pool of 8 KV
    heads quantized per token, token magnitudes spread over a log-normal (so a scale read from
    the wrong tile is far off), and no f64 dense copy: these shapes are checked against XLA."""
    kv = make_paged_kv(rng, lengths, num_kv_heads=8, head_dim=128, page_size=16)
    pools = []
    for p in (kv.k_pages, kv.v_pages):
        p = np.asarray(p, np.float32)
        spread = rng.lognormal(0.0, 1.0, size=(*p.shape[:-1], 1)).astype(np.float32)
        pools.append(quantize_pool(rng, (p * spread)[None], dtype, "token", False))
    (kq, ks), (vq, vs) = pools
    return kq[0], vq[0], kv.block_tables, kv.lengths, ks, vs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
def test_decode_gpu_token_scales_busy(dtype):
    # Per-token scales with many units in flight (96 sequences of 0.5-1.5k tokens, 8 KV heads):
    # the value scales must have landed before they multiply P, which is formed before the V
    # tile is waited for. Small cases passed on an H100 while they had not; the benchmark's
    # rows of 32-128 sequences of 2k tokens gave NaN outputs.
    rng = np.random.default_rng(59)
    lengths = [int(x) for x in rng.integers(512, 1536, size=96)]
    kq, vq, tables, lens, ks, vs = _busy_pool(rng, lengths, dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), 32, 128)), jnp.bfloat16)
    args = (q, kq, vq, tables, lens)
    scales = dict(sm_scale=0.125, k_scale=ks, v_scale=vs)
    out = kernel_gpu.paged_attention_pallas_gpu(*args, **scales)
    _xla_agrees(out, paged_attention_xla(*args, **scales), f"decode {dtype}")


@pytest.mark.gpu
def test_ragged_gpu_token_scales_busy():
    rng = np.random.default_rng(60)
    kv_lens = [int(x) for x in rng.integers(512, 1536, size=64)]
    q_lens = [1] * 60 + [200, 37, 500, 1]
    kq, vq, tables, lens, ks, vs = _busy_pool(rng, kv_lens, "float8_e4m3fn")
    q = jnp.asarray(rng.standard_normal((sum(q_lens), 32, 128)), jnp.bfloat16)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (q, kq, vq, tables, lens, cu, np.int32(len(q_lens)))
    scales = dict(sm_scale=0.125, k_scale=ks, v_scale=vs)
    out = ragged_gpu.ragged_paged_attention_pallas_gpu(*args, **scales)
    _xla_agrees(out, ragged_paged_attention_xla(*args, **scales), "ragged fp8")
