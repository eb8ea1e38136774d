"""Paged decode attention on Mosaic GPU (Hopper sm90; Blackwell sm100-sm110 with ``mma="tcgen05"``).

One CTA (one warpgroup; two with ``producer``) per (sequence, split, KV head). It reads each
K/V byte once for the G query heads of a KV head. At head dims 64 / 128 and 8 query columns
(``swap_ab``, ``default_swap_ab``), the products are transposed: S^T = K Q^T [T, qcols] and
O^T = V^T P^T [H, qcols], so the G heads are a wgmma N of ``qcols`` = 8 columns (16 when their
rows straddle an 8-row boundary) and the M dimension is the keys and the head dim: 2-5% faster
than the 64-row tile in most quick rows on the H200 (eighth and ninth sessions; with splits the
partials leave as rows in ``q.dtype``). Otherwise, and in the ``producer`` and ``persistent``
variants, the G heads are one 64-row wgmma tile (rows past G hold neighbouring
heads' queries and are computed and dropped). K/V tiles of ``T = block_kv``
tokens are gathered page by page with TMA (``copy_gmem_to_smem``) into a multi-stage SMEM ring;
each barrier slot expects one arrival per page copy. The compute tile is independent of the page
size: a tile holds ``T / C`` whole pages when ``C <= T`` and a ``T``-row slice of one page when
``C > T``.

Scores and the online softmax run in f32 in base 2 (``log2(e)`` folded into the scale, and the
scale into the ``exp2`` argument when it is positive and there is no soft cap). Only a tile that
holds the sequence end or the window start masks its scores (a uniform ``lax.cond``). Q and P
are wgmma operands in SMEM (the variant the Mosaic GPU interpreter can run, and as fast as
registers on the H200 per ``research/mosaic_gpu.md``). Rows of the last tile past the sequence
end are zeroed in SMEM before ``P @ V`` so stale or NaN page tails never reach the output.
With ``swap_ab`` the softmax denominators stay per (key row, query) through the loop and are
summed over the keys once at the end (``deferred_sum``): a tile does one reduction across the
warpgroup's four warps (the max, through SMEM) instead of two, and a lone CTA streams 42 GB/s
instead of 36 on the H200 (tenth session). At bf16 (``fixed_max``, ``default_fixed_max``) the
max is taken across the warps only in a unit's first tile, whose max stays the reference of the
others (softmax is shift-invariant): each thread keeps the elementwise max of its scores, one
reduction after the loop checks that none rose past ``fixed_max_headroom`` (32 doublings; exp2's
argument is clamped there) and a unit that did is read again with the running max. That
reduction was 137 of a lone CTA's 707 ns a tile (seventeenth session,
``benchmarks/chain_ablation.py``); with ``fixed_max`` a tile takes 599 ns.

The default kernel compiles without Pallas's automatic warpgroup barriers (one before every
page copy and two around every SMEM store: ``auto_barriers``, ``default_auto_barriers``) and
places the three it needs itself (``_gpu_tile.wg_barrier``): 14 ``bar.sync`` in the lowered
kernel where there were 45 at 16-token pages; a lone CTA streams 2.5-4.7% faster on the H200
(fifteenth session).

Long sequences are split across ``num_splits`` CTAs (split-KV) when the (sequence, KV head)
programs are fewer than about one wave; each writes its normalised partial output (``q.dtype``
with ``swap_ab``, else f32) and base-2 log-sum-exp. At 2-32 splits with ``swap_ab`` a second
Mosaic GPU kernel merges them (``split_merge="mosaic"``, ``_merge_gpu.merge_partials``: one CTA
a (sequence, KV head) pair, two TMA copies and a merge in registers; at B=1 / 32k on the H200
83.8% of the roofline and 61.3 us wall against 80.8% and 73.3 us for the XLA epilogue's three
kernels, and 0.2-2.6% less kernel time than the in-kernel merge at 2-16 splits). Opt-in, the
last split CTA of each pair to finish merges them in the kernel (``"kernel"``,
``_merge_split``: each CTA stores its partial and bumps the pair's arrival counter with an
acquire-release atomic; the one that sees the others all there loads the partials, merges and
stores; no CTA waits for another). Otherwise a small XLA epilogue merges them (``"xla"``;
``default_split_merge`` has the H200 figures). The split count is chosen from static shapes
only (no host sync; jit- and CUDA-graph safe), so from the block table's width; with about one
wave of pairs each CTA then reads only if its sequence's real length gives its split 8+ tiles
(``min_split_tiles``): a short sequence in a table as wide as an engine's longest is read by
one CTA and written straight out (sixteenth session: 14-16% less kernel time at 32 x 512
tokens in 8k and 32k tables). The grid is (sequence, split, KV head) with the
heads innermost and, past one wave of CTAs where a unit can exceed 2048 tokens, sequences
longest first: the hardware hands CTAs out in grid order as slots free up, so the last wave
holds the shortest work (longest-processing-time-first list scheduling). Each CTA counts its
own place in that order from the lengths (``_kernel_order``: one TMA copy of the lengths and
B / 128 keys a thread; multiples of 4 up to 256 sequences), so no XLA kernel runs before the
launch; otherwise the order is an array of packed keys computed by XLA (by counting up to 1024
sequences, by a sort beyond: ``_longest_first_order``).

Where the time goes inside the kernel (``profile_dir``: the Mosaic GPU on-device profiler, read
by ``benchmarks/profile_decode_timeline.py``; H200, tenth session, BENCHMARKS.md): all
resident CTAs start within 1 us and stream after about 3-4 us (order, prologue, first copies);
the steady state keeps every slot busy; the last partial wave of short units runs at about 20
GB/s a CTA (two 32 KB stages in flight under load), so the drain at the end leaves HBM part
idle for 15-25 us at 1k-2k-token units and about 60 us with 8 splits of 2k-6k tokens.

On the H200 (Nsight Compute, seventh session, BENCHMARKS.md) the kernel reads about 1% more
DRAM bytes than the live K/V (partial last pages; cuDNN's non-paged kernel 0.1-0.3%), and
ran (64-row tile, before ``swap_ab``) at 88-93% of DRAM peak at 64+ sequences, where cuDNN's
kernel, of the same shape (one 128-thread CTA per sequence and KV head, two per SM), runs at
91-93%.

``l2_prefetch`` (opt-in) also requests the tiles past the SMEM ring into L2: more bytes in
flight, at no SMEM cost. It was 8-52% slower in every row of the H200 quick table (L2 hits rose
to 31%, DRAM throughput fell), so the ring's depth is not what the stream lacks there.

``early_k`` (refill a K slot once Q K^T has read it), ``k_stages`` (a K ring deeper than V's)
and ``slot_lengths`` (lengths permuted into the schedule's order, read without the order) are
opt-in: on the H200 (eighth session) none beat the default by more than the run-to-run noise
in enough rows; early K lost 1-5% at B=1, B=8, B=32, B=64 / 4k and head dim 64.

``persistent=True`` (opt-in) launches only as many CTAs as are resident at once and loops each
over work units, its K/V ring running on from one unit into the next. It was correct and tied
the default in every row of the H200 quick table (sixth session): the two resident CTAs per SM
already overlap one unit's start with the other's streaming.

``balanced=True`` (opt-in, ``_balanced_body``, stream-K) gives ``num_ctas`` CTAs (default: as
many as are resident, 3 per SM at head dims 64-128) equal shares of the stream of every
(sequence, KV head) pair's tiles, whatever the lengths, so no drain of long units is left at the
end. A pair cut by a share boundary is merged in the kernel by the CTA holding its last piece,
which waits on a semaphore until the other pieces' partials are stored. Correct on the H200, but
slower than the default in 8 of the 9 quick rows (1.9-6.8%, 29.5% at one sequence; 1.4% faster
at B=8 / 32k) and, over split-KV batches, 13-31% slower at one or two sequences, tied or up to
2.3% faster at 4-16 sequences of 16k-32k (eleventh session, BENCHMARKS.md): the on-device
schedule, a ring restart per segment and the merges at the end cost more than the drain they
remove.

``split_tail=N`` (opt-in) splits only the last N sequences of the dispatch order (the shortest,
longest first) into ``num_splits`` CTAs, merged in the kernel, and reads every other sequence
with one: the drain runs shorter units and the rest of the grid pays no split. On the H200
(twentieth session) it was 1.2-1.9% faster on the quick table's B=128 / 2k draw in three runs,
and tied or slower elsewhere: -1.0% to +1.5% over seven other batches of 96-256 sequences of
1k-3k tokens, +1.0% at B=64 / 4k, +5% at head dim 64. A stream of the kernel's own units
(``benchmarks/stream_bound.py``) puts the drain's whole cost at 1.3-3 points of the roofline in
the big rows.

``producer=True`` (opt-in) specializes the warpgroups as JAX's FA3 example does: a second,
40-register warpgroup reads the block table and issues every page copy, refilling a ring slot
as soon as the computing warpgroup arrives on that slot's K-consumed (after ``Q K^T``) or
V-consumed (after ``P @ V``) barrier, so the copies no longer wait behind the math. The output
tiles alias the ring (``RefUnion``): every SMEM allocation of a two-warpgroup kernel must be made
by both, and the ring is idle once the last tile is read. It is correct on the H200 but 2-28%
slower than the default in every row of the quick decode table (first run, 4 stages): ptxas
launches it at 232 registers a thread (ncu), so one CTA, and one computing warpgroup, per SM
where the default (177 registers, 128 threads) runs two.

Pages of 1, 2 and 4 tokens cannot be one TMA copy into the (8, 64)-tiled SMEM ring (a TMA slice
of it must start on an 8-row boundary). By default every thread then copies 16-byte pieces of
the tile's rows with ``cp.async`` straight to their swizzled places (``page_copy="cp_async"``,
``_cp_async``): on the H200 (twelfth session) pages of 1-4 tokens ran at 4.01-4.20 TB/s at
B=128 / 2k, as fast as pages of 16 in the same calls (4.17-4.19; the page-size sweep 1-256:
4.08-4.23). The other way, one TMA copy a page into an untiled staging ring and a re-layout in
SMEM (``page_copy="tma"``, ``_relayout``), is what the interpreter runs (it cannot run inline
Mosaic GPU code); on the H200 its copies, one a page (a row at one-token pages) issued by one
thread, cost about 80 cycles each: 1.51 TB/s at one-token pages, 3.21 at four.
``page_copy="cp_async"`` is opt-in for pages of 8+ tokens: tied with TMA or up to 2.6% slower
in the quick table.

Blackwell (sm100 / sm103 / sm110, ``mma="tcgen05"``, ``default_mma``): the ``swap_ab`` kernel
with its two wgmmas replaced by tcgen05 MMAs issued by one thread into tensor memory (f32
accumulators of 128 lanes: the tile's 128 keys, 128 rows of the head dim each) and read into
registers in the TCGEN05 layout; the rest of a tile (softmax, masks, ``fixed_max``, P's store,
the ring) is the Hopper code. Head dims 128 and 256 (two P @ V products a tile), splits merged
by XLA. Checked in the Mosaic GPU interpreter and by lowering for sm100 on the CPU; not yet run
or timed on Blackwell hardware.

JAX >= 0.12 (``swap_ab_lowers``): Mosaic GPU 0.12 cannot lower ``swap_ab``'s direct store (a
unit's G rows copied out of its transposed output tile, from a dynamic offset or any slice
short of the whole tile), so where G < ``qcols`` each unit stores its whole ``qcols``-row
block to a staging array and XLA gathers the G real rows (``out_blocks``), and the kernel
merge and ``balanced`` are refused. Where G fills the tile (G = 8 or 16; 16 with tcgen05) that
whole-block copy is the direct store (no gather), on any JAX.

Not covered (``unsupported_reason`` says so and auto dispatch falls back to ``xla``): GPUs
other than Hopper and Blackwell sm100-sm110 (sm120 has neither wgmma nor tcgen05), head dim 64
on Blackwell, f32, page sizes neither dividing nor divided by the tile (64 tokens; 128 at H=64
and on Blackwell), head dims other than 64/128/256, groups G > 56 unless a multiple of 8 up to
64.

The code: this module holds the public entry (``paged_attention_pallas_gpu``) and the launch
(``_paged_attention``); ``_gpu_config`` the kernel instance, SMEM sizes, tuning defaults and
``unsupported_reason``; ``_gpu_tile`` a unit's tiles (copies, products, softmax, store);
``_gpu_bodies`` the default and persistent CTA bodies; ``_gpu_balanced`` the balanced one;
``_cp_async`` and ``_merge_gpu`` the inline Mosaic GPU pieces (per-thread page copies, the
split merge) and the second merge kernel. Every private name is re-exported here.
``tools/lowered_ir.py`` fingerprints the lowered device code of every cross-lowering variant, so
a refactor can be checked on CPU.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _backend
from pallas_kernels._split_merge import merge_splits
from pallas_kernels.paged_attention import _merge_gpu
from pallas_kernels.paged_attention._gpu_balanced import (  # noqa: F401  (re-exported)
    _balanced_body,
    _balanced_ctas_per_sm,
    _balanced_schedule,
    _balanced_smem_bytes,
    _stream_tiles,
)
from pallas_kernels.paged_attention._gpu_bodies import (  # noqa: F401  (re-exported)
    _kernel_body,
    _kernel_order,
    _merge_scratch,
    _merge_split,
    _persistent_body,
    _split_rest,
)
from pallas_kernels.paged_attention._gpu_config import (  # noqa: F401  (re-exported)
    _COMPUTE_REGISTERS,
    _KERNEL_ORDER_MAX_SEQS,
    _LOG2E,
    _LONGEST_FIRST_MIN_TOKENS,
    _LSE_COLS,
    _MAX_BALANCED_CTAS,
    _MAX_L2_PREFETCH,
    _MERGE_BATCH,
    _ORDER_BITS,
    _ORDER_MAX_TILES,
    _PRODUCER_REGISTERS,
    _RANK_ORDER_MAX_SEQS,
    _ROWS,
    _SMEM_BYTES,
    _TILE_ROWS,
    _TMA_MAX_DIM,
    _TWO_CTA_SMEM_BYTES,
    _WAVE_CTAS,
    MMAS,
    ORDER_METHODS,
    PAGE_COPIES,
    SPLIT_MERGES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    TCGEN05_BLOCK_KV,
    TCGEN05_HEAD_DIMS,
    TCGEN05_MAJORS,
    _check_order_method,
    _Config,
    _int_knob,
    _kernel_order_reason,
    _longest_first_order,
    _lse_row_step,
    _merge_batch,
    _merge_piece_bytes,
    _packed_key,
    _packed_order,
    _qcols,
    _ring_bytes,
    _smem_bytes,
    _split_merge_batch,
    default_auto_barriers,
    default_block_kv,
    default_deferred_sum,
    default_fixed_max,
    default_longest_first,
    default_min_split_tiles,
    default_mma,
    default_num_splits,
    default_num_stages,
    default_order_method,
    default_split_merge,
    default_swap_ab,
    swap_ab_lowers,
    unsupported_reason,
)
from pallas_kernels.paged_attention._gpu_tile import (  # noqa: F401  (re-exported)
    _attend,
    _finish,
    _init_carry,
    _issue,
    _lookup,
    _make_unit,
    _page_row,
    _partial_dtype,
    _prefetch,
    _relayout,
    _scratch,
    _smem_transforms,
    _staged_tiles,
    _store,
    _sum_l,
    _tile,
    _tile_span,
    _Unit,
    _unit,
)


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
    (column 0 read; base 2; -inf for a split that saw no key): ``_split_merge.merge_splits``."""
    return merge_splits(o_SRH, lse_SRL[..., 0], dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _paged_attention(cfg: _Config, q_BNH, k_pages, v_pages, block_tables_BW, lengths_B, layer):
    B, N, H = q_BNH.shape
    K, P, C = cfg.num_kv_heads, cfg.num_pages, cfg.page_size
    q_RH = q_BNH.reshape(B * N, H)
    if cfg.interpret:  # hardware TMA zero-fills rows past the end; the interpreter raises
        q_RH = jnp.pad(q_RH, ((0, _ROWS), (0, 0)))
    elif (B * N) % 8:  # a TMA source with 8-row SMEM tiling needs a multiple of 8 rows
        q_RH = jnp.pad(q_RH, ((0, -(B * N) % 8), (0, 0)))
    k_RH = k_pages.reshape(-1, H)
    v_RH = v_pages.reshape(-1, H)
    base = jnp.asarray(layer, jnp.int32).reshape(1) * jnp.int32(K * P * C)
    lengths_B = lengths_B.astype(jnp.int32)
    block_tables_BW = block_tables_BW.astype(jnp.int32)
    args = [q_RH, k_RH, v_RH, block_tables_BW, lengths_B, base]
    if cfg.balanced and B % 4:  # one TMA copy of the lengths: a multiple of 16 bytes
        args[4] = jnp.pad(lengths_B, (0, -B % 4))
    if cfg.xla_order:
        order = _longest_first_order(lengths_B, cfg.block_kv, _packed_order(B), cfg.order_method)
        if cfg.slot_lengths:  # one small gather: each CTA reads its length without the order
            seq = order & ((1 << _ORDER_BITS) - 1) if _packed_order(B) else order
            args[4] = lengths_B[seq]
        args.append(order)
    S = cfg.num_splits
    if cfg.balanced:  # the output, and two partial slots a CTA (its share's two ends)
        out_type = (
            jax.ShapeDtypeStruct((B * N, H), cfg.dtype),
            jax.ShapeDtypeStruct((2 * cfg.num_ctas, cfg.q_rows, H), cfg.dtype),
            jax.ShapeDtypeStruct((2 * cfg.num_ctas, cfg.q_rows), jnp.float32),
        )
    elif S == 1:
        out_type = jax.ShapeDtypeStruct((_out_rows(cfg), H), cfg.dtype)
    elif cfg.swap_ab:  # partial rows in q.dtype; the lse of qcols columns per (b, h) slot
        out_type = (
            jax.ShapeDtypeStruct((S, _out_rows(cfg), H), _partial_dtype(cfg)),
            jax.ShapeDtypeStruct((S, B * K, cfg.qcols), jnp.float32),
        )
        if cfg.kernel_merge:  # the output first, merged by each pair's last CTA
            out_type = (jax.ShapeDtypeStruct((B * N, H), cfg.dtype), *out_type)
    else:
        out_type = (
            jax.ShapeDtypeStruct((S, B * N, H), _partial_dtype(cfg)),
            jax.ShapeDtypeStruct((S, B * N, _LSE_COLS), jnp.float32),
        )
    kind = "_ws" if cfg.producer else "_persistent" if cfg.persistent else ""
    kind += f"_bal{cfg.num_ctas}" if cfg.balanced else ""
    stages = f"{cfg.num_stages}" + (f"k{cfg.k_stages}" if cfg.k_stages != cfg.num_stages else "")
    name = f"paged_decode_mgpu{kind}_T{cfg.block_kv}_st{stages}_S{S}_C{C}_G{cfg.group}_H{H}"
    if cfg.early_k:
        name += "_ek"
    if cfg.swap_ab:
        name += f"_sw{cfg.qcols}"
    if cfg.deferred_sum:
        name += "_ds"
    if cfg.longest_first and not cfg.xla_order:
        name += "_ko"  # the order counted in the kernel
    if cfg.l2_prefetch:
        name += f"_pf{cfg.l2_prefetch}"
    if cfg.per_thread or cfg.staged:  # pages copied by every thread, or by TMA to a staging ring
        name += "_cpa" if cfg.per_thread else "_stg"
    if cfg.auto_barriers:
        name += "_ab"  # Pallas's automatic warpgroup barriers (else ``wg_barrier`` by hand)
    if cfg.kernel_merge:
        name += "_km"  # splits merged in the kernel
    if cfg.fixed_max:
        name += "_fm"  # the first tile's max as every tile's reference
    if cfg.out_blocks:
        name += "_ob"  # whole qcols-row output blocks, gathered by XLA
    if cfg.tcgen05:
        name += "_tc05"  # Blackwell's tcgen05 MMAs
    if cfg.split_tail:
        name += f"_tail{cfg.split_tail}"  # only the last split_tail sequences split
    if cfg.order_head:
        name += f"_oh{cfg.order_head}"  # the first order_head sequences unordered
    body_fn = _balanced_body if cfg.balanced else _persistent_body if cfg.persistent else None
    body = functools.partial(body_fn or _kernel_body, cfg)
    body.__name__ = name  # type: ignore[attr-defined]  (names the kernel in profiles)
    if cfg.persistent or cfg.balanced:
        grid, grid_names = (cfg.num_ctas,), ("c",)
    elif cfg.heads_inner:
        # Mosaic GPU maps the last grid axis to blockIdx.x, which the hardware hands out
        # first: the dispatch order is (sequence, split, head), so a longest-first order is
        # longest first over every CTA (LPT). The previous order (heads outer) ran each head's
        # sequences longest first, then the next head's: the last wave held the longest
        # sequences of the last head (BENCHMARKS.md, sixth session: 4-7% slower at B >= 64).
        grid, grid_names = (B, S, K), ("b", "s", "h")
        if cfg.split_tail:  # the tail's splits are consecutive sequence slots
            grid = (B + cfg.split_tail * (S - 1), 1, K)
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
        **({"num_threads": 2, "thread_name": "wg"} if cfg.producer else {}),
    )
    out = kernel(*args)
    if cfg.balanced or cfg.kernel_merge:
        return out[0].reshape(B, N, H)
    if S == 1:
        return _unblock(cfg, out).reshape(B, N, H)
    o_SRH, lse_SRL = out
    if cfg.mosaic_merge:  # one Mosaic GPU kernel for the XLA epilogue's three
        merged = _merge_gpu.merge_partials(
            o_SRH, lse_SRL, num_seqs=B, num_q_heads=N, out_blocks=cfg.out_blocks,
            dtype=cfg.dtype, interpret=cfg.interpret,
        )  # fmt: skip
        return merged.reshape(B, N, H)
    o_SRH = _unblock(cfg, o_SRH)
    if cfg.swap_ab:
        lse_SRL = _swapped_lse(cfg, lse_SRL)
    return _merge_splits(o_SRH, lse_SRL, cfg.dtype).reshape(B, N, H)


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
    interpret: bool | plgpu.InterpretGPUParams = False,
    block_kv: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    longest_first: bool | None = None,
    producer: bool = False,
    heads_inner: bool = True,
    persistent: bool = False,
    num_ctas: int | None = None,
    l2_prefetch: int = 0,
    k_stages: int | None = None,
    early_k: bool = False,
    slot_lengths: bool = False,
    swap_ab: bool | None = None,
    order_method: str | None = None,
    deferred_sum: bool | None = None,
    profile_dir: str | None = None,
    balanced: bool = False,
    page_copy: str | None = None,
    split_merge: str | None = None,
    auto_barriers: bool | None = None,
    min_split_tiles: int | None = None,
    fixed_max: bool | None = None,
    mma: str | None = None,
    out_blocks: bool | None = None,
    split_tail: int = 0,
    order_head: int = 0,
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
      interpret: run in the Mosaic GPU interpreter, any backend: True for the default
        ``plgpu.InterpretGPUParams()``, or the params to use (e.g. ``detect_races=True``).
      block_kv: tokens per K/V tile T, 64 or 128 (default ``default_block_kv(H)``).
      num_stages: depth of the TMA ring (default ``default_num_stages``: 2 with ``swap_ab``
        (three CTAs per SM by SMEM at H=128), else the deepest that keeps 2 CTAs per SM; with
        ``producer``, 4 where it fits in 227 KB; pages below 8 tokens by TMA (a staging ring),
        2, or 1 where 2 do not fit).
      num_splits: split-KV factor (default from static shapes, ``default_num_splits``).
      longest_first: schedule sequences longest first (an on-device order); default
        ``default_longest_first``: on when the grid is more than one wave of CTAs and a unit
        can hold more than 2048 tokens (``block_tables`` width x page size / splits), or when
        about one wave of (sequence, KV head) pairs (256-511) is split.
      producer: warp specialization: a second warpgroup issues the K/V page copies and the
        computing one never waits on the block table or the TMA issue (opt-in: slower than
        the default on the H200, see the module docstring).
      heads_inner: dispatch the CTAs sequence by sequence with the KV heads innermost (the
        default), so ``longest_first`` orders every CTA longest first; False is the previous
        head-major order, kept for the benchmark's comparison.
      persistent: one CTA per slot (2 per SM) loops over the work units, its K/V ring running
        on from one unit into the next (``_persistent_body``); split partials are stored in
        ``q.dtype``. Not with ``producer``.
      num_ctas: the grid of ``persistent`` (default: as many CTAs as fit at once, 2 per SM where
        the SMEM allows, at most one per unit) or ``balanced`` (default: as many as fit at
        once, ``_balanced_ctas_per_sm``; at most one per tile the block table can hold).
      l2_prefetch: also request the next ``l2_prefetch`` tiles (at most 16) past the SMEM ring
        from HBM into L2 (``cp.async.bulk.prefetch``), so more bytes are in flight than the
        ring holds at no SMEM cost. Not with ``producer`` or ``persistent``. Opt-in: 8-52%
        slower than the default in every row of the H200 quick table (seventh session).
      k_stages: depth of the K ring (default ``num_stages``, the V ring's): a deeper K ring
        keeps more bytes in flight where a whole K+V stage no longer fits. Not with
        ``producer`` or ``persistent``.
      early_k: refill a K slot as soon as Q K^T has read it (before the softmax and P @ V),
        so the next K copy is in flight half a tile earlier. Not with ``producer`` (whose
        producer warpgroup already does) or ``persistent``.
      slot_lengths: with ``longest_first``, pass the lengths permuted into the schedule's
        order (one small XLA gather after the sort), so a CTA reads its sequence's length and
        its order entry at once instead of one after the other; ignored when the order is not
        longest first (``longest_first`` False, or None resolving to off). Opt-in: on the H200
        (eighth session) the gather cost more than the shorter start saved (CUPTI 276.2 vs
        272.7 us at B=256 / 1k, 251.5 vs 249.9 at B=128 / 2k).
      swap_ab: compute the scores' transpose K Q^T and O^T = V^T P^T, so the G query heads of
        a KV head are a wgmma N of ``qcols`` (8 for G <= 4) instead of 64 padded rows: 8x
        less tensor work and softmax at G=4, and Q and P tiles of 2 and 1 KB instead of 16 and
        8 at H=128, T=64 and 8 columns. Split partials are stored in ``q.dtype`` (Mosaic GPU
        stores only 16-bit types through the transposed view), their lse per (sequence, KV
        head) slot. Default (None): ``default_swap_ab`` (on at head dims 64 / 128 and 8 query
        columns, where it was measured faster). Not with ``producer`` or ``persistent``.
      order_method: how the longest-first order is computed, the same order every way:
        ``"kernel"`` (each CTA counts its own place from the lengths, no XLA kernel and no order
        array: B a multiple of 4, at most 256, not with ``producer``, ``persistent`` or
        ``slot_lengths``), ``"sort"`` (a key fusion and a one-operand sort) or ``"rank"`` (two
        O(B^2) counting reductions, at most ``_RANK_ORDER_MAX_SEQS`` sequences). Default (None):
        ``default_order_method``. Its limits are checked only where the order is on.
      deferred_sum: with ``swap_ab``, keep the softmax denominators per (key row, query), a
        [T, qcols] array added to elementwise, and sum them over the keys once after the loop,
        so a tile does one reduction across the warpgroup (the max) instead of two. Default
        (None): ``default_deferred_sum``. Ignored without ``swap_ab``.
      profile_dir: record each CTA's SM, start time and the cycles of its regions (order,
        prologue, loop, store) with the Mosaic GPU on-device profiler and write the trace
        (Chrome JSON) to this directory (created if missing). JAX names the file when the
        kernel is compiled and never overwrites it: the first call after a compile writes it
        (later calls warn), or the next call after it is removed. A diagnostic, on a GPU, for
        ``benchmarks/profile_decode_timeline.py``; it slows the kernel by 1-2%.
      balanced: ``num_ctas`` CTAs (default: as many as are resident at once) each read an
        equal share of the stream of every (sequence, KV head) pair's tiles, whatever the
        lengths (stream-K, ``_balanced_body``): a pair cut by a share boundary is finished by
        the CTA holding its last piece, which waits on a semaphore for the others' partials
        and merges them inside the kernel (no XLA epilogue). With ``swap_ab`` (on by default
        with it); not with splits, ``producer``, ``persistent``, ``l2_prefetch``, ``k_stages``,
        ``early_k``, ``longest_first``, ``slot_lengths`` or ``profile_dir``. Opt-in: slower than
        the default in most rows on the H200 (module docstring).
      page_copy: how pages reach the tiled SMEM ring: ``"cp_async"`` (every thread copies
        16-byte pieces of the tile's rows straight to their swizzled places, ``_cp_async``; not
        with ``l2_prefetch``, ``early_k`` or ``k_stages``, ``producer``, ``persistent`` or
        ``balanced``; GPU only) or ``"tma"`` (one TMA copy a page; pages of 1, 2 and 4 tokens,
        which cannot be one TMA copy into the tiled ring, go to an untiled staging ring and are
        re-laid in SMEM, ``_relayout``). Default (None): ``"cp_async"`` for pages below 8 tokens
        on a GPU (4.0-4.15 TB/s at B=128 / 2k on the H200, where ``"tma"`` ran 1.5-3.2), else
        ``"tma"`` (in the interpreter, which cannot run inline Mosaic GPU code, always).
      split_merge: how split partials are merged: ``"kernel"`` (the last of a pair's split
        CTAs to finish merges them and writes the output, ``_merge_split``: no XLA kernel after
        the launch; with ``swap_ab``, not with ``producer`` or ``persistent``), ``"xla"`` (a
        small XLA epilogue, ``_split_merge.merge_splits``: three kernels) or ``"mosaic"`` (a
        second Mosaic GPU kernel, one CTA a (sequence, KV head) pair,
        ``_merge_gpu.merge_partials``: one launch, no counters; with ``swap_ab``, not with
        ``mma="tcgen05"``). Ignored without splits. Default (None): ``default_split_merge``
        (``"mosaic"`` at 2-32 splits with ``swap_ab``), ``"kernel"`` with ``split_tail``.
      auto_barriers: True compiles with Pallas's automatic warpgroup barriers (one before
        every page copy and two around every SMEM store: about 11 a tile at 16-token pages);
        False without them, the kernel placing the three it needs by hand
        (``_gpu_tile.wg_barrier``: after each tile, before its slot is refilled; before the
        output tiles overwrite the ring; before Q's copy), only in the default kernel (not
        with ``producer``, ``persistent``, ``balanced`` or the staging ring of
        ``page_copy="tma"`` below 8 tokens). Default (None): ``default_auto_barriers`` (off
        wherever it may be).
      min_split_tiles: with splits, each sequence is read by only as many of them as keep this
        many tiles each, ``clip(tiles // min_split_tiles, 1, num_splits)`` of equal size,
        decided on the device from its length (so a short sequence in a table as wide as an
        engine's longest, or beside long ones, is not cut into slivers); the splits past them
        read nothing, and with ``split_merge="kernel"`` store nothing, and a sequence read by
        one split is written straight out with no merge. 1: every split reads, as before.
        Default (None): ``default_min_split_tiles`` (8 for about one wave of pairs, else 1).
      fixed_max: take a unit's first tile's max as the softmax reference of all its later
        tiles instead of a running max (softmax is shift-invariant), so no tile after the first
        reduces across the warpgroup's four warps (a shared-memory round trip and two barriers,
        about a fifth of a lone CTA's time a tile on the H200). The largest score is tracked
        elementwise and checked once a unit: a unit whose scores rise more than
        ``fixed_max_headroom`` (32 in base 2 for bf16, 15 for f16) above its reference is read
        again with the running max, so the result never overflows. Only in the default kernel
        (not with ``producer``, ``persistent`` or ``balanced``). Default (None):
        ``default_fixed_max`` (on at bf16 in the default kernel).
      mma: the products' instructions: ``"wgmma"`` (Hopper) or ``"tcgen05"`` (Blackwell
        sm100 / sm103: each product is one MMA issued by one thread into tensor memory, then
        read into registers). tcgen05 runs the ``swap_ab`` form at 128-key tiles (every
        product M = 128: the keys, or 128 rows of the head dim; N = the query columns, rounded
        up to 16), so it needs head dim 128 or 256, ``block_kv`` 128 (its default there),
        ``swap_ab`` and ``split_merge="xla"``, and not ``producer``, ``persistent`` or
        ``balanced``. Verified
        in the Mosaic GPU interpreter and by lowering for sm100 on the CPU; not yet run on
        Blackwell hardware. Default (None): ``default_mma`` (tcgen05 on Blackwell, else wgmma;
        wgmma in the interpreter).
      out_blocks: with ``swap_ab``, each unit stores its output (or split partial) as its whole
        block of ``qcols`` query rows into a staging array, one block per (sequence, KV head),
        and a small XLA gather picks the G real rows after the kernel, instead of copying the
        G rows at their offset straight to their places. Mosaic GPU 0.12 lowers this form and
        not the direct one where G < ``qcols`` (``swap_ab_lowers``; where G == ``qcols`` the
        two are one). Default (None): on where the direct store does not lower (JAX >= 0.12
        and G < ``qcols``), else off. Ignored without ``swap_ab``; not with the
        kernel merge or ``balanced``.
      split_tail: split only the last ``split_tail`` sequences of the dispatch order (the
        shortest, with ``longest_first``; the grid's last CTAs either way) into ``num_splits``
        CTAs each, merged in the kernel, and read every other sequence with one CTA: the grid
        holds B + split_tail * (num_splits - 1) sequence slots, so the kernel's drain (its last
        wave, fewer CTAs than slots, each streaming alone) runs shorter units, and the rest of
        the grid pays no split. With ``min_split_tiles``, a tail sequence is read by
        ``clip(tiles // min_split_tiles, 1, num_splits)`` of its CTAs. 0 (the default): every
        sequence has ``num_splits`` CTAs. Needs ``num_splits`` >= 2, ``split_merge="kernel"``
        (``swap_ab``), at most B, and not ``producer``, ``persistent``, ``balanced`` or
        ``heads_inner=False``. Opt-in.
      order_head: with the in-kernel longest-first order (``order_method="kernel"``), the
        first ``order_head`` sequence slots take sequences 0 .. order_head - 1 in batch order
        without counting the order, so the first wave of CTAs starts its copies at once; the
        later slots take the other sequences longest first. 0 (the default): every slot counts.
        At most B; needs the order on and counted in the kernel. Opt-in: on the H200
        (twentieth session) 0.2-0.8% faster at B=128 / 2k, 0.8-2.9% slower at B=64 / 4k.

    Returns:
      [B, N, H] in ``q.dtype``.

    Raises:
      ValueError: if the kernel cannot run these shapes/dtypes (``unsupported_reason``) or a
        tuning knob is out of range.
    """
    if mma is None:
        mma = default_mma(bool(interpret))
    if mma not in MMAS:
        raise ValueError(f"{mma=} must be one of {MMAS}")
    tcgen05 = mma == "tcgen05"
    if block_kv is None:
        block_kv = TCGEN05_BLOCK_KV if tcgen05 else default_block_kv(q.shape[-1])
    reason = unsupported_reason(
        q, k_pages, v_pages, block_tables, lengths, block_kv=block_kv, check_backend=False
    )
    if reason is not None:
        raise ValueError(f"paged_attention_pallas_gpu cannot run this call: {reason}")
    if block_kv not in (64, 128):
        raise ValueError(f"{block_kv=} must be 64 or 128")
    if tcgen05 and (block_kv != TCGEN05_BLOCK_KV or q.shape[-1] not in TCGEN05_HEAD_DIMS):
        raise ValueError(
            f'mma="tcgen05" needs block_kv={TCGEN05_BLOCK_KV} (got {block_kv}) and a head dim in '
            f"{TCGEN05_HEAD_DIMS} (got {q.shape[-1]}): its products are M=128 MMAs"
        )
    B, N, H = q.shape
    if k_pages.ndim == 5:
        if layer is None:
            raise ValueError("layer must be given with a 5-D [L, K, P, C, H] pool")
        _, K, P, C, _ = k_pages.shape
    else:
        K, P, C, _ = k_pages.shape
        layer = 0
    W = block_tables.shape[1]
    order_args = (B, bool(producer), bool(persistent), bool(slot_lengths))
    if order_method is None:
        order_method = default_order_method(*order_args)
    # "kernel"'s own limits are checked once the order is known to be on (below).
    _check_order_method("order_method", order_method, B, _packed_order(B), kernel=False)
    if B == 0:
        return jnp.zeros(q.shape, q.dtype)
    producer = bool(producer)
    persistent = bool(persistent)
    if producer and persistent:
        raise ValueError("producer=True and persistent=True cannot be combined")
    balanced = bool(balanced)
    if tcgen05 and (producer or persistent or balanced):
        raise ValueError(
            'mma="tcgen05" runs in the default kernel: it cannot take '
            f"producer={producer}, persistent={persistent} or balanced={balanced}"
        )
    small = C < _TILE_ROWS  # pages below 8 tokens: not one TMA copy into the tiled ring
    if page_copy is None:  # the interpreter cannot run cp.async (inline Mosaic GPU code)
        page_copy = "cp_async" if small and not interpret else "tma"
    if page_copy not in PAGE_COPIES:
        raise ValueError(f"{page_copy=} must be one of {PAGE_COPIES}")
    if (small or page_copy == "cp_async") and (producer or persistent or balanced):
        raise ValueError(
            f"page_size={C} with page_copy={page_copy!r} runs only in the default kernel: it "
            f"cannot take producer={producer}, persistent={persistent} or balanced={balanced}"
        )
    if page_copy == "cp_async" and interpret:
        raise ValueError(
            'page_copy="cp_async" runs only on a GPU: the Mosaic GPU interpreter cannot '
            'run its inline Mosaic GPU code (use page_copy="tma", the default there)'
        )
    staged = small and page_copy == "tma"  # land untiled, then re-laid (_relayout)
    needs_auto = default_auto_barriers(producer, persistent, balanced, staged)
    auto_barriers = needs_auto if auto_barriers is None else bool(auto_barriers)
    if not auto_barriers and needs_auto:
        raise ValueError(
            "auto_barriers=False places its barriers in the default kernel only: it cannot take "
            f"producer={producer}, persistent={persistent}, balanced={balanced} or pages of "
            f"{C} tokens with page_copy={page_copy!r} (the staging ring)"
        )
    if balanced:
        clashes = dict(
            producer=producer, persistent=persistent, l2_prefetch=l2_prefetch,
            k_stages=k_stages, early_k=early_k, longest_first=longest_first,
            slot_lengths=slot_lengths, profile_dir=profile_dir,
        )  # fmt: skip
        bad = {k: v for k, v in clashes.items() if v not in (None, False, 0, "")}
        if swap_ab is not None and not swap_ab:
            bad["swap_ab"] = swap_ab
        if num_splits is not None and _int_knob("num_splits", num_splits) != 1:
            bad["num_splits"] = num_splits
        if bad:
            raise ValueError(
                f"balanced=True shares the tiles out itself, with swap_ab: it cannot take {bad} "
                "(leave them at their defaults)"
            )
        # No order: every CTA's share is the same size. (profile_dir: a share's segments would
        # overflow the profiler's fixed number of regions.)
        num_splits, swap_ab, longest_first = 1, True, False
    if num_splits is None:
        splits = default_num_splits(B, K, W * C, block_kv)
    else:
        splits = _int_knob("num_splits", num_splits)
    if splits < 1:
        raise ValueError(f"num_splits={splits} must be >= 1")
    qcols = _qcols(B, N, K, tcgen05)
    # The interpreter does not lower the kernel: swap_ab runs there on any JAX.
    lowers = bool(interpret) or swap_ab_lowers()
    # Where the direct store does not lower, swap_ab stores whole blocks (out_blocks), which
    # neither the kernel merge nor the balanced kernel can take. Where the G heads fill the
    # block (G == qcols) that whole-block store is the direct store: no gather after it.
    blocks_ok = not (balanced or (split_merge == "kernel" and splits > 1))
    fills = qcols == N // K
    if swap_ab is None:
        swap_ab = tcgen05 or (
            default_swap_ab(splits, H, qcols, producer, persistent) and (lowers or blocks_ok)
        )
    swap_ab = bool(swap_ab)
    if out_blocks is None:
        out_blocks = not lowers and not fills and blocks_ok
    out_blocks = bool(out_blocks) and swap_ab
    if out_blocks and not blocks_ok:
        raise ValueError(
            f"out_blocks=True cannot take balanced={balanced} or split_merge={split_merge!r} "
            "with splits (their partials are merged in the kernel)"
            + ("" if lowers else f"; jax {jax.__version__} lowers swap_ab only with out_blocks")
        )
    if tcgen05 and not swap_ab:
        raise ValueError('mma="tcgen05" runs the swap_ab form only: pass swap_ab=None or True')
    if tcgen05 and split_merge in ("kernel", "mosaic") and splits > 1:
        raise ValueError(
            f'mma="tcgen05" merges splits in XLA: pass split_merge=None or "xla" (got '
            f"{split_merge!r})"
        )
    if swap_ab and (producer or persistent):
        raise ValueError(
            "swap_ab=True needs producer=False and persistent=False (got "
            f"producer={producer}, persistent={persistent})"
        )
    if split_merge is not None and split_merge not in SPLIT_MERGES:
        raise ValueError(f"{split_merge=} must be one of {SPLIT_MERGES}")
    merge_ok = swap_ab and not (producer or persistent)
    if split_merge == "mosaic" and splits > 1 and not swap_ab:
        raise ValueError(
            'split_merge="mosaic" merges swap_ab partials: it needs swap_ab=True (got '
            f"swap_ab={swap_ab}, producer={producer}, persistent={persistent}); use "
            'split_merge="xla"'
        )
    if split_merge == "kernel" and splits > 1 and not merge_ok:
        raise ValueError(
            'split_merge="kernel" merges swap_ab partials: it needs swap_ab=True, '
            f"producer=False and persistent=False (got swap_ab={swap_ab}, producer={producer}, "
            f'persistent={persistent}); use split_merge="xla"'
        )
    if split_merge is None:
        if tcgen05:
            split_merge = "xla"
        elif split_tail and lowers and not out_blocks:  # the tail's splits: in the kernel
            split_merge = "kernel"
        else:
            split_merge = default_split_merge(splits, swap_ab, producer, persistent)
    kernel_merge = splits > 1 and split_merge == "kernel"
    mosaic_merge = splits > 1 and split_merge == "mosaic"
    qcols = qcols if swap_ab else None  # SMEM and stage defaults of the swap_ab tiles
    if num_stages is None:
        stages = default_num_stages(H, block_kv, producer, persistent, qcols=qcols, staged=staged)
    else:
        stages = _int_knob("num_stages", num_stages)
    k_stages = stages if k_stages is None else _int_knob("k_stages", k_stages)
    early_k = bool(early_k)
    if (k_stages != stages or early_k) and (producer or persistent):
        raise ValueError(
            f"k_stages={k_stages} (num_stages={stages}) and early_k={early_k} need "
            "producer=False and persistent=False: pass k_stages=None and early_k=False"
        )
    smem = functools.partial(
        _smem_bytes, H, block_kv, producer=producer, persistent=persistent, split=splits > 1,
        k_stages=k_stages, qcols=qcols, staged=staged,
    )  # fmt: skip
    if stages < 1 or k_stages < 1 or smem(stages) > _SMEM_BYTES:
        raise ValueError(
            f"num_stages={stages} and k_stages={k_stages} must be >= 1 and fit in 227 KB of "
            f"SMEM ({smem(stages)} bytes)"
        )
    l2_prefetch = _int_knob("l2_prefetch", l2_prefetch)
    if page_copy == "cp_async" and (l2_prefetch or early_k or k_stages != stages):
        raise ValueError(
            f'page_copy="cp_async" (page_size={C}) keeps K and V in one ring of cp.async '
            f"groups: it cannot take l2_prefetch={l2_prefetch}, early_k={early_k} or "
            f'k_stages={k_stages} != num_stages={stages} (page_copy="tma" can)'
        )
    if not 0 <= l2_prefetch <= _MAX_L2_PREFETCH or (l2_prefetch and (producer or persistent)):
        raise ValueError(
            f"{l2_prefetch=} must be in [0, {_MAX_L2_PREFETCH}], and 0 with producer=True or "
            "persistent=True"
        )
    if fixed_max is None:
        fixed_max = default_fixed_max(q.dtype, producer, persistent, balanced)
    fixed_max = bool(fixed_max)
    if fixed_max and (producer or persistent or balanced):
        raise ValueError(
            "fixed_max=True runs in the default kernel: it cannot take "
            f"producer={producer}, persistent={persistent} or balanced={balanced}"
        )
    if min_split_tiles is None:
        min_split_tiles = default_min_split_tiles(B, K, splits)
    min_split_tiles = _int_knob("min_split_tiles", min_split_tiles)
    if min_split_tiles < 1:
        raise ValueError(f"{min_split_tiles=} must be >= 1")
    if num_ctas is not None:
        num_ctas = _int_knob("num_ctas", num_ctas)
    if num_ctas is not None and (not (persistent or balanced) or num_ctas < 1):
        raise ValueError(f"{num_ctas=} must be >= 1 and needs persistent=True or balanced=True")
    if W == 0:  # no page to read: every length must be 0 (checked arguments, no launch)
        return jnp.zeros(q.shape, q.dtype)
    if persistent and num_ctas is None:
        ctas_per_sm = 2 if smem(stages) <= _TWO_CTA_SMEM_BYTES else 1
        num_ctas = ctas_per_sm * _backend.gpu_num_sms()
    if balanced:
        smem_bal = _balanced_smem_bytes(H, block_kv, stages, qcols, B)
        if smem_bal > _SMEM_BYTES:
            raise ValueError(
                f"balanced=True needs {smem_bal} bytes of SMEM a CTA here (B={B} lengths, "
                f"{qcols} query columns, head_dim={H}), over 227 KB: leave balanced off"
            )
        if num_ctas is None:
            per_sm = _balanced_ctas_per_sm(H, block_kv, stages, qcols, B)
            num_ctas = per_sm * _backend.gpu_num_sms()
        elif num_ctas > _MAX_BALANCED_CTAS:
            raise ValueError(f"{num_ctas=} must be at most {_MAX_BALANCED_CTAS} with balanced=True")
        # No more CTAs than the stream has tiles at most (the rest would only exit).
        num_ctas = min(int(num_ctas), B * K * max(1, -(-W * C // block_kv)))
    else:
        num_ctas = min(B * splits * K, int(num_ctas)) if persistent else 0
    split_tail = _int_knob("split_tail", split_tail)
    if split_tail:
        slots = B + split_tail * (splits - 1)  # blockIdx.z, at most 65535
        if not 0 < split_tail <= B or splits < 2 or not kernel_merge or not heads_inner:
            raise ValueError(
                f"{split_tail=} must be in [0, B={B}] and needs num_splits >= 2 (got {splits}), "
                f'split_merge="kernel" with swap_ab (got {split_merge!r}, swap_ab={swap_ab}) and '
                f"heads_inner=True (got {heads_inner})"
            )
        if slots > 65535:
            raise ValueError(f"{split_tail=} gives {slots} sequence slots: at most 65535")
    if longest_first is None:
        # With split_tail the units before the tail are whole sequences.
        lf = default_longest_first(B, K, 1 if split_tail else splits, W * C)
    else:
        lf = bool(longest_first)
    if lf:  # the in-kernel count's limits matter only where there is an order to count
        _check_order_method(
            "order_method", order_method, B, _packed_order(B), producer, persistent,
            bool(slot_lengths),
        )  # fmt: skip
    order_head = _int_knob("order_head", order_head)
    if order_head and not (0 < order_head <= B and lf and order_method == "kernel"):
        raise ValueError(
            f"{order_head=} must be in [0, B={B}] and needs the longest-first order counted in "
            f"the kernel (got longest_first={lf}, order_method={order_method!r})"
        )
    # (after every other check: theirs come first)
    if swap_ab and not lowers and not ((out_blocks or fills) and blocks_ok):
        raise ValueError(
            f"swap_ab=True{' (balanced=True needs it)' if balanced else ''} does not lower on "
            f"jax {jax.__version__}: Mosaic GPU's layout inference exhausts its search on a "
            "slice of its transposed output tile (jax 0.11.2 lowers it); pass swap_ab=False "
            "or None, and balanced=False"
        )
    cfg = _Config(
        num_seqs=B,
        num_q_heads=N,
        num_kv_heads=K,
        num_pages=P,
        page_size=C,
        head_dim=H,
        dtype=jnp.dtype(q.dtype),
        sm_scale=float(sm_scale),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        block_kv=block_kv,
        num_stages=stages,
        k_stages=k_stages,
        early_k=early_k,
        num_splits=splits,
        producer=producer,
        longest_first=lf,
        order_method=order_method,
        slot_lengths=lf and bool(slot_lengths),
        swap_ab=swap_ab,
        deferred_sum=swap_ab
        and (default_deferred_sum(qcols) if deferred_sum is None else bool(deferred_sum)),
        heads_inner=bool(heads_inner) and B <= 65535,  # blockIdx.z (B) is at most 65535
        persistent=persistent,
        num_ctas=num_ctas,
        l2_prefetch=l2_prefetch,
        interpret=(
            interpret
            if isinstance(interpret, plgpu.InterpretGPUParams)
            else plgpu.InterpretGPUParams()
            if interpret
            else False
        ),
        profile_dir=str(profile_dir) if profile_dir else "",
        balanced=balanced,
        page_copy=page_copy,
        kernel_merge=kernel_merge,
        mosaic_merge=mosaic_merge,
        auto_barriers=auto_barriers,
        min_split_tiles=min_split_tiles if splits > 1 else 1,
        fixed_max=fixed_max,
        mma=mma,
        out_blocks=out_blocks,
        split_tail=split_tail,
        order_head=order_head,
    )
    if profile_dir:
        os.makedirs(profile_dir, exist_ok=True)
    return _paged_attention(cfg, q, k_pages, v_pages, block_tables, lengths, layer)
