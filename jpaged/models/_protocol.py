"""The protocol between a model and the paged cache, so any Flax model can run on it.

A model that runs on jpaged's paged KV cache (and therefore under ``jpaged.LLM``) is a
Flax NNX module with:

- attributes ``num_layers``, ``num_kv_heads``, ``head_dim`` (the cache is allocated as
  ``[L, K, P, C, H]`` from them) and ``vocab_size``;
- ``__call__(tokens_T, positions_T, cache, metadata, *, decode=False) -> (logits_RV, cache)``:
  one forward for prefill, chunked prefill, decode and mixed batches. ``tokens_T`` and
  ``positions_T`` are a ragged batch of query tokens (sequence b owns rows
  ``metadata.cu_q_lens[b]:metadata.cu_q_lens[b+1]``; rows past ``cu_q_lens[num_seqs]`` are
  padding); it returns f32 logits for the rows ``metadata.logits_indices`` only, and the
  cache with this batch's K/V written into it.

Inside, each attention layer computes its q, k, v for the T tokens (RoPE or whatever position
scheme it likes) and calls ``paged_attention_layer(q_TNH, k_TKH, v_TKH, cache, layer,
metadata)``, which writes k, v into the slots ``metadata.slot_mapping`` of layer ``layer`` and
runs attention over the pages. Layers are best stacked and run with ``jax.lax.scan`` with
the cache as a carry and ``layer`` the scan index, so the pool is updated in place and
compile time does not grow with depth. ``examples/custom_model.py`` is a worked example.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jpaged._attention import paged_attention, ragged_paged_attention
from jpaged.kv.cache import write_kv_layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    """Where a ragged token batch lives in the paged cache (built by the engine each step).

    Attributes:
      slot_mapping: i32[T] cache slot (``page * C + offset``) of each token's K/V; -1 for
        padding rows (nothing is written).
      block_tables: i32[B, W] pages of each sequence, in order.
      kv_lens: i32[B] tokens in the cache per sequence after this batch is written (the new
        tokens included); 0 for padding sequences.
      cu_q_lens: i32[B + 1] cumulative query-token counts: sequence b owns rows
        ``cu_q_lens[b]:cu_q_lens[b + 1]``.
      num_seqs: i32[] live sequences; rows from ``cu_q_lens[num_seqs]`` on are padding.
      logits_indices: i32[R] rows whose logits the forward returns (usually each sequence's
        last row, R = B).
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array


class PagedModel(Protocol):
    """What ``jpaged`` needs from a model (see the module docstring)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def __call__(
        self,
        tokens_T: jax.Array,
        positions_T: jax.Array,
        cache: Any,
        metadata: AttentionMetadata,
        *,
        decode: bool = False,
    ) -> tuple[jax.Array, Any]: ...


def paged_attention_layer(
    q_TNH: jax.Array,
    k_TKH: jax.Array,
    v_TKH: jax.Array,
    cache: Any,
    layer: jax.Array | int,
    metadata: AttentionMetadata,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    decode: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, Any]:
    """Writes a batch's K/V into layer ``layer`` of the cache, then attends over the pages.

    Args:
      q_TNH: [T, N, H] queries (position encoding already applied).
      k_TKH: [T, K, H] new keys, written to ``metadata.slot_mapping``.
      v_TKH: [T, K, H] new values.
      cache: a ``jpaged.PagedKVCache`` (``k_pages``/``v_pages`` [L, K, P, C, H]).
      layer: the layer index (int, or i32[] inside a scan).
      metadata: the batch's ``AttentionMetadata``.
      sm_scale: logit scale, default ``1 / sqrt(H)``.
      sliding_window: if set, a query sees only the last ``sliding_window`` keys.
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      decode: static; True when every sequence has exactly one query token and T == B
        (uses the decode kernel, ``jpaged.paged_attention``).
      implementation: forwarded to the attention op (None: auto).

    Returns:
      ``(o_TNH, cache)``: attention output [T, N, H] in ``q_TNH.dtype`` (zeros for padding
      rows) and the updated cache.
    """
    k_TKH = k_TKH.astype(cache.k_pages.dtype)
    v_TKH = v_TKH.astype(cache.v_pages.dtype)
    cache = write_kv_layer(cache, layer, k_TKH, v_TKH, metadata.slot_mapping)
    layer = jnp.asarray(layer, jnp.int32)
    q_TNH_cache = q_TNH.astype(cache.k_pages.dtype)
    common = dict(
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        layer=layer,
        implementation=implementation,
    )
    if decode:
        out = paged_attention(
            q_TNH_cache, cache.k_pages, cache.v_pages, metadata.block_tables, metadata.kv_lens,
            **common,
        )  # fmt: skip
    else:
        out = ragged_paged_attention(
            q_TNH_cache, cache.k_pages, cache.v_pages, metadata.block_tables, metadata.kv_lens,
            metadata.cu_q_lens, metadata.num_seqs, **common,
        )  # fmt: skip
    return out.astype(q_TNH.dtype), cache
