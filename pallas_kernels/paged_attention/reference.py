"""Reference decode attention over a paged KV cache: plain ``jnp``, f32 math.

This is the oracle every implementation is tested against. It gathers each
sequence's pages into a dense [B, K, S, H] view (S = W * C) and runs an ordinary
masked softmax, so it is simple rather than fast (memory O(B * K * W * C * H)).

Two rules make it safe on a real, reused pool:
  * table entries past a sequence's last used page (``ceil(length / C)``) are
    replaced by page 0 before the gather, so no id from an unused entry is read;
  * keys and values at positions ``>= length`` (the unused tail of the last page,
    which may hold stale values, NaN or Inf) are zeroed with ``jnp.where`` before
    any arithmetic, since masking only the scores would still give ``0 * NaN``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _quant
from pallas_kernels.paged_attention.sanitize import sanitize
from pallas_kernels.paged_attention.validate import validate_static

_HIGHEST = jax.lax.Precision.HIGHEST


def paged_attention_reference(
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
) -> jax.Array:
    """Decode attention, one query token per sequence, in plain ``jnp`` with f32 math.

    Args:
      q: [B, N, H]; the query of sequence b sits at position ``lengths[b] - 1``.
      k_pages: [K, P, C, H] key pages, or [L, K, P, C, H] with ``layer``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W]; entry (b, i) is the page holding tokens [i*C, (i+1)*C) of b.
        Entries past page ``ceil(lengths[b] / C) - 1`` are never read.
      lengths: i32[B] in [0, W * C], the query's own token included.
      sm_scale: logit scale, default ``1 / sqrt(H)``.
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      sliding_window: if set to w, key j is seen iff ``lengths[b] - 1 - j < w``.
      layer: layer index (int or i32[]) into a 5-D pool; None for a 4-D pool.
      k_scale: for quantized pages (fp8, int8) f32 broadcastable to [K, P, C] (5-D pool:
        [L or 1, K, P, C]); attention reads ``k_pages.astype(f32) * k_scale``.
      v_scale: like ``k_scale``, for ``v_pages``.

    Returns:
      [B, N, H] in ``q.dtype``; zeros for sequences of length 0, and for those with an
      invalid length or used page id (``sanitize.py``). Query head n reads KV head
      ``n // (N // K)``.

    Raises:
      ValueError: on inconsistent shapes, dtypes or knobs (see ``validate_static``).

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 2, 4)); kv = jnp.ones((1, 3, 2, 4))
    >>> paged_attention_reference(q, kv, kv, jnp.array([[2, 0]]), jnp.array([3]))[0, 0]
    Array([1., 1., 1., 1.], dtype=float32)
    """
    validate_static(
        q, k_pages, v_pages, block_tables, lengths,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, layer=layer,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    # Invalid values get the result every implementation gives (sanitize.py).
    block_tables, lengths, layer = sanitize(
        block_tables, lengths, layer, k_pages_shape=k_pages.shape
    )
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    k_scale, v_scale = _quant.canonical_scales(k_pages, k_scale, v_scale)
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    return _reference(
        q,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        jnp.asarray(layer, jnp.int32),
        k_scale,
        v_scale,
        sm_scale=float(sm_scale),
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "logits_soft_cap", "sliding_window"))
def _reference(
    q_BNH, k_pages_LKPCH, v_pages_LKPCH, tables_BW, lengths_B, layer, k_scale, v_scale, *,
    sm_scale, logits_soft_cap, sliding_window,
):  # fmt: skip
    B, N, H = q_BNH.shape
    _, K, _, C, _ = k_pages_LKPCH.shape
    W = tables_BW.shape[1]
    G = N // K
    S = W * C

    # Never read an id from an unused table entry: clamp those entries to page 0.
    pages_used_B = (lengths_B + C - 1) // C
    used_BW = jnp.arange(W)[None, :] < pages_used_B[:, None]
    tables_BW = jnp.where(used_BW, tables_BW, 0)

    def gather(pages_LKPCH, scale):  # [K, B, W, C, H] -> [B, K, S, H]; quantized: * scale in f32
        x_BWKCH = pages_LKPCH[layer][:, tables_BW].transpose(1, 2, 0, 3, 4)
        x_BWKCH = _quant.dequantize_gathered(x_BWKCH, scale, layer, tables_BW)
        return x_BWKCH.transpose(0, 2, 1, 3, 4).reshape(B, K, S, H)

    k_BKSH = gather(k_pages_LKPCH, k_scale)
    v_BKSH = gather(v_pages_LKPCH, v_scale)

    pos_S = jnp.arange(S)
    visible_BS = pos_S[None, :] < lengths_B[:, None]
    if sliding_window is not None:
        visible_BS &= (lengths_B[:, None] - 1 - pos_S[None, :]) < sliding_window
    # Zero the values (not only the scores) so NaN/Inf in unused slots cannot leak.
    k_BKSH = jnp.where(visible_BS[:, None, :, None], k_BKSH.astype(jnp.float32), 0.0)
    v_BKSH = jnp.where(visible_BS[:, None, :, None], v_BKSH.astype(jnp.float32), 0.0)

    q_BKGH = q_BNH.astype(jnp.float32).reshape(B, K, G, H)
    s_BKGS = jnp.einsum(
        "bkgh,bksh->bkgs", q_BKGH, k_BKSH,
        precision=_HIGHEST, preferred_element_type=jnp.float32,
    )  # fmt: skip
    s_BKGS = s_BKGS * jnp.float32(sm_scale)
    if logits_soft_cap is not None:
        cap = jnp.float32(logits_soft_cap)
        s_BKGS = cap * jnp.tanh(s_BKGS / cap)
    mask_BKGS = visible_BS[:, None, None, :]
    s_BKGS = jnp.where(mask_BKGS, s_BKGS, -jnp.inf)
    m_BKG = jnp.max(s_BKGS, axis=-1, keepdims=True)
    m_BKG = jnp.where(jnp.isfinite(m_BKG), m_BKG, 0.0)  # all masked (length 0)
    p_BKGS = jnp.where(mask_BKGS, jnp.exp(s_BKGS - m_BKG), 0.0)
    l_BKG = jnp.sum(p_BKGS, axis=-1, keepdims=True)
    o_BKGH = jnp.einsum(
        "bkgs,bksh->bkgh", p_BKGS, v_BKSH,
        precision=_HIGHEST, preferred_element_type=jnp.float32,
    )  # fmt: skip
    o_BKGH = jnp.where(l_BKG != 0, o_BKGH / jnp.where(l_BKG != 0, l_BKG, 1.0), 0.0)
    return o_BKGH.reshape(B, N, H).astype(q_BNH.dtype)
