"""The log-sum-exp merge of split partials for the Mosaic GPU decode kernel: in the kernel, or
by a second kernel.

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

``merge_partials`` is the other way (``split_merge="mosaic"``, the default at 2-32 splits): a
second, small Mosaic GPU kernel after the attention kernel, one CTA a pair, no atomics. It
replaces the XLA epilogue's three kernels with one (fewer launches for the host to dispatch and
for the GPU to space out) and, unlike the in-kernel merge, leaves the last split CTA nothing
to do after its own tiles.
"""

from __future__ import annotations

import functools
import math
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


def _on_rows(row_ids, rows: int, value_of):
    """``value_of(r)`` (a scalar) on every element of row r of a [rows, H] register array:
    selected row by row, not multiplied by a 0/1 mask (0 * -inf, a piece that saw no key, is
    NaN)."""
    out = jnp.where(row_ids == 0, value_of(0), 0.0)
    for r in range(1, rows):
        out = jnp.where(row_ids == r, value_of(r), out)
    return out


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
        lse = _on_rows(row_ids, R, lambda r: ml_smem[j * lse_step, r])
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


# The second merge kernel's SMEM for a round (of the H200's 227 KB a CTA) and the f32 values a
# thread may hold for a round's lse rows (of its 255 registers).
_MERGE_KERNEL_SMEM = 192 * 1024
_MERGE_KERNEL_LIVE = 128


def merge_partials(
    o_part,
    lse_part,
    *,
    num_seqs: int,
    num_q_heads: int,
    out_blocks: bool,
    dtype,
    batch: int = 32,
    interpret=None,
):
    """``split_merge="mosaic"``: a second Mosaic GPU kernel merges ``swap_ab`` split partials,
    one CTA a (sequence, KV head) pair, in place of the XLA epilogue's three kernels.

    ``o_part`` [S, rows, H] (``q.dtype``): each split's partial rows, the G rows of pair
    ``b * K + h`` at row ``b * N + h * G`` (or, ``out_blocks``, at ``qoff`` in the pair's
    ``qcols``-row block); ``lse_part`` f32[S, B * K, qcols]: each split's base-2 lse, the pair's
    G columns at ``qoff = (b * N + h * G) % 8`` (-inf for a split that read no key, whose
    partial rows are zeros). Returns [B * N, H] in ``dtype``.

    Each CTA brings a round of up to ``batch`` splits' rows (fewer where SMEM or registers
    would not hold them: 32 at G=4 and head dim 128) in one TMA copy ([n, G, H]; one
    row more at head dim 64 and odd G, for a register layout of whole 128-element rows) and
    their lse rows in another ([n, 1, qcols]), then merges the round in registers without a
    chain through the pieces: the round's max first, then every piece's weight and weighted
    rows, independent of each other. S is static, so every split is merged (an empty one weighs
    0): no atomics, no counters to zero, one launch.
    """
    S, _, H = o_part.shape
    _, pairs, Q = lse_part.shape
    B, N = num_seqs, num_q_heads
    K = pairs // B
    G = N // K
    Rm = G + (G * H % 128 != 0)  # rows loaded a piece: G, or G + 1 (H = 64, odd G)
    per_thread = Rm * H // 128
    layout = plgpu.Layout.WG_STRIDED((Rm, H), vec_size=math.gcd(per_thread, 8))
    # A round's splits: at most ``batch``, within SMEM (its rows and lse rows beside the output
    # rows) and within registers (every split's lse rows are live until the round's max).
    piece = Rm * H * o_part.dtype.itemsize + Q * 4
    fit = (_MERGE_KERNEL_SMEM - Rm * H * jnp.dtype(dtype).itemsize) // piece
    nb = max(1, min(batch, S, fit, _MERGE_KERNEL_LIVE // per_thread))
    rounds = [(g, min(nb, S - g)) for g in range(0, S, nb)]

    def body(o_ref, lse_ref, out_ref, mo_smem, ml_smem, bar, o_smem):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        pair = b * K + h
        qrow = b * N + h * G
        qoff = lax.rem(qrow, 8)
        src = pair * Q + qoff if out_blocks else qrow
        row_ids = plgpu.broadcasted_iota(jnp.int32, (Rm, H), 0, layout=layout)

        def lse_of(j):  # piece j's lse of row g on row g (row G, if loaded: any column)
            lse = _on_rows(row_ids, Rm, lambda g: ml_smem[j, 0, jnp.minimum(qoff + g, Q - 1)])
            return jnp.maximum(lse, -jnp.finfo(jnp.float32).max)  # -inf: weight 0, no NaN

        m_run = s_run = acc = None
        for first, n in rounds:
            if first:  # the last round's SMEM reads before this round's TMA writes
                plgpu.commit_smem()
            plgpu.copy_gmem_to_smem(
                o_ref.at[pl.ds(first, n), pl.ds(src, Rm)], mo_smem.at[pl.ds(0, n)], bar
            )
            plgpu.copy_gmem_to_smem(
                lse_ref.at[pl.ds(first, n), pl.ds(pair, 1)], ml_smem.at[pl.ds(0, n)], bar
            )
            plgpu.barrier_wait(bar)
            lses = [lse_of(j) for j in range(n)]
            m_new = functools.reduce(jnp.maximum, lses if m_run is None else [m_run, *lses])
            ws = [jnp.exp2(lse - m_new) for lse in lses]
            os_ = [plgpu.load(mo_smem.at[j], layout=layout).astype(jnp.float32) for j in range(n)]
            s_new = functools.reduce(jnp.add, ws)
            acc_new = functools.reduce(jnp.add, [w * o for w, o in zip(ws, os_, strict=True)])
            if m_run is not None:
                alpha = jnp.exp2(m_run - m_new)
                s_new, acc_new = s_run * alpha + s_new, acc * alpha + acc_new
            m_run, s_run, acc = m_new, s_new, acc_new
        o_smem[...] = (acc / s_run).astype(dtype)  # s_run >= 1: the max piece weighs 1
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, G)], out_ref.at[pl.ds(qrow, G)])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = f"paged_decode_merge_S{S}_G{G}_H{H}"
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((B * N, H), dtype),
        scratch_types=(
            plgpu.SMEM((nb, Rm, H), o_part.dtype),
            plgpu.SMEM((nb, 1, Q), jnp.float32),
            plgpu.Barrier(num_arrivals=2),
            plgpu.SMEM((Rm, H), dtype),
        ),
        grid=(K, B),
        grid_names=("h", "b"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
    )
    # The last pair's extra row lies past the end: hardware TMA zero-fills it, the interpreter
    # raises. A piece taller than all the rows (B * N < G + 1) is padded on every backend.
    rows = o_part.shape[1]
    pad = max(Rm - rows, 1 if interpret and Rm > G else 0)
    if pad:
        o_part = jnp.pad(o_part, ((0, 0), (0, pad), (0, 0)))
    return kernel(o_part, lse_part)
