"""Shared pieces of the Mosaic GPU decode kernel's tests (``test_paged_attention_gpu_*.py``):
a case run against the f64 dense reference, argument shapes, and the cross-lowering variants'
calls (also used by ``tools/lowered_ir.py``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import dense_attention, make_paged_kv
from _tolerances import assert_close
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import _gpu_sizes, kernel_gpu

# The interpreter's race detector sees SMEM written while a TMA copy still reads it, which
# values alone miss.
RACE_CHECKED = plgpu.InterpretGPUParams(detect_races=True)


def run_case(
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
    q = np.asarray(q_scale * rng.standard_normal((len(lengths), K * G, H)), jnp.dtype(dtype))
    q = q.astype(np.float32)  # rounded to dtype, on the host
    scale = 1.0 / math.sqrt(H) if sm_scale is None else sm_scale
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
    assert np.all(np.asarray(out, np.float32)[empty] == 0.0)
    if isinstance(interpret, plgpu.InterpretGPUParams) and interpret.detect_races:
        assert_no_races()


def assert_no_races():
    # Private: jax 0.11.2 keeps the last interpreted kernel's race report here.
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    assert not gpu_callbacks.get_races().races_found, "the race detector found an SMEM race"


def shapes(dtype=jnp.bfloat16, N=32, K=8, C=16, H=128):
    return (
        jax.ShapeDtypeStruct((2, N, H), dtype),
        jax.ShapeDtypeStruct((K, 10, C, H), dtype),
        jax.ShapeDtypeStruct((K, 10, C, H), dtype),
        jax.ShapeDtypeStruct((2, 4), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
    )


def page_case(rng, C, extra):
    """(lengths, keyword arguments of ``run_case``) of a case given by its page size and a dict
    that may set ``dtype``, ``H``, ``G`` and ``lengths`` (default 0, 1, C-1, C, C+1, 99, 1000,
    2500; ``"many"``: 96 random lengths below 3000) besides kernel options."""
    extra = dict(extra)
    kw = dict(dtype=jnp.dtype(extra.pop("dtype", "bfloat16")), H=extra.pop("H", 128))
    kw["G"] = extra.pop("G", 4)
    lengths = extra.pop("lengths", [0, 1, max(C - 1, 0), C, C + 1, 99, 1000, 2500])
    if isinstance(lengths, str) and lengths == "many":
        lengths = rng.integers(0, 3000, size=96)
    return lengths, {**kw, **extra}


# Cases that a tuning knob's GPU test runs first (``page_case``), before its own.
KNOB_CASES = [
    (16, dict()),
    (16, dict(lengths="many")),  # 96 x 8 pairs, longest first (the in-kernel order)
    (16, dict(lengths=[32768, 1, 20001])),  # splits merged in the kernel
    (64, dict(window=700, soft_cap=50.0, num_splits=3)),
    (8, dict(H=64, G=1, num_splits=1)),  # T=128, 16 copies a tile
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


def variant_id(variant) -> str:
    return "-".join(f"{k}{variant[k]}" for k in variant)


def fills(B, N, K, knobs) -> bool:
    """Whether a unit's G heads fill its ``qcols``-row tile (G == qcols): the direct store is
    then the whole tile, which lowers on any JAX."""
    return _gpu_sizes.qcols(B, N, K, knobs.get("mma") == "tcgen05") == N // K


def skip_unless_swap_ab_lowers():
    if not kernel_gpu.swap_ab_lowers():
        pytest.skip(f"swap_ab does not lower on jax {jax.__version__} (swap_ab_lowers)")
