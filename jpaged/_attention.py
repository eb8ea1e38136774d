"""Public attention entry points: validate, pick an implementation, call it.

Each op's implementations are an explicit table in ``pallas_kernels/<op>/dispatch.py``:
``IMPLEMENTATIONS`` (name -> function) and ``UNSUPPORTED_REASONS`` (name -> a function
returning ``None`` when that implementation can run the given arguments). Auto dispatch
consults the reason and falls back to ``"xla"``; an explicitly requested implementation that
cannot run raises ``ValueError`` with the reason.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax

from pallas_kernels import _backend
from pallas_kernels.paged_attention import dispatch as _paged_dispatch
from pallas_kernels.paged_attention import validate as _paged_validate
from pallas_kernels.ragged_paged_attention import dispatch as _ragged_dispatch
from pallas_kernels.ragged_paged_attention import validate as _ragged_validate

Implementation = Literal["xla", "pallas_gpu", "pallas_tpu"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "pallas_gpu", "pallas_tpu")


def _lookup(op: str, table: Mapping[str, Callable], impl: str) -> Callable:
    if impl not in table:
        raise ValueError(f"implementation={impl!r} is not available for {op}")
    return table[impl]


def _resolve(op: str, dispatch, implementation: str | None, interpret: bool | None, args, kwargs):
    """The implementation that runs this call: ``implementation`` if given (checked), else the
    platform's Pallas kernel where it can run the arguments, else ``"xla"``. ``dispatch``: the
    op's module of tables (``IMPLEMENTATIONS``, ``UNSUPPORTED_REASONS``)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be None (auto) or one of {IMPLEMENTATIONS}")
    if interpret and implementation not in ("pallas_gpu", "pallas_tpu"):
        raise ValueError(
            f"interpret=True runs a Pallas kernel in its interpreter: pass "
            f"implementation='pallas_gpu' or 'pallas_tpu' (got {implementation=})"
        )
    reasons = dispatch.UNSUPPORTED_REASONS
    if implementation is not None:
        _lookup(op, dispatch.IMPLEMENTATIONS, implementation)  # raises if not shipped
        if not interpret:
            reason = _lookup(op, reasons, implementation)(*args, **kwargs)
            if reason is not None:
                raise ValueError(
                    f"implementation={implementation!r} cannot run this call: {reason}"
                )
        return implementation
    platform = _backend.default_platform()
    candidates: list[str] = []
    if platform == "tpu":
        candidates.append("pallas_tpu")
    elif platform == "gpu" and _backend.has_mosaic_gpu():
        candidates.append("pallas_gpu")
    for impl in candidates:
        if impl in dispatch.IMPLEMENTATIONS and reasons[impl](*args, **kwargs) is None:
            return impl
    return "xla"


def _call(op: str, dispatch, impl: str, interpret, args, kwargs, tuning):
    fn = _lookup(op, dispatch.IMPLEMENTATIONS, impl)
    if impl == "xla":
        return fn(*args, **kwargs, **tuning)
    return fn(*args, **kwargs, interpret=bool(interpret), **tuning)


def _check_tuning(implementation: str | None, tuning: dict[str, Any]) -> None:
    if implementation is None and tuning:
        raise ValueError(
            f"tuning knobs {sorted(tuning)} are implementation-specific: pass implementation= "
            f"(one of {IMPLEMENTATIONS}) with them; auto dispatch may pick another implementation"
        )


def _sm_scale(sm_scale: float | None, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise ValueError(
            f"sm_scale must be None or a Python number (a compile-time constant), "
            f"got {type(sm_scale).__name__}"
        )
    return float(sm_scale)


def _scales(k_scale: Any, v_scale: Any) -> dict[str, Any]:
    """The scale keywords of a quantized call; none for an unquantized one (so implementations
    and their ``UNSUPPORTED_REASONS`` see exactly the arguments they had before scales)."""
    if k_scale is None and v_scale is None:
        return {}
    return {"k_scale": k_scale, "v_scale": v_scale}


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    **tuning: Any,
) -> jax.Array:
    """Decode attention over a paged KV cache: one query token per sequence.

    Args:
      q: [B, N, H] queries; the query of sequence b sits at position ``lengths[b] - 1``.
      k_pages: [K, P, C, H] key pages, or [L, K, P, C, H] with ``layer``; floating, or quantized
        (``float8_e4m3fn``, ``float8_e5m2``, ``int8``) with ``k_scale`` and ``v_scale``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W]; entry (b, i) is the page holding tokens [i*C, (i+1)*C) of b.
      lengths: i32[B] tokens in the cache per sequence (the query's own included).
      sm_scale: logit scale, default ``1 / sqrt(H)``.
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      sliding_window: if set, only the last ``sliding_window`` keys are seen.
      layer: layer index (int or i32[]) into a 5-D pool.
      k_scale: quantized pages only: f32 scales broadcastable to [K, P, C] (with a 5-D pool
        [L or 1, K, P, C], ``layer`` picks the row): ``[]`` or ``[1, 1, 1]`` per tensor,
        ``[K, 1, 1]`` per KV head, ``[K, P, 1]`` per page and head, ``[K, P, C]`` per token and
        head. Attention reads ``k_pages.astype(f32) * k_scale`` (f32 accumulation).
      v_scale: like ``k_scale``, for ``v_pages``.
      implementation: None (auto), "xla", "pallas_gpu" or "pallas_tpu".
      interpret: run the Pallas kernel in its interpreter (any backend).
      **tuning: implementation-specific knobs (block sizes, splits); they need an explicit
        ``implementation``.

    Returns:
      [B, N, H] in ``q.dtype``; zeros for sequences of length 0.

    Raises:
      ValueError: on inconsistent shapes or dtypes, or an implementation that cannot run them.

    >>> import jax.numpy as jnp, jpaged
    >>> q = jnp.ones((1, 2, 4)); kv = jnp.ones((1, 3, 2, 4))
    >>> jpaged.paged_attention(q, kv, kv, jnp.array([[2, 0]]), jnp.array([3])).shape
    (1, 2, 4)
    """
    _paged_validate.validate_static(
        q, k_pages, v_pages, block_tables, lengths,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, layer=layer,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    args = (q, k_pages, v_pages, block_tables, lengths)
    kwargs = dict(
        sm_scale=_sm_scale(sm_scale, q.shape[-1]),
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        layer=layer,
        **_scales(k_scale, v_scale),
    )
    _check_tuning(implementation, tuning)
    op = "paged_attention"
    impl = _resolve(op, _paged_dispatch, implementation, interpret, args, kwargs)
    return _call(op, _paged_dispatch, impl, interpret, args, kwargs, tuning)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    causal: bool = True,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    **tuning: Any,
) -> jax.Array:
    """Attention of a ragged batch of query tokens over a paged KV cache.

    Serves prefill, chunked prefill, multi-token decode and mixed batches in one call.

    Args:
      q: [T, N, H]; the tokens of sequence b are ``q[cu_q_lens[b]:cu_q_lens[b+1]]``.
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``; floating, or quantized
        (``float8_e4m3fn``, ``float8_e5m2``, ``int8``) with ``k_scale`` and ``v_scale``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W].
      kv_lens: i32[B] tokens in the cache per sequence, the new query tokens included.
      cu_q_lens: i32[B + 1] cumulative query lengths, starting at 0.
      num_seqs: i32[] (or i32[1]) number of live sequences; rows from
        ``cu_q_lens[num_seqs]`` on are padding and come back as zeros.
      sm_scale: logit scale, default ``1 / sqrt(H)``.
      causal: token i of sequence b, at position ``kv_lens[b] - q_len_b + i``, sees keys
        at positions <= its own. If False it sees all ``kv_lens[b]`` keys.
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      sliding_window: if set, a query at position p sees keys j with ``p - j < sliding_window``.
      layer: layer index into a 5-D pool.
      k_scale: quantized pages only: f32 scales broadcastable to [K, P, C] (as in
        ``paged_attention``).
      v_scale: like ``k_scale``, for ``v_pages``.
      implementation: None (auto), "xla", "pallas_gpu" or "pallas_tpu".
      interpret: run the Pallas kernel in its interpreter.
      **tuning: implementation-specific knobs; they need an explicit ``implementation``.

    Returns:
      [T, N, H] in ``q.dtype``.

    Raises:
      ValueError: on inconsistent shapes or dtypes, or an implementation that cannot run them.
    """
    _ragged_validate.validate_static(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, layer=layer,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    args = (q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs)
    kwargs = dict(
        sm_scale=_sm_scale(sm_scale, q.shape[-1]),
        causal=causal,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        layer=layer,
        **_scales(k_scale, v_scale),
    )
    _check_tuning(implementation, tuning)
    op = "ragged_paged_attention"
    impl = _resolve(op, _ragged_dispatch, implementation, interpret, args, kwargs)
    return _call(op, _ragged_dispatch, impl, interpret, args, kwargs, tuning)
