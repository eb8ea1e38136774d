"""CTA bodies of the Mosaic GPU decode kernel (``kernel_gpu``): the default grid of (sequence,
split, KV head) units with its in-kernel order and split merge, and the persistent grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import _merge_gpu
from pallas_kernels.paged_attention._gpu_config import (
    _COMPUTE_REGISTERS,
    _PRODUCER_REGISTERS,
    _ROWS,
    _Config,
    _lse_row_step,
    _packed_key,
    _split_merge_batch,
)
from pallas_kernels.paged_attention._gpu_tile import (
    _attend,
    _finish,
    _init_carry,
    _issue,
    _lookup,
    _scratch,
    _staged_tiles,
    _store,
    _tc_scratch,
    _tile,
    _Unit,
    _unit,
)


def _merge_scratch(cfg: _Config):
    """SMEM of ``_merge_split``: a round's partial rows and lse rows, their barriers and the
    arrival flag (after the loop: it reuses the ring's SMEM)."""
    NB, R = _split_merge_batch(cfg), cfg.q_rows
    return (
        plgpu.SMEM((NB, R, cfg.head_dim), cfg.dtype),
        plgpu.SMEM((NB * _lse_row_step(R), R), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=NB),
        plgpu.SMEM((1,), jnp.int32),
    )


def _merge_split(cfg: _Config, unit: _Unit, counters, out_ref, parts, o_smem, merge_smem):
    """``split_merge="kernel"`` (``swap_ab``): after this CTA's partial is stored, the last of
    the pair's ``num_splits`` CTAs to arrive (``_merge_gpu.arrive``) loads every split's G
    partial rows and lse row, merges them (``_merge_gpu.merge``) and stores the G output rows;
    the others exit. No CTA waits for another."""
    mo_smem, ml_smem, m_bar, flag = merge_smem
    o_part, lse_part = parts
    G, R, H = cfg.group, cfg.q_rows, cfg.head_dim
    S = unit.splits  # the pair's splits that read (``min_split_tiles``: the others never arrive)
    pair = unit.b * cfg.num_kv_heads + unit.h
    last = _merge_gpu.arrive(
        counters, flag, pair, S, split=unit.s, interpret=bool(cfg.interpret)
    )  # fmt: skip
    step = _lse_row_step(R)
    rows = pl.ds(unit.qoff, G)

    def load_piece(j, k):  # split k's G rows, at their place in the qcols-row block
        plgpu.copy_gmem_to_smem(o_part.at[k, pl.ds(unit.qrow, G)], mo_smem.at[j, rows], m_bar.at[j])
        plgpu.copy_gmem_to_smem(
            lse_part.at[k, pl.ds(pair, 1)], ml_smem.at[pl.ds(j * step, 1)], m_bar.at[j]
        )

    @pl.when(last)
    def _():
        merged = _merge_gpu.merge(
            S, load_piece, mo_smem, ml_smem, m_bar, rows=R, head_dim=H,
            batch=_split_merge_batch(cfg), lse_step=step,
        )  # fmt: skip
        o_smem[...] = merged.astype(cfg.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[rows], out_ref.at[pl.ds(unit.qrow, G)])
        plgpu.wait_smem_to_gmem(0)


def _split_rest(cfg: _Config, rest):
    if cfg.xla_order:
        order_ref, *outs = rest
        return order_ref, outs
    return None, list(rest)


def _kernel_order(cfg: _Config, len_ref, b_slot):
    """(sequence, length) of the sequence whose place in the longest-first order is ``b_slot``,
    counted by this CTA (``order_method="kernel"``): no XLA kernel before the launch.

    One TMA copy brings the B lengths to SMEM; each of the 128 threads computes ``B / 128``
    packed keys (as ``_longest_first_order``'s: ``(0x7FFF - tiles) << 16 | sequence``,
    distinct: ``_packed_key``) and stores them to SMEM, and a loop over the B keys, read back as
    scalars, counts the smaller ones: the ranks. The sequence of rank ``b_slot`` is one sum
    over the warpgroup. B compares of B / 128 keys a thread (128 at B = 128), where ``"rank"``
    runs two [B, B] reductions in XLA kernels.
    """
    B, T, head = cfg.num_seqs, cfg.block_kv, cfg.order_head
    Bp = -(-B // 128) * 128  # a strided register layout covers 128 * k elements
    layout = plgpu.Layout.WG_STRIDED((Bp,), vec_size=Bp // 128)

    def count(len_smem, key_smem, bar):
        plgpu.copy_gmem_to_smem(len_ref, len_smem.at[pl.ds(0, B)], bar)
        plgpu.barrier_wait(bar)
        seqs = plgpu.broadcasted_iota(jnp.int32, (Bp,), 0, layout=layout)
        lengths = plgpu.load(len_smem, layout=layout)  # entries >= B: never written
        # Sequences past B (and with ``order_head`` the head's, which come first in batch
        # order): ranks past the others'.
        counted = (seqs < B) & (seqs >= head) if head else seqs < B
        keys = jnp.where(counted, _packed_key(lengths, seqs, T), jnp.int32(0x7FFFFFFF))
        key_smem[...] = keys  # each key computed once, read back as a scalar by every thread
        plgpu.commit_smem()  # (its warpgroup barrier orders the stores before the loads)

        def smaller(i, rank):  # 4 keys a trip: their SMEM loads in flight together (B % 4 == 0)
            others = [key_smem[i * 4 + u] for u in range(4)]
            for other in others:
                rank = rank + (other < keys).astype(jnp.int32)
            return rank

        zeros = plgpu.layout_cast(jnp.zeros((Bp,), jnp.int32), layout)
        rank = lax.fori_loop(0, B // 4, smaller, zeros)
        b = jnp.sum(jnp.where(rank == (b_slot - head if head else b_slot), seqs, 0))
        return b, len_smem[b]

    return pl.run_scoped(
        count,
        plgpu.SMEM((Bp,), jnp.int32),
        plgpu.SMEM((Bp,), jnp.int32),
        plgpu.Barrier(num_arrivals=1),
    )


def _kernel_body(cfg: _Config, q_ref, k_ref, v_ref, bt_ref, len_ref, base_ref, *rest):
    """Body of one CTA: (sequence slot b, split s, KV head h)."""
    order_ref, outs = _split_rest(cfg, rest)
    stages, k_stages, n_cp = cfg.num_stages, cfg.k_stages, cfg.copies_per_tile
    counters = None  # the pairs' arrival counters of the in-kernel merge
    if cfg.kernel_merge and not cfg.interpret:
        counters = pl.get_global(plgpu.SemaphoreType.REGULAR((cfg.num_seqs * cfg.num_kv_heads,)))
    b_slot, tail, s = lax.axis_index("b"), None, None
    if cfg.split_tail:
        # Slots [0, B - tail) read one sequence each (in the dispatch order); the last
        # split_tail sequences have num_splits consecutive slots each.
        whole, S = cfg.num_seqs - cfg.split_tail, cfg.num_splits
        j = jnp.maximum(b_slot - whole, 0)
        tail = b_slot >= whole
        b_slot, s = jnp.where(tail, whole + j // S, b_slot), jnp.where(tail, j % S, 0)
    seq = None
    if cfg.longest_first and not cfg.xla_order:
        with jax.named_scope("order"):  # the profiler's regions (``profile_dir``)
            if cfg.order_head:  # the head in batch order: no count
                seq = lax.cond(
                    b_slot < cfg.order_head,
                    lambda: (b_slot, len_ref[b_slot]),
                    lambda: _kernel_order(cfg, len_ref, b_slot),
                )
            else:
                seq = _kernel_order(cfg, len_ref, b_slot)
    h = lax.axis_index("h")
    s = lax.axis_index("s") if s is None else s
    unit = _unit(cfg, len_ref, base_ref, order_ref, b_slot, h, s, seq=seq, tail=tail)
    n = unit.n
    refs = (q_ref, k_ref, v_ref, bt_ref)

    q_scratch, ring_scratch, p_scratch, out_scratch = _scratch(cfg)
    q_barrier = plgpu.Barrier(num_arrivals=1)
    ring_barrier = plgpu.Barrier(num_arrivals=n_cp, num_barriers=stages)

    if not cfg.producer:
        k_barrier = plgpu.Barrier(num_arrivals=n_cp, num_barriers=k_stages)
        tiles = _staged_tiles(cfg) if cfg.staged else ()
        tc = _tc_scratch(cfg)

        def attend(*scratch):
            staged, tmem = scratch[7 : 7 + len(tiles)], scratch[7 + len(tiles) :]
            return _attend(cfg, refs, unit, *scratch[:7], tiles=staged or None, tc=tmem or None)

        acc, m, l = pl.run_scoped(
            attend, q_scratch, *ring_scratch, p_scratch, q_barrier, k_barrier, ring_barrier,
            *tiles, *tc,
        )  # fmt: skip
        with jax.named_scope("store"):
            out, lse = _finish(cfg, acc, m, l)
            # A second scope: stack-allocated, it reuses the ring's SMEM.
            if not cfg.kernel_merge:
                pl.run_scoped(
                    lambda *out_smem: _store(cfg, unit, outs, out_smem, out, lse), *out_scratch
                )
                return
            final_ref, *parts = outs

            def store_and_merge(out_smem, merge_smem):
                def split_store():
                    _store(cfg, unit, parts, out_smem, out, lse)
                    _merge_split(cfg, unit, counters, final_ref, parts, out_smem[0], merge_smem)

                if cfg.min_split_tiles <= 1 and not cfg.split_tail:
                    split_store()
                    return
                # A sequence read by one split: its output goes straight out, no partial and no
                # merge; splits past the ones that read store nothing and never arrive.
                alone = unit.splits == 1
                pl.when(alone & (unit.s == 0))(
                    lambda: _store(cfg, unit, (final_ref,), out_smem[:1], out, None, whole=True)
                )
                pl.when(~alone & (unit.s < unit.splits))(split_store)

            pl.run_scoped(store_and_merge, out_scratch, _merge_scratch(cfg))
        return

    def warp_specialized(q_smem, ring, p_smem, q_bar, k_bar, v_bar, k_consumed, v_consumed):
        (k_smem, v_smem), out_smem = ring
        wg = lax.axis_index("wg")

        def drain(consumed):
            """Observes each used slot's last 'consumed' completion (no refill waited on it).

            Free on hardware (nothing is refilled after them); keeps every completion observed,
            which the Mosaic GPU interpreter checks when the barrier is freed.
            """
            for d in range(stages):
                pl.when(d < n)(
                    lambda d=d: plgpu.barrier_wait(
                        consumed.at[lax.rem(n - 1 - d, jnp.int32(stages))]
                    )
                )

        @pl.when(wg == 1)
        def _producer():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

            @pl.loop(0, n)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                pages = _lookup(cfg, bt_ref, unit, i)  # the reads overlap the wait for the slot
                refill = i >= stages  # the slot last held tile i - stages
                pl.when(refill)(lambda: plgpu.barrier_wait(k_consumed.at[slot]))
                _issue(cfg, unit, i, slot, pages, [(k_ref, k_smem, k_bar)])
                pl.when(refill)(lambda: plgpu.barrier_wait(v_consumed.at[slot]))
                _issue(cfg, unit, i, slot, pages, [(v_ref, v_smem, v_bar)])

            drain(k_consumed)
            drain(v_consumed)

        @pl.when(wg == 0)
        def _compute():
            plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
            acc, m, l = _attend(
                cfg, refs, unit, q_smem, k_smem, v_smem, p_smem, q_bar, k_bar, v_bar,
                (k_consumed, v_consumed),
            )  # fmt: skip
            # Every copy into the ring has landed (all its barriers were waited on) and no
            # wgmma reads it any more: the output tiles may overwrite it.
            _store(cfg, unit, outs, out_smem, *_finish(cfg, acc, m, l))

    consumed_barrier = plgpu.Barrier(num_arrivals=1, num_barriers=stages)
    pl.run_scoped(
        warp_specialized,
        q_scratch,
        plgpu.RefUnion(ring_scratch, out_scratch),
        p_scratch,
        q_barrier,
        ring_barrier,
        ring_barrier,
        consumed_barrier,
        consumed_barrier,
        collective_axes="wg",
    )


def _persistent_body(cfg: _Config, q_ref, k_ref, v_ref, bt_ref, len_ref, base_ref, *rest):
    """Body of one persistent CTA: the work units c, then 2P - 1 - c, 2P + c, ... (a snake
    over the longest-first order of (sequence, split, KV head) units, P = ``num_ctas``).

    The K/V ring runs on across units: tile t of this CTA's stream (every unit's tiles in
    order) sits in slot t % stages, and the copies freed by the last tiles of a unit already
    fetch the next unit's first tiles, its Q tile is fetched as soon as the last Q K^T has
    read Q, and the output copies are not waited for. So a unit's start (Q load, first page
    latency) and end (output store) overlap the neighbouring units' streaming, where the
    one-unit-per-CTA grid paid them once per unit.
    """
    order_ref, outs = _split_rest(cfg, rest)
    stages, n_cp = cfg.num_stages, cfg.copies_per_tile
    K, S, P = cfg.num_kv_heads, cfg.num_splits, cfg.num_ctas
    num_units = cfg.num_seqs * S * K
    rounds = -(-num_units // P)
    c = lax.axis_index("c")

    def unit_at(r):
        u = r * P + jnp.where(r % 2 == 0, c, P - 1 - c)
        valid = u < num_units
        u = jnp.minimum(u, num_units - 1)
        return _unit(cfg, len_ref, base_ref, order_ref, u // (S * K), u % K, (u // K) % S, valid)

    def body(q_smem, k_smem, v_smem, p_out, q_bar, k_bar, v_bar):
        p_smem, out_smem = p_out
        kv = [(k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar)]
        smem = (q_smem, k_smem, v_smem, p_smem, k_bar, v_bar)

        def load_q(unit):
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(unit.qrow8, _ROWS)], q_smem, q_bar)

        def run_unit(r, carry):
            t0, n_prev, q_loaded = carry  # stream index of tile 0, the last unit's tiles
            cur, nxt = unit_at(r), unit_at(r + 1)
            n = cur.n
            pl.when((n > 0) & ~q_loaded)(lambda: load_q(cur))
            # The last unit's tail fetched tiles [stages - n_prev, stages) of this one.
            for t in range(stages):
                pl.when((t < n) & (t < stages - n_prev))(
                    lambda t=t: _issue(
                        cfg,
                        cur,
                        t,
                        lax.rem(t0 + t, jnp.int32(stages)),
                        _lookup(cfg, bt_ref, cur, t),
                        kv,
                    )
                )
            pl.when(n > 0)(lambda: plgpu.barrier_wait(q_bar))

            def step(i, carry):
                slot = lax.rem(t0 + i, jnp.int32(stages))
                j = i + stages - n  # the tile this slot takes next: this unit's or the next's
                in_cur = j < 0
                target = cur.where(in_cur, nxt)
                target_i = jnp.where(in_cur, i + stages, j)
                refill = in_cur | (j < nxt.n)
                pages = _lookup(cfg, bt_ref, target, target_i)  # in flight during the tile
                last = i == n - 1
                carry = _tile(
                    cfg, cur, i, slot, carry, smem,
                    after_qk=lambda: pl.when(last & (nxt.n > 0))(lambda: load_q(nxt)),
                    # Only a unit's first P can find the last unit's output copy reading
                    # the shared SMEM; units with no tile wait in _store.
                    before_p=lambda: pl.when(i == 0)(
                        lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    ),
                )  # fmt: skip
                pl.when(refill)(lambda: _issue(cfg, target, target_i, slot, pages, kv))
                return carry

            acc, m, l = lax.fori_loop(0, n, step, _init_carry(cfg))
            out, lse = _finish(cfg, acc, m, l)
            pl.when(cur.valid)(lambda: _store(cfg, cur, outs, out_smem, out, lse, wait=False))
            return t0 + n, n, (n > 0) & (nxt.n > 0)

        lax.fori_loop(0, rounds, run_unit, (jnp.int32(0), jnp.int32(0), jnp.bool_(False)))
        plgpu.wait_smem_to_gmem(0)

    q_scratch, ring_scratch, p_scratch, out_scratch = _scratch(cfg)
    pl.run_scoped(
        body,
        q_scratch,
        *ring_scratch,
        plgpu.RefUnion(p_scratch, out_scratch),  # P is dead once a unit's last P @ V is read
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=stages),
    )
