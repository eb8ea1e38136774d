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
import numpy as np

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
      local_slot_mapping: a pool of two page groups (`jpaged.kv.page_groups`): i32[T] the
        local group's slots of each token, written by the sliding-window layers
        (``slot_mapping`` and ``block_tables`` are then the global group's); None otherwise.
      local_block_tables: with ``local_slot_mapping``, i32[B, W] the local group's pages of
        each sequence; None otherwise.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    local_slot_mapping: jax.Array | None = None
    local_block_tables: jax.Array | None = None

    @property
    def grouped(self) -> bool:
        """Whether the batch runs on a pool of two page groups (static)."""
        return self.local_block_tables is not None

    def local_group(self) -> AttentionMetadata:
        """The metadata a sliding-window layer of a grouped pool reads and writes: the local
        group's slots and tables in place of the global group's."""
        return dataclasses.replace(
            self, slot_mapping=self.local_slot_mapping, block_tables=self.local_block_tables
        )


def batch_metadata(
    block_tables: Any,
    cached_lens: Any,
    query_lens: Any,
    page_size: int,
    *,
    num_tokens: int | None = None,
) -> tuple[np.ndarray, AttentionMetadata]:
    """The positions and `AttentionMetadata` of a ragged batch, for running a model on the
    paged cache by hand (``jpaged.LLM`` builds its own).

    Sequence b already holds ``cached_lens[b]`` tokens in its pages and adds
    ``query_lens[b]`` new ones this step; its rows are ``cu_q_lens[b]:cu_q_lens[b + 1]``.

    Args:
      block_tables: i32[B, W] the pages of each sequence, in order.
      cached_lens: [B] tokens already in the cache per sequence.
      query_lens: [B] new tokens per sequence this step (>= 1 each).
      page_size: C, tokens per page.
      num_tokens: T, rows of the batch (padding rows past the new tokens write nothing);
        default the number of new tokens. A fixed T keeps one compiled shape across steps.

    Returns:
      ``(positions_T, metadata)``: i32[T] the position of each row (0 for padding) and the
      metadata, whose ``logits_indices`` pick each sequence's last row.

    Raises:
      ValueError: mismatched lengths, a query length below 1, more tokens than the block
        table's pages hold, or ``num_tokens`` below the number of new tokens.

    >>> pos, meta = batch_metadata([[3, 1, 5]], [2], [3], page_size=2, num_tokens=4)
    >>> pos.tolist(), meta.slot_mapping.tolist(), meta.kv_lens.tolist()
    ([2, 3, 4, 0], [2, 3, 10, -1], [5])
    """
    tables = np.asarray(block_tables, np.int32)
    cached = np.asarray(cached_lens, np.int64).reshape(-1)
    query = np.asarray(query_lens, np.int64).reshape(-1)
    if tables.ndim != 2 or not len(cached) == len(query) == tables.shape[0]:
        raise ValueError(
            f"block_tables [B, W], cached_lens [B] and query_lens [B] must agree on B; got "
            f"{tables.shape}, {cached.shape}, {query.shape}"
        )
    if (query < 1).any() or (cached < 0).any():
        raise ValueError("query_lens must be >= 1 and cached_lens >= 0 for every sequence")
    capacity = tables.shape[1] * page_size
    if (cached + query > capacity).any():
        raise ValueError(f"a sequence exceeds its block table's {capacity} token slots")
    total = int(query.sum())
    rows = total if num_tokens is None else int(num_tokens)
    if rows < total:
        raise ValueError(f"num_tokens={rows} is below the {total} new tokens")
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, query, strict=True)])
    seq_of_row = np.repeat(np.arange(len(query)), query)
    slots = tables[seq_of_row, positions // page_size] * page_size + positions % page_size
    cu = np.concatenate([[0], np.cumsum(query)]).astype(np.int32)
    metadata = AttentionMetadata(
        slot_mapping=np.pad(slots, (0, rows - total), constant_values=-1).astype(np.int32),
        block_tables=tables,
        kv_lens=(cached + query).astype(np.int32),
        cu_q_lens=cu,
        num_seqs=np.array(len(query), np.int32),
        logits_indices=cu[1:] - 1,
    )
    return np.pad(positions, (0, rows - total)).astype(np.int32), metadata


class PagedModel(Protocol):
    """What ``jpaged`` needs from a model (see the module docstring). Optional: a class
    attribute ``supports_page_groups = True`` declares that the model reads
    ``AttentionMetadata.local_group()`` for its sliding-window layers and indexes the pool by
    each layer's place within its group; only such a model of mixed windowed and
    full-attention layers gets a pool of two page groups (others keep one, releasing nothing).
    """

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
      cache: a ``jpaged.PagedKVCache`` (``k_pages``/``v_pages`` [L, K, P, C, H]); a quantized
        one (fp8 / int8) quantizes the new K/V as it writes them (a scale per token and KV
        head, ``jpaged.kv.quantize.quantize_tokens``) and the attention ops read its pages
        with its ``k_scale`` / ``v_scale`` [L, K, P, C].
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
    quantized = bool(getattr(cache, "scales", None))
    if not quantized:  # a quantized pool quantizes the floating K/V itself, scales included
        k_TKH = k_TKH.astype(cache.k_pages.dtype)
        v_TKH = v_TKH.astype(cache.v_pages.dtype)
    cache = write_kv_layer(cache, layer, k_TKH, v_TKH, metadata.slot_mapping)
    layer = jnp.asarray(layer, jnp.int32)
    # Queries meet floating pages in the pool's dtype; quantized pages are dequantized to f32
    # by the ops, so the queries keep the model's dtype.
    q_TNH_cache = q_TNH if quantized else q_TNH.astype(cache.k_pages.dtype)
    common = dict(
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        layer=layer,
        implementation=implementation,
        **(cache.scales if quantized else {}),
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
