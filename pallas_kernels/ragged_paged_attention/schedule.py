"""On-device metadata for ragged batches: token -> sequence, query tiles, clamped page ids.

Everything here is plain ``jnp`` over static shapes (T, B, W) with a dynamic ``num_seqs``, so
it runs inside ``jit`` with no host sync and one compile serves every batch. Only the first
``num_seqs + 1`` entries of ``cu_q_lens`` and the first ``num_seqs`` of ``kv_lens`` are read;
entries past them may hold anything.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

_BIG = jnp.iinfo(jnp.int32).max


def num_seqs_scalar(num_seqs: jax.Array, B: int) -> jax.Array:
    return jnp.clip(jnp.reshape(num_seqs, ()).astype(jnp.int32), 0, B)


class TokenMap(NamedTuple):
    """Where each query row belongs.

    Attributes:
      seq_T: i32[T] sequence of each row (clamped to [0, B - 1] for padding rows).
      valid_T: bool[T] True for rows before ``cu_q_lens[num_seqs]``.
      offset_T: i32[T] index of the row within its sequence's query tokens.
      pos_T: i32[T] position of the row in its sequence (``kv_len - q_len + offset``).
    """

    seq_T: jax.Array
    valid_T: jax.Array
    offset_T: jax.Array
    pos_T: jax.Array


def token_map(
    kv_lens_B: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int
) -> TokenMap:
    """Maps each of the T query rows to its sequence and position.

    Args:
      kv_lens_B: i32[B].
      cu_q_lens: i32[B + 1].
      num_seqs: i32[] or i32[1].
      num_tokens: T, the static number of rows of q.
    """
    B = kv_lens_B.shape[0]
    ns = num_seqs_scalar(num_seqs, B)
    b1 = jnp.arange(1, B + 1, dtype=jnp.int32)
    # Ends of the live sequences; dead entries pushed past every row so they are never found.
    ends_B = jnp.where(b1 <= ns, cu_q_lens[1:], _BIG)
    t_T = jnp.arange(num_tokens, dtype=jnp.int32)
    # compare_all: one fused [T, B] comparison; the default binary search is a loop of tiny
    # ops, which on GPU costs launch latency on every call.
    seq_T = jnp.searchsorted(ends_B, t_T, side="right", method="compare_all").astype(jnp.int32)
    valid_T = (t_T < cu_q_lens[ns]) & (t_T >= cu_q_lens[0]) & (seq_T < ns)
    seq_T = jnp.minimum(seq_T, B - 1)
    start_T = cu_q_lens[seq_T]
    q_len_T = cu_q_lens[seq_T + 1] - start_T
    offset_T = t_T - start_T
    pos_T = kv_lens_B[seq_T] - q_len_T + offset_T
    return TokenMap(seq_T=seq_T, valid_T=valid_T, offset_T=offset_T, pos_T=pos_T)


def num_tiles_bound(num_tokens: int, num_seqs_max: int, block_q: int) -> int:
    """Static upper bound on the number of query tiles: sum_b ceil(q_len_b / block_q).

    At most ``min(B, T)`` sequences are non-empty and each wastes at most ``block_q - 1`` rows.
    """
    nonempty = min(num_seqs_max, num_tokens)
    return max(1, (num_tokens + nonempty * (block_q - 1)) // block_q)


class TileSchedule(NamedTuple):
    """Query tiles of ``block_q`` consecutive rows of one sequence each.

    Attributes:
      seq: i32[NT] sequence of each tile (clamped to [0, B - 1] for empty tiles).
      q_start: i32[NT] first row of q in the tile.
      q_rows: i32[NT] number of real rows (0 for the empty tiles past the last one).
      pos0: i32[NT] position of the tile's first row in its sequence.
      kv_len: i32[NT] ``kv_lens`` of the tile's sequence (0 for empty tiles).
      num_tiles: i32[] number of non-empty tiles.
      tile_T: i32[T] tile holding each row of q (meaningful for valid rows only); None when
        not asked for (``token_rows=False``).
      row_T: i32[T] row of each q row within its tile; None likewise.
      pad_start: i32[NT] for each empty tile ``j`` (counting from ``num_tiles``), the first row
        of the ``j``-th ``block_q``-row chunk of the padding ``[cu_q_lens[num_seqs], T)``, or
        T when the chunk starts past T (also T for the real tiles).
    """

    seq: jax.Array
    q_start: jax.Array
    q_rows: jax.Array
    pos0: jax.Array
    kv_len: jax.Array
    num_tiles: jax.Array
    tile_T: jax.Array | None
    row_T: jax.Array | None
    pad_start: jax.Array


def tile_schedule(
    kv_lens_B: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    num_tokens: int,
    block_q: int,
    tmap: TokenMap | None = None,
    extra_tiles: int = 0,
    token_rows: bool = True,
) -> TileSchedule:
    """Splits each live sequence's query rows into tiles of ``block_q`` rows.

    The number of tiles NT is the static bound ``num_tiles_bound(T, B, block_q)`` plus
    ``extra_tiles``; tiles past the real ones have ``q_rows == 0``. Two extra tiles make the
    empty ones cover the padding rows in ``block_q`` chunks (``pad_start``): a kernel that
    writes its output in place can zero the padding with them.
    """
    B = kv_lens_B.shape[0]
    NT = num_tiles_bound(num_tokens, B, block_q) + extra_tiles
    ns = num_seqs_scalar(num_seqs, B)
    live_B = jnp.arange(B, dtype=jnp.int32) < ns
    q_len_B = jnp.where(live_B, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    q_len_B = jnp.maximum(q_len_B, 0)
    tiles_B = (q_len_B + block_q - 1) // block_q
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles_B, dtype=jnp.int32)])
    i_NT = jnp.arange(NT, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_tiles[1:], i_NT, side="right", method="compare_all").astype(jnp.int32)
    real = seq < ns
    seq = jnp.minimum(seq, B - 1)
    local = i_NT - cu_tiles[seq]
    q_start = cu_q_lens[seq] + local * block_q
    q_rows = jnp.where(real, jnp.clip(q_len_B[seq] - local * block_q, 0, block_q), 0)
    kv_len = jnp.where(real, kv_lens_B[seq], 0)
    pos0 = kv_len - q_len_B[seq] + local * block_q
    tile_T = row_T = None
    if token_rows:
        if tmap is None:
            tmap = token_map(kv_lens_B, cu_q_lens, num_seqs, num_tokens)
        tile_T = jnp.clip(cu_tiles[tmap.seq_T] + tmap.offset_T // block_q, 0, NT - 1)
        row_T = tmap.offset_T % block_q
    pad_start = jnp.where(real, num_tokens, cu_q_lens[ns] + (i_NT - cu_tiles[-1]) * block_q)
    return TileSchedule(
        seq=seq,
        q_start=jnp.where(real, q_start, 0),
        q_rows=q_rows,
        pos0=pos0,
        kv_len=kv_len,
        num_tiles=cu_tiles[-1],
        tile_T=tile_T,
        row_T=row_T,
        pad_start=jnp.minimum(pad_start, num_tokens),
    )


def clamped_pages(
    block_tables_BW: jax.Array, kv_lens_B: jax.Array, page_size: int, num_pages: int
) -> jax.Array:
    """Block tables with every slot past a sequence's last page replaced by its last page.

    Also clips ids to [0, P) so that a gather never reads outside the pool. Slots a sequence
    does not use may then point at real pages of others: callers mask those keys by length.

    Returns:
      i32[B, W].
    """
    W = block_tables_BW.shape[1]
    npages_B = (kv_lens_B + page_size - 1) // page_size
    last_B = jnp.clip(npages_B - 1, 0, W - 1)
    slot_BW = jnp.minimum(jnp.arange(W, dtype=jnp.int32)[None, :], last_B[:, None])
    pages = jnp.take_along_axis(block_tables_BW, slot_BW, axis=1)
    return jnp.clip(pages, 0, num_pages - 1)


def layer_scalar(layer: Any) -> jax.Array:
    """A layer index (an int or an integer scalar / 1-element array) as i32[]."""
    return jnp.asarray(layer, jnp.int32).reshape(())


def gather_pages(pages_pool: jax.Array, layer: Any, page_ids: jax.Array) -> jax.Array:
    """Gathers whole pages of one layer: only the requested pages are read.

    Args:
      pages_pool: [K, P, C, H], or [L, K, P, C, H] with ``layer`` (never sliced: a layer slice
        of a stacked pool inside a loop would copy the whole layer).
      layer: None, an int or an integer scalar array.
      page_ids: i32[...] page ids, already in [0, P).

    Returns:
      [..., K, C, H] (page_ids' shape first).
    """
    if pages_pool.ndim == 5:
        # Advanced indices first: [..., K, C, H].
        return pages_pool[layer_scalar(layer), :, page_ids]
    return jnp.moveaxis(pages_pool[:, page_ids], 0, -3)
