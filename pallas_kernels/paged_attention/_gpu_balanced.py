"""The balanced (stream-K) body of the Mosaic GPU decode kernel (``kernel_gpu``,
``balanced=True``): equal shares of every pair's tiles, cut pairs merged in the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import _merge_gpu
from pallas_kernels.paged_attention._gpu_config import (
    _ROWS,
    _TMA_MAX_DIM,
    _Config,
    _lse_row_step,
    _merge_batch,
    _ring_bytes,
)
from pallas_kernels.paged_attention._gpu_tile import (
    _attend,
    _finish,
    _make_unit,
    _scratch,
    _tile_span,
)


def _balanced_smem_bytes(head_dim: int, block_kv: int, stages: int, qcols: int, B: int) -> int:
    """SMEM of one balanced CTA as ``_balanced_body`` lays it out: the ring (shared with the
    merge buffers and the tile counts, where they are smaller), Q and P (shared with the output
    and lse tiles), the lengths, and 3 KB of barriers, alignment and Pallas's reduction
    scratch."""
    Bp = -(-B // 128) * 128
    ring = _ring_bytes(head_dim, block_kv, stages)
    tiles = max(qcols * (head_dim + block_kv) * 2, qcols * head_dim * 2 + _ROWS * qcols * 4)
    return max(ring, Bp * 4) + tiles + Bp * 4 + 3 * 1024


def _balanced_ctas_per_sm(head_dim: int, block_kv: int, stages: int, qcols: int, B: int) -> int:
    """CTAs of the balanced kernel resident on one SM by SMEM (228 KB, 1 KB reserved each)."""
    smem = _balanced_smem_bytes(head_dim, block_kv, stages, qcols, B)
    return max(1, (228 * 1024) // (smem + 1024))


def _stream_tiles(cfg: _Config, length):
    """A (sequence, KV head) pair's share of the balanced stream: the tiles it reads, and one
    for a pair with none (length 0), so that every pair has a place and an owner that writes
    its zeros."""
    return jnp.maximum(_tile_span(cfg, length)[2], 1)


def _balanced_schedule(cfg: _Config, len_ref, len_smem, tiles_smem, c):
    """Where CTA c's share of the balanced stream starts: (total, chunk, b0, pre0).

    The stream is every (sequence, KV head) pair's tiles one after the other, sequence-major
    (``_stream_tiles`` each, the same for the K heads of a sequence): ``total`` tiles, of which
    CTA c takes [c * chunk, (c + 1) * chunk), chunk = ceil(total / P). ``b0`` is the sequence
    holding tile c * chunk (B if none does) and ``pre0`` the tiles of one head of each sequence
    before it. One TMA copy brings the lengths to SMEM (``len_smem``, which the walk reads
    after); each thread sums the tiles of the sequences up to its own (``B / 128`` a thread, B
    scalar SMEM reads, as ``_kernel_order`` counts), and two reductions over the warpgroup find
    b0 and pre0. All on device: nothing syncs with the host.
    """
    B, K, P = cfg.num_seqs, cfg.num_kv_heads, cfg.num_ctas
    Bp = len_smem.shape[0]
    Bc = -(-B // 4) * 4  # lengths copied (padded to 16 bytes by the caller)
    layout = plgpu.Layout.WG_STRIDED((Bp,), vec_size=Bp // 128)

    def count(bar):
        for off in range(0, Bc, _TMA_MAX_DIM):  # a TMA box spans at most 256 elements
            size = min(_TMA_MAX_DIM, Bc - off)
            plgpu.copy_gmem_to_smem(
                len_ref.at[pl.ds(off, size)], len_smem.at[pl.ds(off, size)], bar
            )
        plgpu.barrier_wait(bar)
        seqs = plgpu.broadcasted_iota(jnp.int32, (Bp,), 0, layout=layout)
        lengths = jnp.maximum(plgpu.load(len_smem, layout=layout), 0)  # >= Bc: unwritten
        tiles = jnp.where(seqs < B, _stream_tiles(cfg, lengths), 0)
        tiles_smem[...] = tiles
        plgpu.commit_smem()

        def upto(i, incl):  # 4 sequences a trip: their SMEM loads in flight together
            others = [tiles_smem[i * 4 + u] for u in range(4)]
            for u, other in enumerate(others):
                incl = incl + jnp.where(i * 4 + u <= seqs, other, 0)
            return incl

        zeros = plgpu.layout_cast(jnp.zeros((Bp,), jnp.int32), layout)
        incl = lax.fori_loop(0, Bc // 4, upto, zeros)  # tiles of sequences 0..b, one head
        total = K * jnp.sum(tiles)
        chunk = (total + P - 1) // P
        b0 = jnp.sum(((seqs < B) & (K * incl <= c * chunk)).astype(jnp.int32))
        pre0 = jnp.sum(jnp.where(seqs == b0, incl - tiles, 0))
        return total, chunk, b0, pre0

    return pl.run_scoped(count, plgpu.Barrier(num_arrivals=-(-Bc // _TMA_MAX_DIM)))


def _balanced_body(
    cfg: _Config, q_ref, k_ref, v_ref, bt_ref, len_ref, base_ref, out_ref, part_o, part_lse
):
    """Body of one CTA of the balanced grid (``balanced=True``): P = ``num_ctas`` CTAs, CTA c
    reads tiles [c * chunk, (c + 1) * chunk) of the stream of every (sequence, KV head) pair's
    tiles (``_balanced_schedule``), so every CTA streams the same bytes whatever the lengths
    (stream-K). No unit is longer than another, so no tail of long units runs alone after
    the others (the drain that the timeline shows for the grid of whole units).

    A CTA walks its share pair by pair (a segment each). A pair wholly inside the share is
    finished and stored. A pair cut by a share boundary leaves a partial (its normalised
    output in ``q.dtype`` and base-2 lse) in the slot 2c (the share's first segment) or 2c + 1
    (its last), and the CTA holding the pair's last piece, c2, merges the pieces: the others
    signal c2's semaphore once their partial is stored, and c2, at the end of its share, waits
    for them, loads the partials (``_merge_batch`` at a time) and writes the output. A CTA
    waits only for CTAs of lower index. By default every CTA is resident at once (``num_ctas``
    from ``_balanced_ctas_per_sm``), so none waits for one that has not started. With more CTAs
    than fit, it relies on the hardware starting CTAs in index order, as it does (CUDA does not
    promise it). The Mosaic GPU interpreter runs the CTAs one after the
    other in index order, so it needs (and has) no semaphores.
    """
    B, N, K, G, P = cfg.num_seqs, cfg.num_q_heads, cfg.num_kv_heads, cfg.group, cfg.num_ctas
    R, H = cfg.q_rows, cfg.head_dim
    NB = _merge_batch(H, cfg.block_kv, cfg.num_stages, R)
    c = lax.axis_index("c")
    refs = (q_ref, k_ref, v_ref, bt_ref)
    sem = None if cfg.interpret else pl.get_global(plgpu.SemaphoreType.REGULAR((P,)))

    def body(ring_merge, tiles, len_smem, q_bar, k_bar, v_bar, m_bar):
        (k_smem, v_smem), (mo_smem, ml_smem), (tiles_smem,) = ring_merge
        (q_smem, p_smem), (o_smem, lse_smem) = tiles

        def store_rows(qrow, qoff):  # a pair's G output rows (at qoff in o_smem) to the output
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(qoff, G)], out_ref.at[pl.ds(qrow, G)])

        with jax.named_scope("order"):  # the profiler's regions (``profile_dir``)
            total, chunk, b0, pre0 = _balanced_schedule(cfg, len_ref, len_smem, tiles_smem, c)
        r0 = c * chunk
        r1 = jnp.minimum(r0 + chunk, total)
        b0 = jnp.minimum(b0, B - 1)  # B: an empty share (r0 >= total), no segment
        t0 = _stream_tiles(cfg, jnp.maximum(len_smem[b0], 0))
        h0 = jnp.minimum((r0 - K * pre0) // t0, K - 1)
        p0 = K * pre0 + h0 * t0  # the first pair's place in the stream
        e0 = p0 + t0

        def segment(carry):
            pos, b, h, pre = carry  # pair (b, h) starts at K * pre + h * t
            length = jnp.maximum(len_smem[b], 0)
            lo, t_lo, tiles = _tile_span(cfg, length)
            t = jnp.maximum(tiles, 1)
            p_start = K * pre + h * t
            p_end = p_start + t
            first = pos - p_start
            n = jnp.maximum(jnp.minimum(jnp.minimum(p_end, r1) - p_start, tiles) - first, 0)
            unit = _make_unit(cfg, base_ref, b, length, lo, h, t_lo + first, n)
            acc, m, l = _attend(
                cfg, refs, unit, q_smem, k_smem, v_smem, p_smem, q_bar, k_bar, v_bar
            )
            with jax.named_scope("store"):
                out, lse = _finish(cfg, acc, m, l, with_lse=True)
                whole = (p_start >= r0) & (p_end <= r1)
                o_smem.transpose((1, 0))[...] = out.astype(cfg.dtype)  # O^T stored as rows
                plgpu.commit_smem()

                pl.when(whole)(lambda: store_rows(unit.qrow, unit.qoff))

                @pl.when(~whole)
                def _():
                    slot = 2 * c + (pos != r0).astype(jnp.int32)
                    lse_smem[...] = lax.broadcast_in_dim(lse, lse_smem.shape, [1])
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem, part_o.at[slot])
                    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, 1)], part_lse.at[pl.ds(slot, 1)])

                plgpu.wait_smem_to_gmem(0)  # stored (and o_smem free for the next segment)
                if sem is not None:

                    @pl.when(~whole & (p_end > r1))  # a piece of a pair the next CTAs finish
                    def _():
                        _merge_gpu.gmem_proxy_fence()
                        pl.semaphore_signal(sem.at[(p_end - 1) // chunk])

            wrap = h + 1 == K
            return (
                jnp.minimum(p_end, r1),
                jnp.where(wrap, b + 1, b),
                jnp.where(wrap, 0, h + 1),
                jnp.where(wrap, pre + t, pre),
            )

        lax.while_loop(lambda carry: carry[0] < r1, segment, (r0, b0, h0, pre0))

        @pl.when((r0 < total) & (p0 < r0) & (e0 <= r1))  # this CTA holds a pair's last piece
        def _merge():
            with jax.named_scope("merge"):
                c1 = p0 // chunk  # the pair's first piece: c1's last segment, or its first
                pieces = c - c1 + 1
                if sem is not None:
                    plgpu.semaphore_wait(sem.at[c], pieces - 1)
                    _merge_gpu.gmem_proxy_fence()
                first_slot = 2 * c1 + (p0 != c1 * chunk).astype(jnp.int32)
                step = _lse_row_step(R)

                def load_piece(j, k):  # piece k -> merge buffer j
                    slot = jnp.where(k == 0, first_slot, 2 * (c1 + k))
                    plgpu.copy_gmem_to_smem(part_o.at[slot], mo_smem.at[j], m_bar.at[j])
                    plgpu.copy_gmem_to_smem(
                        part_lse.at[pl.ds(slot, 1)], ml_smem.at[pl.ds(j * step, 1)], m_bar.at[j]
                    )

                merged = _merge_gpu.merge(
                    pieces, load_piece, mo_smem, ml_smem, m_bar, rows=R, head_dim=H, batch=NB,
                    lse_step=step,
                )  # fmt: skip
                o_smem[...] = merged.astype(cfg.dtype)
                plgpu.commit_smem()
                qrow = b0 * N + h0 * G
                store_rows(qrow, qrow % 8)
                plgpu.wait_smem_to_gmem(0)

    q_scratch, ring_scratch, p_scratch, _ = _scratch(cfg)
    n_cp = cfg.copies_per_tile
    # A piece's lse row lands 128-byte aligned, as a TMA copy into SMEM needs
    # (``_lse_row_step``).
    merge_scratch = (
        plgpu.SMEM((NB, R, H), cfg.dtype),
        plgpu.SMEM((NB * _lse_row_step(R), R), jnp.float32),
    )
    Bp = -(-B // 128) * 128
    # Swizzled tiles on 1024-byte boundaries: the ring first (64 KB at H=128), then Q and P
    # (sizes multiples of 1 KB), small buffers last. Two unions keep the kernel at three CTAs
    # per SM (``_balanced_ctas_per_sm``): the ring with the schedule's tile counts (before the
    # walk) and the merge buffers (after it), and Q and P with the output and lse tiles (a
    # segment's stores complete before the next segment loads its Q).
    out_tiles = (plgpu.SMEM((R, H), cfg.dtype), plgpu.SMEM((_ROWS, R), jnp.float32))
    pl.run_scoped(
        body,
        plgpu.RefUnion(ring_scratch, merge_scratch, (plgpu.SMEM((Bp,), jnp.int32),)),
        plgpu.RefUnion((q_scratch, p_scratch), out_tiles),
        plgpu.SMEM((Bp,), jnp.int32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=cfg.num_stages),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=cfg.num_stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=NB),
    )
