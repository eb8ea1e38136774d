"""The second Mosaic GPU kernel of the decode kernel's split-KV (``split_merge="mosaic"``, the
default at 2-32 splits with ``swap_ab``): ``merge_partials``.

Split-KV leaves each (sequence, KV head) pair's output in ``num_splits`` partials (a normalised
output in ``q.dtype`` and a base-2 log-sum-exp). Merged by XLA, that is three more kernels after
the attention kernel; this kernel is one, one CTA a pair, no atomics: fewer launches for the
host to dispatch and for the GPU to space out.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def _on_rows(row_ids, rows: int, value_of):
    """``value_of(r)`` (a scalar) on every element of row r of a [rows, H] register array:
    selected row by row, not multiplied by a 0/1 mask (0 * -inf, a piece that saw no key, is
    NaN)."""
    out = jnp.where(row_ids == 0, value_of(0), 0.0)
    for r in range(1, rows):
        out = jnp.where(row_ids == r, value_of(r), out)
    return out


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
