"""Per-warpgroup device code of the Mosaic GPU ragged kernel (``kernel_gpu``), shared by both
bodies: a warpgroup's work unit (``_Tile``), its page copies, masks, Q load and output store."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._gpu.config import LSE_COLS, ROWS
from pallas_kernels._gpu.pages import copy_pages
from pallas_kernels.ragged_paged_attention._gpu_config import _Config
from pallas_kernels.ragged_paged_attention._gpu_order import _order_index_bits


def _compute_registers(num_compute_wgs: int) -> int:
    """setmaxnreg of a compute warpgroup beside the producer (1 or 2 of them, 128 threads
    each, share the 64K registers with it)."""
    return 232 if num_compute_wgs == 2 else 240


@dataclasses.dataclass(frozen=True)
class _Tile:
    """What one warpgroup knows about its work unit (a query tile x KV head ``h``, or with
    ``kv_splits`` one split of the tile's K/V range), shared by both kernel bodies."""

    wg: Any  # this warpgroup's index (0 without warp specialization)
    cwg: Any  # compute warpgroup index (the producer's is clamped; unused)
    seq: Any
    ntok: Any  # real query tokens in the tile (0: empty tile)
    pos0: Any  # position of the tile's first token
    kv_len: Any
    t_lo: Any  # first K/V tile visited
    n: Any  # K/V tiles visited
    n_full: Any  # leading tiles every row sees entirely (no mask)
    last_page: Any
    head_base: Any
    q_row: Any  # first row of this warpgroup's Q/O tile in the [K*NT*W*64, H] slabs (gather)
    t0: Any  # direct_io: first query row of this warpgroup in [T, N, H]
    n_store: Any  # direct_io: rows of this warpgroup to store (0 .. tokens_per_wg)
    head0: Any  # first query head of the KV head
    tok_off: Any  # first token of this warpgroup within the tile (0 with ``paired``)
    split: Any  # this work unit's part of the tile's K/V range (0 .. kv_splits - 1)


def _tile(
    cfg: _Config, q_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref, order_ref,
    qs_ref, store_ref, pick=None, item=None,
):  # fmt: skip
    """This warpgroup's tile; with ``paired`` tile ``pick`` (0 or 1, default this compute
    warpgroup's) of the CTA's two; with ``persistent`` the work item ``item`` = (unit, KV
    head) of ``_persistent_items`` instead of the CTA's grid indices."""
    T, C, W, Tw = cfg.block_kv, cfg.page_size, cfg.num_wgs, cfg.tokens_per_wg
    NT = order_ref.shape[0]
    h = lax.axis_index("h") if item is None else item[1]
    threads = W + int(cfg.producer)
    wg = lax.axis_index("wg") if threads > 1 else jnp.int32(0)
    cwg = jnp.minimum(wg, W - 1)
    # Work unit u = (tile order[u // S], split u % S); with ``paired`` a CTA runs units
    # W i .. W i + W - 1, one per compute warpgroup.
    S = cfg.kv_splits
    if item is not None:
        u = item[0]
        tok_off = cwg * Tw
    elif cfg.paired:
        u = W * lax.axis_index("i") + (cwg if pick is None else pick)
        tok_off = jnp.int32(0)
    else:
        u = lax.axis_index("i")
        tok_off = cwg * Tw
    i, split = (order_ref[u], jnp.int32(0)) if S == 1 else (order_ref[u // S], lax.rem(u, S))
    bits = _order_index_bits(cfg, NT)
    if bits is not None:  # packed longest-first keys: the tile is the low bits
        i = i & ((1 << bits) - 1)
    ntok, pos0, kv_len = ntok_ref[i], pos0_ref[i], kvlen_ref[i]
    pos_last = pos0 + ntok - 1
    # Keys any row of the tile may see: [lo, hi).
    hi = jnp.minimum(kv_len, pos_last + 1) if cfg.causal else kv_len
    hi = jnp.where(ntok > 0, hi, 0)
    if cfg.sliding_window is not None:
        lo = jnp.maximum(pos0 - cfg.sliding_window + 1, 0)
    else:
        lo = jnp.int32(0)
    t_lo = lo // T
    n = jnp.maximum((hi + T - 1) // T - t_lo, 0)
    # Leading tiles every row sees entirely (no mask needed): whole tiles below the first
    # row's position (causal) / below kv_len (non-causal). With a window every tile is masked.
    if cfg.sliding_window is not None:
        n_full = jnp.int32(0)
    elif cfg.causal:
        n_full = jnp.clip(jnp.minimum(pos0 + 1, kv_len) // T, 0, n)
    else:
        n_full = jnp.clip(kv_len // T, 0, n)
    if S > 1:  # this split's share of the n tiles: [first, first + n) of the range
        per = (n + S - 1) // S
        first = split * per
        n_split = jnp.clip(n - first, 0, per)
        t_lo, n_full, n = t_lo + first, jnp.clip(n_full - first, 0, n_split), n_split
    return _Tile(
        wg=wg,
        cwg=cwg,
        seq=seq_ref[i],
        ntok=ntok,
        pos0=pos0,
        kv_len=kv_len,
        t_lo=t_lo,
        n=n,
        n_full=n_full,
        last_page=jnp.clip((kv_len + C - 1) // C - 1, 0, bt_ref.shape[1] - 1),
        head_base=base_ref[0] + h * (cfg.num_pages * C),
        q_row=pl.multiple_of(((h * NT + i) * W + cwg) * ROWS, ROWS),
        t0=qs_ref[i] + tok_off,
        n_store=jnp.clip(store_ref[i] - tok_off, 0, Tw),
        head0=h * cfg.group,
        tok_off=tok_off,
        split=split,
    )


def _persistent_items(cfg: _Config, num_units: int, cta=None):
    """This CTA's work items with ``persistent``: ``(count, item)``, ``item(j)`` the (unit, KV
    head) of its ``j``-th. The ``U = num_units x K`` items are listed head-major (as the
    one-item grid launches them: the CTAs running at once read one KV head of one or a few
    sequences, which stays in L2; unit-major, a 16k-token prompt's 8 heads of K/V overflowed
    it) and dealt in blocks of two tiles (``2 x kv_splits`` units), block ``b`` to CTA
    ``b mod P``. The persistent grid's tile order pairs each sequence's longest tile with its
    shortest (``_gpu_order.pair_long_with_short``), so every block holds about the same
    work and a static deal balances the CTAs as the hardware's dynamic launch of one item
    per CTA does (round by round, a 16k-token prompt's 512 tiles a head against 132 CTAs left
    some CTAs half as much work again as the mean). ``cta``: this CTA's index (default its
    grid index)."""
    P, K, S = cfg.persistent, cfg.num_kv_heads, cfg.kv_splits
    U, per_block = num_units * K, 2 * S
    num_blocks = -(-U // per_block)
    short_last = num_blocks * per_block - U  # the last block's missing items
    c = lax.axis_index("i") if cta is None else jnp.asarray(cta, jnp.int32)
    blocks = jnp.maximum((num_blocks - c + P - 1) // P, 0)  # blocks c, c + P, ... < num_blocks
    owns_last = lax.rem(jnp.int32(num_blocks - 1), jnp.int32(P)) == c
    count = blocks * per_block - jnp.where(owns_last, short_last, 0)

    def item(j):
        w = (lax.div(j, per_block) * P + c) * per_block + lax.rem(j, per_block)
        return lax.rem(w, jnp.int32(num_units)), lax.div(w, jnp.int32(num_units))

    return count.astype(jnp.int32), item


def _tile_rows(cfg: _Config, t: _Tile, bt_ref, step):
    """Pool rows of the page copies of K/V tile ``step`` (clamped to the sequence's pages)."""
    T, C, r = cfg.block_kv, cfg.page_size, cfg.rows_per_copy
    rows = []
    for j in range(cfg.copies_per_tile):
        tok = (t.t_lo + step) * T + j * r
        page = bt_ref[t.seq, jnp.minimum(tok // C, t.last_page)]
        page = jnp.clip(page, 0, cfg.num_pages - 1)
        rows.append(t.head_base + page * C + tok % C)
    return rows


def _issue(cfg: _Config, src_ref, smem, bar, rows, slot):
    """Page copies of one K (or V) tile into ``smem[slot]``, one arrival on ``bar[slot]`` each."""
    aligned = (pl.multiple_of(row, 8) for row in rows)
    copy_pages(aligned, [(src_ref, smem, bar)], slot, cfg.rows_per_copy)


def _visible(cfg: _Config, t: _Tile, tile_tok, shape):
    """[64, block_kv] mask of the keys each row of this warpgroup's Q tile may see."""
    G, Tw = cfg.group, cfg.tokens_per_wg
    col = tile_tok + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    # Row r is (token r // G, head r % G), or with direct_io (head r // Tw, token r % Tw).
    # Padding rows (token >= ntok) repeat the last real token: never all-masked.
    in_wg = lax.rem(row, jnp.int32(Tw)) if cfg.direct_io else lax.div(row, jnp.int32(G))
    tok = jnp.minimum(t.tok_off + in_wg, t.ntok - 1)
    pos = t.pos0 + tok
    visible = col < t.kv_len
    if cfg.causal:
        visible = visible & (col <= pos)
    if cfg.sliding_window is not None:
        visible = visible & (pos - col < cfg.sliding_window)
    return visible


def _zero_v_tail(cfg: _Config, t: _Tile, v_tile, tile_tok):
    """Zeroes the V rows of the tile past the sequence end (stale or NaN page tails: 0 * NaN
    would poison P @ V). With several warpgroups each zeroes the same rows while the other may
    be reading the tile (its own P @ V): formally a data race (the interpreter's race detector
    flags it), harmless because every write stores the value already there or a zero that the
    first writer already stored; the reader never sees a third value."""

    @pl.when(tile_tok + cfg.block_kv > t.kv_len)
    def _():
        shape = (cfg.block_kv, cfg.head_dim)
        rows = tile_tok + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        vals = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
        v_tile[...] = jnp.where(rows < t.kv_len, vals, jnp.zeros_like(vals))
        plgpu.commit_smem()


def _load_q(cfg: _Config, t: _Tile, q_ref, q_smem, o_smem, bar):
    """Starts the Q tile's TMA: one aligned [64, H] block of the gathered slab, or with
    ``direct_io`` one [Tw, H] box per query head straight from q[T, N, H] into the untiled O
    staging tile (rows past T read as zeros; rows of the next sequence in a partial tile are
    computed and never stored). A tiled destination would need 8-aligned row starts, which
    sequence boundaries do not give; ``_wait_q`` moves the tile into the tiled Q buffer."""
    if not cfg.direct_io:
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(t.q_row, ROWS)], q_smem, bar)
        return
    Tw = cfg.tokens_per_wg
    for g in range(cfg.group):
        plgpu.copy_gmem_to_smem(
            q_ref.at[pl.ds(t.t0, Tw), t.head0 + g], o_smem.at[pl.ds(g * Tw, Tw)], bar
        )


def _wait_q(cfg: _Config, q_smem, o_smem, bar):
    """Waits for the Q tile; with ``direct_io`` copies it (through registers) from the untiled
    staging tile into the tiled, swizzled wgmma operand. Staging rows past ``G * Tw`` are never
    written: their garbage stays in their own rows, which are computed and never stored."""
    plgpu.barrier_wait(bar)
    if cfg.direct_io:
        q_smem[...] = plgpu.load(o_smem, layout=plgpu.Layout.WGMMA)
        plgpu.commit_smem()


def _finish(
    cfg: _Config, t: _Tile, acc, m, l, q_smem, o_smem, o_ref, lse_smem, lse_ref, out_scale=None
):  # fmt: skip
    """Normalises the accumulator (rows that saw no key give zeros) and stores the O tile;
    ``out_scale``: a factor on the output (quantized pages' per-head value scale).

    With ``direct_io`` the tile goes through an untiled SMEM staging tile straight into
    o[T, N, H]: a whole warpgroup tile as one [Tw, H] box per head, a partial one (a
    sequence's last tile) row by row, so no row of another sequence is overwritten. Without
    split-KV the tiles past
    the real ones write the zero rows of the padding (``n_store``).

    With ``kv_splits`` S > 1 (always ``direct_io``) the output is this split's partial: the
    normalised tile into plane ``split`` of o[S, T, N, H] (``q.dtype``, as FlashInfer's and
    vLLM's merged states) and its base-2 log-sum-exp (-inf where no key was seen) into
    lse[S, T, N, 32] f32, merged by ``_merge_splits``.
    """
    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    if out_scale is not None:
        inv_l = inv_l * out_scale
    out = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(cfg.dtype)
    split = cfg.kv_splits > 1
    if split:
        o_ref = o_ref.at[t.split]
        lse_ref = lse_ref.at[t.split]
        lse = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
        lse_smem[...] = lax.broadcast_in_dim(lse, (ROWS, LSE_COLS), [0])
    if not cfg.direct_io:
        q_smem[...] = out  # Q is no longer needed: reuse its tile for O
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[pl.ds(t.q_row, ROWS)])
        plgpu.wait_smem_to_gmem(0)
        return
    G, Tw = cfg.group, cfg.tokens_per_wg
    o_smem[...] = out
    plgpu.commit_smem()

    def store(src, dst, row, rows):  # rows [g Tw + row, + rows) of each head g
        for g in range(G):
            plgpu.copy_smem_to_gmem(
                src.at[pl.ds(g * Tw + row, rows)], dst.at[pl.ds(t.t0 + row, rows), t.head0 + g]
            )

    @pl.when(t.n_store == Tw)
    def _whole():
        store(o_smem, o_ref, 0, Tw)
        if split:
            store(lse_smem, lse_ref, 0, Tw)

    @pl.when((t.n_store > 0) & (t.n_store < Tw))
    def _partial():
        @pl.loop(0, t.n_store)
        def _(j):
            store(o_smem, o_ref, j, 1)
            if split:
                store(lse_smem, lse_ref, j, 1)

    # A persistent CTA's next tile may reuse the staging tiles once the stores have read them;
    # their writes complete in the background (the body waits for them before it exits).
    plgpu.wait_smem_to_gmem(0, wait_read_only=cfg.persistent > 0)


def _init_state(H):
    acc = plgpu.layout_cast(jnp.zeros((ROWS, H), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    return acc, m, l
