"""Quantized pages in the Pallas-Triton decode and ragged kernels: in Pallas's interpreter on the
CPU (decode and ragged: each granularity in CI, dtypes rotating, the product slow; mixed key /
value granularities, splits, windows, soft caps, 5-D pools), lowered
for CUDA as for the A100, A10, L4 and H200 (float8_e4m3fn refused below sm89), the dispatcher's
reasons, and compiled on a GPU (``pytest -m gpu``: any NVIDIA GPU, the kernels forced), always
against the f64 oracle on the dequantized values with permuted tables and poisoned free pages,
tails and scales (``_quantized_cases``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantized_cases import (
    DTYPES,
    GRANULARITIES,
    assert_matches,
    decode_case,
    decode_oracle,
    ragged_case,
    ragged_oracle,
)
from _triton_lowering import lower_for_device

import jpaged
from jpaged import _attention
from pallas_kernels import _backend
from pallas_kernels.paged_attention import kernel_triton
from pallas_kernels.ragged_paged_attention import kernel_triton as ragged_triton

C = 16
PRODUCT = [(d, g) for d in DTYPES for g in GRANULARITIES]
# CI: decode and ragged each granularity once, the dtypes rotating (other pairs in decode
# than in ragged); the rest of each product is slow.
_DECODE_CI = {
    ("float8_e5m2", "tensor"),
    ("float8_e4m3fn", "head"),
    ("int8", "page"),
    ("float8_e4m3fn", "token"),
}
_RAGGED_CI = {
    ("float8_e4m3fn", "tensor"),
    ("float8_e5m2", "page"),
    ("int8", "token"),
    ("int8", "head"),
}
SLOW_CASES = {
    f"test_ragged_triton_interpret[{d}-{g}]" for d, g in PRODUCT if (d, g) not in _RAGGED_CI
} | {f"test_decode_triton_interpret[{d}-{g}]" for d, g in PRODUCT if (d, g) not in _DECODE_CI}
SLOW_CASES |= {"test_ragged_triton_interpret_modes[token-page-layered-split2]"}


def _decode(q, kv, *, interpret=True, layer=None, **kw):
    return kernel_triton.paged_attention_pallas_triton(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=0.125, layer=layer,
        k_scale=kv.k_scale, v_scale=kv.v_scale, interpret=interpret, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("dtype,granularity", PRODUCT)
def test_decode_triton_interpret(dtype, granularity):
    rng = np.random.default_rng(61 + len(dtype) + len(granularity))
    q, kv = decode_case(
        rng, [0, 1, C - 1, C, C + 1, 150], C=C, dtype=dtype, granularity=granularity
    )
    out = _decode(q, kv)
    assert out.dtype == jnp.bfloat16
    assert_matches(out, decode_oracle(q, kv, sm_scale=0.125), f"{dtype} {granularity}")
    assert np.all(np.asarray(out, np.float32)[0] == 0.0)  # length 0


_DECODE_MODES = [  # (id, key granularity, value granularity, query dtype, options)
    ("page-token-split3", "page", "token", jnp.bfloat16, dict(num_splits=3)),
    ("token-head-T16-f16", "token", "head", jnp.float16, dict(block_kv=16)),
    (
        "head-page-cap-window",
        "head",
        "page",
        jnp.bfloat16,
        dict(logits_soft_cap=5.0, sliding_window=40, num_splits=2),
    ),
    ("tensor-token-f32", "tensor", "token", jnp.float32, dict(block_kv=32)),
]


@pytest.mark.parametrize(
    "kg,vg,q_dtype,opts", [m[1:] for m in _DECODE_MODES], ids=[m[0] for m in _DECODE_MODES]
)
def test_decode_triton_interpret_modes(kg, vg, q_dtype, opts):
    # Key and value scales of different modes with splits, small tiles, a soft cap and window
    # (tiles before the window never read), f16 and f32 queries (the products in q's dtype).
    rng = np.random.default_rng(62)
    q, kv = decode_case(
        rng, [0, 1, C - 1, C, C + 1, 300], G=4, C=C, dtype="float8_e5m2", granularity=kg,
        v_granularity=vg, q_dtype=q_dtype,
    )  # fmt: skip
    out = _decode(q, kv, **opts)
    assert out.dtype == q_dtype
    cap, window = opts.get("logits_soft_cap"), opts.get("sliding_window")
    ref = decode_oracle(q, kv, sm_scale=0.125, logits_soft_cap=cap, sliding_window=window)
    assert_matches(out, ref, f"{kg} {vg} {opts}")


def test_decode_triton_interpret_layered():
    # A 5-D pool, scales with their L axis (per token keys, per page values), a traced layer,
    # pages larger than a tile.
    rng = np.random.default_rng(63)
    q, kv = decode_case(
        rng, [0, 1, 63, 64, 65, 200], C=64, dtype="int8", granularity="token",
        v_granularity="page", num_layers=2,
    )  # fmt: skip
    out = _decode(q, kv, layer=jnp.int32(1), block_kv=32)
    assert_matches(out, decode_oracle(q, kv, layer=1, sm_scale=0.125))


@pytest.mark.parametrize("dtype,granularity", PRODUCT)
def test_ragged_triton_interpret(dtype, granularity):
    rng = np.random.default_rng(65 + len(dtype) + len(granularity))
    case, ks, vs = ragged_case(
        rng, [C - 1, 1, C + 1, 150], [3, 1, C + 1, 20], C=C, dtype=dtype, granularity=granularity
    )
    out = ragged_triton.ragged_paged_attention_pallas_triton(
        *case.args, sm_scale=0.125, k_scale=ks, v_scale=vs, interpret=True
    )
    assert out.dtype == jnp.bfloat16
    assert_matches(out, ragged_oracle(case, sm_scale=0.125), f"{dtype} {granularity}")


_RAGGED_MODES = [  # (id, granularity, dtype, layers, options)
    (
        "page-noncausal-cap",
        "page",
        "float8_e4m3fn",
        None,
        dict(causal=False, logits_soft_cap=5.0),
    ),
    ("head-window-T16", "head", "int8", None, dict(sliding_window=24, block_kv=16)),
    ("token-page-layered-split2", "token", "float8_e5m2", 2, dict(num_splits=2, layer=1)),
]


@pytest.mark.parametrize(
    "granularity,dtype,layers,opts",
    [m[1:] for m in _RAGGED_MODES],
    ids=[m[0] for m in _RAGGED_MODES],
)
def test_ragged_triton_interpret_modes(granularity, dtype, layers, opts):
    rng = np.random.default_rng(66)
    case, ks, vs = ragged_case(
        rng, [C + 1, 1, 150], [C + 1, 1, 40], C=C, dtype=dtype, granularity=granularity,
        num_layers=layers,
    )  # fmt: skip
    out = ragged_triton.ragged_paged_attention_pallas_triton(
        *case.args, sm_scale=0.125, k_scale=ks, v_scale=vs, interpret=True, **opts
    )
    ref = ragged_oracle(
        case, sm_scale=0.125, causal=opts.get("causal", True), layer=opts.get("layer"),
        logits_soft_cap=opts.get("logits_soft_cap"), sliding_window=opts.get("sliding_window"),
    )  # fmt: skip
    assert_matches(out, ref, f"{granularity} {dtype} {opts}")


def test_through_jpaged_ops():
    # jpaged.paged_attention / ragged_paged_attention pass the scales to the kernel; the XLA
    # path on the same quantized pages agrees.
    rng = np.random.default_rng(67)
    q, kv = decode_case(rng, [0, 1, C + 1, 90], C=C, dtype="float8_e4m3fn", granularity="page")
    args = (q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
    scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale, sm_scale=0.125)
    out = jpaged.paged_attention(*args, implementation="pallas_triton", interpret=True, **scales)
    assert_matches(out, decode_oracle(q, kv, sm_scale=0.125))
    xla = jpaged.paged_attention(*args, implementation="xla", **scales)
    assert_matches(out, np.asarray(xla, np.float32).astype(np.float64))
    case, ks, vs = ragged_case(rng, [C + 1, 40], [3, 40], C=C, dtype="int8", granularity="token")
    out = jpaged.ragged_paged_attention(
        *case.args, sm_scale=0.125, k_scale=ks, v_scale=vs, implementation="pallas_triton",
        interpret=True,
    )  # fmt: skip
    assert_matches(out, ragged_oracle(case, sm_scale=0.125))


def _gpu(monkeypatch, cc):
    monkeypatch.setattr(_backend, "default_platform", lambda: "gpu")
    monkeypatch.setattr(_backend, "gpu_compute_capability", lambda: cc)
    monkeypatch.setattr(_backend, "_rocm", lambda: False)


def _shapes(dtype, K=2, P=6, H=64):
    q = jax.ShapeDtypeStruct((2, 4, H), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((K, P, C, H), dtype)
    tables, lens = jax.ShapeDtypeStruct((2, 3), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    scales = dict(k_scale=jnp.ones((K, P, 1), jnp.float32), v_scale=jnp.ones((), jnp.float32))
    return (q, pool, pool, tables, lens), scales


@pytest.mark.parametrize("cc", [(8, 0), (8, 6)])
def test_e4m3_needs_sm89(monkeypatch, cc):
    # Triton converts float8_e4m3fn from sm89 on: below it the kernels decline those pages,
    # naming the dtype, an explicit request raises that reason and auto dispatch runs the XLA
    # path; float8_e5m2 and int8 pages run there.
    _gpu(monkeypatch, cc)
    args, scales = _shapes(jnp.float8_e4m3fn)
    for reason_of in (kernel_triton.unsupported_reason, _ragged_reason):
        reason = reason_of(*args, **scales)
        assert "k_pages.dtype=float8_e4m3fn needs sm89" in reason
        assert f"sm{cc[0]}{cc[1]}" in reason
    for dtype in (jnp.float8_e5m2, jnp.int8):
        other, _ = _shapes(dtype)
        assert kernel_triton.unsupported_reason(*other, **scales) is None
        assert _ragged_reason(*other, **scales) is None
    _gpu(monkeypatch, (8, 9))
    assert kernel_triton.unsupported_reason(*args, **scales) is None
    # Through jpaged: real (small) arrays on this CPU, the GPU generation patched.
    _gpu(monkeypatch, cc)
    rng = np.random.default_rng(68)
    q, kv = decode_case(rng, [5, 40], C=C, dtype="float8_e4m3fn", granularity="page")
    call = (q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
    kw = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
    with pytest.raises(ValueError, match=r"'pallas_triton' cannot run .*float8_e4m3fn needs sm89"):
        jpaged.paged_attention(*call, implementation="pallas_triton", **kw)
    with pytest.raises(ValueError, match="float8_e4m3fn needs sm89"):
        kernel_triton.paged_attention_pallas_triton(*call, sm_scale=0.1, **kw)
    out = jpaged.paged_attention(*call, **kw)
    impl, why = _attention.last_auto_choice("paged_attention")
    assert impl == "xla" and "float8_e4m3fn needs sm89" in why
    assert_matches(out, decode_oracle(q, kv))


def _ragged_reason(q, k, v, tables, lens, **scales):
    T = jax.ShapeDtypeStruct((6, *q.shape[1:]), q.dtype)
    cu, ns = jax.ShapeDtypeStruct((3,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)
    return ragged_triton.unsupported_reason(T, k, v, tables, lens, cu, ns, **scales)


def test_scales_are_checked():
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    pool = jnp.zeros((2, 6, C, 64), jnp.int8)
    args = (q, pool, pool, jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="k_scale is missing"):
        kernel_triton.paged_attention_pallas_triton(*args, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match=r"v_scale.shape=\(2, 6, 3\) must be"):
        kernel_triton.paged_attention_pallas_triton(
            *args, sm_scale=0.1, interpret=True, k_scale=jnp.ones(()), v_scale=jnp.ones((2, 6, 3))
        )
    bf = jnp.zeros((2, 6, C, 64), jnp.bfloat16)
    reason = kernel_triton._triton.common_reason(q, bf, bf, jnp.ones(()), jnp.ones(()))
    assert "k_scale is given but k_pages.dtype=bfloat16 is not quantized" in reason


# --- lowered for CUDA on the CPU, per target GPU ------------------------------------------

_LOWERINGS = {  # id: (op, device kind, pool dtype, key mode, value mode, knobs)
    "decode-A100-e5m2-token-head": (
        "decode",
        "NVIDIA A100",
        jnp.float8_e5m2,
        "token",
        "head",
        dict(num_splits=2),
    ),
    "decode-A100-int8-page-token": ("decode", "NVIDIA A100", jnp.int8, "page", "token", {}),
    "decode-A10-e5m2-page-token": ("decode", "NVIDIA A10", jnp.float8_e5m2, "page", "token", {}),
    "decode-L4-e4m3-page-page": ("decode", "NVIDIA L4", jnp.float8_e4m3fn, "page", "page", {}),
    "ragged-A100-int8-token-page": ("ragged", "NVIDIA A100", jnp.int8, "token", "page", {}),
    "ragged-H200-e4m3-head-token": (
        "ragged",
        "NVIDIA H200",
        jnp.float8_e4m3fn,
        "head",
        "token",
        dict(num_splits=2),
    ),
}
SLOW_CASES |= {"test_quantized_triton_lowers[ragged-H200-e4m3-head-token]"}


def _lower(op, device, dtype, km, vm, knobs):
    K, P, H = 2, 40, 128
    pool = jax.ShapeDtypeStruct((K, P, C, H), dtype)
    shape = {"head": (K, 1, 1), "page": (K, P, 1), "token": (K, P, C)}
    ks = jax.ShapeDtypeStruct(shape[km], jnp.float32)
    vs = jax.ShapeDtypeStruct(shape[vm], jnp.float32)
    tables, lens = jax.ShapeDtypeStruct((4, 8), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)
    if op == "decode":
        q = jax.ShapeDtypeStruct((4, 8, H), jnp.bfloat16)

        def f(q, k, v, t, n, ks, vs):
            cfg = kernel_triton.make_config(q, k, t, sm_scale=0.1, k_scale=ks, v_scale=vs, **knobs)
            return kernel_triton._paged_attention(cfg, q, k, v, t, n, None, ks, vs)

        return lower_for_device(device, f, (q, pool, pool, tables, lens, ks, vs))
    q = jax.ShapeDtypeStruct((40, 8, H), jnp.bfloat16)
    cu, ns = jax.ShapeDtypeStruct((5,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)

    def g(q, k, v, t, n, cu, ns, ks, vs):
        cfg = ragged_triton.make_config(q, k, t, sm_scale=0.1, k_scale=ks, v_scale=vs, **knobs)
        return ragged_triton._ragged(cfg, q, k, v, t, n, cu, ns, None, ks, vs)

    return lower_for_device(device, g, (q, pool, pool, tables, lens, cu, ns, ks, vs))


@pytest.mark.parametrize("variant", list(_LOWERINGS))
def test_quantized_triton_lowers(variant):
    op, device, dtype, km, vm, knobs = _LOWERINGS[variant]
    text = _lower(op, device, dtype, km, vm, knobs)
    assert "__gpu$xla.gpu.triton" in text
    kernel = "paged_decode_triton" if op == "decode" else "ragged_paged_triton"
    assert kernel in text
    assert f"_{jnp.dtype(dtype).name}_k{km[0]}v{vm[0]}" in text  # the quantized kernel


def test_e4m3_does_not_lower_for_sm80():
    # What ``generation_reason`` stands for: JAX's Pallas-Triton lowering refuses the cast.
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        _lower("decode", "NVIDIA A100", jnp.float8_e4m3fn, "page", "page", {})


# --- compiled on a GPU --------------------------------------------------------------------

GPU_PRODUCT = [
    (d, g, C_, H)
    for d in DTYPES
    for g in GRANULARITIES
    for C_, H in ((16, 128), (64, 64), (32, 256))
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,granularity,C,H", GPU_PRODUCT, ids=str)
def test_decode_triton_gpu(dtype, granularity, C, H):
    rng = np.random.default_rng(C + H + len(dtype) + len(granularity))
    lengths = [0, 1, C - 1, C, C + 1, 2 * C + 5, int(rng.integers(300, 3000)), 32768 // 8]
    q, kv = decode_case(rng, lengths, K=2, G=4, H=H, C=C, dtype=dtype, granularity=granularity)
    assert_matches(_decode(q, kv, interpret=False), decode_oracle(q, kv, sm_scale=0.125))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kg,vg,q_dtype,opts", [m[1:] for m in _DECODE_MODES], ids=[m[0] for m in _DECODE_MODES]
)
def test_decode_triton_gpu_modes(kg, vg, q_dtype, opts):
    rng = np.random.default_rng(69)
    q, kv = decode_case(
        rng, [0, 1, 15, 16, 17, 999, 4000], K=4, G=8, H=128, dtype="float8_e4m3fn",
        granularity=kg, v_granularity=vg, num_layers=2, q_dtype=q_dtype,
    )  # fmt: skip
    out = _decode(q, kv, interpret=False, layer=1, **opts)
    cap, window = opts.get("logits_soft_cap"), opts.get("sliding_window")
    ref = decode_oracle(q, kv, layer=1, sm_scale=0.125, logits_soft_cap=cap, sliding_window=window)
    assert_matches(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,granularity", PRODUCT)
def test_ragged_triton_gpu(dtype, granularity):
    rng = np.random.default_rng(70 + len(dtype) + len(granularity))
    case, ks, vs = ragged_case(
        rng, [C - 1, 1, C + 1, 1500, 700], [3, 1, C + 1, 400, 1], K=2, G=4, H=128, C=C,
        dtype=dtype, granularity=granularity,
    )  # fmt: skip
    out = ragged_triton.ragged_paged_attention_pallas_triton(
        *case.args, sm_scale=0.125, k_scale=ks, v_scale=vs
    )
    assert_matches(out, ragged_oracle(case, sm_scale=0.125), f"{dtype} {granularity}")
