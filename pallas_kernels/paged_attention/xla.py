"""The "xla" decode-attention implementation: chunked page gathers, online softmax.

Not the naive "gather every page, then dense attention" (which materialises
[B, K, W * C, H] and ran at 0.5 TB/s on an H200). Instead a ``lax.while_loop``
walks each sequence's pages in chunks of ``pages_per_chunk`` pages:

  1. gather one chunk of pages for all B sequences at once with the block table
     (one XLA gather of [B, pages_per_chunk, K, C, H]),
  2. score it against the G query heads that share each KV head
     (``"bkgh,bpkch->bkgpc"``, so every K/V byte is read once per step),
  3. fold it into a running max / sum / accumulator in f32 (online softmax).

Memory is O(B * N * H + B * K * pages_per_chunk * C * H), whatever the context.
The trip count is dynamic: it is the largest number of chunks any sequence needs,
so a batch of short sequences does little work. With a sliding window each
sequence starts at the page holding its first visible key, so pages before the
window are never gathered. Chunks are per-sequence offsets into each block table,
so sequences of different lengths never pad each other.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _quant

DEFAULT_CHUNK_TOKENS = 256


def unsupported_reason(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
    lengths: jax.Array, **kwargs: Any,
) -> str | None:  # fmt: skip
    """The XLA path runs every call that passes ``validate_static``: always None."""
    del q, k_pages, v_pages, block_tables, lengths, kwargs
    return None


def default_pages_per_chunk(page_size: int, width: int) -> int:
    """Pages gathered per loop step: about ``DEFAULT_CHUNK_TOKENS`` tokens, at most W."""
    return max(1, min(width, DEFAULT_CHUNK_TOKENS // page_size))


def paged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    interpret: bool = False,
    pages_per_chunk: int | None = None,
) -> jax.Array:
    """Decode attention over a paged KV cache with a chunked online softmax in XLA.

    Callers normally go through ``jpaged.paged_attention`` (which validates the
    arguments and resolves ``sm_scale``); this function trusts them. Works inside
    ``jit`` with traced tables, lengths and ``layer``.

    Args:
      q: [B, N, H]; the query of sequence b sits at position ``lengths[b] - 1``.
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W]; entries past a sequence's last used page are never read.
      lengths: i32[B].
      sm_scale: logit scale (a Python float).
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      sliding_window: if set to w, key j is seen iff ``lengths[b] - 1 - j < w``.
      layer: layer index (int or i32[]) into a 5-D pool; None for a 4-D pool.
      k_scale: quantized (fp8, int8) pages: f32 broadcastable to [K, P, C] ([L or 1, K, P, C]
        with a 5-D pool); each gathered page is dequantized to ``page.astype(f32) * scale``.
      v_scale: like ``k_scale``, for ``v_pages``.
      interpret: must be False (there is no Pallas kernel to interpret here).
      pages_per_chunk: pages gathered per loop step (static); default about 256
        tokens' worth (``default_pages_per_chunk``).

    Returns:
      [B, N, H] in ``q.dtype``; zeros for sequences of length 0.

    Raises:
      ValueError: if ``interpret`` is True or ``pages_per_chunk`` is not an int >= 1.

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 2, 4)); kv = jnp.ones((1, 3, 2, 4))
    >>> out = paged_attention_xla(q, kv, kv, jnp.array([[2, 0]]), jnp.array([3]),
    ...                           sm_scale=0.5, pages_per_chunk=1)
    >>> out[0, 1]
    Array([1., 1., 1., 1.], dtype=float32)
    """
    if interpret:
        raise ValueError(f"{interpret=} is not supported by the 'xla' implementation")
    width = block_tables.shape[1]
    if pages_per_chunk is None:
        pages_per_chunk = default_pages_per_chunk(k_pages.shape[-2], width)
    if isinstance(pages_per_chunk, bool) or not (
        isinstance(pages_per_chunk, int) and pages_per_chunk >= 1
    ):
        raise ValueError(f"{pages_per_chunk=} must be an int >= 1")
    k_scale, v_scale = _quant.canonical_scales(k_pages, k_scale, v_scale)
    if k_pages.ndim == 4:
        # A leading unit axis is a free reshape; one code path serves both layouts.
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    return _paged_attention_xla(
        q,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        jnp.asarray(layer, jnp.int32),
        k_scale,
        v_scale,
        sm_scale=float(sm_scale),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        sliding_window=sliding_window,
        pages_per_chunk=min(pages_per_chunk, width),
    )


def chunk_schedule(
    lengths_B: jax.Array,
    *,
    page_size: int,
    width: int,
    pages_per_chunk: int,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Which pages each sequence walks, and how many loop steps the batch needs.

    Sequence b reads table columns ``[first_page_B[b], pages_used_B[b])``, in steps of
    ``pages_per_chunk`` columns; the loop runs ``num_chunks`` steps, the most any
    sequence needs. With a sliding window, ``first_page_B`` is the page of the first
    visible key, so pages before the window cost nothing.

    Args:
      lengths_B: i32[B] sequence lengths (clipped to [0, W * C]).
      page_size: C.
      width: W, the block-table width.
      pages_per_chunk: table columns gathered per step.
      sliding_window: None or the window w.

    Returns:
      ``(lengths_B, lo_B, first_page_B, pages_used_B, num_chunks)``: clipped lengths,
      first visible position, first table column read, columns in use, i32[] steps.
    """
    C, R = page_size, pages_per_chunk
    lengths_B = jnp.clip(lengths_B, 0, width * C)
    pages_used_B = (lengths_B + C - 1) // C
    if sliding_window is None:
        lo_B = jnp.zeros_like(lengths_B)
    else:
        lo_B = jnp.maximum(lengths_B - sliding_window, 0)
    first_page_B = jnp.minimum(lo_B // C, pages_used_B)
    chunks_B = (pages_used_B - first_page_B + R - 1) // R
    num_chunks = jnp.max(chunks_B, initial=0)
    return lengths_B, lo_B, first_page_B, pages_used_B, num_chunks


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "logits_soft_cap", "sliding_window", "pages_per_chunk"),
)
def _paged_attention_xla(
    q_BNH, k_pages_LKPCH, v_pages_LKPCH, tables_BW, lengths_B, layer, k_scale, v_scale, *,
    sm_scale, logits_soft_cap, sliding_window, pages_per_chunk,
):  # fmt: skip
    B, N, H = q_BNH.shape
    _, K, P, C, _ = k_pages_LKPCH.shape
    W = tables_BW.shape[1]
    G = N // K
    R = pages_per_chunk
    kv_dtype = k_pages_LKPCH.dtype if k_scale is None else jnp.dtype(jnp.float32)  # dequantized
    # Dots run in the storage dtype with f32 accumulation (f32 if q and pages differ).
    dot_dtype = kv_dtype if q_BNH.dtype == kv_dtype else jnp.dtype(jnp.float32)
    precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None

    lengths_B, lo_B, first_page_B, pages_used_B, num_chunks = chunk_schedule(
        lengths_B, page_size=C, width=W, pages_per_chunk=R, sliding_window=sliding_window
    )

    q_BKGH = q_BNH.reshape(B, K, G, H).astype(dot_dtype)
    page_R = jnp.arange(R, dtype=jnp.int32)
    offset_C = jnp.arange(C, dtype=jnp.int32)

    def body(carry):
        i, m_BKG, l_BKG, acc_BKGH = carry
        col_BR = first_page_B[:, None] + i * R + page_R[None, :]  # table columns
        live_BR = col_BR < pages_used_B[:, None]
        ids_BR = jnp.take_along_axis(tables_BW, jnp.minimum(col_BR, W - 1), axis=1)
        ids_BR = jnp.clip(jnp.where(live_BR, ids_BR, 0), 0, P - 1)
        # One gather per chunk: [B, R, K, C, H] straight from the (layer of the) pool.
        k_BRKCH = k_pages_LKPCH[layer, :, ids_BR]
        v_BRKCH = v_pages_LKPCH[layer, :, ids_BR]
        # Quantized pools: page.astype(f32) * scale, the scales gathered with their pages.
        k_BRKCH = _quant.dequantize_gathered(k_BRKCH, k_scale, layer, ids_BR)
        v_BRKCH = _quant.dequantize_gathered(v_BRKCH, v_scale, layer, ids_BR)

        pos_BRC = col_BR[:, :, None] * C + offset_C[None, None, :]
        visible_BRC = (pos_BRC < lengths_B[:, None, None]) & (pos_BRC >= lo_B[:, None, None])
        vis_BR1C1 = visible_BRC[:, :, None, :, None]
        k_BRKCH = jnp.where(vis_BR1C1, k_BRKCH, jnp.zeros((), kv_dtype)).astype(dot_dtype)
        v_BRKCH = jnp.where(vis_BR1C1, v_BRKCH, jnp.zeros((), kv_dtype)).astype(dot_dtype)

        s_BKGRC = jnp.einsum(
            "bkgh,brkch->bkgrc", q_BKGH, k_BRKCH,
            precision=precision, preferred_element_type=jnp.float32,
        )  # fmt: skip
        s_BKGRC = s_BKGRC * jnp.float32(sm_scale)
        if logits_soft_cap is not None:
            cap = jnp.float32(logits_soft_cap)
            s_BKGRC = cap * jnp.tanh(s_BKGRC / cap)
        mask_BKGRC = visible_BRC[:, None, None, :, :]
        s_BKGRC = jnp.where(mask_BKGRC, s_BKGRC, -jnp.inf)

        m_new_BKG = jnp.maximum(m_BKG, jnp.max(s_BKGRC, axis=(-2, -1)))
        m_safe_BKG = jnp.where(m_new_BKG == -jnp.inf, 0.0, m_new_BKG)
        alpha_BKG = jnp.exp(m_BKG - m_safe_BKG)  # exp(-inf) = 0 before the first key
        p_BKGRC = jnp.exp(s_BKGRC - m_safe_BKG[..., None, None])  # masked -> 0
        l_BKG = alpha_BKG * l_BKG + jnp.sum(p_BKGRC, axis=(-2, -1))
        pv_BKGH = jnp.einsum(
            "bkgrc,brkch->bkgh", p_BKGRC.astype(dot_dtype), v_BRKCH,
            precision=precision, preferred_element_type=jnp.float32,
        )  # fmt: skip
        acc_BKGH = alpha_BKG[..., None] * acc_BKGH + pv_BKGH
        return i + 1, m_new_BKG, l_BKG, acc_BKGH

    init = (
        jnp.int32(0),
        jnp.full((B, K, G), -jnp.inf, jnp.float32),
        jnp.zeros((B, K, G), jnp.float32),
        jnp.zeros((B, K, G, H), jnp.float32),
    )
    _, _, l_BKG, acc_BKGH = jax.lax.while_loop(lambda c: c[0] < num_chunks, body, init)
    safe_l_BKG = jnp.where(l_BKG > 0, l_BKG, 1.0)
    o_BKGH = jnp.where(l_BKG[..., None] > 0, acc_BKGH / safe_l_BKG[..., None], 0.0)
    return o_BKGH.reshape(B, N, H).astype(q_BNH.dtype)
