"""Quantized K/V pages (fp8 / int8 with float32 scales), shared by every attention op.

A quantized pool stores ``k_pages`` / ``v_pages`` in ``float8_e4m3fn``, ``float8_e5m2`` or
``int8`` and comes with ``k_scale`` / ``v_scale``: float32 arrays broadcastable to the pool's
``[K, P, C]`` (a 5-D pool ``[L, K, P, C, H]`` puts ``L``, or 1, in front), one of four
granularities (``GRANULARITIES``):

- ``"tensor"``: ``[]`` or all ones, ``[1, 1, 1]``;
- ``"head"``: one per KV head, ``[K, 1, 1]``;
- ``"page"``: one per page and KV head, ``[K, P, 1]``;
- ``"token"``: one per token and KV head, ``[K, P, C]``.

Attention reads ``page.astype(f32) * scale`` (the scale broadcast over the head dim H).
Everything here is static (shapes and dtypes) or plain ``jnp`` usable inside ``jit``; the
kernels read ``granularity`` and ``layered_scale`` and apply the scales themselves.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

QUANTIZED_DTYPES = (
    jnp.dtype(jnp.float8_e4m3fn),
    jnp.dtype(jnp.float8_e5m2),
    jnp.dtype(jnp.int8),
)
GRANULARITIES = ("tensor", "head", "page", "token")


def is_quantized(dtype: Any) -> bool:
    """Whether ``dtype`` is a quantized page dtype (``QUANTIZED_DTYPES``)."""
    return jnp.dtype(dtype) in QUANTIZED_DTYPES


def granularity(scale_shape: tuple[int, ...], pool_shape: tuple[int, ...]) -> str | None:
    """The granularity of a scale of ``scale_shape`` for a pool of ``pool_shape`` (``[K, P, C,
    H]`` or ``[L, K, P, C, H]``), or None if the shape is not one of the four.

    >>> granularity((2, 5, 1), (2, 5, 16, 64)), granularity((), (3, 2, 5, 16, 64))
    ('page', 'tensor')
    """
    scale_shape, pool_shape = tuple(scale_shape), tuple(pool_shape)
    if scale_shape == ():
        return "tensor"
    if len(scale_shape) != len(pool_shape) - 1:
        return None
    if len(pool_shape) == 5 and scale_shape[0] not in (1, pool_shape[0]):
        return None
    K, P, C = pool_shape[-4:-1]
    return {
        (1, 1, 1): "tensor",
        (K, 1, 1): "head",
        (K, P, 1): "page",
        (K, P, C): "token",
    }.get(scale_shape[-3:])


def check_scales(k_pages: Any, v_pages: Any, k_scale: Any, v_scale: Any) -> list[str]:
    """The problems of a call's scales (shapes and dtypes only), one message each.

    Quantized pages (``QUANTIZED_DTYPES``) need both scales; other pages take none. Each scale
    is a float32 array of a granularity of ``granularity``; ``k_pages`` and ``v_pages`` share
    one dtype (checked by the callers).
    """
    errors: list[str] = []
    kv_dtype = getattr(k_pages, "dtype", None)
    pool_shape = tuple(getattr(k_pages, "shape", ()))
    if kv_dtype is None or len(pool_shape) not in (4, 5):
        return errors
    quantized = is_quantized(kv_dtype)
    given = {"k_scale": k_scale, "v_scale": v_scale}
    if not quantized:
        for name, scale in given.items():
            if scale is not None:
                errors.append(
                    f"{name} is given but k_pages.dtype={jnp.dtype(kv_dtype)} is not quantized: "
                    f"scales go with pages of dtype {', '.join(map(str, QUANTIZED_DTYPES))}"
                )
        return errors
    if getattr(v_pages, "dtype", None) is not None and v_pages.dtype != kv_dtype:
        return errors  # the callers report the dtype mismatch
    letters = "[L, K, P, C]" if len(pool_shape) == 5 else "[K, P, C]"
    for name, scale in given.items():
        if scale is None:
            errors.append(
                f"{name} is missing: k_pages.dtype={jnp.dtype(kv_dtype)} is quantized, so "
                f"k_scale and v_scale (float32, broadcastable to {letters}) must be given"
            )
            continue
        shape, dtype = getattr(scale, "shape", None), getattr(scale, "dtype", None)
        if shape is None or dtype is None:
            errors.append(f"{name} must be a float32 array, got {type(scale).__name__}")
            continue
        if jnp.dtype(dtype) != jnp.float32:
            errors.append(f"{name}.dtype={jnp.dtype(dtype)} must be float32")
        if granularity(tuple(shape), pool_shape) is None:
            errors.append(f"{name}.shape={tuple(shape)} must be {_allowed(pool_shape)}")
    return errors


def _allowed(pool_shape: tuple[int, ...]) -> str:
    K, P, C = pool_shape[-4:-1]
    lead = (f"{pool_shape[0]} or 1, ",) if len(pool_shape) == 5 else ("",)
    shapes = [
        f"[{lead[0]}{s}]" for s in ("1, 1, 1", f"{K}, 1, 1", f"{K}, {P}, 1", f"{K}, {P}, {C}")
    ]
    return (
        "() or one of " + ", ".join(shapes) + " (per tensor, per KV head, per page and head, "
        "per token and head)"
    )


def layered_scale(scale: jax.Array, pool_ndim: int) -> jax.Array:
    """``scale`` as f32[L', K', P', C'] (L' in {1, L}; K', P', C' each 1 or the pool's): the
    one 4-D form the implementations index, whatever the pool's rank."""
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim == 0:
        return scale.reshape(1, 1, 1, 1)
    return scale if pool_ndim == 5 else scale[None]


def gather_scales(scale_LKPC: jax.Array, layer: Any, page_ids: jax.Array) -> jax.Array:
    """The scales of gathered pages: f32[..., K', C', 1] (``page_ids``' shape first), which
    broadcasts against pages gathered as ``[..., K, C, H]``.

    Args:
      scale_LKPC: f32[L', K', P', C'] (``layered_scale``).
      layer: the layer index (traced or not) into a 5-D pool; ignored where L' is 1.
      page_ids: i32[...] page ids, already in [0, P).
    """
    L1, K1, P1, C1 = scale_LKPC.shape
    s_KPC = scale_LKPC[jnp.asarray(layer, jnp.int32).reshape(()) if L1 > 1 else 0]
    if P1 > 1:
        s = jnp.moveaxis(s_KPC[:, page_ids], 0, -2)  # [..., K', C']
    else:
        s = s_KPC[:, 0].reshape((1,) * page_ids.ndim + (K1, C1))
    return s[..., None]


def dequantize_gathered(
    pages: jax.Array, scale: jax.Array | None, layer: Any, page_ids: jax.Array
) -> jax.Array:
    """Pages gathered as ``[..., K, C, H]`` (``page_ids``' shape first) times their scales, in
    f32; the pages unchanged when ``scale`` is None (an unquantized pool).

    Args:
      pages: [..., K, C, H] gathered pages.
      scale: None, or the pool's ``layered_scale`` f32[L', K', P', C'].
      layer: the layer index of a 5-D pool (None or 0 for a 4-D one).
      page_ids: i32[...] the gathered page ids, in [0, P).
    """
    if scale is None:
        return pages
    return pages.astype(jnp.float32) * gather_scales(scale, 0 if layer is None else layer, page_ids)


def dequantize_gathered_heads_first(
    pages: jax.Array, scale: jax.Array | None, layer: Any, page_ids: jax.Array
) -> jax.Array:
    """Like `dequantize_gathered`, for pages gathered heads first, as ``[K, ..., C, H]``
    (``page_ids``' shape after the KV head axis).

    Args:
      pages: [K, ..., C, H] gathered pages.
      scale: None, or the pool's ``layered_scale`` f32[L', K', P', C'].
      layer: the layer index of a 5-D pool (None or 0 for a 4-D one).
      page_ids: i32[...] the gathered page ids, in [0, P).
    """
    if scale is None:
        return pages
    s = gather_scales(scale, 0 if layer is None else layer, page_ids)  # [..., K', C', 1]
    return pages.astype(jnp.float32) * jnp.moveaxis(s, -3, 0)


def canonical_scales(
    k_pages: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None
) -> tuple[jax.Array | None, jax.Array | None]:
    """Both scales as ``layered_scale`` arrays, or (None, None) for an unquantized pool."""
    if k_scale is None or v_scale is None:
        return None, None
    return layered_scale(k_scale, k_pages.ndim), layered_scale(v_scale, k_pages.ndim)
