"""Per-tile device code of the Mosaic GPU decode kernel (``kernel_gpu``): a work unit's tiles,
their page copies (TMA, or ``_cp_async``), Q K^T, the online softmax, P @ V, and the store of
the result (``_attend``, ``_finish``, ``_store``)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._gpu import quant as gpu_quant
from pallas_kernels._gpu.config import LOG2E, LSE_COLS, ROWS, TILE_ROWS, smem_transforms
from pallas_kernels._gpu.pages import copy_pages
from pallas_kernels.paged_attention import _cp_async, _gpu_quant, _gpu_tcgen05
from pallas_kernels.paged_attention._gpu_config import _Config
from pallas_kernels.paged_attention._gpu_order import ORDER_BITS, packed_order
from pallas_kernels.paged_attention._gpu_tcgen05 import (
    _TMEM_LANES,
    _acc_map,
    _o_parts,
    _store_transposed,
    _tc_pv,
    tmem_sync,
)


@plgpu.inline_mgpu()
def _warpgroup_barrier(ctx):
    del ctx
    mgpu_utils.warpgroup_barrier()


def wg_barrier(cfg: _Config) -> None:
    """A warpgroup barrier where the kernel runs without Pallas's automatic ones
    (``auto_barriers=False``): every warp's reads of SMEM (its part of a wgmma, its loads) are
    done before any warp issues a copy or a store that overwrites them. A no-op with the
    automatic barriers, and in the interpreter (which runs a warpgroup as one and cannot run
    inline Mosaic GPU code)."""
    if not (cfg.auto_barriers or cfg.interpret):
        _warpgroup_barrier()


def _layout(cfg: _Config):
    """The register layout of the products' results and of everything kept beside them (the
    accumulator, the scores, their masks and maxima): wgmma's, or an M=128 tcgen05 MMA's
    accumulator as it is read from TMEM (a key row or head-dim row a thread)."""
    return plgpu.Layout.TCGEN05 if cfg.tcgen05 else plgpu.Layout.WGMMA


class _Unit(NamedTuple):
    """One (sequence, split, KV head) work unit: traced scalars."""

    b: Any  # the sequence (after the longest-first permutation)
    length: Any
    lo: Any  # first visible key (sliding window)
    start: Any  # first K/V tile of this split
    n: Any  # tiles of this split (0: nothing to read; the output is zeros)
    last_page: Any  # the last block-table entry a lookup may read
    head_base: Any  # row of the KV head's page 0 in the flattened pool
    qrow: Any  # first query row of the unit's G heads
    s: Any  # the split
    h: Any  # the KV head
    splits: Any = 1  # the sequence's splits that read (``min_split_tiles``; else num_splits)

    @property
    def qrow8(self):
        return pl.multiple_of((self.qrow // 8) * 8, 8)

    @property
    def qoff(self):
        return self.qrow - self.qrow8


def _tile_span(cfg: _Config, length):
    """(first visible key, first tile, tiles) of a sequence of ``length`` >= 0 keys: the tiles
    that hold its visible keys (all of them, or the sliding window's)."""
    T = cfg.block_kv
    lo = jnp.maximum(length - cfg.sliding_window, 0) if cfg.sliding_window else length * 0
    t_lo = lo // T
    return lo, t_lo, (length + T - 1) // T - t_lo


def _unit(cfg: _Config, len_ref, base_ref, order_ref, b_slot, h, s, seq=None) -> _Unit:
    """The unit of grid slot (``b_slot``, ``s``, ``h``); ``seq``: its (sequence, length), as
    ``_kernel_order`` found them."""
    S = cfg.num_splits
    if seq is not None:
        b = seq[0]
    elif order_ref is None:
        b = b_slot
    elif packed_order(cfg.num_seqs):  # packed keys (``_longest_first_order``)
        b = order_ref[b_slot] & ((1 << ORDER_BITS) - 1)
    else:
        b = order_ref[b_slot]
    # Lengths < 0 (invalid) count as 0, so no tile index and no table lookup goes negative.
    length = seq[1] if seq is not None else len_ref[b]
    length = jnp.maximum(length, 0)
    lo, t_lo, tiles = _tile_span(cfg, length)
    t_hi = t_lo + tiles
    splits = S
    if cfg.min_split_tiles > 1:
        # Only as many splits as keep min_split_tiles tiles each (at least one): a short
        # sequence in a wide table, or beside long ones, is not cut into slivers; the
        # splits past them read nothing and store nothing (``_kernel_body``).
        splits = jnp.clip(tiles // cfg.min_split_tiles, 1, S)
    per_split = (tiles + splits - 1) // splits
    start = t_lo + s * per_split
    n = jnp.maximum(jnp.minimum(start + per_split, t_hi) - start, 0)
    # (A select on a constant: kept, so the lowered kernel stays the one measured.)
    n = jnp.where(True, n, 0)
    return _make_unit(cfg, base_ref, b, length, lo, h, start, n, s)._replace(splits=splits)


def _make_unit(cfg: _Config, base_ref, b, length, lo, h, start, n, s=0) -> _Unit:
    """The unit reading tiles [start, start + n) of KV head h of sequence b (``length`` >= 0
    keys, the first visible one ``lo``)."""
    C = cfg.page_size
    return _Unit(
        b=b,
        length=length,
        lo=lo,
        start=start,
        n=n,
        last_page=jnp.maximum((length + C - 1) // C - 1, 0),
        head_base=base_ref[0] + h * (cfg.num_pages * C),
        qrow=b * cfg.num_q_heads + h * cfg.group,
        s=jnp.asarray(s, jnp.int32),
        h=jnp.asarray(h, jnp.int32),
    )


def _lookup(cfg: _Config, bt_ref, unit: _Unit, i):
    """Block-table entries of tile i of ``unit`` (clamped: never past the last page)."""
    tile_tok = (unit.start + i) * cfg.block_kv
    C, r = cfg.page_size, cfg.rows_per_copy
    return [
        bt_ref[unit.b, jnp.minimum((tile_tok + j * r) // C, unit.last_page)]
        for j in range(cfg.copies_per_tile)
    ]


def _page_row(cfg: _Config, unit: _Unit, i, j, page):
    """First pool row of copy j of tile i of ``unit`` (``rows_per_copy`` rows of ``page``): a
    multiple of the rows a copy moves (8 rows of the SMEM tiling, or a whole small page)."""
    tok = (unit.start + i) * cfg.block_kv + j * cfg.rows_per_copy
    row = unit.head_base + page * cfg.page_size + tok % cfg.page_size
    return pl.multiple_of(row, min(cfg.rows_per_copy, TILE_ROWS))


def _issue(cfg: _Config, unit: _Unit, i, slot, pages, streams):
    """Page copies of tile i of ``unit`` into ring slot ``slot``: for each page, one copy per
    ``(gmem, smem ring, barrier)`` stream, each one arrival on ``barrier[slot]``."""
    rows = (_page_row(cfg, unit, i, j, page) for j, page in enumerate(pages))
    copy_pages(rows, streams, slot, cfg.rows_per_copy)


def _init_carry(cfg: _Config):
    """(acc, m, l): acc [64, H] with m, l per row; ``swap_ab``: acc^T [H, qcols], m, l per
    column, and with ``deferred_sum`` l [T, qcols] in the scores' layout (``_sum_l``)."""
    H = cfg.head_dim
    if cfg.swap_ab:
        shape, vec, axis = (H, cfg.qcols), cfg.qcols, 0
    else:
        shape, vec, axis = (ROWS, H), ROWS, 1
    layout = _layout(cfg)
    if cfg.tcgen05:  # O^T as parts of 128 head-dim rows (``_o_parts``)
        zeros = jnp.zeros((_TMEM_LANES, cfg.qcols), jnp.float32)
        acc = tuple(plgpu.layout_cast(zeros, layout) for _ in range(_o_parts(cfg)))
    else:
        acc = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)
    vec_layout = layout.reduce(axis)
    m = plgpu.layout_cast(jnp.full((vec,), -jnp.inf, jnp.float32), vec_layout)
    if cfg.deferred_sum:
        l = plgpu.layout_cast(jnp.zeros((cfg.block_kv, cfg.qcols), jnp.float32), layout)
    else:
        l = plgpu.layout_cast(jnp.zeros((vec,), jnp.float32), vec_layout)
    return acc, m, l


def _sum_l(cfg: _Config, l):
    """The softmax denominators per query: with ``deferred_sum`` the per-key partial sums
    [T, qcols] are reduced over the keys here, once, instead of once a tile (a reduction across
    the warpgroup's four warps, through SMEM, in every tile's critical path)."""
    return l.sum(axis=0) if cfg.deferred_sum else l


def _folds_scale(cfg: _Config) -> bool:
    """The logit scale is applied inside exp2 (``exp2(s * scale - m)``, m in scaled units), not
    to every score: without a soft cap and for a positive scale (max(s) * scale = max(s * scale))."""
    return not cfg.logits_soft_cap and cfg.sm_scale > 0


def _scores_shape(cfg: _Config):
    """A tile's scores: [T, qcols] with ``swap_ab`` (keys down), else [64, T]."""
    return (cfg.block_kv, cfg.qcols) if cfg.swap_ab else (ROWS, cfg.block_kv)


def _init_hi(cfg: _Config):
    """``fixed_max``: the running elementwise max of the scores, in their layout."""
    shape = _scores_shape(cfg)
    return plgpu.layout_cast(jnp.full(shape, -jnp.inf, jnp.float32), _layout(cfg))


def _past_headroom(cfg: _Config, unit: _Unit, hi, m):
    """``fixed_max``: whether any real query's largest score (``hi``, unscaled where the scale
    folds into exp2) lies more than ``fixed_max_headroom`` (base 2) above the reference ``m``
    its probabilities were taken against: then some exp2 may have overflowed, and the unit is
    redone exactly. One reduction across the warps a unit. A unit with no tile (m = -inf) never
    is: -inf - -inf is NaN, which compares false."""
    keys = 0 if cfg.swap_ab else 1
    q = plgpu.broadcasted_iota(jnp.int32, hi.shape, 1 - keys, layout=_layout(cfg))
    real = (q >= unit.qoff) & (q < unit.qoff + cfg.group)  # not the padding rows of Q
    top = jnp.where(real, hi, -jnp.inf).max(axis=keys)
    if _folds_scale(cfg):
        top = top * (cfg.sm_scale * LOG2E)
    return jnp.max(top - m) > cfg.fixed_max_headroom


def _relayout(cfg: _Config, src, dst):
    """Copies the untiled [T, H] staging tile ``src`` into the tiled, swizzled ``dst`` through
    registers, in a layout of 16-byte vectors that reads and writes SMEM without bank conflicts
    (a quarter warp moves one 128-byte row), then makes it visible to wgmma (``staged``)."""
    layout = plgpu.Layout.SMEM_GMEM_COPY((cfg.block_kv, cfg.head_dim), cfg.dtype, 128)
    dst[...] = plgpu.load(src, layout=layout)
    plgpu.commit_smem()


def _tile(cfg: _Config, unit: _Unit, i, slot, carry, smem, *, tiles=None, tc=None, quant=None):
    """Tile i of ``unit`` (K and V in ring slot ``slot``): Q K^T, online softmax, P @ V.

    ``smem`` is (q_smem, k_smem, v_smem, p_smem, k_bar, v_bar). ``tiles`` (``staged``): the
    tiled K and V tiles [1, T, H] that the ring's untiled slots are re-laid into once they land;
    the products read those. ``tc`` (tcgen05): the scores' and P @ V's TMEM accumulators and
    their two completion barriers. ``quant`` (quantized pages): (the unit's
    ``_gpu_quant.UnitScales``, the bf16 tile K and then V are dequantized into, the tile's
    per-page scales). Returns the new (acc, m, l); P @ V has completed by then, so the slot's V
    is free.
    """
    T, H = cfg.block_kv, cfg.head_dim
    q_smem, k_smem, v_smem, p_smem, k_bar, v_bar = smem
    acc, m, l, *hi = carry  # hi: ``fixed_max``'s running max of every score
    tile_tok = (unit.start + i) * T

    def landed(bar, ring, at, tile, later_groups):
        """Waits for the slot's copies; the tile the products read. ``per_thread``: a tile's
        K and V are two cp.async groups, issued ``num_stages`` tiles ahead (``_attend``), so
        ``later_groups`` (the other stream's and the later tiles') may still be in flight."""
        if cfg.per_thread:
            if later_groups is not None:  # (V's group was waited for with P's store)
                _cp_async.wait(later_groups)
                plgpu.commit_smem()
            return ring.at[at]
        plgpu.barrier_wait(bar.at[at])
        if tile is None:
            return ring.at[at]
        _relayout(cfg, ring.at[at], tile.at[0])
        return tile.at[0]

    k_tile, v_tile = (None, None) if tiles is None else tiles
    later = 2 * cfg.num_stages - 1  # cp.async groups after this tile's K group
    # swap_ab: the scores' transpose K Q^T [T, qcols] (keys down, queries across), P^T stored
    # through a transposed view of P [qcols, T], and O^T = V^T P^T [H, qcols]: the wgmma M is
    # the keys / the head dim, and only N = qcols columns of queries are computed (8 for
    # G <= 4) where the default tile computes 64 query rows.
    swap = cfg.swap_ab
    keys = 0 if swap else 1  # the scores' key axis
    k_tile = landed(k_bar, k_smem, slot, k_tile, later)
    if quant is not None:
        qs, deq, scalars = quant
        if cfg.k_registers:  # 8-bit K into registers, the scores' A operand
            k_tile = gpu_quant.tile_operand(k_tile, cfg.kv_dtype)
        else:  # into the bf16 tile (every warp is past the last P @ V)
            _gpu_quant.dequantize(cfg, k_tile, deq)
            k_tile = deq

    def qk(acc_ref):
        if swap:
            plgpu.wgmma(acc_ref, k_tile, q_smem.transpose((1, 0)))
        else:
            plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
        return acc_ref[...]

    sc_shape = _scores_shape(cfg)
    if cfg.tcgen05:  # S^T = K Q^T: M = the tile's 128 keys, N = the query columns
        s_tmem, o_tmem, mma_bar = tc
        sc = _gpu_tcgen05._tc_product(s_tmem, k_tile, q_smem.transpose((1, 0)), mma_bar.at[0])
    else:
        sc = pl.run_scoped(qk, plgpu.ACC(sc_shape, jnp.float32))
    if quant is not None:  # the key rows' scales (stale rows past the end are masked below)
        sc = _gpu_quant.scale_scores(cfg, qs, scalars, slot, sc, _layout(cfg))
    scale = cfg.sm_scale * LOG2E  # base-2 logits; m is in these units
    fold = _folds_scale(cfg)  # scale applied inside exp2, not per score
    if cfg.logits_soft_cap:
        cap = cfg.logits_soft_cap
        sc = (cap * LOG2E) * jnp.tanh(sc * (cfg.sm_scale / cap))
    elif not fold:
        sc = sc * scale

    def mask(sc):
        key = tile_tok + plgpu.broadcasted_iota(jnp.int32, sc_shape, keys, layout=_layout(cfg))
        return jnp.where((key < unit.length) & (key >= unit.lo), sc, -jnp.inf)

    # Only a tile holding the sequence end or the window start has keys to hide: the others
    # skip the per-score iota, compares and select (a uniform branch).
    partial = (tile_tok + T > unit.length) | (tile_tok < unit.lo)
    sc = lax.cond(partial, mask, lambda sc: sc, sc)
    queries = [1 - keys]  # where a per-query vector broadcasts to

    def running_max():  # max(s) * scale = max(s * scale) for scale > 0
        return jnp.maximum(m, sc.max(axis=keys) * scale if fold else sc.max(axis=keys))

    if cfg.fixed_max:
        # The first tile's max stays the reference of every later tile: no reduction across
        # the warps in the loop (softmax is shift-invariant; ``_attend`` checks the headroom).
        m_new = lax.cond(i == 0, running_max, lambda: m)
        hi = [jnp.maximum(hi[0], sc)]
    else:
        m_new = running_max()
    if fold:  # exp2(s * scale - m) per score
        x = sc * scale - lax.broadcast_in_dim(m_new, sc.shape, queries)
    else:
        x = sc - lax.broadcast_in_dim(m_new, sc.shape, queries)
    if cfg.fixed_max:  # never past the headroom (the unit is redone if a score was clamped)
        x = jnp.minimum(x, cfg.fixed_max_headroom)
    p = jnp.exp2(x)
    alpha = jnp.exp2(m - m_new)
    if cfg.deferred_sum:  # l [T, qcols]: no reduction across the warps in the loop
        l = l * lax.broadcast_in_dim(alpha, sc.shape, queries) + p
    else:
        l = l * alpha + p.sum(axis=keys)
    if quant is not None:  # the value rows' scales ride on P (l sums the unscaled P)
        p = _gpu_quant.scale_probabilities(
            cfg, qs, scalars, slot, p, _layout(cfg), unit.length - tile_tok
        )
    if swap:
        p_smem.transpose((1, 0))[...] = p.astype(cfg.dtype)
    else:
        p_smem[...] = p.astype(cfg.dtype)
    if cfg.per_thread:  # V's cp.async group, made visible by P's fence and barrier
        _cp_async.wait(later - 1)
    # tcgen05: this tile's scores and the last tile's P @ V are read out of TMEM before the
    # next products overwrite them.
    tmem_sync(cfg, plgpu.commit_smem)
    v_tile = landed(v_bar, v_smem, slot, v_tile, None if cfg.per_thread else later - 1)

    def zero_tail():  # stale/NaN rows past the end: 0 * NaN would poison P @ V
        rows = tile_tok + plgpu.broadcasted_iota(jnp.int32, (T, H), 0, layout=plgpu.Layout.WGMMA)
        vals = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
        v_tile[...] = jnp.where(rows < unit.length, vals, jnp.zeros_like(vals))
        plgpu.commit_smem()

    if quant is None:
        pl.when(tile_tok + T > unit.length)(zero_tail)
    else:  # 8-bit V into the bf16 tile, zeros past the end (P's barrier: Q K^T has read it)
        _gpu_quant.dequantize(cfg, v_tile, deq, tile_tok, unit.length)
        v_tile = deq

    def pv(acc_ref):
        if swap:
            plgpu.wgmma(acc_ref, v_tile.transpose((1, 0)), p_smem.transpose((1, 0)))
        else:
            plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]

    if cfg.tcgen05:  # O^T = V^T P^T: M = 128 head-dim rows a part, N = the query columns
        o = _tc_pv(cfg, o_tmem, v_tile, p_smem, mma_bar.at[1])
        acc = tuple(
            a * lax.broadcast_in_dim(alpha, a.shape, queries) + oj
            for a, oj in zip(acc, o, strict=True)
        )
        return (acc, m_new, l, *hi)
    o = pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, queries) + o
    return (acc, m_new, l, *hi)


def _finish(cfg: _Config, acc, m, l, with_lse: bool | None = None, out_scale=None):
    """The normalised output (rows that saw no key give zeros) and, split (or ``with_lse``),
    its base-2 log-sum-exp; ``out_scale``: a factor on the output (a per-head value scale)."""
    l = _sum_l(cfg, l)
    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    if out_scale is not None:
        inv_l = inv_l * out_scale
    dims = [1] if cfg.swap_ab else [0]
    out = _acc_map(lambda a: a * lax.broadcast_in_dim(inv_l, a.shape, dims), acc)
    if not (cfg.num_splits > 1 if with_lse is None else with_lse):
        return out, None
    return out, jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def _store(cfg: _Config, unit: _Unit, outs, out_smem, out, lse):
    """Writes the unit's G real rows: the output tile in ``q.dtype`` (S == 1), or the partial
    (``_partial_dtype``) and its log-sum-exp (``swap_ab`` with splits: the G rows of the
    partial, and the lse row of its ``qcols`` columns to the (sequence, KV head) slot)."""
    G = cfg.group
    rows = pl.ds(unit.qoff, G)
    wg_barrier(cfg)  # the output tiles reuse the ring's SMEM: every warp's last wgmma is done
    block = pl.ds(pl.multiple_of((unit.b * cfg.num_kv_heads + unit.h) * cfg.q_rows, 8), cfg.q_rows)
    if cfg.swap_ab and cfg.num_splits == 1:  # out is O^T [H, qcols]: transposed
        (o_ref,), (o_smem,) = outs, out_smem
        _store_transposed(o_smem, out, cfg.dtype)
        plgpu.commit_smem()
        if cfg.whole_blocks:  # to the staging array's rows, or (G fills it) the G rows
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[block])
        else:
            plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[pl.ds(unit.qrow, G)])
    elif cfg.swap_ab:
        # The partial O^T goes out as its G rows in q.dtype through a transposed view, as
        # without splits (Mosaic GPU cannot store f32 through a transposed view). The lse row
        # of the qcols columns goes to the (sequence, KV head) slot b * K + h, and the merge
        # picks the G real columns (``_swapped_lse``).
        (o_ref, lse_ref), (o_smem, lse_smem) = outs, out_smem
        cta = unit.b * cfg.num_kv_heads + unit.h
        _store_transposed(o_smem, out, o_smem.dtype)
        lse_smem[...] = lax.broadcast_in_dim(lse, lse_smem.shape, [1])
        plgpu.commit_smem()
        if cfg.whole_blocks:
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[unit.s, block])
        else:
            plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[unit.s, pl.ds(unit.qrow, G)])
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, 1)], lse_ref.at[unit.s, pl.ds(cta, 1)])
    elif cfg.num_splits == 1:
        (o_ref,), (o_smem,) = outs, out_smem
        o_smem[...] = out.astype(cfg.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[pl.ds(unit.qrow, G)])
    else:
        (o_ref, lse_ref), (o_smem, lse_smem) = outs, out_smem
        o_smem[...] = out.astype(o_smem.dtype)
        lse_smem[...] = lax.broadcast_in_dim(lse, (ROWS, LSE_COLS), [0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[unit.s, pl.ds(unit.qrow, G)])
        plgpu.copy_smem_to_gmem(lse_smem.at[rows], lse_ref.at[unit.s, pl.ds(unit.qrow, G)])
    plgpu.wait_smem_to_gmem(0)


def _partial_dtype(cfg: _Config):
    """Split partials: f32, or ``q.dtype`` (as FlashInfer's and vLLM's merged states are
    stored) with ``swap_ab``, whose O^T leaves through a transposed view (Mosaic GPU stores
    only 16-bit types that way)."""
    return cfg.dtype if cfg.swap_ab else jnp.float32


def _scratch(cfg: _Config):
    """(q, (k ring, v ring), p, out tiles) SMEM scratch shapes."""
    T, H, stages, dtype = cfg.block_kv, cfg.head_dim, cfg.num_stages, cfg.dtype
    tr = smem_transforms()
    rows = cfg.q_rows  # with swap_ab, Q^T and P^T are wgmma B operands (transposed views)
    # Output tiles, untiled: slices of G < 8 rows at qoff must not cross (8, 64) tiles.
    if cfg.num_splits == 1:
        out = (plgpu.SMEM((rows, H), dtype),)
    elif cfg.swap_ab:  # the partial's rows (stored through O^T's transposed view), lse row
        out = (plgpu.SMEM((rows, H), _partial_dtype(cfg)), plgpu.SMEM((ROWS, rows), jnp.float32))
    else:
        out = (
            plgpu.SMEM((ROWS, H), _partial_dtype(cfg)),
            plgpu.SMEM((ROWS, LSE_COLS), jnp.float32),
        )
    ring_tr = {} if cfg.staged else {"transforms": tr}  # staged: copies land untiled
    ring_dtype = dtype
    if cfg.quantized:  # the 8-bit pages as stored (``_gpu_quant.scratch``: the bf16 tile)
        ring_dtype = cfg.kv_dtype
        ring_tr = {"transforms": gpu_quant.ring_transforms(cfg.kv_dtype, H)}
    return (
        plgpu.SMEM((rows, H), dtype, transforms=tr),
        (
            plgpu.SMEM((stages, T, H), ring_dtype, **ring_tr),
            plgpu.SMEM((stages, T, H), ring_dtype, **ring_tr),
        ),
        plgpu.SMEM((rows, T), dtype, transforms=tr),
        out,
    )


def _staged_tiles(cfg: _Config):
    """``staged``: the tiled K and V tiles [1, T, H] the products read (``_relayout``). One
    shared tile would need a warpgroup barrier between a tile's P @ V and the next tile's K
    re-layout (a warp may finish its wgmma before another); with two, the P store's barrier
    separates every tile's last read from the next write."""
    tile = plgpu.SMEM((1, cfg.block_kv, cfg.head_dim), cfg.dtype, transforms=smem_transforms())
    return tile, tile


def _attend(
    cfg: _Config, refs, unit: _Unit, q_smem, k_smem, v_smem, p_smem, q_bar, k_bar, v_bar,
    tiles=None, tc=None, quant=None,
):  # fmt: skip
    """The attention loop over ``unit``'s n tiles: (acc, m, l) in ``_layout(cfg)``. ``refs``:
    (q_ref, k_ref, v_ref, bt_ref); ``tiles``: ``staged``'s tiled K and V tiles, ``tc``:
    tcgen05's TMEM accumulators and barriers (``_tile``, ``_tc_scratch``); ``quant``
    (quantized pages): the unit's ``_gpu_quant.UnitScales`` and the bf16 dequantized tile.

    The warpgroup issues every copy: the first ``num_stages`` tiles' K and V up front, then
    tile i + num_stages's once tile i's P @ V has read its slot. With per-page scales, tile
    i + 1's are read during tile i and carried into the next step.
    """
    q_ref, k_ref, v_ref, bt_ref = refs
    stages, n = cfg.num_stages, unit.n
    k_stream, v_stream = (k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar)
    smem = (q_smem, k_smem, v_smem, p_smem, k_bar, v_bar)

    def issue(i, slot, pages):
        _issue(cfg, unit, i, slot, pages, [k_stream, v_stream])
        if quant is not None:  # per-token scales: TMA copies beside the pages
            _gpu_quant.issue(cfg, unit, quant[0], i, slot, pages, k_bar)

    def per_thread_issue(i, slot, live):
        _cp_async.issue(
            cfg, bt_ref, k_ref, v_ref, k_smem, v_smem, unit, i, slot, live, smem_transforms()
        )

    with jax.named_scope("prologue"):  # Q and the first tiles requested, Q landed
        if cfg.longest_first and not cfg.xla_order:
            # Q's and the ring's TMA copies overwrite the in-kernel order's SMEM, which its
            # reduction wrote with generic stores: a proxy fence and a barrier (commit_smem).
            plgpu.commit_smem()
        else:
            wg_barrier(cfg)  # (nothing wrote SMEM before; kept as a guard)
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(unit.qrow8, cfg.q_rows)], q_smem, q_bar)
        if cfg.per_thread:  # every thread copies pieces of the first tiles (cp.async)
            for i in range(stages):
                per_thread_issue(i, i, i < n)
        else:
            # Every prologue lookup first (clamped, so in bounds even past n): the block-table
            # reads are in flight together rather than one tile's after the last one's issue.
            first = [_lookup(cfg, bt_ref, unit, i) for i in range(stages)]
            for i in range(stages):
                pl.when(i < n)(lambda i=i: issue(i, i, first[i]))
            if quant is not None:
                scalars = _gpu_quant.page_scales(cfg, quant[0], first[0])
        plgpu.barrier_wait(q_bar)

    def step(i, carry):
        slot = lax.rem(i, jnp.int32(stages))
        if cfg.per_thread:  # the slot's next tile, two cp.async groups (committed even if none)
            carry = _tile(cfg, unit, i, slot, carry, smem, tc=tc)
            per_thread_issue(i + stages, slot, i + stages < n)
            return carry
        next_pages = _lookup(cfg, bt_ref, unit, i + stages)  # in flight during the tile
        if quant is None:
            carry = _tile(cfg, unit, i, slot, carry, smem, tiles=tiles, tc=tc)
        else:  # the carry's last item: this tile's per-page scales (read a tile ahead)
            qs, scalars = quant[0], carry[-1]
            ahead = _gpu_quant.page_scales(cfg, qs, _lookup(cfg, bt_ref, unit, i + 1))
            carry = _tile(cfg, unit, i, slot, carry[:-1], smem, quant=(qs, quant[1], scalars))
            carry = (*carry, ahead)
        # Every warp's part of P @ V (and Q K^T) has read the slot and P before any warp
        # refills the slot or writes the next P (and, quantized, the dequantized tile).
        wg_barrier(cfg)
        pl.when(i + stages < n)(lambda: issue(i + stages, slot, next_pages))
        return carry

    with jax.named_scope("loop"):
        if quant is not None:
            init = (*_init_carry(cfg), *([_init_hi(cfg)] if cfg.fixed_max else []), scalars)
            out = lax.fori_loop(0, n, step, init)[:-1]
            if not cfg.fixed_max:
                return out
            acc, m, l, hi = out
        elif not cfg.fixed_max:
            return lax.fori_loop(0, n, step, _init_carry(cfg))
        else:
            acc, m, l, hi = lax.fori_loop(0, n, step, (*_init_carry(cfg), _init_hi(cfg)))
    # Every copy has landed and every product has read its slot (the loop's last barrier): the
    # exact loop may start over on the same ring.
    exact = dataclasses.replace(cfg, fixed_max=False)
    return lax.cond(
        _past_headroom(cfg, unit, hi, m),
        lambda: _attend(exact, refs, unit, q_smem, k_smem, v_smem, p_smem, q_bar, k_bar, v_bar,
                        tiles, tc, quant),
        lambda: (acc, m, l),
    )  # fmt: skip
