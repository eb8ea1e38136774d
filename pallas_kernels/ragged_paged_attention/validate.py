"""Input validation shared by every ragged paged attention implementation.

``validate_static`` checks shapes, dtypes and knobs at trace time (works on tracers);
``validate_dynamic`` checks values eagerly (it reads the arrays back to the host, so call it
outside ``jit``, e.g. in tests or behind a debug flag). Both report every problem at once in
one ``ValueError`` whose lines name the argument and the expected value.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _quant


def _is_int_scalar_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape")


def _raise(errors: list[str]) -> None:
    if errors:
        raise ValueError("ragged_paged_attention: invalid arguments:\n  " + "\n  ".join(errors))


def static_options(
    *,
    sm_scale: float,
    causal: bool,
    logits_soft_cap: float | None,
    sliding_window: int | None,
) -> dict[str, Any]:
    """The attention knobs as hashable Python scalars, for an implementation's ``jit`` statics.

    Returns:
      ``dict(sm_scale=float, causal=bool, logits_soft_cap=None | float,
      sliding_window=None | int)``: NumPy scalars become Python ones, so equal knobs share one
      compile.
    """
    return dict(
        sm_scale=float(sm_scale),
        causal=bool(causal),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
    )


def validate_static(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    causal: Any = True,
    k_scale: Any = None,
    v_scale: Any = None,
) -> None:
    """Checks shapes, dtypes and static knobs; works on tracers.

    Args:
      q: [T, N, H] floating.
      k_pages: [K, P, C, H], or [L, K, P, C, H] together with ``layer``: floating, or
        quantized (``float8_e4m3fn``, ``float8_e5m2``, ``int8``) with ``k_scale``/``v_scale``.
      v_pages: same shape and dtype as ``k_pages``.
      block_tables: i32[B, W].
      kv_lens: i32[B].
      cu_q_lens: i32[B + 1].
      num_seqs: i32[] or i32[1].
      logits_soft_cap: None or a positive float.
      sliding_window: None or an int >= 1.
      layer: None for a 4-D pool; an int in [0, L) or an integer scalar array for a 5-D pool.
      causal: a bool.
      k_scale: None, or for quantized pages float32 broadcastable to [K, P, C] (a 5-D pool:
        [L or 1, K, P, C]; ``pallas_kernels._quant.GRANULARITIES``).
      v_scale: like ``k_scale``.

    Raises:
      ValueError: listing every mismatch found.
    """
    errors: list[str] = []
    if not isinstance(causal, bool | np.bool_):
        errors.append(f"causal={causal!r} must be a bool")
    if q.ndim != 3:
        errors.append(f"q must be [T, N, H] (3-D), got {q.shape=}")
    elif not jnp.issubdtype(q.dtype, jnp.floating):
        errors.append(f"q must have a floating dtype, got {q.dtype=}")
    if k_pages.ndim not in (4, 5):
        errors.append(f"k_pages must be [K, P, C, H] or [L, K, P, C, H], got {k_pages.shape=}")
    if v_pages.shape != k_pages.shape:
        errors.append(f"v_pages.shape must equal {k_pages.shape=}, got {v_pages.shape=}")
    if v_pages.dtype != k_pages.dtype:
        errors.append(f"v_pages.dtype must equal {k_pages.dtype=}, got {v_pages.dtype=}")
    if not (jnp.issubdtype(k_pages.dtype, jnp.floating) or _quant.is_quantized(k_pages.dtype)):
        errors.append(
            f"k_pages must have a floating dtype or int8 (quantized, with scales), got "
            f"{k_pages.dtype=}"
        )
    errors += _quant.check_scales(k_pages, v_pages, k_scale, v_scale)
    if k_pages.ndim == 5:
        if layer is None:
            errors.append(f"layer is required for a 5-D pool {k_pages.shape=} (got layer=None)")
        elif _is_int_scalar_array(layer):
            if layer.shape not in ((), (1,)) or not jnp.issubdtype(layer.dtype, jnp.integer):
                errors.append(
                    f"layer must be an int or an integer scalar array, got "
                    f"shape={layer.shape} dtype={layer.dtype}"
                )
        else:
            try:
                layer_int = operator.index(layer)
            except TypeError:
                errors.append(f"layer must be an int or an integer scalar array, got {layer=!r}")
            else:
                if not 0 <= layer_int < k_pages.shape[0]:
                    errors.append(f"{layer=} must be in [0, L={k_pages.shape[0]})")
    elif k_pages.ndim == 4 and layer is not None:
        errors.append(f"layer must be None for a 4-D pool {k_pages.shape=}, got {layer=!r}")
    if q.ndim == 3 and k_pages.ndim in (4, 5):
        _, N, H = q.shape
        K, _, C, Hk = k_pages.shape[-4:]
        if Hk != H:
            errors.append(f"k_pages head dim must equal q's H={H}, got {Hk}")
        if K == 0 or N % K != 0:
            errors.append(f"num_q_heads N={N} must be divisible by num_kv_heads K={K}")
        if C < 1:
            errors.append(f"page size C must be >= 1, got {C}")
    if block_tables.ndim != 2:
        errors.append(f"block_tables must be i32[B, W], got {block_tables.shape=}")
    else:
        B, W = block_tables.shape
        if B < 1 or W < 1:
            errors.append(f"block_tables must have B >= 1 and W >= 1, got {block_tables.shape=}")
        if kv_lens.shape != (B,):
            errors.append(f"kv_lens.shape must be (B,)=({B},), got {kv_lens.shape=}")
        if cu_q_lens.shape != (B + 1,):
            errors.append(f"cu_q_lens.shape must be (B + 1,)=({B + 1},), got {cu_q_lens.shape=}")
    for name, x in (
        ("block_tables", block_tables),
        ("kv_lens", kv_lens),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        if x.dtype != jnp.int32:
            errors.append(f"{name}.dtype must be int32, got {x.dtype}")
    if num_seqs.shape not in ((), (1,)):
        errors.append(f"num_seqs must be i32[] or i32[1], got {num_seqs.shape=}")
    if logits_soft_cap is not None and not (
        isinstance(logits_soft_cap, (int, float)) and logits_soft_cap > 0
    ):
        errors.append(f"{logits_soft_cap=} must be None or a positive float")
    if sliding_window is not None and not (
        isinstance(sliding_window, (int, np.integer))
        and not isinstance(sliding_window, bool)
        and sliding_window >= 1
    ):
        errors.append(f"{sliding_window=} must be None or an int >= 1")
    _raise(errors)


def validate_dynamic(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    layer: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> None:
    """Checks the values of the index arrays; eager only (reads them back to the host).

    Checks ``validate_static`` first, then, over the live sequences ``b < num_seqs``:
    ``cu_q_lens[0] == 0``, ``cu_q_lens`` non-decreasing, ``cu_q_lens[num_seqs] <= T``,
    ``q_len_b <= kv_lens[b]``, ``0 <= kv_lens[b] <= W * C``, ``0 <= num_seqs <= B``, the
    page ids of the pages a sequence uses in ``[0, P)``, and ``layer`` in ``[0, L)``.
    ``k_scale``/``v_scale`` are the call's scales (quantized pages), for ``validate_static``.

    Raises:
      ValueError: listing every violated condition with the offending values.
    """
    validate_static(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
        layer=layer, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    T = q.shape[0]
    B, W = block_tables.shape
    C, P = k_pages.shape[-2], k_pages.shape[-3]
    tables = np.asarray(block_tables)
    lens = np.asarray(kv_lens).astype(np.int64)
    cu = np.asarray(cu_q_lens).astype(np.int64)
    ns = int(np.asarray(num_seqs).reshape(()))
    errors: list[str] = []
    if layer is not None and k_pages.ndim == 5:
        layer_int = int(np.asarray(layer).reshape(()))
        if not 0 <= layer_int < k_pages.shape[0]:
            errors.append(f"layer={layer_int} must be in [0, L={k_pages.shape[0]})")
    if not 0 <= ns <= B:
        errors.append(f"num_seqs={ns} must be in [0, B={B}]")
        ns = min(max(ns, 0), B)
    if cu[0] != 0:
        errors.append(f"cu_q_lens[0] must be 0, got {int(cu[0])}")
    live_cu = cu[: ns + 1]
    q_lens = np.diff(live_cu)
    bad = np.nonzero(q_lens < 0)[0]
    if bad.size:
        b = int(bad[0])
        errors.append(
            f"cu_q_lens must be non-decreasing over the first num_seqs+1={ns + 1} entries, got "
            f"cu_q_lens[{b}]={int(cu[b])} > cu_q_lens[{b + 1}]={int(cu[b + 1])}"
        )
    if cu[ns] > T:
        errors.append(f"cu_q_lens[num_seqs={ns}]={int(cu[ns])} must be <= T={T} (rows of q)")
    live_lens = lens[:ns]
    bad = np.nonzero((live_lens < 0) | (live_lens > W * C))[0]
    if bad.size:
        b = int(bad[0])
        errors.append(f"kv_lens[{b}]={int(lens[b])} must be in [0, W*C={W * C}]")
    bad = np.nonzero(q_lens > live_lens)[0]
    if bad.size:
        b = int(bad[0])
        errors.append(
            f"query length of sequence {b} (cu_q_lens[{b + 1}] - cu_q_lens[{b}] = "
            f"{int(q_lens[b])}) must be <= kv_lens[{b}]={int(lens[b])}: the new tokens' K/V "
            f"must already be in the pages"
        )
    npages = -(-np.clip(live_lens, 0, W * C) // C)
    for b in range(ns):
        used = tables[b, : npages[b]]
        out = np.nonzero((used < 0) | (used >= P))[0]
        if out.size:
            i = int(out[0])
            errors.append(f"block_tables[{b}, {i}]={int(used[i])} must be a page id in [0, P={P})")
            break
    _raise(errors)
