"""The "xla" decode-attention implementation: chunked page gathers, online softmax.

Not the naive "gather every page, then dense attention" (which materialises
[B, K, W * C, H] and ran at 0.5 TB/s on an H200). A loop walks each sequence's pages in
chunks of ``pages_per_chunk`` pages:

  1. gather one chunk of pages for all B sequences at once with the block table
     (one XLA gather of [K, B, pages_per_chunk, C, H] per K and V),
  2. score it against the G query heads that share each KV head
     (``"kbgh,kbrch->kbgrc"``: K/V are never repeated per query head, and the dots'
     batch axes lead, so the chunk is never transposed),
  3. fold it into a running max / sum / accumulator in f32 (online softmax).

Memory is O(B * N * H + B * K * pages_per_chunk * C * H), whatever the context.

The trip count is static, ``ceil(W / pages_per_chunk)`` (with a window of w keys, the chunks
of its ``ceil(w / C) + 1`` pages when fewer): a loop whose trip count depends on
the lengths is a ``while_loop`` whose condition XLA on GPU reads back to the host every
iteration (the call then blocks until the loop ends, and the GPU idles between steps). Table
slots past a sequence's last page are redirected to that last page, so a short sequence's
idle steps re-read one page (from L2), never the rest of the table (or its poisoned or
out-of-range entries). With a sliding window each sequence starts at the page holding its
first visible key, so pages before the window are never gathered. Chunks are per-sequence
offsets into each block table, so sequences of different lengths never pad each other. K is
used as stored (its scores are masked after the dot); V rows outside the sequence are zeroed
before ``P @ V`` so NaN tails never reach the output.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _quant

# Tokens gathered per loop step: at B=128 / 2k on the H200 1024 (pages_per_chunk 64 at C=16)
# took 1247 us, 256 1423, 2048 1547 (CUPTI, 2026-12-06; benchmarks/results/
# triton_sweep_xla_h200.json).
DEFAULT_CHUNK_TOKENS = 1024


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
      pages_per_chunk: pages gathered per loop step (static); default about
        ``DEFAULT_CHUNK_TOKENS`` tokens' worth (``default_pages_per_chunk``).

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
    ``pages_per_chunk`` columns; ``num_chunks`` is the most steps any sequence needs. The
    XLA path's loop runs a static ``ceil(W / R)`` steps instead (a trip count computed on
    the device is a loop condition read back to the host on GPU); steps past a sequence's
    last page re-read that page and mask it. With a sliding window, ``first_page_B`` is the
    page of the first visible key, so pages before the window cost nothing.

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

    lengths_B, lo_B, first_page_B, pages_used_B, _ = chunk_schedule(
        lengths_B, page_size=C, width=W, pages_per_chunk=R, sliding_window=sliding_window
    )
    last_col_B = jnp.clip(pages_used_B - 1, 0, W - 1)
    # Each sequence's last page id (clipped into the pool): where idle slots read.
    last_id_B = jnp.clip(
        jnp.take_along_axis(tables_BW, last_col_B[:, None], axis=1)[:, 0], 0, P - 1
    )

    q_KBGH = q_BNH.reshape(B, K, G, H).transpose(1, 0, 2, 3).astype(dot_dtype)
    head_K = jnp.arange(K, dtype=jnp.int32)
    page_R = jnp.arange(R, dtype=jnp.int32)
    offset_C = jnp.arange(C, dtype=jnp.int32)

    def body(i, carry):
        m_KBG, l_KBG, acc_KBGH = carry
        col_BR = first_page_B[:, None] + i * R + page_R[None, :]  # table columns
        live_BR = col_BR < pages_used_B[:, None]
        ids_BR = jnp.take_along_axis(tables_BW, jnp.minimum(col_BR, last_col_B[:, None]), axis=1)
        ids_BR = jnp.where(live_BR, jnp.clip(ids_BR, 0, P - 1), last_id_B[:, None])
        pos_BRC = col_BR[:, :, None] * C + offset_C[None, None, :]
        visible_BRC = (pos_BRC < lengths_B[:, None, None]) & (pos_BRC >= lo_B[:, None, None])
        # One gather each, [K, B, R, C, H] (the dots' batch axes (k, b) leading, so neither
        # dot transposes the chunk), straight from the (layer of the) pool: the layer is an
        # index of the gather, never a slice (which would copy the layer).
        at = (layer, head_K[:, None, None], ids_BR[None])
        # Quantized pools: page.astype(f32) * scale, the scales gathered with their pages.
        k_KBRCH = _quant.dequantize_gathered_heads_first(k_pages_LKPCH[at], k_scale, layer, ids_BR)
        v_KBRCH = _quant.dequantize_gathered_heads_first(v_pages_LKPCH[at], v_scale, layer, ids_BR)
        k_KBRCH = k_KBRCH.astype(dot_dtype)
        vis_1BRC1 = visible_BRC[None, :, :, :, None]
        v_KBRCH = jnp.where(vis_1BRC1, v_KBRCH, jnp.zeros((), kv_dtype)).astype(dot_dtype)

        s_KBGRC = jnp.einsum(
            "kbgh,kbrch->kbgrc", q_KBGH, k_KBRCH,
            precision=precision, preferred_element_type=jnp.float32,
        )  # fmt: skip
        s_KBGRC = s_KBGRC * jnp.float32(sm_scale)
        if logits_soft_cap is not None:
            cap = jnp.float32(logits_soft_cap)
            s_KBGRC = cap * jnp.tanh(s_KBGRC / cap)
        s_KBGRC = jnp.where(visible_BRC[None, :, None], s_KBGRC, -jnp.inf)

        m_new_KBG = jnp.maximum(m_KBG, jnp.max(s_KBGRC, axis=(-2, -1)))
        m_safe_KBG = jnp.where(m_new_KBG == -jnp.inf, 0.0, m_new_KBG)
        alpha_KBG = jnp.exp(m_KBG - m_safe_KBG)  # exp(-inf) = 0 before the first key
        p_KBGRC = jnp.exp(s_KBGRC - m_safe_KBG[..., None, None])  # masked -> 0
        l_KBG = alpha_KBG * l_KBG + jnp.sum(p_KBGRC, axis=(-2, -1))
        pv_KBGH = jnp.einsum(
            "kbgrc,kbrch->kbgh", p_KBGRC.astype(dot_dtype), v_KBRCH,
            precision=precision, preferred_element_type=jnp.float32,
        )  # fmt: skip
        acc_KBGH = alpha_KBG[..., None] * acc_KBGH + pv_KBGH
        return m_new_KBG, l_KBG, acc_KBGH

    init = (
        jnp.full((K, B, G), -jnp.inf, jnp.float32),
        jnp.zeros((K, B, G), jnp.float32),
        jnp.zeros((K, B, G, H), jnp.float32),
    )
    # A static trip count: no loop condition read back to the host (module docstring). A window
    # of w keys spans at most ceil(w / C) + 1 pages from each sequence's first visible one.
    steps = -(-W // R)
    if sliding_window is not None:
        steps = min(steps, -(-(-(-sliding_window // C) + 1) // R))
    _, l_KBG, acc_KBGH = jax.lax.fori_loop(0, steps, body, init)
    safe_l_KBG = jnp.where(l_KBG != 0, l_KBG, 1.0)
    o_KBGH = jnp.where(l_KBG[..., None] != 0, acc_KBGH / safe_l_KBG[..., None], 0.0)
    return o_KBGH.transpose(1, 0, 2, 3).reshape(B, N, H).astype(q_BNH.dtype)
