"""The two CTA bodies of the Mosaic GPU ragged kernel (``kernel_gpu``): ``_kernel_body`` (Q and
P as SMEM wgmma operands; the one the interpreter runs) and ``_kernel_body_fa3`` (a producer
warpgroup, P as a register operand, two compute warpgroups in ping-pong)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._gpu.config import LOG2E, LSE_COLS, PRODUCER_REGISTERS, ROWS, smem_transforms
from pallas_kernels.ragged_paged_attention import _gpu_quant
from pallas_kernels.ragged_paged_attention._gpu_config import _Config
from pallas_kernels.ragged_paged_attention._gpu_tile import (
    _compute_registers,
    _finish,
    _init_state,
    _issue,
    _load_q,
    _persistent_items,
    _tile,
    _tile_rows,
    _visible,
    _wait_q,
    _zero_v_tail,
)


def _kernel_body(
    cfg: _Config, q_ref, k_ref, v_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref,
    order_ref, qs_ref, store_ref, *rest,
):  # fmt: skip
    """One CTA: work unit ``i`` (query tile ``order[i // S]``, split ``i % S``) x KV head ``h``,
    ``num_wgs`` warpgroups. ``rest``: with quantized pages the key and value scales and their
    bases (``_gpu_quant``), then the output (and the split LSE).

    Warpgroup ``w`` owns rows ``[64 w, 64 (w + 1))`` of the tile (tokens ``[w Tw, (w+1) Tw)``);
    all warpgroups share the K/V ring, which warpgroup 0 refills once every warpgroup has
    consumed a slot (``c_bar``). Quantized, each warpgroup dequantizes a slot's K, then its V,
    into a bf16 tile of its own.
    """
    scale_refs, (o_ref, *lse) = (rest[:3], rest[3:]) if cfg.quantized else (None, rest)
    lse_ref = lse[0] if lse else None
    H, W = cfg.head_dim, cfg.num_wgs
    stages, dtype = cfg.num_stages, cfg.dtype
    t = _tile(
        cfg, q_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref, order_ref, qs_ref,
        store_ref,
    )  # fmt: skip
    wg, cwg, n, n_full, t_lo = t.wg, t.cwg, t.n, t.n_full, t.t_lo
    T = cfg.block_kv

    def scoped(
        q_smem2, k_smem, v_smem, p_smem2, o_smem2, lse_smem2, q_bar, k_bar, v_bar, c_bar, *quant
    ):  # fmt: skip
        q_smem, p_smem = q_smem2.at[cwg], p_smem2.at[cwg]
        ts = deq = None
        if cfg.quantized:  # the scales, this warpgroup's bf16 tile, the token-scale rings
            ts = _gpu_quant.tile_scales(cfg, scale_refs, lax.axis_index("h"), quant[1:])
            deq = quant[0].at[cwg]
        o_smem = None if o_smem2 is None else o_smem2.at[cwg]
        lse_smem = None if lse_smem2 is None else lse_smem2.at[cwg]

        def tile_rows(step):
            # Loaded a whole step ahead of the copies so the block-table reads' latency hides
            # behind the current tile's math.
            return _tile_rows(cfg, t, bt_ref, step)

        def issue(rows, slot):
            _issue(cfg, k_ref, k_smem, k_bar, rows, slot)
            _issue(cfg, v_ref, v_smem, v_bar, rows, slot)
            if ts is not None:  # per-token scales beside the pages
                _gpu_quant.issue(cfg, ts, t.head_base, rows, slot, 0, k_bar)
                _gpu_quant.issue(cfg, ts, t.head_base, rows, slot, 1, k_bar)

        def drain_consumed():
            """Observes each slot's last 'consumed' completion (the refills skipped them).

            Free on hardware (nothing is refilled after them); keeps every completion observed,
            which the Mosaic GPU interpreter checks when the barrier is freed.
            """
            for d in range(stages):
                pl.when(d < n)(
                    lambda d=d: plgpu.barrier_wait(c_bar.at[lax.rem(n - 1 - d, jnp.int32(stages))])
                )

        def compute():
            _load_q(cfg, t, q_ref, q_smem, o_smem, q_bar.at[cwg])
            if not cfg.producer:
                for s in range(stages):
                    pl.when((s < n) & (wg == 0))(functools.partial(issue, tile_rows(s), s))
            _wait_q(cfg, q_smem, o_smem, q_bar.at[cwg])
            acc, m, l = _init_state(H)

            def step(masked: bool, st, carry):
                acc, m, l = carry
                slot = lax.rem(st, jnp.int32(stages))
                tile_tok = (t_lo + st) * T
                next_rows = None if cfg.producer else tile_rows(st + stages)
                if ts is not None:  # per-page scales: their loads in flight during the wait
                    scalars = _gpu_quant.page_scalars(cfg, ts, t, bt_ref, st)
                plgpu.barrier_wait(k_bar.at[slot])
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
                if ts is not None:
                    _gpu_quant.dequantize(cfg, k_tile, deq)
                    k_tile = v_tile = deq

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
                    return acc_ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((ROWS, T), jnp.float32))
                if ts is not None:  # keys' scales (stale keys past the end are masked below)
                    sc = _gpu_quant.scale_scores(cfg, ts, scalars, slot, sc)
                if cfg.logits_soft_cap:
                    cap = cfg.logits_soft_cap
                    sc = (cap * LOG2E) * jnp.tanh(sc * (cfg.sm_scale / cap))
                else:
                    sc = sc * (cfg.sm_scale * LOG2E)
                if masked:
                    sc = jnp.where(_visible(cfg, t, tile_tok, sc.shape), sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1))
                if cfg.sliding_window is not None or cfg.kv_splits > 1:
                    # a row may see nothing in its first tiles (window) or a whole split
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                else:
                    m_use = m_new
                alpha = jnp.exp2(m - m_use)
                p = jnp.exp2(sc - lax.broadcast_in_dim(m_use, sc.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                if ts is not None:  # values' scales ride on P (l sums the unscaled P)
                    p = _gpu_quant.scale_probabilities(
                        cfg, ts, scalars, slot, p, t.kv_len - tile_tok
                    )
                p_smem[...] = p.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_wait(v_bar.at[slot])
                if ts is not None:  # zeros past the end on the masked tiles
                    valid = t.kv_len - tile_tok if masked else None
                    _gpu_quant.dequantize(cfg, v_smem.at[slot], deq, valid)
                elif masked:
                    _zero_v_tail(cfg, t, v_smem.at[slot], tile_tok)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_tile)
                    return acc_ref[...]

                o = pl.run_scoped(pv, plgpu.ACC((ROWS, H), jnp.float32))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o
                if W > 1 or cfg.producer:
                    plgpu.barrier_arrive(c_bar.at[slot])

                if not cfg.producer:

                    @pl.when((st + stages < n) & (wg == 0))
                    def _refill():
                        if W > 1:  # every warpgroup is done with the slot
                            plgpu.barrier_wait(c_bar.at[slot])
                        issue(next_rows, slot)

                return acc, m_new, l

            carry = lax.fori_loop(0, n_full, functools.partial(step, False), (acc, m, l))
            acc, m, l = lax.fori_loop(n_full, n, functools.partial(step, True), carry)
            if W > 1 and not cfg.producer:
                pl.when(wg == 0)(drain_consumed)
            _finish(
                cfg, t, acc, m, l, q_smem, o_smem, o_ref, lse_smem, lse_ref,
                out_scale=_gpu_quant.output_scale(cfg, ts),
            )  # fmt: skip

        if not cfg.producer:
            compute()
            return

        @pl.when(wg == W)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            @pl.loop(0, n)
            def _(st):
                slot = lax.rem(st, jnp.int32(stages))

                @pl.when(st >= stages)
                def _():  # every compute warpgroup is done with the slot
                    plgpu.barrier_wait(c_bar.at[slot])

                issue(tile_rows(st), slot)

            drain_consumed()

        @pl.when(wg < W)
        def _compute():
            plgpu.set_max_registers(_compute_registers(W), action="increase")
            compute()

    tr = smem_transforms()
    threads = W + int(cfg.producer)
    n_cp = cfg.copies_per_tile
    q_arrivals = cfg.group if cfg.direct_io else 1
    ring_tr, ring_dtype = _gpu_quant.ring_transforms(cfg), cfg.kv_dtype or dtype
    k_arrivals, v_arrivals = _gpu_quant.arrivals(cfg) if cfg.quantized else (n_cp, n_cp)
    pl.run_scoped(
        scoped,
        plgpu.SMEM((W, ROWS, H), dtype, transforms=tr),
        plgpu.SMEM((stages, T, H), ring_dtype, transforms=ring_tr),
        plgpu.SMEM((stages, T, H), ring_dtype, transforms=ring_tr),
        plgpu.SMEM((W, ROWS, T), dtype, transforms=tr),
        plgpu.SMEM((W, ROWS, H), dtype) if cfg.direct_io else None,
        plgpu.SMEM((W, ROWS, LSE_COLS), jnp.float32) if cfg.kv_splits > 1 else None,
        plgpu.Barrier(num_arrivals=q_arrivals, num_barriers=W),
        plgpu.Barrier(num_arrivals=k_arrivals, num_barriers=stages),
        plgpu.Barrier(num_arrivals=v_arrivals, num_barriers=stages),
        plgpu.Barrier(num_arrivals=W, num_barriers=stages) if threads > 1 else None,
        *_gpu_quant.scratch(cfg, W),
        **({"collective_axes": "wg"} if threads > 1 else {}),
    )


def _kernel_body_fa3(
    cfg: _Config, q_ref, k_ref, v_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref,
    order_ref, qs_ref, store_ref, o_ref, lse_ref=None,
):  # fmt: skip
    """FA3-style CTA: a producer warpgroup issues every K/V page copy; ``num_wgs`` compute
    warpgroups take P as a register wgmma operand and accumulate ``P @ V`` onto the running
    output in place; K and V slots are released separately (K right after ``Q K^T``); with two
    compute warpgroups a schedule barrier alternates their tensor-core phases (ping-pong), so one
    warpgroup's softmax overlaps the other's matmuls. Needs the GPU: the Mosaic GPU interpreter
    cannot run register wgmma operands (``research/mosaic_gpu.md`` section 5).

    With ``paired`` the two compute warpgroups run two different query tiles (decode-heavy
    batches: a tile there is one token, and a second warpgroup on the same K/V would compute
    padding): each has its own K/V ring, and the producer feeds both rings, so one CTA per SM
    keeps two independent K/V streams in flight without a second CTA's registers.

    With ``persistent`` (P CTAs, one per SM) each CTA runs its work items one after another
    (``_persistent_items``): the ring's steps count on across items, so the producer fills the
    next item's first K/V tiles while the compute warpgroups finish the current one, and each
    compute warpgroup loads its next Q tile into a staging tile of its own while it computes.
    A short prompt's tile visits a few K/V tiles, and the per-CTA start (schedule reads, block
    table, Q and first K/V latency) is then a large part of its time.
    """
    H, W, T = cfg.head_dim, cfg.num_wgs, cfg.block_kv
    stages, dtype = cfg.num_stages, cfg.dtype
    pingpong = W == 2 and not cfg.paired
    persistent = cfg.persistent > 0
    tile_refs = (
        q_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref, order_ref, qs_ref,
        store_ref,
    )  # fmt: skip
    if persistent:
        num_items, item_of = _persistent_items(cfg, order_ref.shape[0] * cfg.kv_splits)

        def tile_of(j, pick=None):  # ``pick`` is paired's, which is never persistent
            return _tile(cfg, *tile_refs, item=item_of(j))
    else:
        num_items, t_cta = None, _tile(cfg, *tile_refs)

        def tile_of(j, pick=None):
            return t_cta if pick is None else _tile(cfg, *tile_refs, pick=pick)

    def over_items(body):
        """``body(j, step0) -> step0 + K/V tiles of item j`` over this CTA's items; ``step0``
        counts the ring's steps across items (None: the CTA's one item, from step 0)."""
        if not persistent:
            body(None, None)
        else:
            lax.fori_loop(0, num_items, body, jnp.int32(0))

    def ring_step(step0, st):  # the ring's step count at the item's step ``st``
        return st if step0 is None else step0 + st

    wg = lax.axis_index("wg")
    cwg = jnp.minimum(wg, W - 1)
    # Scores stay unscaled; the scale is folded into exp2's argument (one FMA per score).
    fold = not cfg.logits_soft_cap and cfg.sm_scale > 0
    c = cfg.sm_scale * LOG2E

    def scoped(
        q_smem2, k_smem, v_smem, o_smem2, lse_smem2, stage_smem2, q_bar, k_bar, v_bar, kc_bar,
        vc_bar, sched_bar,
    ):  # fmt: skip
        def sched():  # the other compute warpgroup's matching phase has begun
            plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(sched_bar)

        @pl.when(wg == W)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            def item(j, step0):
                # The tiles whose rings this warpgroup fills: the item's one, or (paired) each
                # compute warpgroup's, ring r in slots [r * stages, (r + 1) * stages).
                tiles = [tile_of(j, pick=r) for r in range(W)] if cfg.paired else [tile_of(j)]
                n_max = functools.reduce(jnp.maximum, [tr.n for tr in tiles])

                @pl.loop(0, n_max)
                def _(st):
                    g = ring_step(step0, st)
                    slot = lax.rem(g, jnp.int32(stages))
                    rows = [_tile_rows(cfg, tr, bt_ref, st) for tr in tiles]
                    for src, smem, bar, consumed in ((k_ref, k_smem, k_bar, kc_bar),
                                                     (v_ref, v_smem, v_bar, vc_bar)):  # fmt: skip
                        for r, tr in enumerate(tiles):

                            @pl.when(st < tr.n)
                            def _(r=r, src=src, smem=smem, bar=bar, consumed=consumed):
                                s = slot + r * stages
                                pl.when(g >= stages)(lambda: plgpu.barrier_wait(consumed.at[s]))
                                _issue(cfg, src, smem, bar, rows[r], s)

                return None if step0 is None else step0 + n_max

            over_items(item)

        @pl.when(wg < W)
        def _compute():
            plgpu.set_max_registers(_compute_registers(W), action="increase")
            q_smem = q_smem2.at[cwg]
            o_smem = None if o_smem2 is None else o_smem2.at[cwg]
            lse_smem = None if lse_smem2 is None else lse_smem2.at[cwg]
            # Q arrives in the untiled staging tile: O's (one item), or its own (persistent:
            # the next item's Q is in flight while O is stored)
            q_stage = stage_smem2.at[cwg] if persistent else o_smem
            ring = cwg * stages if cfg.paired else 0  # first slot of this warpgroup's ring
            if persistent:
                pl.when(num_items > 0)(
                    lambda: _load_q(cfg, tile_of(0), q_ref, q_smem, q_stage, q_bar.at[cwg])
                )
            else:
                _load_q(cfg, tile_of(0), q_ref, q_smem, q_stage, q_bar.at[cwg])

            def item(j, step0):
                t = tile_of(j)
                n = t.n
                _wait_q(cfg, q_smem, q_stage, q_bar.at[cwg])
                if persistent:  # the next item's Q, while this one computes
                    pl.when(j + 1 < num_items)(
                        lambda: _load_q(cfg, tile_of(j + 1), q_ref, q_smem, q_stage, q_bar.at[cwg])
                    )

                def slot_of(st):
                    if step0 is None and isinstance(st, int):
                        return ring + st % stages
                    return ring + lax.rem(ring_step(step0, st), jnp.int32(stages))

                acc, m, l = _init_state(H)
                pl.when(n > 0)(lambda: plgpu.barrier_wait(k_bar.at[slot_of(0)]))
                if pingpong:
                    pl.when(wg == 1)(sched)

                def step(masked: bool, st, carry):
                    acc, m, l = carry
                    slot = slot_of(st)
                    tile_tok = (t.t_lo + st) * T

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                        if pingpong:
                            sched()
                        return acc_ref[...]

                    sc = pl.run_scoped(qk, plgpu.ACC((ROWS, T), jnp.float32))
                    plgpu.barrier_arrive(kc_bar.at[slot])
                    if cfg.logits_soft_cap:
                        cap = cfg.logits_soft_cap
                        sc = (cap * LOG2E) * jnp.tanh(sc * (cfg.sm_scale / cap))
                    elif not fold:
                        sc = sc * c
                    if masked:
                        sc = jnp.where(_visible(cfg, t, tile_tok, sc.shape), sc, -jnp.inf)
                    m_new = jnp.maximum(m, sc.max(axis=1) * c if fold else sc.max(axis=1))
                    if cfg.sliding_window is not None or cfg.kv_splits > 1:
                        # a row may see nothing in its first tiles (window) or a whole split
                        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                    else:
                        m_use = m_new
                    alpha = jnp.exp2(m - m_use)
                    m_b = lax.broadcast_in_dim(m_use, sc.shape, [0])
                    p = jnp.exp2(sc * c - m_b if fold else sc - m_b)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l = l * alpha + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    # The order of these barriers against the softmax's tail matters for speed
                    # (JAX's FA3 example found the same); keep the math above them.
                    acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                    if pingpong:
                        plgpu.barrier_arrive(sched_bar)  # softmax done
                    plgpu.barrier_wait(v_bar.at[slot])
                    if masked:
                        _zero_v_tail(cfg, t, v_smem.at[slot], tile_tok)
                    if pingpong:
                        plgpu.barrier_wait(sched_bar)  # the tensor cores are free

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        nxt = st + 1

                        @pl.when(nxt < n)
                        def _():  # overlaps the wgmma in flight
                            plgpu.barrier_wait(k_bar.at[slot_of(nxt)])

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(vc_bar.at[slot])
                    return acc, m_new, l

                carry = lax.fori_loop(0, t.n_full, functools.partial(step, False), (acc, m, l))
                acc, m, l = lax.fori_loop(t.n_full, n, functools.partial(step, True), carry)
                if pingpong:
                    pl.when(wg == 0)(sched)
                _finish(cfg, t, acc, m, l, q_smem, o_smem, o_ref, lse_smem, lse_ref)
                return None if step0 is None else step0 + n

            over_items(item)
            if persistent:  # the last stores' writes (``_finish`` waited for their reads)
                plgpu.wait_smem_to_gmem(0)

    tr = smem_transforms()
    n_cp = cfg.copies_per_tile
    rings, users = (W, 1) if cfg.paired else (1, W)  # K/V rings; warpgroups reading each slot
    pl.run_scoped(
        scoped,
        plgpu.SMEM((W, ROWS, H), dtype, transforms=tr),
        plgpu.SMEM((rings * stages, T, H), dtype, transforms=tr),
        plgpu.SMEM((rings * stages, T, H), dtype, transforms=tr),
        plgpu.SMEM((W, ROWS, H), dtype) if cfg.direct_io else None,
        plgpu.SMEM((W, ROWS, LSE_COLS), jnp.float32) if cfg.kv_splits > 1 else None,
        plgpu.SMEM((W, ROWS, H), dtype) if persistent else None,
        plgpu.Barrier(num_arrivals=cfg.group if cfg.direct_io else 1, num_barriers=W),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=rings * stages),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=rings * stages),
        plgpu.Barrier(num_arrivals=users, num_barriers=rings * stages),
        plgpu.Barrier(num_arrivals=users, num_barriers=rings * stages),
        plgpu.Barrier(num_arrivals=W) if pingpong else None,
        collective_axes="wg",
    )
