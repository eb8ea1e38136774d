"""Plain-jnp f32 reference of ragged paged attention (the oracle of every implementation).

Written for clarity, not speed: it gathers each sequence's whole K/V ([B, W*C, K, H]) and each
query row's copy of it ([T, W*C, K, H]). Use ``xla.ragged_paged_attention_xla`` for real sizes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _quant
from pallas_kernels.ragged_paged_attention import sanitize, schedule, validate


def ragged_paged_attention_reference(
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
) -> jax.Array:
    """Attention of a ragged batch of query rows over a paged KV cache, in f32.

    Args:
      q: [T, N, H]; the rows of sequence b are ``q[cu_q_lens[b]:cu_q_lens[b+1]]``.
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W]; only the first ``ceil(kv_lens[b] / C)`` entries are read.
      kv_lens: i32[B] keys per sequence, the new query tokens' own included.
      cu_q_lens: i32[B + 1] cumulative query lengths.
      num_seqs: i32[] or i32[1] live sequences.
      sm_scale: logit scale, default ``1 / sqrt(H)``.
      causal: row i of sequence b (position ``kv_lens[b] - q_len_b + i``) sees keys at
        positions <= its own; if False it sees all ``kv_lens[b]`` keys.
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      sliding_window: if set, a row at position p sees keys j with ``p - j < sliding_window``.
      layer: layer index into a 5-D pool.
      k_scale: for quantized pages (fp8, int8) f32 broadcastable to [K, P, C] (5-D pool:
        [L or 1, K, P, C]); attention reads ``k_pages.astype(f32) * k_scale``.
      v_scale: like ``k_scale``, for ``v_pages``.

    Returns:
      [T, N, H] in ``q.dtype``; padding rows (from ``cu_q_lens[num_seqs]`` on) and rows that
      see no key are zeros, and every row when a value is invalid (``sanitize.py``).

    Raises:
      ValueError: on inconsistent shapes or dtypes (``validate.validate_static``).

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((3, 2, 4)); kv = jnp.ones((1, 2, 2, 4))
    >>> ragged_paged_attention_reference(q, kv, kv, jnp.array([[1, 0]], jnp.int32),
    ...     jnp.array([3], jnp.int32), jnp.array([0, 3], jnp.int32), jnp.array(1, jnp.int32)).shape
    (3, 2, 4)
    """
    validate.validate_static(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, layer=layer,
        causal=causal, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    # Invalid values get the result every implementation gives (sanitize.py).
    block_tables, kv_lens, cu_q_lens, num_seqs, layer = sanitize.sanitize(
        block_tables, kv_lens, cu_q_lens, num_seqs, layer,
        num_rows=q.shape[0], k_pages_shape=k_pages.shape,
    )  # fmt: skip
    k_scale, v_scale = _quant.canonical_scales(k_pages, k_scale, v_scale)
    T, N, H = q.shape
    K, P, C, _ = k_pages.shape[-4:]
    G = N // K
    B, W = block_tables.shape
    S = W * C
    scale = 1.0 / math.sqrt(H) if sm_scale is None else float(sm_scale)
    f32 = jnp.float32

    tm = schedule.token_map(kv_lens, cu_q_lens, num_seqs, T)
    pages_BW = schedule.clamped_pages(block_tables, kv_lens, C, P)
    # [B, W, K, C, H] (quantized: * scale in f32) -> [B, S, K, H]
    k_BSKH = _quant.dequantize_gathered(
        schedule.gather_pages(k_pages, layer, pages_BW), k_scale, layer, pages_BW
    ).transpose(0, 1, 3, 2, 4)
    v_BSKH = _quant.dequantize_gathered(
        schedule.gather_pages(v_pages, layer, pages_BW), v_scale, layer, pages_BW
    ).transpose(0, 1, 3, 2, 4)
    k_BSKH = k_BSKH.reshape(B, S, K, H).astype(f32)
    v_BSKH = v_BSKH.reshape(B, S, K, H).astype(f32)
    j_S = jnp.arange(S, dtype=jnp.int32)
    in_len_BS = j_S[None, :] < kv_lens[:, None]
    # Mask values, not only scores: stale/NaN keys past a length must not reach the output.
    k_BSKH = jnp.where(in_len_BS[:, :, None, None], k_BSKH, 0.0)
    v_BSKH = jnp.where(in_len_BS[:, :, None, None], v_BSKH, 0.0)

    q_TKGH = q.astype(f32).reshape(T, K, G, H)
    k_TSKH = k_BSKH[tm.seq_T]
    v_TSKH = v_BSKH[tm.seq_T]
    s_TKGS = jnp.einsum("tkgh,tskh->tkgs", q_TKGH, k_TSKH, precision="highest") * scale
    if logits_soft_cap is not None:
        s_TKGS = logits_soft_cap * jnp.tanh(s_TKGS / logits_soft_cap)
    pos_T = tm.pos_T[:, None]
    visible_TS = (j_S[None, :] < kv_lens[tm.seq_T][:, None]) & tm.valid_T[:, None]
    if causal:
        visible_TS &= j_S[None, :] <= pos_T
    if sliding_window is not None:
        visible_TS &= pos_T - j_S[None, :] < sliding_window
    s_TKGS = jnp.where(visible_TS[:, None, None, :], s_TKGS, -jnp.inf)
    m_TKG1 = jnp.max(s_TKGS, axis=-1, keepdims=True)
    m_TKG1 = jnp.where(jnp.isfinite(m_TKG1), m_TKG1, 0.0)
    p_TKGS = jnp.exp(s_TKGS - m_TKG1)
    l_TKG1 = jnp.sum(p_TKGS, axis=-1, keepdims=True)
    o_TKGH = jnp.einsum("tkgs,tskh->tkgh", p_TKGS, v_TSKH, precision="highest")
    o_TKGH = jnp.where(l_TKG1 != 0, o_TKGH / jnp.where(l_TKG1 != 0, l_TKG1, 1.0), 0.0)
    return o_TKGH.reshape(T, N, H).astype(q.dtype)
