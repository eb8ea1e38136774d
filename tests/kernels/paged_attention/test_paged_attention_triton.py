"""The Pallas-Triton decode kernel (``pallas_kernels/paged_attention/kernel_triton.py``) against
the f64 dense reference: in Pallas's interpreter on the CPU (tiny shapes), lowered for CUDA on
the CPU for the A100, A10, L4 and T4 (abstract devices: Pallas -> Triton IR for each compute
capability), and compiled on a GPU (``pytest -m gpu``; forced on any NVIDIA GPU, the H200
included). Inputs: page sizes 1..256 and odd ones, GQA 1/4/8 (and 6, 16, 64), head dims
64/128/256, lengths 0, 1, C-1, C, C+1 and 32k, randomly permuted tables, NaN in free pages, in
each last page's tail and behind unused table entries (``_paged_inputs``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_checks import assert_rows_close, planted_decode_case, reference
from _paged_inputs import dense_attention, make_paged_kv
from _tolerances import assert_close
from _triton_lowering import lower_for_device

from pallas_kernels.paged_attention import kernel_triton

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)

# The whole cube of page size x group x head dim runs on the GPU and in ``make test-all``;
# ``make test`` runs the spread (``_SPREAD``) in the interpreter: each page size once, each
# group and head dim at least twice.
_CUBE = [
    (C, G, H) for C in (1, 2, 4, 8, 16, 32, 64, 128, 256) for G in (1, 4, 8) for H in (64, 128, 256)
]
_SPREAD = {
    (1, 8, 256), (2, 4, 64), (4, 8, 128), (8, 1, 256), (16, 4, 128), (32, 4, 64), (64, 8, 128),
    (128, 1, 256), (256, 8, 256),
}  # fmt: skip
SLOW_CASES = {
    f"test_interpret_matches_reference[{C}-{G}-{H}]"
    for (C, G, H) in _CUBE
    if (C, G, H) not in _SPREAD
}


def run_case(rng, lengths, *, K, G, H, C, dtype=BF16, interpret=True, num_layers=None,
             layer=None, soft_cap=None, window=None, sm_scale=None, out_of_range_tail=False,
             **knobs):  # fmt: skip
    kv = make_paged_kv(
        rng, lengths, num_kv_heads=K, head_dim=H, page_size=C, dtype=dtype,
        num_layers=num_layers, out_of_range_tail=out_of_range_tail,
    )  # fmt: skip
    q = np.asarray(jnp.asarray(rng.standard_normal((len(lengths), K * G, H)), dtype))
    scale = 1.0 / math.sqrt(H) if sm_scale is None else sm_scale
    out = kernel_triton.paged_attention_pallas_triton(
        jnp.asarray(q), kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=scale,
        logits_soft_cap=soft_cap, sliding_window=window, layer=layer, interpret=interpret,
        **knobs,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    k = kv.k_dense if num_layers is None else kv.k_dense[int(layer)]
    v = kv.v_dense if num_layers is None else kv.v_dense[int(layer)]
    ref = dense_attention(
        np.asarray(q, np.float32), k, v, kv.lengths, sm_scale=scale, logits_soft_cap=soft_cap,
        sliding_window=window,
    )  # fmt: skip
    assert_close(out, ref, dtype, err_msg=f"{lengths=} {K=} {G=} {H=} {C=} {knobs=}")
    empty = np.asarray(kv.lengths) == 0
    assert np.all(np.asarray(out, np.float32)[empty] == 0.0)


def _edge_lengths(C, extra):
    return [0, 1, max(C - 1, 0), C, C + 1, *extra]


@pytest.mark.parametrize("C,G,H", _CUBE)
def test_interpret_matches_reference(C, G, H):
    rng = np.random.default_rng(C * 1000 + G * 10 + H)
    run_case(rng, _edge_lengths(C, [2 * C + 5, 150]), K=2, G=G, H=H, C=C)


@pytest.mark.parametrize(
    "C,G,H,dtype,extra",
    [
        (16, 4, 64, F16, dict(num_splits=3)),
        (3, 1, 32, F32, dict(num_splits=2)),  # a page size no power of two; f32 (IEEE dots)
        (24, 6, 64, BF16, dict(soft_cap=5.0, window=20, num_splits=2)),  # G=6: 16 rows
        (8, 16, 32, BF16, dict(window=1)),  # the window of one key: the query's own
        (4, 64, 16, F16, dict(num_layers=3, layer=jnp.int32(2), block_kv=16)),  # G=64
        (16, 80, 16, BF16, dict(num_splits=2)),  # G=80: two head blocks of 64 rows
        (16, 4, 64, BF16, dict(out_of_range_tail=True, num_splits=3)),  # ids < 0 or >= P
        (32, 4, 64, BF16, dict(sm_scale=-0.2, block_kv=16, num_stages=1, num_warps=2)),
    ],
    ids=[
        "f16-split3",
        "C3-f32",
        "C24-G6-cap-window",
        "window1",
        "G64-layer",
        "G80",
        "bad-ids",
        "negative-scale",
    ],
)
def test_interpret_options(C, G, H, dtype, extra):
    rng = np.random.default_rng(C + G + H)
    run_case(rng, _edge_lengths(C, [70, 200]), K=2, G=G, H=H, C=C, dtype=dtype, **extra)


def test_interpret_planted_tiles_all_count():
    """Every 64-key tile and page moves some row by several tolerances (``_attention_checks``):
    a skipped tile or a mis-scaled logit fails here where i.i.d. data would pass."""
    rng = np.random.default_rng(5)
    case = planted_decode_case(
        rng, [700, 333, 1, 0, 64], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16
    )
    for splits in (1, 3):
        out = kernel_triton.paged_attention_pallas_triton(
            *[jnp.asarray(a) for a in case.args], sm_scale=1 / 8.0, interpret=True,
            num_splits=splits,
        )  # fmt: skip
        assert_rows_close(out, reference(case), BF16, err_msg=f"{splits=}")


def test_bad_knobs_raise():
    q = jnp.zeros((2, 8, 64), BF16)
    kv = jnp.zeros((2, 5, 16, 64), BF16)
    args = (q, kv, kv, jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32))
    for knobs, match in [
        (dict(block_kv=48), "block_kv=48 must be a power of two"),
        (dict(num_splits=0), "num_splits=0 must be an int >= 1"),
        (dict(num_stages=True), "num_stages=True"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel_triton.paged_attention_pallas_triton(
                *args, sm_scale=0.1, interpret=True, **knobs
            )
    with pytest.raises(ValueError, match="head dim 96"):
        q96 = jnp.zeros((2, 8, 96), BF16)
        kv96 = jnp.zeros((2, 5, 16, 96), BF16)
        kernel_triton.paged_attention_pallas_triton(
            q96, kv96, kv96, *args[3:], sm_scale=0.1, interpret=True
        )


def test_unsupported_reasons():
    q = jax.ShapeDtypeStruct((2, 8, 128), BF16)
    kv = jax.ShapeDtypeStruct((2, 5, 16, 128), BF16)
    t, n = jax.ShapeDtypeStruct((2, 3), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    reason = kernel_triton.unsupported_reason(q, kv, kv, t, n)
    if jax.default_backend() == "gpu":
        assert reason is None
    else:
        assert "needs a GPU backend" in reason
    mixed = jax.ShapeDtypeStruct((2, 5, 16, 128), F16)
    assert "share one dtype" in kernel_triton._triton.common_reason(q, mixed, mixed)
    big = jax.ShapeDtypeStruct((2, 8, 256), F32)
    kv256 = jax.ShapeDtypeStruct((2, 5, 16, 256), F32)
    assert "float32 with head dim 256" in kernel_triton._triton.common_reason(big, kv256, kv256)


# --- lowered for CUDA on the CPU, per target GPU ------------------------------------------

# (device kind, what it stands for): the lowering asks the abstract device's compute
# capability (Pallas -> Triton IR); XLA compiles the IR for the real device later.
_TARGETS = ["NVIDIA A100", "NVIDIA A10", "NVIDIA L4", "Tesla T4", "NVIDIA H200"]
_LOWER_VARIANTS = [
    dict(),
    dict(num_splits=4, logits_soft_cap=30.0, sliding_window=100),
    dict(H=64, C=1, G=8, dtype=F16, L=3),
    dict(H=256, C=256, G=1),
    dict(H=64, C=3, G=6, dtype=F32),
]


def lower_for(device_kind: str, variant: dict) -> str:
    """The program lowered for CUDA as if on ``device_kind``; its text."""
    v = dict(variant)
    B, K, G = v.pop("B", 4), v.pop("K", 2), v.pop("G", 4)
    H, C, W = v.pop("H", 128), v.pop("C", 16), v.pop("W", 8)
    dtype, L = v.pop("dtype", BF16), v.pop("L", None)
    pool = (K, 40, C, H) if L is None else (L, K, 40, C, H)
    args = (
        jax.ShapeDtypeStruct((B, K * G, H), dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct((B, W), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )

    def f(q, k, vp, bt, ln, layer):
        return kernel_triton._paged_attention(
            kernel_triton.make_config(q, k, bt, sm_scale=0.125, **v), q, k, vp, bt, ln,
            None if L is None else layer,
        )  # fmt: skip

    return lower_for_device(device_kind, f, args)


@pytest.mark.parametrize("device_kind", _TARGETS)
@pytest.mark.parametrize("variant", _LOWER_VARIANTS, ids=str)
def test_lowers_for_cuda(device_kind, variant):
    text = lower_for(device_kind, variant)
    assert "__gpu$xla.gpu.triton" in text
    assert "paged_decode_triton" in text


# --- compiled on a GPU --------------------------------------------------------------------


# On the GPU: every page size, group and head dim, each meeting each other axis's values
# (a third of the cube, a compile each), bf16 and f16 alternating.
_GPU_CASES = [
    (C, G, H, "bfloat16" if (C + G) % 2 else "float16")
    for (C, G, H) in _CUBE
    if (C + G + H) % 3 == 0 or (C, H) == (16, 128)
]


@pytest.mark.gpu
@pytest.mark.parametrize("C,G,H,dtype", _GPU_CASES)
def test_gpu_matches_reference(C, G, H, dtype):
    rng = np.random.default_rng(C * 1000 + G * 10 + H)
    lengths = _edge_lengths(C, [2 * C + 5, int(rng.integers(300, 1500))])
    run_case(rng, lengths, K=2, G=G, H=H, C=C, dtype=jnp.dtype(dtype), interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_gpu_long_32k(splits):
    rng = np.random.default_rng(32)
    run_case(rng, [32768, 1, 20001], K=2, G=4, H=128, C=16, num_splits=splits, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [
        dict(soft_cap=30.0),
        dict(window=100),
        dict(window=1, num_splits=3),
        dict(window=700, soft_cap=50.0, num_splits=3),
        dict(num_layers=3, layer=jnp.int32(2)),
        dict(sm_scale=-0.05, num_splits=2),
        dict(out_of_range_tail=True, num_splits=2),
        dict(dtype=F32, C=3),
        dict(G=6, C=24),
        dict(G=64, H=64),
    ],
    ids=str,
)
def test_gpu_options(extra):
    rng = np.random.default_rng(7)
    kw = dict(K=4, G=4, H=128, C=16)
    kw.update(extra)
    run_case(rng, [0, 1, 15, 16, 17, 99, 1000, 2500], interpret=False, **kw)


@pytest.mark.gpu
def test_gpu_planted_tiles_all_count():
    rng = np.random.default_rng(11)
    case = planted_decode_case(
        rng, [4096, 2047, 65, 1, 0], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16
    )
    for splits in (None, 1, 4):
        out = kernel_triton.paged_attention_pallas_triton(
            *[jnp.asarray(a) for a in case.args], sm_scale=1 / math.sqrt(128), num_splits=splits
        )
        assert_rows_close(out, reference(case), BF16, err_msg=f"{splits=}")
