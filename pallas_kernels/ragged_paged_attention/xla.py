"""Ragged paged attention in plain XLA: query tiles x KV chunks with an online softmax.

Memory-lean (never a dense [T, S] score matrix over the pool): the query rows are cut into
tiles of ``block_q`` rows of one sequence each (metadata computed on device,
``schedule.tile_schedule``), and a loop walks KV chunks of ``pages_per_chunk`` pages, gathering
for every tile only its own sequence's pages of that chunk, from the tile's first visible key on
(a sliding window's start). The trip count is static, ``ceil(W / pages_per_chunk)`` (with a
causal window, the chunks its span can touch when fewer): a trip count from the lengths would be
a ``while_loop`` whose condition XLA on GPU reads back to the host every iteration. Slots past a
tile's last page are redirected to that page, so idle steps re-read one page (from L2), never
the rest of the table. Math is f32, so the result is exact to f32 rounding against the
reference. Shapes are static in (T, B, W) and ``num_seqs`` is dynamic: one compile serves every
batch.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _quant
from pallas_kernels.ragged_paged_attention import schedule, validate

_F32 = jnp.float32


def default_block_q(num_tokens: int, num_seqs_max: int) -> int:
    """Rows per query tile: about the mean query length, a power of two in [1, 16].

    Decode-only batches (T ~ B) get 1-row tiles (no wasted rows); prefill gets 16.
    """
    mean = max(1, num_tokens // max(1, num_seqs_max))
    return min(16, 1 << (mean.bit_length() - 1))


def default_pages_per_chunk(page_size: int, block_kv: int = 128) -> int:
    """Pages per KV chunk: about ``block_kv`` keys, at least one page."""
    return max(1, block_kv // page_size)


def unsupported_reason(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    **kwargs: Any,
) -> str | None:
    """The XLA implementation runs every validated input: always None."""
    del q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, kwargs
    return None


def ragged_paged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    causal: bool = True,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    block_q: int | None = None,
    pages_per_chunk: int | None = None,
) -> jax.Array:
    """Ragged paged attention with XLA ops; semantics of ``reference``.

    Args:
      q: [T, N, H].
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W].
      kv_lens: i32[B].
      cu_q_lens: i32[B + 1].
      num_seqs: i32[] or i32[1].
      sm_scale: logit scale (already resolved to a float).
      causal, logits_soft_cap, sliding_window: as in ``reference``.
      layer: None, an int or an i32[] array (traced: no recompile per layer).
      k_scale: quantized (fp8, int8) pages: f32 broadcastable to [K, P, C] ([L or 1, K, P, C]
        with a 5-D pool); each gathered page is dequantized to ``page.astype(f32) * scale``.
      v_scale: like ``k_scale``, for ``v_pages``.
      block_q: rows per query tile (default ``default_block_q(T, B)``).
      pages_per_chunk: pages per KV chunk (default about 128 keys).

    Returns:
      [T, N, H] in ``q.dtype``; padding rows are zeros.
    """
    T = q.shape[0]
    B = block_tables.shape[0]
    C = k_pages.shape[-2]
    if block_q is None:
        block_q = default_block_q(T, B)
    if pages_per_chunk is None:
        pages_per_chunk = default_pages_per_chunk(C)
    if block_q < 1 or pages_per_chunk < 1:
        raise ValueError(f"{block_q=} and {pages_per_chunk=} must be >= 1")
    if layer is not None:
        layer = schedule.layer_scalar(layer)
    k_scale, v_scale = _quant.canonical_scales(k_pages, k_scale, v_scale)
    return _ragged_xla(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, layer, k_scale, v_scale,
        **validate.static_options(
            sm_scale=sm_scale, causal=causal, logits_soft_cap=logits_soft_cap,
            sliding_window=sliding_window,
        ),
        block_q=int(block_q), pages_per_chunk=int(pages_per_chunk),
    )  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "causal", "logits_soft_cap", "sliding_window", "block_q", "pages_per_chunk",
    ),
)  # fmt: skip
def _ragged_xla(
    q_TNH, k_pages, v_pages, block_tables_BW, kv_lens_B, cu_q_lens, num_seqs, layer, k_scale,
    v_scale, *, sm_scale, causal, logits_soft_cap, sliding_window, block_q, pages_per_chunk,
):  # fmt: skip
    T, N, H = q_TNH.shape
    K, P, C, _ = k_pages.shape[-4:]
    G = N // K
    W = block_tables_BW.shape[1]
    Tq, pc = block_q, pages_per_chunk
    Sc = pc * C

    tm = schedule.token_map(kv_lens_B, cu_q_lens, num_seqs, T)
    ts = schedule.tile_schedule(kv_lens_B, cu_q_lens, num_seqs, num_tokens=T, block_q=Tq, tmap=tm)
    NT = ts.seq.shape[0]
    row_Q = jnp.arange(Tq, dtype=jnp.int32)
    row_ok_IQ = row_Q[None, :] < ts.q_rows[:, None]
    q_rows_IQ = jnp.clip(ts.q_start[:, None] + row_Q[None, :], 0, T - 1)
    # [NT, Tq, N, H] -> [NT, K, Tq, G, H]
    q_IKQGH = q_TNH[q_rows_IQ].astype(_F32).reshape(NT, Tq, K, G, H).transpose(0, 2, 1, 3, 4)
    q_IKQGH = q_IKQGH * jnp.asarray(sm_scale, _F32)
    pos_IQ = ts.pos0[:, None] + row_Q[None, :]
    kv_len_I = ts.kv_len
    npages_I = (kv_len_I + C - 1) // C
    last_slot_I = jnp.clip(npages_I - 1, 0, W - 1)
    seq_tables_IW = block_tables_BW[ts.seq]

    # Each tile's first chunk (a window's start; 0 without one): step c reads chunk first + c.
    if sliding_window is not None:
        first_I = jnp.maximum(ts.pos0 - sliding_window + 1, 0) // Sc
    else:
        first_I = jnp.zeros_like(kv_len_I)

    def body(c, carry):
        m_IKQG, l_IKQG, acc_IKQGH = carry
        chunk_I = first_I + c
        slot_Ip = chunk_I[:, None] * pc + jnp.arange(pc, dtype=jnp.int32)[None, :]
        slot_Ip = jnp.minimum(slot_Ip, last_slot_I[:, None])
        pages_Ip = jnp.clip(jnp.take_along_axis(seq_tables_IW, slot_Ip, axis=1), 0, P - 1)
        key_IS = chunk_I[:, None] * Sc + jnp.arange(Sc, dtype=jnp.int32)[None, :]
        in_len_IS = key_IS < kv_len_I[:, None]

        def load(pool, scale):
            x = schedule.gather_pages(pool, layer, pages_Ip)  # [NT, pc, K, C, H]
            x = _quant.dequantize_gathered(x, scale, layer, pages_Ip)  # quantized: * scale, f32
            x = x.transpose(0, 2, 1, 3, 4).reshape(NT, K, Sc, H).astype(_F32)
            return jnp.where(in_len_IS[:, None, :, None], x, 0.0)

        k_IKSH = load(k_pages, k_scale)
        v_IKSH = load(v_pages, v_scale)
        s = jnp.einsum("ikqgh,iksh->ikqgs", q_IKQGH, k_IKSH, precision="highest")
        if logits_soft_cap is not None:
            s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
        vis_IQS = in_len_IS[:, None, :] & row_ok_IQ[:, :, None]
        if causal:
            vis_IQS &= key_IS[:, None, :] <= pos_IQ[:, :, None]
        if sliding_window is not None:
            vis_IQS &= pos_IQ[:, :, None] - key_IS[:, None, :] < sliding_window
        s = jnp.where(vis_IQS[:, None, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_IKQG, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m_IKQG - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l_new = alpha * l_IKQG + jnp.sum(p, axis=-1)
        pv = jnp.einsum("ikqgs,iksh->ikqgh", p, v_IKSH, precision="highest")
        return m_new, l_new, alpha[..., None] * acc_IKQGH + pv

    init = (
        jnp.full((NT, K, Tq, G), -jnp.inf, _F32),
        jnp.zeros((NT, K, Tq, G), _F32),
        jnp.zeros((NT, K, Tq, G, H), _F32),
    )
    # A static trip count: no loop condition read back to the host (module docstring). With a
    # causal window a tile's keys span at most w + Tq - 1 positions from its first chunk's start.
    steps = -(-W // pc)
    if sliding_window is not None and causal:
        steps = min(steps, -(-(sliding_window + Tq - 1) // Sc) + 1)
    _, l_IKQG, acc_IKQGH = jax.lax.fori_loop(0, steps, body, init)
    l_safe = jnp.where(l_IKQG != 0, l_IKQG, 1.0)
    o_IKQGH = jnp.where(l_IKQG[..., None] != 0, acc_IKQGH / l_safe[..., None], 0.0)
    o_rows = o_IKQGH.transpose(0, 2, 1, 3, 4).reshape(NT * Tq, N, H)
    o_TNH = o_rows[ts.tile_T * Tq + ts.row_T]
    return jnp.where(tm.valid_T[:, None, None], o_TNH, 0.0).astype(q_TNH.dtype)
