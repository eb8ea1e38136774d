"""Input validation shared by every decode-attention implementation.

``validate_static`` looks only at shapes, dtypes and Python knobs, so it runs at trace
time (inside ``jit`` too) and costs nothing per call. ``validate_dynamic`` reads the
values (lengths, page ids) and needs concrete arrays: call it eagerly, for example in
tests or behind a debug flag, never inside a jitted function.

Both collect every problem they find and raise one ``ValueError`` listing them all.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _quant


def _shape_dtype(x: Any, name: str, errors: list[str]) -> tuple[tuple[int, ...], Any] | None:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        errors.append(f"{name} must be an array with .shape and .dtype, got {type(x).__name__}")
        return None
    return tuple(shape), jnp.dtype(dtype)


def _is_static_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_layer(layer: Any, kv_ndim: int, num_layers: int | None, errors: list[str]) -> None:
    if kv_ndim == 4:
        if layer is not None:
            errors.append(f"{layer=} must be None for a 4-D pool [K, P, C, H]")
        return
    if kv_ndim != 5:
        return
    if layer is None:
        errors.append("layer must be given (int or i32[]) for a 5-D pool [L, K, P, C, H]")
        return
    if isinstance(layer, bool):
        errors.append(f"{layer=} must be an int or an integer scalar array, not a bool")
    elif isinstance(layer, numbers.Integral):
        if not 0 <= layer < num_layers:
            errors.append(f"{layer=} must be in [0, {num_layers=})")
    elif hasattr(layer, "shape") and hasattr(layer, "dtype"):
        if tuple(layer.shape) != () or not jnp.issubdtype(layer.dtype, jnp.integer):
            errors.append(
                f"layer must be an int or an integer scalar array, got "
                f"shape={tuple(layer.shape)} dtype={jnp.dtype(layer.dtype)}"
            )
    else:
        errors.append(
            f"layer must be an int or an integer scalar array, got {type(layer).__name__}"
        )


def validate_static(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_tables: Any,
    lengths: Any,
    *,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> None:
    """Checks shapes, dtypes and knobs of a decode-attention call (trace-time safe).

    Args:
      q: [B, N, H] floating queries.
      k_pages: [K, P, C, H] key pages, or [L, K, P, C, H] with ``layer``: floating, or
        quantized (``float8_e4m3fn``, ``float8_e5m2``, ``int8``) with ``k_scale``/``v_scale``.
      v_pages: same shape and dtype as ``k_pages``.
      block_tables: i32[B, W].
      lengths: i32[B].
      logits_soft_cap: None or a Python number > 0.
      sliding_window: None or a Python int >= 1.
      layer: None for a 4-D pool; an int in [0, L) or an integer scalar array for a 5-D pool.
      k_scale: None, or for quantized pages float32 broadcastable to [K, P, C] (a 5-D pool:
        [L or 1, K, P, C]; ``pallas_kernels._quant.GRANULARITIES``).
      v_scale: like ``k_scale``.

    Raises:
      ValueError: listing every mismatch found, one per line.

    >>> import numpy as np
    >>> q = np.zeros((2, 6, 8), np.float32); kv = np.zeros((4, 3, 2, 8), np.float32)
    >>> validate_static(q, kv, kv, np.zeros((2, 1), np.int32), np.zeros(2, np.int32))
    Traceback (most recent call last):
    ...
    ValueError: invalid paged attention arguments:
      num_q_heads=6 must be divisible by num_kv_heads=4
    """
    errors: list[str] = []
    sd = {
        name: _shape_dtype(x, name, errors)
        for name, x in [
            ("q", q),
            ("k_pages", k_pages),
            ("v_pages", v_pages),
            ("block_tables", block_tables),
            ("lengths", lengths),
        ]
    }
    q_sd, k_sd, v_sd, t_sd, l_sd = sd.values()

    if q_sd is not None:
        if len(q_sd[0]) != 3:
            errors.append(f"q.ndim={len(q_sd[0])} must be 3 ([B, N, H]), got q.shape={q_sd[0]}")
            q_sd = None
        elif not jnp.issubdtype(q_sd[1], jnp.floating):
            errors.append(f"q.dtype={q_sd[1]} must be a floating dtype")
    if k_sd is not None:
        if len(k_sd[0]) not in (4, 5):
            errors.append(
                f"k_pages.ndim={len(k_sd[0])} must be 4 ([K, P, C, H]) or 5 ([L, K, P, C, H]),"
                f" got k_pages.shape={k_sd[0]}"
            )
            k_sd = None
        elif not (jnp.issubdtype(k_sd[1], jnp.floating) or _quant.is_quantized(k_sd[1])):
            errors.append(
                f"k_pages.dtype={k_sd[1]} must be a floating dtype or int8 (quantized, with scales)"
            )
    if k_sd is not None and v_sd is not None:
        if v_sd[0] != k_sd[0]:
            errors.append(f"v_pages.shape={v_sd[0]} must equal k_pages.shape={k_sd[0]}")
        if v_sd[1] != k_sd[1]:
            errors.append(f"v_pages.dtype={v_sd[1]} must equal k_pages.dtype={k_sd[1]}")
    if t_sd is not None:
        if len(t_sd[0]) != 2:
            errors.append(f"block_tables.ndim={len(t_sd[0])} must be 2 ([B, W])")
        elif t_sd[0][1] < 1:
            errors.append(f"block_tables.shape={t_sd[0]} must have W >= 1 (pages per sequence)")
        if t_sd[1] != jnp.int32:
            errors.append(f"block_tables.dtype={t_sd[1]} must be int32")
    if l_sd is not None:
        if len(l_sd[0]) != 1:
            errors.append(f"lengths.ndim={len(l_sd[0])} must be 1 ([B])")
        if l_sd[1] != jnp.int32:
            errors.append(f"lengths.dtype={l_sd[1]} must be int32")

    if q_sd is not None:
        batch, num_q_heads, head_dim = q_sd[0]
        if t_sd is not None and len(t_sd[0]) == 2 and t_sd[0][0] != batch:
            errors.append(f"block_tables.shape[0]={t_sd[0][0]} must equal batch size B={batch}")
        if l_sd is not None and len(l_sd[0]) == 1 and l_sd[0][0] != batch:
            errors.append(f"lengths.shape[0]={l_sd[0][0]} must equal batch size B={batch}")
        if k_sd is not None:
            num_kv_heads, kv_head_dim = k_sd[0][-4], k_sd[0][-1]
            if kv_head_dim != head_dim:
                errors.append(f"k_pages head dim {kv_head_dim} must equal q head dim {head_dim}")
            if num_kv_heads == 0 or num_q_heads % num_kv_heads:
                errors.append(f"{num_q_heads=} must be divisible by {num_kv_heads=}")
    if k_sd is not None:
        if 0 in k_sd[0][-3:]:
            errors.append(f"k_pages.shape={k_sd[0]} must have P, C, H >= 1")
        _check_layer(layer, len(k_sd[0]), k_sd[0][0], errors)
        errors += _quant.check_scales(k_pages, v_pages, k_scale, v_scale)

    if logits_soft_cap is not None and not (
        _is_static_number(logits_soft_cap) and logits_soft_cap > 0
    ):
        errors.append(f"{logits_soft_cap=} must be None or a Python number > 0")
    if sliding_window is not None and not (
        isinstance(sliding_window, numbers.Integral)
        and not isinstance(sliding_window, bool)
        and sliding_window >= 1
    ):
        errors.append(f"{sliding_window=} must be None or a Python int >= 1")

    if errors:
        raise ValueError("invalid paged attention arguments:\n  " + "\n  ".join(errors))


def _concrete(x: Any, name: str) -> np.ndarray:
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        raise ValueError(
            f"validate_dynamic reads the values of {name}: call it eagerly, outside jit"
        ) from None


def validate_dynamic(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_tables: Any,
    lengths: Any,
    *,
    layer: Any = None,
) -> None:
    """Checks the values of a decode-attention call (eager only: it reads arrays).

    Lengths must lie in [0, W * C]; the page ids of the pages a sequence uses (its
    first ``ceil(lengths[b] / C)`` table entries) must lie in [0, P); a 5-D pool's
    ``layer`` must lie in [0, L). Entries past the used pages may hold anything.
    Call ``validate_static`` first; this one assumes the shapes are consistent.

    Args:
      q: [B, N, H] (unused beyond the static checks; taken for a uniform signature).
      k_pages: [K, P, C, H] or [L, K, P, C, H].
      v_pages: like ``k_pages``.
      block_tables: i32[B, W], concrete.
      lengths: i32[B], concrete.
      layer: None, an int, or a concrete integer scalar array.

    Raises:
      ValueError: listing every out-of-range value found (the first few per kind).
    """
    del q, v_pages
    errors: list[str] = []
    tables_BW = _concrete(block_tables, "block_tables")
    lengths_B = _concrete(lengths, "lengths")
    num_pages, page_size = k_pages.shape[-3], k_pages.shape[-2]
    width = tables_BW.shape[1]
    max_len = width * page_size
    bad = np.flatnonzero((lengths_B < 0) | (lengths_B > max_len))
    if bad.size:
        errors.append(
            f"lengths must be in [0, W * C = {max_len}]; lengths[{bad[:4].tolist()}] = "
            f"{lengths_B[bad[:4]].tolist()}"
        )
    used_B = -(-np.clip(lengths_B, 0, max_len) // page_size)
    used_BW = np.arange(width)[None, :] < used_B[:, None]
    bad_ids = used_BW & ((tables_BW < 0) | (tables_BW >= num_pages))
    if bad_ids.any():
        rows, cols = np.nonzero(bad_ids)
        shown = [
            f"block_tables[{r}, {c}] = {tables_BW[r, c]}"
            for r, c in zip(rows[:4], cols[:4], strict=True)
        ]
        errors.append(
            f"page ids of used pages must be in [0, P = {num_pages}): {', '.join(shown)}"
            + (f" (and {rows.size - 4} more)" if rows.size > 4 else "")
        )
    if len(k_pages.shape) == 5 and layer is not None:
        layer_value = int(_concrete(layer, "layer"))
        num_layers = k_pages.shape[0]
        if not 0 <= layer_value < num_layers:
            errors.append(f"layer={layer_value} must be in [0, {num_layers=})")
    if errors:
        raise ValueError("invalid paged attention values:\n  " + "\n  ".join(errors))
