"""Paged decode attention on Mosaic GPU (Hopper sm90; Blackwell sm100-sm110 with ``mma="tcgen05"``).

One CTA (one warpgroup) per (sequence, split, KV head). It reads each K/V byte once for the G
query heads of a KV head. At head dims 64 / 128 and 8 query columns (``swap_ab``) the products
are transposed: S^T = K Q^T [T, qcols] and O^T = V^T P^T [H, qcols], so the G heads are a wgmma
N of ``qcols`` = 8 columns (16 when their rows straddle an 8-row boundary) and M is the keys and
the head dim; otherwise the G heads are one 64-row wgmma tile (rows past G hold neighbouring
heads' queries and are computed and dropped). K/V tiles of ``T = block_kv`` tokens are gathered
page by page with TMA into a multi-stage SMEM ring (``pallas_kernels._gpu.pages``); a tile holds
``T / C`` whole pages when ``C <= T`` and a ``T``-row slice of one page when ``C > T``.

Scores and the online softmax run in f32 in base 2 (``log2(e)`` folded into the scale, and the
scale into the ``exp2`` argument when it is positive and there is no soft cap). Only a tile that
holds the sequence end or the window start masks its scores (a uniform ``lax.cond``). Q and P
are wgmma operands in SMEM (the form the Mosaic GPU interpreter can run). Rows of the last tile
past the sequence end are zeroed in SMEM before ``P @ V``, so stale or NaN page tails never
reach the output. With ``swap_ab`` the softmax denominators stay per (key row, query) through
the loop and are summed once at the end (``deferred_sum``). At bf16 (``fixed_max``) a unit's
first tile's max is the reference of all its tiles (softmax is shift-invariant); one reduction
after the loop checks that no score rose past ``fixed_max_headroom`` (exp2's argument is
clamped there) and a unit that did is read again with the running max. The default kernel
compiles without Pallas's automatic warpgroup barriers and places the three it needs itself
(``_gpu_tile.wg_barrier``).

Long sequences are split across ``num_splits`` CTAs (split-KV) when the (sequence, KV head)
pairs are fewer than about one wave; each writes its normalised partial output and base-2
log-sum-exp, merged by a second Mosaic GPU kernel (``_merge_gpu.merge_partials``) or a small
XLA epilogue (``pallas_kernels._gpu.merge``). The split count comes from static shapes only (no
host sync), so from the block table's width; with about one wave of pairs a sequence is read
only by as many splits as keep ``min_split_tiles`` tiles each. Past one wave of CTAs, where a
unit can exceed 2048 tokens, the grid takes sequences longest first: the hardware hands CTAs
out in grid order, so the last wave holds the shortest work. Each CTA counts its own place in
that order from the lengths (``_gpu_bodies._kernel_order``) up to 256 sequences; beyond, the
order is an XLA array of packed keys (``_gpu_order``).

Pages of 1, 2 and 4 tokens cannot be one TMA copy into the (8, 64)-tiled SMEM ring. On a GPU
every thread then copies 16-byte pieces straight to their swizzled places (``_cp_async``); in
the interpreter, which cannot run inline Mosaic GPU code, each page lands in an untiled staging
ring by TMA and is re-laid in SMEM (``page_copy="tma"``).

Blackwell (``mma="tcgen05"``): the ``swap_ab`` kernel with its two wgmmas replaced by tcgen05
MMAs into tensor memory (head dims 128 and 256, 128-key tiles, splits merged by XLA); checked
in the interpreter and by lowering for sm100, not run on Blackwell hardware.

JAX >= 0.12 (``swap_ab_lowers``) cannot lower ``swap_ab``'s direct store of a unit's G rows, so
where G < ``qcols`` each unit stores its whole ``qcols``-row block to a staging array and XLA
gathers the G real rows (``out_blocks``).

Not covered (``unsupported_reason`` says so and auto dispatch falls back to ``xla``): GPUs
other than Hopper and Blackwell sm100-sm110, head dim 64 on Blackwell, f32, page sizes neither
dividing nor divided by the tile, head dims other than 64/128/256, groups G > 56 unless a
multiple of 8 up to 64.

The defaults and the measurements behind them are ``tuning_gpu.TUNING``. Modules: this one
holds the entry and the launch; ``_gpu_config`` the kernel instance and ``make_config``;
``_gpu_tile`` a unit's tiles; ``_gpu_bodies`` the CTA body; ``_cp_async`` and ``_merge_gpu``
the per-thread page copies and the merge kernel. ``tools/lowered_ir.py`` fingerprints the
lowered device code, so a refactor can be checked on CPU.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._gpu import quant as gpu_quant
from pallas_kernels._gpu.config import LSE_COLS, ROWS
from pallas_kernels._gpu.merge import merge_splits
from pallas_kernels.paged_attention import _merge_gpu
from pallas_kernels.paged_attention._gpu_bodies import _kernel_body
from pallas_kernels.paged_attention._gpu_config import (
    MMAS as MMAS,
)
from pallas_kernels.paged_attention._gpu_config import (
    PAGE_COPIES as PAGE_COPIES,
)
from pallas_kernels.paged_attention._gpu_config import (
    SPLIT_MERGES as SPLIT_MERGES,
)
from pallas_kernels.paged_attention._gpu_config import (
    SUPPORTED_DTYPES as SUPPORTED_DTYPES,
)
from pallas_kernels.paged_attention._gpu_config import (
    SUPPORTED_HEAD_DIMS as SUPPORTED_HEAD_DIMS,
)
from pallas_kernels.paged_attention._gpu_config import (
    _Config,
)
from pallas_kernels.paged_attention._gpu_config import (
    make_config as make_config,
)
from pallas_kernels.paged_attention._gpu_config import (
    swap_ab_lowers as swap_ab_lowers,
)
from pallas_kernels.paged_attention._gpu_config import (
    unsupported_reason as unsupported_reason,
)
from pallas_kernels.paged_attention._gpu_order import longest_first_order, packed_order
from pallas_kernels.paged_attention._gpu_tile import _partial_dtype
from pallas_kernels.paged_attention.tuning_gpu import TUNING as TUNING
from pallas_kernels.paged_attention.tuning_gpu import default_block_kv as default_block_kv
from pallas_kernels.paged_attention.tuning_gpu import default_fixed_max as default_fixed_max
from pallas_kernels.paged_attention.tuning_gpu import default_longest_first as default_longest_first
from pallas_kernels.paged_attention.tuning_gpu import (
    default_min_split_tiles as default_min_split_tiles,
)
from pallas_kernels.paged_attention.tuning_gpu import default_mma as default_mma
from pallas_kernels.paged_attention.tuning_gpu import default_num_splits as default_num_splits
from pallas_kernels.paged_attention.tuning_gpu import default_num_stages as default_num_stages
from pallas_kernels.paged_attention.tuning_gpu import default_order_method as default_order_method
from pallas_kernels.paged_attention.tuning_gpu import default_split_merge as default_split_merge
from pallas_kernels.paged_attention.tuning_gpu import default_swap_ab as default_swap_ab


def _unit_cols(cfg: _Config, xp):
    """[B, K, G] (``xp``: numpy or jax.numpy): the query columns of a ``swap_ab`` unit's block
    that its G heads own, qoff .. qoff + G with qoff = (b * N + h * G) % 8."""
    B, K, N, G = cfg.num_seqs, cfg.num_kv_heads, cfg.num_q_heads, cfg.group
    b = xp.arange(B, dtype=xp.int32)[:, None, None]
    h = xp.arange(K, dtype=xp.int32)[None, :, None]
    return (b * N + h * G) % 8 + xp.arange(G, dtype=xp.int32)


def _swapped_lse(cfg: _Config, lse_SCQ):
    """``swap_ab`` split lse [S, B*K, qcols] per (sequence, KV head) slot -> [S, B*N, 1] (the
    partials themselves are stored as rows). Head h of sequence b owns columns
    qoff .. qoff + G of its slot, qoff = (b * N + h * G) % 8 (a small XLA gather: S x B x N
    floats)."""
    S, B, K, N = cfg.num_splits, cfg.num_seqs, cfg.num_kv_heads, cfg.num_q_heads
    cols = _unit_cols(cfg, jnp)
    lse = jnp.take_along_axis(lse_SCQ.reshape(S, B, K, -1), cols[None], axis=3)
    return lse.reshape(S, B * N, 1)


def _out_rows(cfg: _Config) -> int:
    """Rows of the output (or of each split's partials): B * N, or with ``out_blocks`` a
    ``qcols``-row block per (sequence, KV head)."""
    if cfg.out_blocks:
        return cfg.num_seqs * cfg.num_kv_heads * cfg.q_rows
    return cfg.num_seqs * cfg.num_q_heads


def _unblock(cfg: _Config, x):
    """``out_blocks``: the G real rows of each (sequence, KV head) block of ``x`` [..., rows, H]
    -> [..., B * N, H] (head h of sequence b at row qoff + g of block b * K + h, qoff =
    (b * N + h * G) % 8: one small XLA gather); ``x`` itself otherwise, or where G fills the
    block (``q_rows == G``: the blocks are the rows)."""
    if not cfg.out_blocks or cfg.qcols == cfg.group:
        return x
    B, K = cfg.num_seqs, cfg.num_kv_heads
    block = np.arange(B * K, dtype=np.int32).reshape(B, K, 1)  # b * K + h
    rows = block * cfg.q_rows + _unit_cols(cfg, np)  # [B, K, G]
    return jnp.take(x, jnp.asarray(rows.reshape(-1)), axis=-2)


def _merge_splits(o_SRH, lse_SRL, dtype):
    """Log-sum-exp merge of split partials: o [S, R, H] (f32 or q.dtype), lse f32[S, R, L]
    (column 0 read; base 2; -inf for a split that saw no key): ``_gpu.merge.merge_splits``."""
    return merge_splits(o_SRH, lse_SRL[..., 0], dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _paged_attention(
    cfg: _Config, q_BNH, k_pages, v_pages, block_tables_BW, lengths_B, layer, k_scale, v_scale
):
    B, N, H = q_BNH.shape
    K, P, C = cfg.num_kv_heads, cfg.num_pages, cfg.page_size
    out_dtype = q_BNH.dtype
    if cfg.quantized:  # the products run in bf16 (``_gpu.quant``); the output in q's dtype
        q_BNH = q_BNH.astype(cfg.dtype)
    q_RH = q_BNH.reshape(B * N, H)
    if cfg.interpret:  # hardware TMA zero-fills rows past the end; the interpreter raises
        q_RH = jnp.pad(q_RH, ((0, ROWS), (0, 0)))
    elif (B * N) % 8:  # a TMA source with 8-row SMEM tiling needs a multiple of 8 rows
        q_RH = jnp.pad(q_RH, ((0, -(B * N) % 8), (0, 0)))
    k_RH = k_pages.reshape(-1, H)
    v_RH = v_pages.reshape(-1, H)
    base = jnp.asarray(layer, jnp.int32).reshape(1) * jnp.int32(K * P * C)
    lengths_B = lengths_B.astype(jnp.int32)
    block_tables_BW = block_tables_BW.astype(jnp.int32)
    args = [q_RH, k_RH, v_RH, block_tables_BW, lengths_B, base]
    if cfg.xla_order:
        order = longest_first_order(lengths_B, cfg.block_kv, packed_order(B), cfg.order_method)
        args.append(order)
    if cfg.quantized:
        args += gpu_quant.flat_scales(cfg, k_pages, layer, k_scale, v_scale)
    S = cfg.num_splits
    if S == 1:
        out_type = jax.ShapeDtypeStruct((_out_rows(cfg), H), cfg.dtype)
    elif cfg.swap_ab:  # partial rows in q.dtype; the lse of qcols columns per (b, h) slot
        out_type = (
            jax.ShapeDtypeStruct((S, _out_rows(cfg), H), _partial_dtype(cfg)),
            jax.ShapeDtypeStruct((S, B * K, cfg.qcols), jnp.float32),
        )
    else:
        out_type = (
            jax.ShapeDtypeStruct((S, B * N, H), _partial_dtype(cfg)),
            jax.ShapeDtypeStruct((S, B * N, LSE_COLS), jnp.float32),
        )
    name = f"paged_decode_mgpu_T{cfg.block_kv}_st{cfg.num_stages}_S{S}_C{C}_G{cfg.group}_H{H}"
    if cfg.swap_ab:
        name += f"_sw{cfg.qcols}"
    if cfg.deferred_sum:
        name += "_ds"
    if cfg.longest_first and not cfg.xla_order:
        name += "_ko"  # the order counted in the kernel
    if cfg.per_thread or cfg.staged:  # pages copied by every thread, or by TMA to a staging ring
        name += "_cpa" if cfg.per_thread else "_stg"
    if cfg.auto_barriers:
        name += "_ab"  # Pallas's automatic warpgroup barriers (else ``wg_barrier`` by hand)
    if cfg.fixed_max:
        name += "_fm"  # the first tile's max as every tile's reference
    if cfg.out_blocks:
        name += "_ob"  # whole qcols-row output blocks, gathered by XLA
    if cfg.tcgen05:
        name += "_tc05"  # Blackwell's tcgen05 MMAs
    if cfg.quantized:  # 8-bit pages and the scales' modes (head, page, token)
        name += f"_{cfg.kv_dtype.name}_k{cfg.k_scales[0]}v{cfg.v_scales[0]}"
    body = functools.partial(_kernel_body, cfg)
    body.__name__ = name  # type: ignore[attr-defined]  (names the kernel in profiles)
    if cfg.heads_inner:
        # Mosaic GPU maps the last grid axis to blockIdx.x, which the hardware hands out
        # first: the dispatch order is (sequence, split, head), so a longest-first order is
        # longest first over every CTA (LPT; heads outer was 4-7% slower at B >= 64).
        grid, grid_names = (B, S, K), ("b", "s", "h")
    else:
        grid, grid_names = (K, S, B), ("h", "s", "b")
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            unsafe_no_auto_barriers=not cfg.auto_barriers,
            # 4 regions (order, prologue, loop, store) of 2 events a warpgroup, and spare
            **({"profile_space": 16, "profile_dir": cfg.profile_dir} if cfg.profile_dir else {}),
        ),
        interpret=cfg.interpret or None,
    )
    out = kernel(*args)
    if S == 1:
        return _unblock(cfg, out).reshape(B, N, H).astype(out_dtype)
    o_SRH, lse_SRL = out
    if cfg.mosaic_merge:  # one Mosaic GPU kernel for the XLA epilogue's three
        merged = _merge_gpu.merge_partials(
            o_SRH, lse_SRL, num_seqs=B, num_q_heads=N, out_blocks=cfg.out_blocks,
            dtype=cfg.dtype, interpret=cfg.interpret,
        )  # fmt: skip
        return merged.reshape(B, N, H).astype(out_dtype)
    o_SRH = _unblock(cfg, o_SRH)
    if cfg.swap_ab:
        lse_SRL = _swapped_lse(cfg, lse_SRL)
    return _merge_splits(o_SRH, lse_SRL, cfg.dtype).reshape(B, N, H).astype(out_dtype)


def paged_attention_pallas_gpu(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,
    k_scale=None,
    v_scale=None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    **knobs,
) -> jax.Array:
    """Decode attention over a paged KV cache with the Mosaic GPU kernel.

    Args:
      q: [B, N, H] bf16 or f16; the query of sequence b sits at position ``lengths[b] - 1``.
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W]; entry (b, i) is the page of tokens [i*C, (i+1)*C) of b.
      lengths: i32[B] tokens per sequence (the query's own included); 0 gives zeros.
      sm_scale: logit scale (already resolved).
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      sliding_window: if set, only the last ``sliding_window`` keys are seen; whole tiles
        before the window are never read.
      layer: int or i32[] layer index into a 5-D pool (a row offset; nothing is sliced).
      k_scale: quantized pages (fp8, int8; pages of 8+ tokens): f32 broadcastable to [K, P, C]
        ([L or 1, K, P, C] with a 5-D pool). The 8-bit pages are copied as stored and each tile
        is dequantized in registers into a bf16 tile; key scales multiply the scores, value
        scales P (or, per head, the output): ``pallas_kernels._gpu.quant``.
      v_scale: like ``k_scale``, for ``v_pages``.
      interpret: run in the Mosaic GPU interpreter, any backend: True for the default
        ``plgpu.InterpretGPUParams()``, or the params to use (e.g. ``detect_races=True``).
      **knobs: tuning knobs, each defaulting (None) to ``tuning_gpu``'s rule:
        ``block_kv`` (tokens per K/V tile, 64 or 128), ``num_stages`` (ring depth),
        ``num_splits`` (split-KV factor), ``longest_first`` (the on-device order),
        ``order_method`` (``"kernel"``, ``"rank"`` or ``"sort"``: the same order computed in
        each CTA, by two O(B^2) reductions, or by a sort), ``swap_ab`` (scores as K Q^T),
        ``split_merge`` (``"mosaic"`` or ``"xla"``), ``min_split_tiles``, ``fixed_max``,
        ``page_copy`` (``"cp_async"`` or ``"tma"``), ``mma`` (``"wgmma"`` or ``"tcgen05"``),
        ``out_blocks`` (whole ``qcols``-row output blocks, gathered by XLA), ``k_registers``
        (quantized K tiles converted into registers, the scores' A operand), and
        ``profile_dir`` (record each CTA's regions with the Mosaic GPU on-device profiler and
        write the trace there; a GPU diagnostic for ``benchmarks/profile_decode_timeline.py``).

    Returns:
      [B, N, H] in ``q.dtype``.

    Raises:
      ValueError: if the kernel cannot run these shapes/dtypes (``unsupported_reason``) or a
        tuning knob is out of range.
    """
    cfg, layer = make_config(
        q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, layer=layer,
        k_scale=k_scale, v_scale=v_scale, interpret=interpret, **knobs,
    )  # fmt: skip
    if cfg is None:  # no sequence, or no page to read
        return jnp.zeros(q.shape, q.dtype)
    if cfg.profile_dir:
        os.makedirs(cfg.profile_dir, exist_ok=True)
    return _paged_attention(
        cfg, q, k_pages, v_pages, block_tables, lengths, layer, k_scale, v_scale
    )
