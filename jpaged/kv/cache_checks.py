"""Argument checks of the KV pool's updates (``jpaged.kv.cache``): sizes, dtypes, index
vectors and, where their values are known now (not traced), their ranges."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.kv import quantize


def check_sizes(**sizes: int) -> None:
    """Each size a positive int, else one ValueError naming every bad one."""
    bad = [
        f"{k}={v!r}"
        for k, v in sizes.items()
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1
    ]
    if bad:
        raise ValueError(f"{', '.join(bad)}: sizes must be positive ints")


def pool_dtype(dtype: Any) -> np.dtype:
    """A pool's dtype: floating, or quantized (a name of ``quantize.KV_DTYPES`` or fp8 /
    int8)."""
    dtype = quantize.kv_dtype(dtype)
    if not (jnp.issubdtype(dtype, jnp.floating) or quantize.is_quantized(dtype)):
        raise ValueError(
            f"{dtype=} must be a floating dtype or quantized ({sorted(quantize.KV_DTYPES)})"
        )
    return dtype


def concrete(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array if its value is known now, else ``None`` (a tracer)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_int_vector(name: str, x: Any, ndim: int = 1) -> Any:
    """Checks rank and integer dtype; returns ``x`` (a list or tuple as a NumPy array)."""
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
    if x.ndim != ndim or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of rank {ndim}, got {x.shape} {x.dtype}")
    return x


def check_range(name: str, x: Any, hi: int, validate: bool) -> None:
    """Eagerly checks that concrete ``x`` lies in ``[-1, hi)``."""
    if not validate:
        return
    values = concrete(x)
    if values is None or values.size == 0:
        return
    lo_v, hi_v = int(values.min()), int(values.max())
    if lo_v < -1 or hi_v >= hi:
        raise ValueError(
            f"{name} must lie in [-1, {hi}) (-1 = skip), got values in [{lo_v}, {hi_v}]"
        )


def check_distinct_slots(x: Any, validate: bool) -> None:
    """Eagerly checks that the written (non ``-1``) slots of concrete ``x`` are distinct."""
    values = concrete(x) if validate else None
    if values is None:
        return
    written = values[values >= 0]
    unique, counts = np.unique(written, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"slots_T must be distinct (two tokens written to one slot leave either one), "
            f"repeated: {unique[counts > 1][:8].tolist()}"
        )


def check_kv(
    name: str, x: Any, expected: tuple[int, ...], letters: str, codes=None, pool=None
) -> None:
    """``x`` of shape ``expected`` (named by ``letters``) and floating, or of dtype ``codes``
    (a quantized pool's own pages) where that is given. ``pool``: the dtype of the pool ``x``
    is written to; a quantized pool takes unquantized values (K/V already cast to fp8 would
    have lost their range before the pool could scale them)."""
    if tuple(np.shape(x)) != expected:
        raise ValueError(f"{name} must have shape [{letters}] = {expected}, got {np.shape(x)}")
    if codes is not None:
        if jnp.dtype(x.dtype) != jnp.dtype(codes):
            raise ValueError(f"{name} must hold the pool's {jnp.dtype(codes)} codes, got {x.dtype}")
    elif not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got {x.dtype}")
    if codes is None and pool is not None and quantize.is_quantized(pool) and x.dtype == pool:
        raise ValueError(
            f"{name}.dtype={x.dtype} is the pool's own quantized dtype: pass the unquantized K/V "
            "(bf16, f16 or f32); the pool quantizes them with a scale per token and head"
        )
