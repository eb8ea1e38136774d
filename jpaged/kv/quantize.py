"""Quantizing K/V for an fp8 / int8 page pool: scales from the values, saturating casts.

The pool (``jpaged.kv.cache.PagedKVCache``) stores ``float8_e4m3fn``, ``float8_e5m2`` or
``int8`` pages beside float32 scales, one per token and KV head (``[L, K, P, C]``), and the
attention ops read ``page.astype(f32) * scale`` (``pallas_kernels._quant``). A token's scale is
``amax / fmax``: ``amax`` the largest ``|x|`` of its head's H values, ``fmax`` the dtype's
largest finite value (448 for e4m3, 57344 for e5m2, 127 for int8). Values are divided by it,
clipped to ``[-fmax, fmax]`` (a cast never overflows to inf or NaN) and, for int8, rounded to
the nearest integer. An all-zero token gets scale 1 and zero codes, never ``0 / 0``.

Why per token and head (the measurements are in ``docs/architecture.md``, "Quantized KV
cache", and ``benchmarks/kv_quantization.py``): it is exact to write (a token's scale depends
on its own values only, so a decode step writes one token without reading or re-rounding the
page it lands in, and copy-on-write, swap and prefix sharing move whole pages with their
scales), and it is the most accurate of the four granularities the kernels take, markedly so
for int8 and for keys whose per-token norms vary (attention sinks, outlier tokens). It costs 4
bytes a token and head beside the H codes (3% of an fp8 page at head dim 128).

``quantize`` does any granularity (offline, tests and benchmarks); the cache's write path uses
``quantize_tokens``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _quant

# Names an engine may use for a quantized cache (``cache_dtype="fp8"``), and their dtypes.
KV_DTYPES: dict[str, Any] = {
    "fp8": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
    "int8": jnp.dtype(jnp.int8),
}
SCALE_DTYPE = jnp.dtype(jnp.float32)


def kv_dtype(name_or_dtype: Any) -> np.dtype:
    """The pool dtype of a cache dtype given by name (``KV_DTYPES``) or as a dtype.

    >>> kv_dtype("fp8"), kv_dtype("int8"), kv_dtype(jnp.bfloat16)
    (dtype(float8_e4m3fn), dtype('int8'), dtype(bfloat16))

    Raises:
      ValueError: an unknown name.
    """
    if isinstance(name_or_dtype, str) and name_or_dtype in KV_DTYPES:
        return KV_DTYPES[name_or_dtype]
    try:
        return jnp.dtype(name_or_dtype)
    except TypeError:
        raise ValueError(
            f"cache dtype {name_or_dtype!r} must be one of {sorted(KV_DTYPES)} or a dtype"
        ) from None


def is_quantized(dtype: Any) -> bool:
    """Whether pages of ``dtype`` are quantized (fp8 e4m3 / e5m2, int8)."""
    return _quant.is_quantized(dtype)


def fmax(dtype: Any) -> float:
    """The largest finite value of a quantized dtype or name (int8: 127; -128 is never used)."""
    dtype = kv_dtype(dtype)
    return 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)


def _codes(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``x / scale`` clipped to the dtype's range (rounded for int8), cast to ``dtype``."""
    top = jnp.float32(fmax(dtype))
    q = jnp.clip(x.astype(jnp.float32) / scale, -top, top)
    if jnp.dtype(dtype) == jnp.int8:
        q = jnp.round(q)
    return q.astype(dtype)


def _scale(amax: jax.Array, dtype) -> jax.Array:
    """``amax / fmax``, and 1 where ``amax`` is 0 (an all-zero block: zero codes, no 0 / 0)."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, amax / jnp.float32(fmax(dtype)), jnp.float32(1.0))


def quantize_tokens(x_TKH: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Quantizes T tokens' K (or V) with one scale a token and KV head.

    Args:
      x_TKH: [..., K, H] floating values (any leading shape, e.g. [T, K, H] or [L, T, K, H]).
      dtype: a quantized dtype (``float8_e4m3fn``, ``float8_e5m2``, ``int8``).

    Returns:
      ``(codes [..., K, H] in dtype, scale f32[..., K])`` with ``codes * scale[..., None] ~ x``.

    >>> q, s = quantize_tokens(jnp.array([[[4.0, -2.0], [0.0, 0.0]]]), jnp.int8)
    >>> q.tolist(), s.tolist()
    ([[[127, -64], [0, 0]]], [[0.031496062874794006, 1.0]])
    """
    scale = _scale(jnp.max(jnp.abs(x_TKH.astype(jnp.float32)), axis=-1), dtype)
    return _codes(x_TKH, scale[..., None], dtype), scale


def quantize(x: jax.Array, dtype: Any, granularity: str = "token") -> tuple[jax.Array, jax.Array]:
    """Quantizes a whole pool (or any ``[..., K, P, C, H]`` array) at one of the kernels'
    granularities (``pallas_kernels._quant.GRANULARITIES``): one scale for all of it, a KV
    head, a page and head, or a token and head.

    Args:
      x: [K, P, C, H] or [L, K, P, C, H] floating values.
      dtype: a quantized dtype, or its cache name ("fp8", "fp8_e5m2", "int8"; ``KV_DTYPES``).
      granularity: "tensor", "head", "page" or "token".

    Returns:
      ``(pages, scale)``: pages in ``dtype``, scale f32 of the granularity's shape (``[]``,
      ``[K, 1, 1]``, ``[K, P, 1]`` or ``[K, P, C]``; a 5-D ``x`` keeps L in front, ``[L, 1, 1,
      1]`` per tensor), ready for ``jpaged.paged_attention``'s ``k_scale`` / ``v_scale``.

    Raises:
      ValueError: an unknown granularity or a dtype that is not quantized.
    """
    if granularity not in _quant.GRANULARITIES:
        raise ValueError(f"{granularity=} must be one of {_quant.GRANULARITIES}")
    dtype = kv_dtype(dtype)
    if not is_quantized(dtype):
        raise ValueError(f"dtype={jnp.dtype(dtype)} must be one of {_quant.QUANTIZED_DTYPES}")
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)  # [..., K, P, C]
    axes = {"tensor": (-3, -2, -1), "head": (-2, -1), "page": (-1,), "token": ()}[granularity]
    if axes:
        amax = jnp.max(amax, axis=axes, keepdims=True)
    scale = _scale(amax, dtype)
    pages = _codes(x, scale[..., None], dtype)
    if granularity == "tensor" and x.ndim == 4:
        scale = scale.reshape(())
    return pages, scale


def dequantize(pages: jax.Array, scale: jax.Array) -> jax.Array:
    """f32 ``pages * scale`` (``scale`` broadcast over H): what attention reads."""
    pages5 = pages.astype(jnp.float32)
    return pages5 * jnp.asarray(scale, jnp.float32)[..., None]
