"""The order the ragged kernel's CTAs take the query tiles in (an on-device sort)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._gpu import order
from pallas_kernels.ragged_paged_attention import schedule
from pallas_kernels.ragged_paged_attention._gpu_config import _Config

# The longest-first tile order is one single-operand sort of packed int32 keys
# (``_longest_first_order``), so the kernel reads the tile as ``key & (2**bits - 1)``; an order
# of more than ``_ORDER_MAX_LEN`` entries (tiles and the paired sentinel) holds plain indices.
_ORDER_MAX_LEN = 1 << 16


def _order_index_bits(cfg: _Config, length: int) -> int | None:
    """Low bits holding the tile in the order's entries, for an order of ``length`` entries
    (the tiles, plus the paired sentinel where there is one): packed longest-first keys need
    the largest entry, ``length - 1``; None where the entries are plain tile indices (other
    orders, or more than ``_ORDER_MAX_LEN`` entries). Host and kernel both call this on the
    same static length, so they agree on the encoding."""
    if cfg.tile_order != "longest_first" or length > _ORDER_MAX_LEN:
        return None
    return max(1, (length - 1).bit_length())


def _longest_first_order(work_NT, real_NT, bits: int | None) -> jax.Array:
    """Tiles by decreasing ``work``, ties in index order, tiles not ``real`` last: the stable
    ``argsort(-where(real, work, -1))``, as packed keys when ``bits`` (else those indices).

    Keys: ``(top - w) << bits | tile`` with ``w = clip(where(real, work, -1), -1, top)`` and
    ``top = 2**(31 - bits) - 2``, sorted by one single-operand ``lax.sort``; the tile is
    ``key & (2**bits - 1)``. ``(top - w) << bits`` stays below 2**31 (no int32 overflow).
    ``work`` is in tokens: with ``bits = 16`` (2**16 entries) ``top`` is 0x7FFE, 32k tokens;
    with 2**9 entries (decode-heavy batches of ~256 sequences) it is 4M. Work past ``top``
    ties (index order), acceptable for scheduling. The tile takes only the bits the order
    needs, not the decode kernel's fixed 16: work here is in tokens, and 15 bits would tie
    every decode past 32k tokens. Real tiles with work < -1 (only from invalid lengths,
    kv_len < q_len) tie with the empty tiles instead of sorting after them. Why packed keys:
    ``pallas_kernels._gpu.order`` (measured on the decode kernel, not on this one).
    """
    if bits is None:
        return jnp.argsort(-jnp.where(real_NT, work_NT, -1)).astype(jnp.int32)
    top = (1 << (31 - bits)) - 2  # largest work kept apart; the empty tiles' key is top + 1
    w = jnp.clip(jnp.where(real_NT, work_NT, -1), -1, top).astype(jnp.int32)
    tile = jnp.arange(work_NT.shape[0], dtype=jnp.int32)
    return order.sort_keys(order.pack(w, tile, bits, top))


def pair_long_with_short(order_NT, num_real) -> jax.Array:
    """``order`` with its first ``num_real`` entries (the real tiles, longest first within a
    sequence or over the batch) interleaved from both ends: the first, the last, the second,
    the second to last, ... (the empty tiles after them stay in place). The persistent grid
    deals consecutive pairs to its CTAs (``_gpu_tile._persistent_items``): a long tile and a
    short one, about the same work in every pair.

    order_NT: i32[NT], the tiles' order (or packed keys: entries are only moved).
    num_real: i32[], how many leading entries are real tiles.
    """
    k = jnp.arange(order_NT.shape[0], dtype=jnp.int32)
    half = k // 2
    src = jnp.where(k % 2 == 0, half, num_real - 1 - half)
    return order_NT[jnp.where(k < num_real, src, k)]


def _tile_order(
    cfg: _Config, ts: schedule.TileSchedule, B: int, sentinel: bool = False
) -> jax.Array:
    """The order CTAs take the query tiles in (an on-device sort; empty tiles last).

    ``longest_first``: the tiles with the most K/V to visit first (``work``, in tokens), over
    the whole batch (the best tail when tiles are few, as in decode-heavy batches); the
    entries are packed sort keys (``_longest_first_order``: one single-operand sort instead of
    a negate and a two-operand argsort) that the kernel decodes with ``_order_index_bits``.
    ``by_sequence``: sequence by sequence, longest first within each, so the CTAs running at
    once share one sequence's K/V in L2 (long prefills); a lexsort (three fields: sequence,
    work and tile do not fit one int32 key without tying long tiles). ``index``: schedule
    order. With ``persistent`` the real tiles are then paired long with short
    (``pair_long_with_short``). ``sentinel``: one more entry, ``NT``, for the paired grid's inert unit (it is
    below ``2**bits``, so it decodes to itself).
    """
    NT = ts.seq.shape[0]
    if cfg.tile_order == "index":
        order = jnp.arange(NT, dtype=jnp.int32)
    else:
        work = jnp.minimum(ts.kv_len, ts.pos0 + ts.q_rows) if cfg.causal else ts.kv_len
        if cfg.sliding_window is not None:  # keys before the first row's window are never read
            work = work - jnp.maximum(ts.pos0 - cfg.sliding_window + 1, 0)
        real = ts.q_rows > 0
        if cfg.tile_order == "longest_first":
            bits = _order_index_bits(cfg, NT + int(sentinel))
            order = _longest_first_order(work, real, bits)
        else:
            order = jnp.lexsort((-work, jnp.where(real, ts.seq, B))).astype(jnp.int32)
    if cfg.persistent:
        order = pair_long_with_short(order, jnp.sum(ts.q_rows > 0, dtype=jnp.int32))
    if sentinel:
        order = jnp.concatenate([order, jnp.full((1,), NT, jnp.int32)])
    return order
