"""Public attention entry points: validate, pick an implementation, call it.

Each op's implementations are an explicit table in ``pallas_kernels/<op>/dispatch.py``:
``IMPLEMENTATIONS`` (name -> function) and ``UNSUPPORTED_REASONS`` (name -> a function
returning ``None`` when that implementation can run the given arguments). Auto dispatch
consults the reason and falls back to ``"xla"``; an explicitly requested implementation that
cannot run raises ``ValueError`` with the reason.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax

from pallas_kernels import _backend
from pallas_kernels.paged_attention import dispatch as _paged_dispatch
from pallas_kernels.paged_attention import sanitize as _paged_sanitize
from pallas_kernels.paged_attention import validate as _paged_validate
from pallas_kernels.ragged_paged_attention import dispatch as _ragged_dispatch
from pallas_kernels.ragged_paged_attention import sanitize as _ragged_sanitize
from pallas_kernels.ragged_paged_attention import validate as _ragged_validate

Implementation = Literal["xla", "pallas_gpu", "pallas_tpu", "pallas_triton"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "pallas_gpu", "pallas_tpu", "pallas_triton")
_PALLAS = ("pallas_gpu", "pallas_tpu", "pallas_triton")
_log = logging.getLogger("jpaged.dispatch")
# The latest auto choice per op: (implementation, why), read by ``last_auto_choice``.
_LAST_AUTO: dict[str, tuple[str, str]] = {}


def last_auto_choice(op: str = "paged_attention") -> tuple[str, str] | None:
    """The implementation ``implementation=None`` picked at the latest trace of ``op``
    ("paged_attention" or "ragged_paged_attention") and why, or None before any. The same
    line goes to the ``jpaged.dispatch`` logger at DEBUG level; ``jpaged.auto_route()``
    says which kernel this machine tries first without a call."""
    return _LAST_AUTO.get(op)


def _lookup(op: str, table: Mapping[str, Callable], impl: str) -> Callable:
    if impl not in table:
        raise ValueError(f"implementation={impl!r} is not available for {op}")
    return table[impl]


def _resolve(op: str, dispatch, implementation: str | None, interpret: bool | None, args, kwargs):
    """The implementation that runs this call: ``implementation`` if given (checked), else the
    platform's Pallas kernel where it can run the arguments, else its second kernel where it
    has one and that can (``AutoRoute.fallback``), else ``"xla"``. ``dispatch``: the
    op's module of tables (``IMPLEMENTATIONS``, ``UNSUPPORTED_REASONS``)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be None (auto) or one of {IMPLEMENTATIONS}")
    if interpret and implementation not in _PALLAS:
        raise ValueError(
            f"interpret=True runs a Pallas kernel in its interpreter: pass "
            f"implementation= one of {_PALLAS} (got {implementation=})"
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
    route = _backend.auto_route()
    impl, refusals = "xla", []
    for kernel in (k for k in route.kernels if k in dispatch.IMPLEMENTATIONS):
        reason = reasons[kernel](*args, **kwargs)
        if reason is None:
            impl = kernel
            break
        refusals.append(f"{kernel} cannot run this call ({reason})")
    why = "; ".join([route.reason, *refusals])
    if refusals:
        why += f": {'the XLA path' if impl == 'xla' else impl}"
    _LAST_AUTO[op] = (impl, why)
    _log.debug("%s: implementation=None picked %r: %s", op, impl, why)
    return impl


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


def _checks_values(check: bool | None, *metadata: Any) -> tuple[bool, bool]:
    """``(check eagerly, check with checkify)`` for ``check`` and the metadata arrays: eager
    when they are concrete (unless ``check=False``); under ``jit`` only with ``check=True``."""
    if check is not None and not isinstance(check, bool):
        raise ValueError(f"check={check!r} must be None (check concrete values), True or False")
    if check is False:
        return False, False
    traced = any(isinstance(x, jax.core.Tracer) for x in metadata)
    return not traced, traced and check is True


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
    check: bool | None = None,
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
      implementation: None (auto), "xla", "pallas_gpu", "pallas_tpu" or "pallas_triton".
      interpret: run the Pallas kernel in its interpreter (any backend).
      check: value checks (lengths in ``[0, W * C]``, used page ids in ``[0, P)``, ``layer``
        in ``[0, L)``). None (default): checked when the values are concrete (eager call;
        they are read back to the host), not under ``jit``. True: also under ``jit``, as
        ``jax.experimental.checkify`` checks (wrap the caller in ``checkify.checkify``).
        False: never. Unchecked invalid values get one result in every implementation: a
        sequence with a bad length or used page id gives zeros, a traced ``layer`` out of
        range gives zeros everywhere (``pallas_kernels/paged_attention/sanitize.py``).
      **tuning: implementation-specific knobs (block sizes, splits); they need an explicit
        ``implementation``.

    Returns:
      [B, N, H] in ``q.dtype``; zeros for sequences of length 0. NaN or inf in ``q``, or in
      the keys and values a query sees, give NaN in that query head's output (never read
      slots and pages do not matter); so does ``sm_scale=nan``.

    Raises:
      ValueError: on inconsistent shapes or dtypes, or an implementation that cannot run
        them; with the value checks on, an invalid value (its index named).

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
    eager, traced = _checks_values(check, block_tables, lengths, layer)
    if eager:  # valid values pass `sanitize` unchanged: it is skipped
        _paged_validate.validate_dynamic(q, k_pages, v_pages, block_tables, lengths, layer=layer)
    else:
        if traced:
            _paged_sanitize.check_traced(block_tables, lengths, layer, k_pages_shape=k_pages.shape)
        block_tables, lengths, layer = _paged_sanitize.sanitize(
            block_tables, lengths, layer, k_pages_shape=k_pages.shape
        )
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
    check: bool | None = None,
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
      implementation: None (auto), "xla", "pallas_gpu", "pallas_tpu" or "pallas_triton".
      interpret: run the Pallas kernel in its interpreter.
      check: value checks (``cu_q_lens`` from 0, non-decreasing, ending at most at T;
        ``num_seqs`` in ``[0, B]``; ``q_len_b <= kv_lens[b] <= W * C``; used page ids in
        ``[0, P)``; ``layer`` in ``[0, L)``). None (default): checked when the values are
        concrete (eager call), not under ``jit``. True: also under ``jit``, as
        ``jax.experimental.checkify`` checks. False: never. Unchecked invalid values get one
        result in every implementation: the whole output is zeros
        (``pallas_kernels/ragged_paged_attention/sanitize.py``).
      **tuning: implementation-specific knobs; they need an explicit ``implementation``.

    Returns:
      [T, N, H] in ``q.dtype``. NaN or inf in ``q``, or in the keys and values a row sees,
      give NaN in that row's head (never read slots and pages do not matter); so does
      ``sm_scale=nan``.

    Raises:
      ValueError: on inconsistent shapes or dtypes, a non-bool ``causal``, or an
        implementation that cannot run them; with the value checks on, an invalid value
        (its index named).
    """
    _ragged_validate.validate_static(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, layer=layer,
        causal=causal, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    metadata = (block_tables, kv_lens, cu_q_lens, num_seqs)
    eager, traced = _checks_values(check, *metadata, layer)
    if eager:  # valid values pass `sanitize` unchanged: it is skipped
        _ragged_validate.validate_dynamic(
            q, k_pages, v_pages, *metadata, layer=layer, k_scale=k_scale, v_scale=v_scale
        )
    else:
        shapes = dict(num_rows=q.shape[0], k_pages_shape=k_pages.shape)
        if traced:
            _ragged_sanitize.check_traced(*metadata, layer, **shapes)
        *metadata, layer = _ragged_sanitize.sanitize(*metadata, layer, **shapes)
    block_tables, kv_lens, cu_q_lens, num_seqs = metadata
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
