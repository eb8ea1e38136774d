"""In-kernel log-sum-exp merge of split partials for the Mosaic GPU decode kernel.

Split-KV leaves each (sequence, KV head) pair's output in ``num_splits`` partials (a normalised
output in ``q.dtype`` and a base-2 log-sum-exp). Merged by XLA, that is three more kernels
after the attention kernel (about 3.6 us of kernel time at B=8 on the H200, and their launch
gaps). Merged in the kernel (``split_merge="kernel"``), the CTA that finishes a pair's
partials last merges them:

- every split CTA stores its partial (TMA), waits for the store, fences the async proxy and
  adds one to the pair's arrival counter with an acquire-release atomic (``arrive``);
- the CTA that sees ``num_splits - 1`` there is the last: it resets the counter to 0, loads
  the pair's partials (``merge``, rounds of up to ``batch`` pieces) and writes the output.

No CTA ever waits for another, so the grid may be any number of waves and CTAs may run in any
order (the balanced kernel's semaphore merge waits, and so needs every CTA resident). The
counters are a ``pl.get_global`` semaphore array, zeroed by JAX before each launch (a memset
in the same stream).

Mosaic GPU's interpreter runs the grid one CTA after the other in grid order and cannot run
inline Mosaic GPU code, so there the last split (``s == num_splits - 1``) is the last to
arrive and merges without a counter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref


def gmem_proxy_fence() -> None:
    """``fence.proxy.async.global`` in every thread: orders its TMA (async proxy) accesses to
    global memory with its generic ones (the atomics): a partial's TMA store before the
    arrival that announces it, and the merger's TMA loads after the arrival that found it
    last."""

    @plgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

    fence()


@functools.cache
def _arrive_fn():
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), splat, splat))
    def arrive(ctx, counters, flag, index, total):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        index, total = index.registers.flat[0], total.registers.flat[0]
        ptr = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(counters), [index], i32)
        # Every thread's TMA stores were waited for and fenced: after this barrier, the one
        # thread's release covers them all.
        mgpu_utils.warpgroup_barrier()
        with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
            old = mgpu_utils.inline_ptx(
                "atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;",
                ptr,
                result_types=i32,
                has_side_effects=True,
            )
            last = arith.cmpi(
                arith.CmpIPredicate.eq, old, arith.subi(total, arith.constant(i32, 1))
            )
            with mgpu_utils.when(last):  # every split has arrived: none touches it again
                mgpu_utils.inline_ptx(
                    "st.relaxed.gpu.global.u32 [$0], 0;", ptr, has_side_effects=True
                )
            memref.store(arith.extui(i32, last), flag, [arith.constant(ir.IndexType.get(), 0)])
        mgpu_utils.warpgroup_barrier()  # the flag is in SMEM for every thread
        return ()

    return arrive


def arrive(counters, flag_smem, index, total: int, *, split, interpret: bool):
    """Counts this CTA's partial (already stored and waited for) as arrived at pair ``index``
    of ``counters`` (a semaphore array, zero at launch); True (a traced bool) for the CTA that
    arrives last of ``total``, which must merge. ``flag_smem``: an i32[1] SMEM scratch.
    Interpreted: the last split (grid order), no counter."""
    if interpret:
        return split == total - 1
    gmem_proxy_fence()
    _arrive_fn()(counters, flag_smem, jnp.asarray(index, jnp.int32), jnp.int32(total))
    last = flag_smem[0] != 0
    gmem_proxy_fence()  # the TMA loads of the merge come after the acquire
    return last


def merge(
    pieces,
    load_piece: Callable[[int, jax.Array], None],
    mo_smem,
    ml_smem,
    m_bar,
    *,
    rows: int,
    head_dim: int,
    batch: int,
    lse_step: int,
):
    """The online log-sum-exp merge of ``pieces`` partials (traced count >= 1): f32 [rows,
    head_dim] (WG_STRIDED), the merged output (zeros where no piece saw a key).

    ``load_piece(j, k)`` copies piece k's output rows into ``mo_smem[j]`` ([batch, rows,
    head_dim], ``q.dtype``) and its lse row (``rows`` base-2 f32, one per query row; -inf for
    a piece that saw no key) into row ``j * lse_step`` of ``ml_smem``, both arriving on
    ``m_bar[j]``. Rounds of ``batch`` pieces: all loads of a round, then their combines.
    Rows a piece does not own hold stale data; they are merged and dropped by the caller.
    A round's loads wait for the previous round's reads of the buffers (``commit_smem``).
    """
    R, H = rows, head_dim
    layout = plgpu.Layout.WG_STRIDED((R, H), vec_size=min(8, R * H // 128))
    row_ids = plgpu.broadcasted_iota(jnp.int32, (R, H), 0, layout=layout)

    def combine(j, carry):
        m_run, s_run, acc = carry
        plgpu.barrier_wait(m_bar.at[j])
        o = plgpu.load(mo_smem.at[j], layout=layout).astype(jnp.float32)
        # This piece's lse of query row r, on row r: selected, not multiplied by a 0/1 mask
        # (0 * -inf, a piece that saw no key, is NaN; XLA on CPU simplifies the product to a
        # select, Mosaic GPU does not).
        lse = jnp.where(row_ids == 0, ml_smem[j * lse_step, 0], 0.0)
        for r in range(1, R):
            lse = jnp.where(row_ids == r, ml_smem[j * lse_step, r], lse)
        m_new = jnp.maximum(m_run, lse)
        ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha, w = jnp.exp2(m_run - ref), jnp.exp2(lse - ref)
        return m_new, s_run * alpha + w, acc * alpha + o * w

    def round_(g, carry):
        # The last round's reads of these buffers (generic proxy) before this round's TMA
        # writes (async proxy): a proxy fence and a warpgroup barrier.
        plgpu.commit_smem()
        for j in range(batch):
            k = g * batch + j
            pl.when(k < pieces)(functools.partial(load_piece, j, k))
        for j in range(batch):
            carry = lax.cond(
                g * batch + j < pieces,  # buffers past the last piece are never read
                functools.partial(combine, j),
                lambda carry: carry,
                carry,
            )
        return carry

    init = tuple(
        plgpu.layout_cast(jnp.full((R, H), v, jnp.float32), layout) for v in (-jnp.inf, 0.0, 0.0)
    )
    _, s_run, acc = lax.fori_loop(0, (pieces + batch - 1) // batch, round_, init)
    return acc / jnp.where(s_run == 0.0, 1.0, s_run)
