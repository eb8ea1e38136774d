"""Blackwell's tcgen05 pieces of the Mosaic GPU decode kernel (``mma="tcgen05"``): products by
one thread into tensor memory (TMEM), read back into registers, and the fences that order the
threads' TMEM reads before the next products."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir.dialects import nvvm

from pallas_kernels.paged_attention._gpu_config import _Config


@plgpu.inline_mgpu()
def _tmem_before_sync(ctx):
    del ctx
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


@plgpu.inline_mgpu()
def _tmem_after_sync(ctx):
    del ctx
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)


def tmem_sync(cfg: _Config, barrier) -> None:
    """``barrier()`` (a warpgroup barrier) ordering every thread's TMEM loads before any MMA
    the elected thread issues after it (tcgen05): each thread waits for its loads
    (``wait_load_tmem``) and fences before the barrier, and fences after it, so the next
    products may overwrite the accumulators the threads read. Just the barrier with wgmma; the
    interpreter, which runs a warpgroup as one and cannot run inline Mosaic GPU code, takes the
    wait and the barrier."""
    if cfg.tcgen05:
        plgpu.wait_load_tmem()
    fence = cfg.tcgen05 and not cfg.interpret
    if fence:
        _tmem_before_sync()
    barrier()
    if fence:
        _tmem_after_sync()


def _tc_product(acc_tmem, a, b, bar):
    """``a @ b`` by one tcgen05 MMA into ``acc_tmem`` (overwritten), issued by one thread; waits
    for it (``bar``: its completion, tensor-core ordered) and reads the result into registers."""
    plgpu.tcgen05_mma(acc_tmem, a, b, bar, accumulate=False)
    plgpu.barrier_wait(bar)
    return plgpu.async_load_tmem(acc_tmem)


_TMEM_LANES = 128  # a tcgen05 product's M: the rows of each part of O^T (``_o_parts``)


def _o_parts(cfg: _Config) -> int:
    """tcgen05: O^T [H, qcols] is H / 128 products of M = 128 head-dim rows each, kept as that
    many [128, qcols] arrays (a tuple; the register accumulator of one M = 128 product cannot
    grow past TMEM's 128 lanes). 0: wgmma, whose accumulator is one array."""
    return cfg.head_dim // _TMEM_LANES if cfg.tcgen05 else 0


def _acc_map(f, acc):
    """``f`` of the accumulator: of each of its parts with tcgen05 (``_o_parts``)."""
    return tuple(f(a) for a in acc) if isinstance(acc, tuple) else f(acc)


def _tc_pv(cfg: _Config, o_tmem, v_tile, p_smem, bar):
    """tcgen05: O^T = V^T P^T, one M = 128 MMA for each 128 rows of the head dim into its
    ``qcols`` columns of ``o_tmem``, issued in order by one thread (only the last arrives on
    ``bar``: an MMA's completion implies its predecessors'); the parts read into registers."""
    parts, q = _o_parts(cfg), cfg.qcols
    v_t = v_tile.transpose((1, 0))
    if parts == 1:
        return (_tc_product(o_tmem, v_t, p_smem.transpose((1, 0)), bar),)
    for j in range(parts):
        plgpu.tcgen05_mma(
            o_tmem.at[:, pl.ds(j * q, q)],
            v_tile.at[:, pl.ds(j * _TMEM_LANES, _TMEM_LANES)].transpose((1, 0)),
            p_smem.transpose((1, 0)),
            bar if j == parts - 1 else None,
            accumulate=False,
        )
    plgpu.barrier_wait(bar)
    return tuple(plgpu.async_load_tmem(o_tmem.at[:, pl.ds(j * q, q)]) for j in range(parts))


def _store_transposed(o_smem, out, dtype):
    """O^T (an array, or tcgen05's parts of 128 head-dim rows) into the [rows, H] tile
    ``o_smem`` through a transposed view."""
    if not isinstance(out, tuple) or len(out) == 1:
        o_smem.transpose((1, 0))[...] = (out[0] if isinstance(out, tuple) else out).astype(dtype)
        return
    for j, part in enumerate(out):
        cols = pl.ds(j * _TMEM_LANES, _TMEM_LANES)
        o_smem.at[:, cols].transpose((1, 0))[...] = part.astype(dtype)


def _tc_scratch(cfg: _Config):
    """tcgen05: the TMEM accumulators of the scores S^T [T, qcols] and of P @ V's O^T
    [H, qcols] (f32, qcols columns each of TMEM's 128 lanes), and the two barriers their MMAs
    arrive on when complete. Empty with wgmma."""
    if not cfg.tcgen05:
        return ()
    return (
        plgpu.TMEM((cfg.block_kv, cfg.qcols), jnp.float32),
        plgpu.TMEM((_TMEM_LANES, _o_parts(cfg) * cfg.qcols), jnp.float32),
        plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True),
    )
