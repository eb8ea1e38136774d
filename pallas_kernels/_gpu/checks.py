"""Argument checks shared by the Mosaic GPU kernels' ``unsupported_reason`` (decode and ragged):
the GPU, the dtypes, the head dim and the pool's row count. Each returns the reasons it finds,
in the order the messages list them."""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import _backend, _quant

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def device_and_dtype_reasons(
    q, k_pages, v_pages, *, check_backend: bool, majors: tuple[int, ...] = (9,)
) -> list[str]:
    """A GPU whose compute capability's major is in ``majors`` (with ``check_backend``; default
    Hopper, for wgmma), one 16-bit dtype for q and the pools, and a supported head dim."""
    reasons = []
    if check_backend:
        cc = _backend.gpu_compute_capability()
        if cc is None or cc[0] not in majors:
            what = "Hopper wgmma" if majors == (9,) else "Hopper wgmma or Blackwell tcgen05"
            wanted = " or ".join(f"{m}.x" for m in majors)
            reasons.append(
                f"the kernel uses {what}: it needs compute capability {wanted} (got {cc})"
            )
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_pages.dtype), jnp.dtype(v_pages.dtype)}
    if _quant.is_quantized(k_pages.dtype):
        reasons += quantized_reasons(
            q, k_pages, v_pages, majors=majors, check_backend=check_backend
        )
    elif len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
        reasons.append(
            f"q/k_pages/v_pages dtypes ({q.dtype}, {k_pages.dtype}, {v_pages.dtype}) must all be "
            "bfloat16 or all float16 (or quantized pages with a bfloat16 or float16 q)"
        )
    H = k_pages.shape[-1]
    if H not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim={H} must be one of {SUPPORTED_HEAD_DIMS}")
    return reasons


def pool_rows_reasons(k_pages) -> list[str]:
    """The kernels index the flattened pool's rows with int32."""
    rows = math.prod(k_pages.shape[:-1])
    if rows >= 2**31:
        return [f"the pool has {rows} rows; the kernel indexes rows with int32"]
    return []


def quantized_reasons(q, k_pages, v_pages, *, majors, check_backend: bool) -> list[str]:
    """Quantized pages (``_quant.QUANTIZED_DTYPES``, both pools one dtype) with a bf16 or f16
    q, pages of 8+ tokens (TMA copies into the 8-row tiled ring; token scales 32+ bytes a copy),
    on Hopper's wgmma (the tcgen05 products do not take them)."""
    reasons = []
    if jnp.dtype(v_pages.dtype) != jnp.dtype(k_pages.dtype):
        reasons.append(f"v_pages.dtype={v_pages.dtype} must equal k_pages.dtype={k_pages.dtype}")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        reasons.append(f"q.dtype={q.dtype} must be bfloat16 or float16 with quantized pages")
    if k_pages.shape[-2] % 8:
        reasons.append(
            f"page_size={k_pages.shape[-2]} must be a multiple of 8 with quantized pages"
        )
    if check_backend and majors != (9,):
        cc = _backend.gpu_compute_capability()
        if cc is not None and cc[0] != 9:
            reasons.append(f"quantized pages run on Hopper's wgmma only (compute capability {cc})")
    return reasons
