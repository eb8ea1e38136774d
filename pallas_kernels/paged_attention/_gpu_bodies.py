"""The CTA body of the Mosaic GPU decode kernel (``kernel_gpu``): one (sequence, split, KV head)
unit, with the longest-first order counted in the CTA (``_kernel_order``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import _gpu_quant
from pallas_kernels.paged_attention._gpu_config import _Config
from pallas_kernels.paged_attention._gpu_order import packed_key
from pallas_kernels.paged_attention._gpu_tcgen05 import _tc_scratch
from pallas_kernels.paged_attention._gpu_tile import (
    _attend,
    _finish,
    _scratch,
    _staged_tiles,
    _store,
    _unit,
)


def _split_rest(cfg: _Config, rest):
    """(order_ref, the scale refs (key, value, bases) or None, outputs) of the refs after the
    base: the order with ``xla_order``, the scales with quantized pages."""
    rest = list(rest)
    order_ref = rest.pop(0) if cfg.xla_order else None
    scales = (rest.pop(0), rest.pop(0), rest.pop(0)) if cfg.quantized else None
    return order_ref, scales, rest


def _kernel_order(cfg: _Config, len_ref, b_slot):
    """(sequence, length) of the sequence whose place in the longest-first order is ``b_slot``,
    counted by this CTA (``order_method="kernel"``): no XLA kernel before the launch.

    One TMA copy brings the B lengths to SMEM; each of the 128 threads computes ``B / 128``
    packed keys (as ``_gpu_order.longest_first_order``'s: ``(0x7FFF - tiles) << 16 | sequence``,
    distinct: ``packed_key``) and stores them to SMEM, and a loop over the B keys, read back as
    scalars, counts the smaller ones: the ranks. The sequence of rank ``b_slot`` is one sum
    over the warpgroup. B compares of B / 128 keys a thread (128 at B = 128), where ``"rank"``
    runs two [B, B] reductions in XLA kernels.
    """
    B, T = cfg.num_seqs, cfg.block_kv
    Bp = -(-B // 128) * 128  # a strided register layout covers 128 * k elements
    layout = plgpu.Layout.WG_STRIDED((Bp,), vec_size=Bp // 128)

    def count(len_smem, key_smem, bar):
        plgpu.copy_gmem_to_smem(len_ref, len_smem.at[pl.ds(0, B)], bar)
        plgpu.barrier_wait(bar)
        seqs = plgpu.broadcasted_iota(jnp.int32, (Bp,), 0, layout=layout)
        lengths = plgpu.load(len_smem, layout=layout)  # entries >= B: never written
        # Sequences past B: ranks past the others'.
        keys = jnp.where(seqs < B, packed_key(lengths, seqs, T), jnp.int32(0x7FFFFFFF))
        key_smem[...] = keys  # each key computed once, read back as a scalar by every thread
        plgpu.commit_smem()  # (its warpgroup barrier orders the stores before the loads)

        def smaller(i, rank):  # 4 keys a trip: their SMEM loads in flight together (B % 4 == 0)
            others = [key_smem[i * 4 + u] for u in range(4)]
            for other in others:
                rank = rank + (other < keys).astype(jnp.int32)
            return rank

        zeros = plgpu.layout_cast(jnp.zeros((Bp,), jnp.int32), layout)
        rank = lax.fori_loop(0, B // 4, smaller, zeros)
        b = jnp.sum(jnp.where(rank == b_slot, seqs, 0))
        return b, len_smem[b]

    return pl.run_scoped(
        count,
        plgpu.SMEM((Bp,), jnp.int32),
        plgpu.SMEM((Bp,), jnp.int32),
        plgpu.Barrier(num_arrivals=1),
    )


def _kernel_body(cfg: _Config, q_ref, k_ref, v_ref, bt_ref, len_ref, base_ref, *rest):
    """Body of one CTA: (sequence slot b, split s, KV head h)."""
    order_ref, scale_refs, outs = _split_rest(cfg, rest)
    stages, n_cp = cfg.num_stages, cfg.copies_per_tile
    b_slot = lax.axis_index("b")
    seq = None
    if cfg.longest_first and not cfg.xla_order:
        with jax.named_scope("order"):  # the profiler's regions (``profile_dir``)
            seq = _kernel_order(cfg, len_ref, b_slot)
    h = lax.axis_index("h")
    s = lax.axis_index("s")
    unit = _unit(cfg, len_ref, base_ref, order_ref, b_slot, h, s, seq=seq)
    refs = (q_ref, k_ref, v_ref, bt_ref)
    qs = None if scale_refs is None else _gpu_quant.unit_scales(cfg, *scale_refs, h)

    q_scratch, ring_scratch, p_scratch, out_scratch = _scratch(cfg)
    q_barrier = plgpu.Barrier(num_arrivals=1)
    k_arrivals, v_arrivals = n_cp, n_cp
    if cfg.quantized:  # per-token scales: more copies on the K barrier
        k_arrivals, v_arrivals = _gpu_quant.arrivals(cfg)
    k_barrier = plgpu.Barrier(num_arrivals=k_arrivals, num_barriers=stages)
    ring_barrier = plgpu.Barrier(num_arrivals=v_arrivals, num_barriers=stages)
    tiles = _staged_tiles(cfg) if cfg.staged else ()
    tc = _tc_scratch(cfg)
    quant = _gpu_quant.scratch(cfg)

    def attend(*scratch):
        staged, rest = scratch[7 : 7 + len(tiles)], scratch[7 + len(tiles) :]
        tmem, qsmem = rest[: len(tc)], rest[len(tc) :]
        q = None
        if qsmem:  # the dequantized tile, then the per-token scale rings
            q = (_gpu_quant.with_rings(cfg, qs, qsmem[1:]), qsmem[0])
        return _attend(
            cfg, refs, unit, *scratch[:7], tiles=staged or None, tc=tmem or None, quant=q
        )

    acc, m, l = pl.run_scoped(
        attend, q_scratch, *ring_scratch, p_scratch, q_barrier, k_barrier, ring_barrier,
        *tiles, *tc, *quant,
    )  # fmt: skip
    with jax.named_scope("store"):
        out_scale = None if qs is None else qs.v_head  # per-head value scales
        out, lse = _finish(cfg, acc, m, l, out_scale=out_scale)
        # A second scope: stack-allocated, it reuses the ring's SMEM.
        pl.run_scoped(lambda *out_smem: _store(cfg, unit, outs, out_smem, out, lse), *out_scratch)
