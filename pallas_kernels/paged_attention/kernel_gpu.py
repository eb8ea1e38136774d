"""Paged decode attention on Mosaic GPU (Hopper, sm90).

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
instead of 36 on the H200 (tenth session).

Long sequences are split across ``num_splits`` CTAs (split-KV) when the (sequence, KV head)
programs are fewer than about one wave; each writes its normalised partial output (``q.dtype``
with ``swap_ab``, else f32) and base-2 log-sum-exp. At 2-16 splits with ``swap_ab`` the last
split CTA of each pair to finish merges them in the kernel (``split_merge="kernel"``,
``_merge_split``: each CTA stores its partial and bumps the pair's arrival counter with an
acquire-release atomic; the one that sees the others all there loads the partials, merges and
stores; no CTA waits for another); otherwise a small XLA epilogue merges them (``"xla"``;
``default_split_merge`` has the H200 figures). The split count is chosen from static shapes
only (no host sync; jit- and CUDA-graph safe). The grid is (sequence, split, KV head) with the
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

Not covered (``unsupported_reason`` says so and auto dispatch falls back to ``xla``): GPUs
other than Hopper (sm90: the kernel is built on wgmma; Blackwell would need tcgen05), f32, page
sizes neither dividing nor divided by the tile (64 tokens; 128 at H=64), head dims other than
64/128/256, groups G > 56 unless a multiple of 8 up to 64.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._split_merge import merge_splits
from pallas_kernels.paged_attention import _cp_async, _merge_gpu

_ROWS = 64  # wgmma M tile: the G query heads of one KV head, padded
_LOG2E = math.log2(math.e)
_TILE_ROWS = 8  # rows of the (8, 64) SMEM tiling: a TMA copy into a tiled ref starts on one
_LSE_COLS = 32  # lse rows are 32 f32 = 128 B: TMA needs 128-byte-aligned SMEM row slices
_SMEM_BYTES = 227 * 1024
_TWO_CTA_SMEM_BYTES = 113 * 1024  # two CTAs per SM (228 KB, 1 KB reserved per CTA)
# setmaxnreg split of the producer variant's 2 x 128 threads. ptxas launches the kernel at the
# larger count (232 a thread, ncu on the H200): 232 * 256 = 59392 of the SM's 64K registers, so
# one such CTA per SM whatever its SMEM.
_COMPUTE_REGISTERS = 232
_PRODUCER_REGISTERS = 40
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static description of one kernel instance (hashable: a jit static argument)."""

    num_seqs: int  # B
    num_q_heads: int  # N
    num_kv_heads: int  # K
    num_pages: int  # P (per layer and head)
    page_size: int  # C
    head_dim: int  # H
    dtype: Any
    sm_scale: float
    logits_soft_cap: float | None
    sliding_window: int | None
    block_kv: int  # T
    num_stages: int  # V ring depth (and K's unless ``k_stages`` differs)
    k_stages: int  # K ring depth
    early_k: bool  # a K slot is refilled once Q K^T has read it, not after P @ V
    slot_lengths: bool  # lengths passed in the longest-first slot order (with longest_first)
    swap_ab: bool  # scores as K Q^T (keys x queries): the G heads are a wgmma N of ``qcols``
    deferred_sum: bool  # swap_ab: l kept per (key row, query) and summed over keys once at the end
    num_splits: int
    producer: bool  # a second warpgroup issues every K/V copy (warp specialization)
    longest_first: bool
    order_method: str  # how the longest-first order is computed (``ORDER_METHODS``)
    heads_inner: bool  # grid (B, S, K): a sequence's KV heads are adjacent CTAs
    persistent: bool  # num_ctas CTAs loop over the units (``_persistent_body``)
    num_ctas: int  # persistent grid size (0 otherwise)
    l2_prefetch: int  # tiles past the ring prefetched into L2 (``_prefetch``; 0: none)
    interpret: Any  # False, or the plgpu.InterpretGPUParams to interpret with
    profile_dir: str = ""  # Mosaic GPU on-device profiler trace directory ("": off)
    balanced: bool = False  # num_ctas CTAs share the stream of tiles equally (``_balanced_body``)
    page_copy: str = "tma"  # "cp_async" (per thread, the default below 8 tokens) or "tma"
    kernel_merge: bool = False  # splits merged by the last CTA of each pair (``_merge_split``)

    @property
    def xla_order(self) -> bool:
        """The longest-first order comes in as an array computed by XLA (else the kernel
        computes it: ``order_method="kernel"``, or there is none)."""
        return self.longest_first and self.order_method != "kernel"

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def copies_per_tile(self) -> int:
        return max(1, self.block_kv // self.page_size)

    @property
    def rows_per_copy(self) -> int:
        return min(self.page_size, self.block_kv)

    @property
    def staged(self) -> bool:
        """Pages below 8 tokens copied by TMA (``page_copy="tma"``): each page copy lands
        in an untiled staging ring, and a tile is re-laid into the (8, 64)-tiled, swizzled
        wgmma tiles before it is read (``_relayout``); a TMA copy into the tiled ring must start
        on an 8-row boundary."""
        return self.page_size < _TILE_ROWS and self.page_copy == "tma"

    @property
    def per_thread(self) -> bool:
        """Pages copied by every thread (``page_copy="cp_async"``, the default below 8 tokens):
        16-byte ``cp.async`` pieces straight into the tiled ring (``_cp_async``)."""
        return self.page_copy == "cp_async"

    @property
    def qcols(self) -> int:
        """``swap_ab``: query rows a CTA loads (its G heads at offset ``qoff`` in an 8-row
        aligned block), the wgmma N of both products."""
        return _qcols(self.num_seqs, self.num_q_heads, self.num_kv_heads)

    @property
    def q_rows(self) -> int:
        """Query rows of a CTA's Q and P tiles: ``qcols`` with ``swap_ab``, else the 64-row
        wgmma M tile."""
        return self.qcols if self.swap_ab else _ROWS


def _qcols(num_seqs: int, num_q_heads: int, num_kv_heads: int) -> int:
    G = num_q_heads // num_kv_heads
    offs = {
        (b * num_q_heads + h * G) % 8 for b in range(min(num_seqs, 8)) for h in range(num_kv_heads)
    }
    return -(-(max(offs) + G) // 8) * 8


def _smem_bytes(
    head_dim: int,
    block_kv: int,
    num_stages: int,
    itemsize: int = 2,
    producer: bool = False,
    persistent: bool = False,
    split: bool = True,
    k_stages: int | None = None,
    qcols: int | None = None,
    staged: bool = False,
) -> int:
    """SMEM of one CTA; ``qcols`` set: the ``swap_ab`` kernel, whose Q and P tiles hold
    ``qcols`` query rows instead of 64; ``staged`` (pages below 8 tokens by TMA): the ring is
    the untiled staging ring and one tiled K and one V tile come on top. Output tiles reuse the
    ring's SMEM (a later scope; the split path's qcols x H partial and 64 x qcols f32 lse are
    far below the ring)."""
    k_stages = num_stages if k_stages is None else k_stages
    kv = (num_stages + k_stages + 2 * staged) * block_kv * head_dim * itemsize
    if qcols is not None:
        return qcols * (head_dim + block_kv) * itemsize + kv + 1024
    q = _ROWS * head_dim * itemsize
    if producer:  # the output tiles share the ring's SMEM (RefUnion), the largest at S > 1
        kv = max(kv, _ROWS * (head_dim + _LSE_COLS) * 4 + 1024)
    p = _ROWS * block_kv * itemsize
    if persistent:  # the output tiles share P's SMEM; split partials in q.dtype
        out = _ROWS * head_dim * itemsize + (_ROWS * _LSE_COLS * 4 if split else 0)
        p = max(p, out)
    return q + kv + p + 1024  # barriers and alignment


def default_block_kv(head_dim: int) -> int:
    """Tokens per K/V tile: 128 for H=64 (same bytes per tile as H=128: 2.22 -> 2.72 TB/s on the
    H200, run 3 in docs/gpu_test_log.md), else 64 (at H=128, T=128 was 1-14% slower)."""
    return 128 if head_dim == 64 else 64


def default_num_stages(
    head_dim: int,
    block_kv: int = 64,
    producer: bool = False,
    persistent: bool = False,
    qcols: int | None = None,
    staged: bool = False,
) -> int:
    """Deepest ring that keeps two CTAs per SM (about 113 KB of SMEM each), at least 2.

    With the producer warpgroup the registers already hold the SM to one CTA
    (``_COMPUTE_REGISTERS``), so SMEM is no constraint below 227 KB: 4 stages where they fit
    (else the deepest that does). On the H200 quick table 4 beat 6 (the deepest at H=128) in
    every row and were within 2% of 2 or better.
    """
    if producer:
        stages = 4
        while stages > 1 and _smem_bytes(head_dim, block_kv, stages, producer=True) > _SMEM_BYTES:
            stages -= 1
        return stages
    if staged:
        # Pages below 8 tokens by TMA: 2 staging stages and the two tiled tiles, 99 KB at H=128
        # with swap_ab (two CTAs per SM), 121 KB with the 64-row tile (one); 1 stage where 2 do
        # not fit (H=256 with the 64-row tile).
        smem = functools.partial(_smem_bytes, head_dim, block_kv, qcols=qcols, staged=True)
        return 2 if smem(2) <= _SMEM_BYTES else 1
    if qcols is not None:
        # swap_ab: 2 stages (about 68 KB at H=128: three CTAs per SM by SMEM) beat 3 (two per
        # SM) in 8 of 9 quick rows on the H200 (eighth session, decode_quick_s8_swap.json).
        return 2
    for stages in (4, 3):
        if _smem_bytes(head_dim, block_kv, stages, persistent=persistent) <= _TWO_CTA_SMEM_BYTES:
            return stages
    return 2


def default_swap_ab(
    num_splits: int, head_dim: int, qcols: int, producer: bool = False, persistent: bool = False
) -> bool:
    """``swap_ab`` by default at head dims 64 and 128 and 8 query columns (G <= 8 heads whose
    rows do not straddle an 8-row boundary), with or without splits, where it was measured on
    the H200. Without splits (eighth session): 0.4-4.7% faster on CUPTI in all seven
    split-free quick rows, G = 1, 4, 8. With splits, once the partials left as rows in
    ``q.dtype`` instead of whole f32 tiles that the merge gathered (ninth session,
    ``decode_cases_s9_swap_splits.json``, CUPTI): B=1 / 32k -4.8%, B=1 / 8k at 32 KV heads
    -3.0%, B=32 / 8k -1.0%, B=8 / 8k at 32 KV heads -1.1%, B=1 / 32k at 32 KV heads -0.9%;
    slower at B=8 / 32k (+0.9%) and B=8 / 8k (+1.8%). Head dim 256 and 16+ query columns are
    correct in the interpreter, on the H200 and in CUDA lowering, but were not timed: opt in
    with ``swap_ab=True``. ``num_splits`` no longer changes the answer."""
    del num_splits
    return head_dim in (64, 128) and qcols == 8 and not producer and not persistent


def default_split_merge(
    num_splits: int, swap_ab: bool, producer: bool = False, persistent: bool = False
) -> str:
    """``"kernel"`` (the last split CTA of a pair merges, ``_merge_split``) at 2 to
    ``_KERNEL_MERGE_MAX_SPLITS`` splits with ``swap_ab`` and neither ``producer`` nor
    ``persistent``; else ``"xla"``.

    H200, thirteenth session (BENCHMARKS.md, ``decode_cases_s13_merge*.json``): at the default
    4-16 splits of six batches the kernel's CUPTI time tied the XLA path's attention and merge
    kernels (-1.2% to +1.8%), and 50 calls chained in one program (no host dispatch; the
    merge's two XLA kernels and their launch gaps gone) were faster or tied in all five batches
    timed so (1-13%, where the same configuration varied up to 10% between runs); at 32 splits
    the last CTA's merge, two rounds of 16 pieces after the slowest split, made the kernel
    12-14% slower (B=1 and B=2 at 32k: 54.4 vs 47.6 us, 55.9 vs 49.6).
    """
    ok = 1 < num_splits <= _KERNEL_MERGE_MAX_SPLITS and swap_ab and not (producer or persistent)
    return "kernel" if ok else "xla"


def default_deferred_sum(qcols: int = 8) -> bool:
    """``swap_ab`` tiles defer the softmax sum to the end (``deferred_sum``) at 8 query
    columns, the shape it was timed at; with 16-64 columns the [T, qcols] sums would hold
    T * qcols / 128 more f32 registers a thread (64 at 64 columns and T=128), unmeasured, so
    those keep the per-tile sum unless asked.

    On the H200 (tenth session, ``decode_cta_rate_s10.json``): a lone CTA streamed 42 GB/s
    instead of 36 (one sequence of 8 KV heads at 32k, no splits: 525.8 vs 616.1 us CUPTI), and
    the quick table was 0.1-2.4% faster on CUPTI in all nine rows (B=32 / 2k 69.2 vs 70.9 us,
    B=128 / 2k 239.0 vs 240.4; ``decode_quick_s10_deferred.json``): the second reduction
    across the warpgroup's warps is gone from every tile's critical path.
    """
    return qcols == 8


# CTAs resident at once on an H100/H200 (132 SMs x 2 CTAs of the default ring): below one such
# wave the dispatch order cannot matter and ``longest_first`` is off by default.
_WAVE_CTAS = 2 * 132


# Longest first pays only where a unit (a sequence's split) can be long: below this many
# tokens per unit (table width x page size / splits) the order costs more than the tail saves.
_LONGEST_FIRST_MIN_TOKENS = 2048


def default_longest_first(
    num_seqs: int, num_kv_heads: int, num_splits: int, max_tokens: int | None = None
) -> bool:
    """Order sequences longest first (an on-device order) when there is more than one wave
    and, given ``max_tokens`` (the block table's width x page size), a unit can hold more than
    ``_LONGEST_FIRST_MIN_TOKENS`` tokens.

    The hardware hands out CTAs in grid order as slots free up (greedy list scheduling): with
    the longest work first (LPT) the last wave holds the shortest CTAs and the tail is short.
    The XLA forms of the order cost 2-5 us per call (two or three small kernels); counted in
    each CTA (``order_method="kernel"``, the default up to 256 sequences) it costs 1.4-1.9 us of
    each CTA's prologue at 64-128 sequences (tenth session) and still lost on 1k-2k-token
    tables (B=256 / 512: 142.5 vs 133.5 us CUPTI, ``decode_cases_s10_order_splits.json``), so
    this rule stays. With the XLA order, on the H200 (ninth session, ``decode_cases_s9_order.json``, wall us with / without) it
    paid at 3072- to 6144-token tables without splits (B=128 / 2k 265.5 vs 271.0, B=64 / 4k
    246.9 vs 254.7, K=32 488.6 vs 495.2, B=256 / 2k 476.2 vs 487.2, head dim 64 81.8 vs 86.3)
    and lost at 1024- and 2048-token ones (B=256 / 1k 267.3 vs 262.1, B=256 / 512 144.4 vs
    136.4, B=512 / 1k 501.8 vs 499.0, B=128 / 1k 141.5 vs 135.7): short units leave a short
    tail in any order. With splits the evidence is mixed: it paid at 4 splits (B=32 / 8k,
    B=8 / 8k at 32 KV heads: 1.2-1.4% on CUPTI, ``decode_cases_s9_swap_splits.json``) and
    lost at B=8 / 32k with 8 splits (6k-token units; 0.9-1.7% on CUPTI in two calls), where
    it stays on.
    """
    if num_seqs <= 1 or num_seqs * num_kv_heads * num_splits <= _WAVE_CTAS:
        return False
    return max_tokens is None or max_tokens > _LONGEST_FIRST_MIN_TOKENS * num_splits


# ``l2_prefetch`` tiles are unrolled in the prologue: keep the program small.
_MAX_L2_PREFETCH = 16


def _int_knob(name: str, value) -> int:
    """An integer tuning argument (Python or NumPy int, not bool), else a ValueError naming it."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be an integer, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be an integer") from None


# The longest-first order is the ascending order of packed keys (0x7FFF - tiles) << 16 |
# sequence: an XLA array (by a sort, or by counting: ``_longest_first_order``) from which the
# kernel reads the sequence as ``key & 0xFFFF``, or counted in each CTA (``_kernel_order``).
_ORDER_BITS = 16
_ORDER_MAX_TILES = 0x7FFF


def _packed_order(num_seqs: int) -> bool:
    """Whether the order array holds packed keys (else plain sequence indices)."""
    return num_seqs <= 1 << _ORDER_BITS


# Up to this many sequences the packed keys' order can be computed by counting (``"rank"``, two
# O(B^2) reductions) instead of a sort: B^2 int32 compares are 1M at 1024.
_RANK_ORDER_MAX_SEQS = 1024

# Up to this many sequences each CTA can count its own place in the order (``"kernel"``): B
# compares of B / 128 keys a thread, in the CTA's prologue. The lengths reach SMEM by one TMA
# copy, whose bytes must be a multiple of 16 (B % 4 == 0) and whose box at most 256 long.
_KERNEL_ORDER_MAX_SEQS = 256

ORDER_METHODS = ("sort", "rank", "kernel")

# How pages reach the tiled SMEM ring (``page_copy``): copied by every thread in 16-byte
# pieces (the default below 8 tokens), or by TMA a page (into a staging ring below 8 tokens).
PAGE_COPIES = ("cp_async", "tma")

# How split partials are merged (``split_merge``): by the last split CTA of each pair, or by an
# XLA epilogue; in the kernel by default up to this many splits (``default_split_merge``).
SPLIT_MERGES = ("kernel", "xla")
_KERNEL_MERGE_MAX_SPLITS = 16


def _kernel_order_reason(
    num_seqs: int, producer: bool = False, persistent: bool = False, slot_lengths: bool = False
):
    """Why ``order_method="kernel"`` cannot order this call (None if it can)."""
    if num_seqs > _KERNEL_ORDER_MAX_SEQS or num_seqs % 4:
        return (
            f"needs a multiple of 4 sequences, at most {_KERNEL_ORDER_MAX_SEQS} (the lengths "
            f"reach SMEM by one TMA copy), got {num_seqs}"
        )
    if producer or persistent:
        return "is not built for producer=True or persistent=True"
    if slot_lengths:
        return "leaves no order array to permute the lengths by (slot_lengths=True)"
    return None


def default_order_method(
    num_seqs: int, producer: bool = False, persistent: bool = False, slot_lengths: bool = False
) -> str:
    """``"kernel"`` where each CTA can count its own place (``_kernel_order_reason``), else
    ``"rank"`` up to ``_RANK_ORDER_MAX_SEQS`` sequences, else ``"sort"``.

    H200, ninth session: the counting form's kernels cost less than the key fusion and sort
    at 8-1024 sequences (CUPTI, ``decode_order_s9.json``: 1.0 vs 2.1 us at B=8, 3.6 vs 4.4 at
    256, 4.4 vs 8.8 at 1024), and in the whole call it was faster on CUPTI in all 11 cases of
    ``decode_cases_s9_order.json`` (0.3-2.2 us) and on wall-clock in 8. The in-kernel count
    needs no XLA kernel at all (``_kernel_order``).
    """
    if _kernel_order_reason(num_seqs, producer, persistent, slot_lengths) is None:
        return "kernel"
    return "rank" if num_seqs <= _RANK_ORDER_MAX_SEQS and _packed_order(num_seqs) else "sort"


def _check_order_method(
    name: str,
    method,
    num_seqs: int,
    packed: bool,
    producer: bool = False,
    persistent: bool = False,
    slot_lengths: bool = False,
    kernel: bool = True,
) -> None:
    """A ValueError naming ``name`` unless ``method`` can order ``num_seqs`` sequences
    (``kernel=False``: without ``"kernel"``'s own limits, for a call that may not order)."""
    if method not in ORDER_METHODS:
        raise ValueError(f"{name}={method!r} must be one of {ORDER_METHODS}")
    why = _kernel_order_reason(num_seqs, producer, persistent, slot_lengths)
    if kernel and method == "kernel" and why:
        raise ValueError(f'{name}="kernel" {why}')
    if method == "rank" and not packed:
        raise ValueError(
            f'{name}="rank" needs packed keys (at most {1 << _ORDER_BITS} sequences), '
            f"got {num_seqs}"
        )
    if method == "rank" and num_seqs > _RANK_ORDER_MAX_SEQS:
        raise ValueError(
            f'{name}="rank" takes at most {_RANK_ORDER_MAX_SEQS} sequences, got {num_seqs}'
        )


def _packed_key(length, seq, block_kv: int):
    """The order's sort key of a sequence: ``(0x7FFF - tiles) << 16 | seq``, tiles =
    ceil(max(length, 0) / block_kv) capped at 0x7FFF. Shared by the XLA order and the kernel's
    own count (``_kernel_order``), on arrays or in-kernel values alike; ``block_kv`` is a power
    of two, so the division is a shift (and no int32 overflows near 2**31: 0 -> (-1 >> k) + 1
    = 0)."""
    if block_kv & (block_kv - 1):
        raise ValueError(f"{block_kv=} must be a power of two")
    shift = block_kv.bit_length() - 1
    tiles = jnp.minimum(((jnp.maximum(length, 0) - 1) >> shift) + 1, _ORDER_MAX_TILES)
    return ((_ORDER_MAX_TILES - tiles) << _ORDER_BITS) | seq


def _longest_first_order(lengths_B, block_kv: int, packed: bool, method: str = "sort"):
    """Sequence slots longest first: packed sort keys (``packed``) or plain argsort indices.

    ``jnp.argsort(-lengths)`` is a negate and a two-operand sort on the GPU (7.3 us at B=256 on
    the H200, ncu); the packed keys are one small fusion and a one-operand sort (2.5-4.7 us).
    Lengths compare in tiles (the work a unit does), capped at 0x7FFF tiles (2M tokens at
    T=64), so longer sequences tie; ties go in index order; lengths <= 0 sort last.

    ``method="rank"`` (packed keys, at most ``_RANK_ORDER_MAX_SEQS`` sequences) gives the same
    array without a sort: each key's rank is the count of smaller keys (the keys are distinct),
    and entry i is the key whose rank is i; two reductions over [B, B] that compute the keys
    inline, where the sort path is a key fusion, a copy into the sort's buffer and the sort.
    """
    if method == "kernel":
        raise ValueError('method="kernel" is computed inside the kernel (``_kernel_order``)')
    _check_order_method("method", method, lengths_B.shape[0], packed)
    live = jnp.maximum(lengths_B, 0)
    if not packed:
        return jnp.argsort(-live).astype(jnp.int32)
    slot = jnp.arange(lengths_B.shape[0], dtype=jnp.int32)
    keys = _packed_key(live, slot, block_kv)
    if method == "sort":
        return lax.sort(keys)
    rank = jnp.sum(keys[None, :] < keys[:, None], axis=1, dtype=jnp.int32)
    picked = jnp.where(rank[None, :] == slot[:, None], keys[None, :], 0)
    return jnp.sum(picked, axis=1, dtype=jnp.int32)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, block_kv: int) -> int:
    """Split-KV factor from static shapes (``programs`` = B x K (sequence, KV head) pairs):

    - >= 512 programs (two waves of 2 x 132 CTAs): none;
    - 256-511 (about one wave): enough splits for ~1024 CTAs if each keeps >= 32 tiles
      (2k tokens at T=64), else none: a wave of whole sequences is balanced badly (lengths
      vary) only when they are long enough for splits to pay for the merge;
    - fewer: enough for ~512 CTAs (two waves: sequences of different lengths split into
      units of different sizes, which the second wave evens out), but ~256 (one wave) for one
      or two sequences; >= 4 tiles per split; at most 64.

    H200, sixth session (BENCHMARKS.md), with the grid longest first over every CTA: no split
    beat 2 at B=64 / 4k and at head dim 64, and 4 at B=32 / 2k (two runs); 4 splits beat none
    at B=32 / 8k (3.81 vs 3.36 TB/s) and B=8, 32 KV heads / 8k (3.91 vs 3.77); 8 tie 16 at
    B=8 / 32k (4 and 32 were slower). Seventh session, B=1: one wave beat two in all three
    cases (CUPTI 44.9 vs 49.2 us at 8 KV heads / 32k; 94.3 vs 99.6 at 32 / 32k; 48.8 vs 53.8 at
    32 / 8k). Thirteenth session, B=2 / 32k at 8 KV heads: 16 splits (one wave) beat 32 in both
    runs, with either merge (CUPTI 46.8-47.7 us merged in the kernel, 48.4-49.1 by XLA, against
    49.6-49.7 at 32 splits merged by XLA).
    """
    programs = num_seqs * num_kv_heads
    max_tiles = -(-max_tokens // block_kv)
    if programs >= 512:
        return 1
    if programs >= 256:
        return max(1, min(-(-1024 // programs), max_tiles // 32))
    target = 256 if num_seqs <= 2 else 512
    return max(1, min(-(-target // programs), max_tiles // 4, 64))


def unsupported_reason(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    *,
    sm_scale=None,
    logits_soft_cap=None,
    sliding_window=None,
    layer=None,
    block_kv: int | None = None,
    check_backend: bool = True,
) -> str | None:
    """Why this kernel cannot run these arguments, or None if it can.

    Args:
      q: [B, N, H]; k_pages, v_pages: [K, P, C, H] or [L, K, P, C, H]; block_tables: i32[B, W];
        lengths: i32[B]. Only shapes and dtypes are read.
      sm_scale, logits_soft_cap, sliding_window, layer: accepted for signature parity.
      block_kv: the token tile T the kernel would use (default ``default_block_kv(H)``).
      check_backend: also require a Hopper (sm90) GPU as the default backend.
    """
    del sm_scale, logits_soft_cap, sliding_window, layer, block_tables, lengths
    reasons = []
    if check_backend:
        from jpaged import _backend

        cc = _backend.gpu_compute_capability()
        if cc is None or cc[0] != 9:  # wgmma is sm90a-only; Blackwell has tcgen05 instead
            reasons.append(
                f"the kernel uses Hopper wgmma: it needs compute capability 9.x (got {cc})"
            )
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_pages.dtype), jnp.dtype(v_pages.dtype)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
        reasons.append(
            f"q/k_pages/v_pages dtypes ({q.dtype}, {k_pages.dtype}, {v_pages.dtype}) must all be "
            "bfloat16 or all float16"
        )
    *_, C, H = k_pages.shape
    block_kv = default_block_kv(H) if block_kv is None else block_kv
    if H not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim={H} must be one of {SUPPORTED_HEAD_DIMS}")
    if C < 1 or (block_kv % C and C % block_kv):
        reasons.append(f"page_size={C} must divide or be a multiple of the tile {block_kv=}")
    N = q.shape[1]
    K = k_pages.shape[-4]
    G = N // K if K else 0
    if G > _ROWS or (G % 8 and G > _ROWS - 7):
        reasons.append(f"group size G={G} must be <= 56 (or a multiple of 8 up to 64)")
    rows = math.prod(k_pages.shape[:-1])
    if rows >= 2**31:
        reasons.append(f"the pool has {rows} rows; the kernel indexes rows with int32")
    return "; ".join(reasons) if reasons else None


def _smem_transforms():
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


class _Unit(NamedTuple):
    """One (sequence, split, KV head) work unit: traced scalars."""

    b: Any  # the sequence (after the longest-first permutation)
    length: Any
    lo: Any  # first visible key (sliding window)
    start: Any  # first K/V tile of this split
    n: Any  # tiles of this split (0: nothing to read; the output is zeros)
    last_page: Any  # the last block-table entry a lookup may read
    head_base: Any  # row of the KV head's page 0 in the flattened pool
    qrow: Any  # first query row of the unit's G heads
    s: Any  # the split
    valid: Any  # False for the padding units of a persistent CTA's last round
    h: Any  # the KV head

    @property
    def qrow8(self):
        return pl.multiple_of((self.qrow // 8) * 8, 8)

    @property
    def qoff(self):
        return self.qrow - self.qrow8

    def where(self, pred, other: _Unit) -> _Unit:
        return _Unit(*(jnp.where(pred, a, b) for a, b in zip(self, other, strict=True)))


def _tile_span(cfg: _Config, length):
    """(first visible key, first tile, tiles) of a sequence of ``length`` >= 0 keys: the tiles
    that hold its visible keys (all of them, or the sliding window's)."""
    T = cfg.block_kv
    lo = jnp.maximum(length - cfg.sliding_window, 0) if cfg.sliding_window else length * 0
    t_lo = lo // T
    return lo, t_lo, (length + T - 1) // T - t_lo


def _unit(cfg: _Config, len_ref, base_ref, order_ref, b_slot, h, s, valid=True, seq=None) -> _Unit:
    """The unit of grid slot (``b_slot``, ``s``, ``h``); ``seq``: its (sequence, length), as
    ``_kernel_order`` found them."""
    S = cfg.num_splits
    if seq is not None:
        b = seq[0]
    elif order_ref is None:
        b = b_slot
    elif _packed_order(cfg.num_seqs):  # packed keys (``_longest_first_order``)
        b = order_ref[b_slot] & ((1 << _ORDER_BITS) - 1)
    else:
        b = order_ref[b_slot]
    # With ``slot_lengths`` the lengths come in slot order: read at once, not after the order.
    # Lengths < 0 (invalid) count as 0, so no tile index and no table lookup goes negative.
    if seq is not None:
        length = seq[1]
    else:
        length = len_ref[b_slot] if cfg.slot_lengths else len_ref[b]
    length = jnp.maximum(length, 0)
    lo, t_lo, tiles = _tile_span(cfg, length)
    t_hi = t_lo + tiles
    per_split = (tiles + S - 1) // S
    start = t_lo + s * per_split
    n = jnp.maximum(jnp.minimum(start + per_split, t_hi) - start, 0)
    n = jnp.where(valid, n, 0)
    return _make_unit(cfg, base_ref, b, length, lo, h, start, n, s, valid)


def _make_unit(cfg: _Config, base_ref, b, length, lo, h, start, n, s=0, valid=True) -> _Unit:
    """The unit reading tiles [start, start + n) of KV head h of sequence b (``length`` >= 0
    keys, the first visible one ``lo``)."""
    C = cfg.page_size
    return _Unit(
        b=b,
        length=length,
        lo=lo,
        start=start,
        n=n,
        last_page=jnp.maximum((length + C - 1) // C - 1, 0),
        head_base=base_ref[0] + h * (cfg.num_pages * C),
        qrow=b * cfg.num_q_heads + h * cfg.group,
        s=jnp.asarray(s, jnp.int32),
        valid=jnp.asarray(valid, jnp.bool_),
        h=jnp.asarray(h, jnp.int32),
    )


def _lookup(cfg: _Config, bt_ref, unit: _Unit, i):
    """Block-table entries of tile i of ``unit`` (clamped: never past the last page)."""
    tile_tok = (unit.start + i) * cfg.block_kv
    C, r = cfg.page_size, cfg.rows_per_copy
    return [
        bt_ref[unit.b, jnp.minimum((tile_tok + j * r) // C, unit.last_page)]
        for j in range(cfg.copies_per_tile)
    ]


def _page_row(cfg: _Config, unit: _Unit, i, j, page):
    """First pool row of copy j of tile i of ``unit`` (``rows_per_copy`` rows of ``page``): a
    multiple of the rows a copy moves (8 rows of the SMEM tiling, or a whole small page)."""
    tok = (unit.start + i) * cfg.block_kv + j * cfg.rows_per_copy
    row = unit.head_base + page * cfg.page_size + tok % cfg.page_size
    return pl.multiple_of(row, min(cfg.rows_per_copy, _TILE_ROWS))


def _issue(cfg: _Config, unit: _Unit, i, slot, pages, streams):
    """Page copies of tile i of ``unit`` into ring slot ``slot``: for each page, one copy per
    ``(gmem, smem ring, barrier)`` stream, each one arrival on ``barrier[slot]``."""
    r = cfg.rows_per_copy
    for j, page in enumerate(pages):
        row = _page_row(cfg, unit, i, j, page)
        for src, ring, bar in streams:
            plgpu.copy_gmem_to_smem(
                src.at[pl.ds(row, r)], ring.at[slot, pl.ds(j * r, r)], bar.at[slot]
            )


def _prefetch(cfg: _Config, unit: _Unit, i, pages, srcs):
    """L2 prefetches (``cp.async.bulk.prefetch``) of tile i's pages of each of ``srcs``: the
    bytes are requested from HBM now and land in L2, not in SMEM, so more of the stream is in
    flight than the SMEM ring holds. A no-op in the interpreter."""
    r = cfg.rows_per_copy
    for j, page in enumerate(pages):
        row = _page_row(cfg, unit, i, j, page)
        for src in srcs:
            plgpu.async_prefetch(src.at[pl.ds(row, r)])


def _init_carry(cfg: _Config):
    """(acc, m, l): acc [64, H] with m, l per row; ``swap_ab``: acc^T [H, qcols], m, l per
    column, and with ``deferred_sum`` l [T, qcols] in the scores' layout (``_sum_l``)."""
    H = cfg.head_dim
    if cfg.swap_ab:
        shape, vec, axis = (H, cfg.qcols), cfg.qcols, 0
    else:
        shape, vec, axis = (_ROWS, H), _ROWS, 1
    acc = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    vec_layout = plgpu.Layout.WGMMA.reduce(axis)
    m = plgpu.layout_cast(jnp.full((vec,), -jnp.inf, jnp.float32), vec_layout)
    if cfg.deferred_sum:
        l = plgpu.layout_cast(jnp.zeros((cfg.block_kv, cfg.qcols), jnp.float32), plgpu.Layout.WGMMA)
    else:
        l = plgpu.layout_cast(jnp.zeros((vec,), jnp.float32), vec_layout)
    return acc, m, l


def _sum_l(cfg: _Config, l):
    """The softmax denominators per query: with ``deferred_sum`` the per-key partial sums
    [T, qcols] are reduced over the keys here, once, instead of once a tile (a reduction across
    the warpgroup's four warps, through SMEM, in every tile's critical path)."""
    return l.sum(axis=0) if cfg.deferred_sum else l


def _relayout(cfg: _Config, src, dst):
    """Copies the untiled [T, H] staging tile ``src`` into the tiled, swizzled ``dst`` through
    registers, in a layout of 16-byte vectors that reads and writes SMEM without bank conflicts
    (a quarter warp moves one 128-byte row), then makes it visible to wgmma (``staged``)."""
    layout = plgpu.Layout.SMEM_GMEM_COPY((cfg.block_kv, cfg.head_dim), cfg.dtype, 128)
    dst[...] = plgpu.load(src, layout=layout)
    plgpu.commit_smem()


def _tile(
    cfg: _Config,
    unit: _Unit,
    i,
    slot,
    carry,
    smem,
    *,
    v_slot=None,
    after_qk=None,
    before_p=None,
    tiles=None,
):
    """Tile i of ``unit`` (K in ring slot ``slot``, V in ``v_slot``, default the same): Q K^T,
    online softmax, P @ V.

    ``smem`` is (q_smem, k_smem, v_smem, p_smem, k_bar, v_bar). ``after_qk`` runs once the
    scores are read (Q and this slot's K are free), ``before_p`` before P is written to SMEM.
    ``tiles`` (``staged``): the tiled K and V tiles [1, T, H] that the ring's untiled slots are
    re-laid into once they land; the products read those. Returns the new (acc, m, l); P @ V
    has completed by then, so the slot's V is free.
    """
    T, H = cfg.block_kv, cfg.head_dim
    q_smem, k_smem, v_smem, p_smem, k_bar, v_bar = smem
    acc, m, l = carry
    tile_tok = (unit.start + i) * T
    v_slot = slot if v_slot is None else v_slot

    def landed(bar, ring, at, tile, later_groups):
        """Waits for the slot's copies; the tile the products read. ``per_thread``: a tile's
        K and V are two cp.async groups, issued ``num_stages`` tiles ahead (``_attend``), so
        ``later_groups`` (the other stream's and the later tiles') may still be in flight."""
        if cfg.per_thread:
            if later_groups is not None:  # (V's group was waited for with P's store)
                _cp_async.wait(later_groups)
                plgpu.commit_smem()
            return ring.at[at]
        plgpu.barrier_wait(bar.at[at])
        if tile is None:
            return ring.at[at]
        _relayout(cfg, ring.at[at], tile.at[0])
        return tile.at[0]

    k_tile, v_tile = (None, None) if tiles is None else tiles
    later = 2 * cfg.num_stages - 1  # cp.async groups after this tile's K group
    # swap_ab: the scores' transpose K Q^T [T, qcols] (keys down, queries across), P^T stored
    # through a transposed view of P [qcols, T], and O^T = V^T P^T [H, qcols]: the wgmma M is
    # the keys / the head dim, and only N = qcols columns of queries are computed (8 for
    # G <= 4) where the default tile computes 64 query rows.
    swap = cfg.swap_ab
    keys = 0 if swap else 1  # the scores' key axis
    k_tile = landed(k_bar, k_smem, slot, k_tile, later)

    def qk(acc_ref):
        if swap:
            plgpu.wgmma(acc_ref, k_tile, q_smem.transpose((1, 0)))
        else:
            plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
        return acc_ref[...]

    sc_shape = (T, cfg.qcols) if swap else (_ROWS, T)
    sc = pl.run_scoped(qk, plgpu.ACC(sc_shape, jnp.float32))
    if after_qk is not None:
        after_qk()
    scale = cfg.sm_scale * _LOG2E  # base-2 logits; m is in these units
    fold = not cfg.logits_soft_cap and scale > 0  # scale applied inside exp2, not per score
    if cfg.logits_soft_cap:
        cap = cfg.logits_soft_cap
        sc = (cap * _LOG2E) * jnp.tanh(sc * (cfg.sm_scale / cap))
    elif not fold:
        sc = sc * scale

    def mask(sc):
        key = tile_tok + plgpu.broadcasted_iota(
            jnp.int32, sc_shape, keys, layout=plgpu.Layout.WGMMA
        )
        return jnp.where((key < unit.length) & (key >= unit.lo), sc, -jnp.inf)

    # Only a tile holding the sequence end or the window start has keys to hide: the others
    # skip the per-score iota, compares and select (a uniform branch).
    partial = (tile_tok + T > unit.length) | (tile_tok < unit.lo)
    sc = lax.cond(partial, mask, lambda sc: sc, sc)
    queries = [1 - keys]  # where a per-query vector broadcasts to
    if fold:  # max(s) * scale = max(s * scale) for scale > 0; exp2(s * scale - m) per score
        m_new = jnp.maximum(m, sc.max(axis=keys) * scale)
        p = jnp.exp2(sc * scale - lax.broadcast_in_dim(m_new, sc.shape, queries))
    else:
        m_new = jnp.maximum(m, sc.max(axis=keys))
        p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, queries))
    alpha = jnp.exp2(m - m_new)
    if cfg.deferred_sum:  # l [T, qcols]: no reduction across the warps in the loop
        l = l * lax.broadcast_in_dim(alpha, sc.shape, queries) + p
    else:
        l = l * alpha + p.sum(axis=keys)
    if before_p is not None:
        before_p()
    if swap:
        p_smem.transpose((1, 0))[...] = p.astype(cfg.dtype)
    else:
        p_smem[...] = p.astype(cfg.dtype)
    if cfg.per_thread:  # V's cp.async group, made visible by P's fence and barrier
        _cp_async.wait(later - 1)
    plgpu.commit_smem()
    v_tile = landed(v_bar, v_smem, v_slot, v_tile, None if cfg.per_thread else later - 1)

    @pl.when(tile_tok + T > unit.length)
    def _zero_tail():  # stale/NaN rows past the end: 0 * NaN would poison P @ V
        rows = tile_tok + plgpu.broadcasted_iota(jnp.int32, (T, H), 0, layout=plgpu.Layout.WGMMA)
        vals = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
        v_tile[...] = jnp.where(rows < unit.length, vals, jnp.zeros_like(vals))
        plgpu.commit_smem()

    def pv(acc_ref):
        if swap:
            plgpu.wgmma(acc_ref, v_tile.transpose((1, 0)), p_smem.transpose((1, 0)))
        else:
            plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]

    o = pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, queries) + o
    return acc, m_new, l


def _finish(cfg: _Config, acc, m, l, with_lse: bool | None = None):
    """The normalised output (rows that saw no key give zeros) and, split (or ``with_lse``),
    its base-2 log-sum-exp."""
    l = _sum_l(cfg, l)
    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [1] if cfg.swap_ab else [0])
    if not (cfg.num_splits > 1 if with_lse is None else with_lse):
        return out, None
    return out, jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def _store(cfg: _Config, unit: _Unit, outs, out_smem, out, lse, *, wait: bool = True):
    """Writes the unit's G real rows: the output tile in ``q.dtype`` (S == 1), or the partial
    (``_partial_dtype``) and its log-sum-exp (``swap_ab`` with splits: the G rows of the
    partial, and the lse row of its ``qcols`` columns to the (sequence, KV head) slot). ``wait=False``
    leaves the copies in flight (the persistent loop waits for their SMEM reads before it
    writes the tiles again)."""
    G = cfg.group
    rows = pl.ds(unit.qoff, G)
    if not wait:  # the previous unit's copies may still read these tiles
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if cfg.swap_ab and cfg.num_splits == 1:  # out is O^T [H, qcols]: stored transposed
        (o_ref,), (o_smem,) = outs, out_smem
        o_smem.transpose((1, 0))[...] = out.astype(cfg.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[pl.ds(unit.qrow, G)])
    elif cfg.swap_ab:
        # The partial O^T goes out as its G rows in q.dtype through a transposed view, as
        # without splits (Mosaic GPU cannot store f32 through a transposed view). The lse row
        # of the qcols columns goes to the (sequence, KV head) slot b * K + h, and the merge
        # picks the G real columns (``_swapped_lse``).
        (o_ref, lse_ref), (o_smem, lse_smem) = outs, out_smem
        cta = unit.b * cfg.num_kv_heads + unit.h
        o_smem.transpose((1, 0))[...] = out.astype(o_smem.dtype)
        lse_smem[...] = lax.broadcast_in_dim(lse, lse_smem.shape, [1])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[unit.s, pl.ds(unit.qrow, G)])
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, 1)], lse_ref.at[unit.s, pl.ds(cta, 1)])
    elif cfg.num_splits == 1:
        (o_ref,), (o_smem,) = outs, out_smem
        o_smem[...] = out.astype(cfg.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[pl.ds(unit.qrow, G)])
    else:
        (o_ref, lse_ref), (o_smem, lse_smem) = outs, out_smem
        o_smem[...] = out.astype(o_smem.dtype)
        lse_smem[...] = lax.broadcast_in_dim(lse, (_ROWS, _LSE_COLS), [0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[unit.s, pl.ds(unit.qrow, G)])
        plgpu.copy_smem_to_gmem(lse_smem.at[rows], lse_ref.at[unit.s, pl.ds(unit.qrow, G)])
    if wait:
        plgpu.wait_smem_to_gmem(0)


def _partial_dtype(cfg: _Config):
    """Split partials: f32, or ``q.dtype`` as FlashInfer's and vLLM's merged states are stored:
    in the persistent kernel, whose output tiles have their own SMEM (f32 would not leave room
    for two CTAs per SM), and with ``swap_ab``, whose O^T leaves through a transposed view
    (Mosaic GPU stores only 16-bit types that way)."""
    return cfg.dtype if cfg.persistent or cfg.swap_ab else jnp.float32


def _scratch(cfg: _Config):
    """(q, (k ring, v ring), p, out tiles) SMEM scratch shapes."""
    T, H, stages, dtype = cfg.block_kv, cfg.head_dim, cfg.num_stages, cfg.dtype
    tr = _smem_transforms()
    rows = cfg.q_rows  # with swap_ab, Q^T and P^T are wgmma B operands (transposed views)
    # Output tiles, untiled: slices of G < 8 rows at qoff must not cross (8, 64) tiles.
    if cfg.num_splits == 1:
        out = (plgpu.SMEM((rows, H), dtype),)
    elif cfg.swap_ab:  # the partial's rows (stored through O^T's transposed view), lse row
        out = (plgpu.SMEM((rows, H), _partial_dtype(cfg)), plgpu.SMEM((_ROWS, rows), jnp.float32))
    else:
        out = (
            plgpu.SMEM((_ROWS, H), _partial_dtype(cfg)),
            plgpu.SMEM((_ROWS, _LSE_COLS), jnp.float32),
        )
    ring_tr = {} if cfg.staged else {"transforms": tr}  # staged: copies land untiled
    return (
        plgpu.SMEM((rows, H), dtype, transforms=tr),
        (
            plgpu.SMEM((cfg.k_stages, T, H), dtype, **ring_tr),
            plgpu.SMEM((stages, T, H), dtype, **ring_tr),
        ),
        plgpu.SMEM((rows, T), dtype, transforms=tr),
        out,
    )


def _staged_tiles(cfg: _Config):
    """``staged``: the tiled K and V tiles [1, T, H] the products read (``_relayout``). One
    shared tile would need a warpgroup barrier between a tile's P @ V and the next tile's K
    re-layout (a warp may finish its wgmma before another); with two, the P store's barrier
    separates every tile's last read from the next write."""
    tile = plgpu.SMEM((1, cfg.block_kv, cfg.head_dim), cfg.dtype, transforms=_smem_transforms())
    return tile, tile


def _merge_rounds(cfg: _Config) -> int:
    """Pieces a round of the in-kernel split merge loads (``_merge_split``)."""
    return min(cfg.num_splits, _merge_batch(cfg.head_dim, cfg.block_kv, cfg.num_stages, cfg.q_rows))


def _merge_scratch(cfg: _Config):
    """SMEM of ``_merge_split``: a round's partial rows and lse rows, their barriers and the
    arrival flag (after the loop: it reuses the ring's SMEM)."""
    NB, R = _merge_rounds(cfg), cfg.q_rows
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
    S, G, R, H = cfg.num_splits, cfg.group, cfg.q_rows, cfg.head_dim
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
            batch=_merge_rounds(cfg), lse_step=step,
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
    B, T = cfg.num_seqs, cfg.block_kv
    Bp = -(-B // 128) * 128  # a strided register layout covers 128 * k elements
    layout = plgpu.Layout.WG_STRIDED((Bp,), vec_size=Bp // 128)

    def count(len_smem, key_smem, bar):
        plgpu.copy_gmem_to_smem(len_ref, len_smem.at[pl.ds(0, B)], bar)
        plgpu.barrier_wait(bar)
        seqs = plgpu.broadcasted_iota(jnp.int32, (Bp,), 0, layout=layout)
        lengths = plgpu.load(len_smem, layout=layout)  # entries >= B: never written
        keys = jnp.where(
            seqs < B, _packed_key(lengths, seqs, T), jnp.int32(0x7FFFFFFF)
        )  # ranks >= B
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


def _attend(
    cfg: _Config,
    refs,
    unit: _Unit,
    q_smem,
    k_smem,
    v_smem,
    p_smem,
    q_bar,
    k_bar,
    v_bar,
    consumed=None,
    tiles=None,
):
    """The attention loop over ``unit``'s n tiles: (acc, m, l) in the WGMMA layout. ``refs``:
    (q_ref, k_ref, v_ref, bt_ref); ``tiles``: ``staged``'s tiled K and V tiles (``_tile``).

    Without ``consumed`` this warpgroup also issues every copy: the first ``k_stages`` K
    and ``stages`` V tiles up front, then K of tile i + k_stages once tile i's Q K^T
    (``early_k``) or P @ V has read its slot, and V of tile i + stages once P @ V has. With
    ``consumed`` (the K- and V-consumed barriers of the producer variant) it issues none
    and arrives on them as soon as the slot's K (after Q K^T) or V (after P @ V) is no
    longer read.
    """
    q_ref, k_ref, v_ref, bt_ref = refs
    stages, k_stages, n = cfg.num_stages, cfg.k_stages, unit.n
    k_stream, v_stream = (k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar)
    smem = (q_smem, k_smem, v_smem, p_smem, k_bar, v_bar)

    def per_thread_issue(i, slot, live):
        _cp_async.issue(
            cfg, bt_ref, k_ref, v_ref, k_smem, v_smem, unit, i, slot, live, _smem_transforms()
        )

    with jax.named_scope("prologue"):  # Q and the first tiles requested, Q landed
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(unit.qrow8, cfg.q_rows)], q_smem, q_bar)
        ring = max(stages, k_stages)  # tiles whose K or V the ring requests up front
        ahead = ring + cfg.l2_prefetch  # tiles requested from HBM ahead of the one computed
        if cfg.per_thread:  # every thread copies pieces of the first tiles (cp.async)
            for i in range(stages):
                per_thread_issue(i, i, i < n)
        elif consumed is None:
            # Every prologue lookup first (clamped, so in bounds even past n): the block-table
            # reads are in flight together rather than one tile's after the last one's issue.
            first = [_lookup(cfg, bt_ref, unit, i) for i in range(ring)]
            for i in range(ring):
                streams = [k_stream] * (i < k_stages) + [v_stream] * (i < stages)
                pl.when(i < n)(
                    lambda i=i, streams=streams: _issue(cfg, unit, i, i, first[i], streams)
                )
            for i in range(ring, ahead):
                pl.when(i < n)(
                    lambda i=i: _prefetch(
                        cfg, unit, i, _lookup(cfg, bt_ref, unit, i), (k_ref, v_ref)
                    )
                )
        plgpu.barrier_wait(q_bar)

    def step(i, carry):
        slot = lax.rem(i, jnp.int32(stages))
        if cfg.per_thread:  # the slot's next tile, two cp.async groups (committed even if none)
            assert consumed is None, "page_copy='cp_async' has no producer warpgroup"
            carry = _tile(cfg, unit, i, slot, carry, smem)
            per_thread_issue(i + stages, slot, i + stages < n)
            return carry
        if consumed is None:
            k_slot = slot if k_stages == stages else lax.rem(i, jnp.int32(k_stages))
            # The block-table reads are in flight during the tile.
            next_v = _lookup(cfg, bt_ref, unit, i + stages)
            next_k = next_v if k_stages == stages else _lookup(cfg, bt_ref, unit, i + k_stages)
            if cfg.l2_prefetch:
                far_pages = _lookup(cfg, bt_ref, unit, i + ahead)

            def refill_k():
                pl.when(i + k_stages < n)(
                    lambda: _issue(cfg, unit, i + k_stages, k_slot, next_k, [k_stream])
                )

            carry = _tile(
                cfg, unit, i, k_slot, carry, smem, v_slot=slot,
                after_qk=refill_k if cfg.early_k else None, tiles=tiles,
            )  # fmt: skip
            if cfg.early_k:
                streams = [v_stream]
            elif k_stages == stages:
                streams = [k_stream, v_stream]
            else:
                refill_k()
                streams = [v_stream]
            pl.when(i + stages < n)(lambda: _issue(cfg, unit, i + stages, slot, next_v, streams))
            if cfg.l2_prefetch:
                pl.when(i + ahead < n)(
                    lambda: _prefetch(cfg, unit, i + ahead, far_pages, (k_ref, v_ref))
                )
            return carry
        # reading the scores waited for the wgmma: K is free
        after_qk = lambda: plgpu.barrier_arrive(consumed[0].at[slot])  # noqa: E731
        carry = _tile(cfg, unit, i, slot, carry, smem, after_qk=after_qk)
        plgpu.barrier_arrive(consumed[1].at[slot])
        return carry

    with jax.named_scope("loop"):
        return lax.fori_loop(0, n, step, _init_carry(cfg))


def _kernel_body(cfg: _Config, q_ref, k_ref, v_ref, bt_ref, len_ref, base_ref, *rest):
    """Body of one CTA: (sequence slot b, split s, KV head h)."""
    order_ref, outs = _split_rest(cfg, rest)
    stages, k_stages, n_cp = cfg.num_stages, cfg.k_stages, cfg.copies_per_tile
    counters = None  # the pairs' arrival counters of the in-kernel merge
    if cfg.kernel_merge and not cfg.interpret:
        counters = pl.get_global(plgpu.SemaphoreType.REGULAR((cfg.num_seqs * cfg.num_kv_heads,)))
    b_slot = lax.axis_index("b")
    seq = None
    if cfg.longest_first and not cfg.xla_order:
        with jax.named_scope("order"):  # the profiler's regions (``profile_dir``)
            seq = _kernel_order(cfg, len_ref, b_slot)
    unit = _unit(
        cfg, len_ref, base_ref, order_ref, b_slot, lax.axis_index("h"), lax.axis_index("s"),
        seq=seq,
    )  # fmt: skip
    n = unit.n
    refs = (q_ref, k_ref, v_ref, bt_ref)

    q_scratch, ring_scratch, p_scratch, out_scratch = _scratch(cfg)
    q_barrier = plgpu.Barrier(num_arrivals=1)
    ring_barrier = plgpu.Barrier(num_arrivals=n_cp, num_barriers=stages)

    if not cfg.producer:
        k_barrier = plgpu.Barrier(num_arrivals=n_cp, num_barriers=k_stages)
        tiles = _staged_tiles(cfg) if cfg.staged else ()
        acc, m, l = pl.run_scoped(
            lambda *scratch: _attend(cfg, refs, unit, *scratch[:7], tiles=scratch[7:] or None),
            q_scratch, *ring_scratch, p_scratch, q_barrier, k_barrier, ring_barrier, *tiles,
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
                _store(cfg, unit, parts, out_smem, out, lse)
                _merge_split(cfg, unit, counters, final_ref, parts, out_smem[0], merge_smem)

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


_TMA_MAX_DIM = 256  # elements a TMA copy spans along one dimension, at most

# Pieces whose partials one round of the balanced merge loads at once (``_balanced_body``), at
# most: fewer where 16 would not fit in the ring's SMEM, which the merge buffers share.
_MERGE_BATCH = 16


# The balanced grid's semaphores and partial slots scale with its CTAs: keep them bounded.
_MAX_BALANCED_CTAS = 65535


def _ring_bytes(head_dim: int, block_kv: int, stages: int) -> int:
    """SMEM of the balanced kernel's K and V rings (``stages`` tiles each, 16-bit)."""
    return 2 * stages * block_kv * head_dim * 2


def _merge_batch(head_dim: int, block_kv: int, stages: int, qcols: int) -> int:
    """Pieces a round of the balanced merge loads: ``_MERGE_BATCH``, or as many as fit in the
    ring's SMEM (at least 1: the ring holds at least two 64-row tiles, a piece at most 64 rows)."""
    ring = _ring_bytes(head_dim, block_kv, stages)
    piece = qcols * head_dim * 2 + _lse_row_step(qcols) * qcols * 4
    return max(1, min(_MERGE_BATCH, ring // piece))


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


def _lse_row_step(qcols: int) -> int:
    """Rows of ``qcols`` f32 a piece's lse row is placed apart in SMEM: the fewest whose bytes
    are a multiple of 128, so every piece's row starts 128-byte aligned (a TMA destination)."""
    return 128 // math.gcd(128, 4 * qcols)


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


def _swapped_lse(cfg: _Config, lse_SCQ):
    """``swap_ab`` split lse [S, B*K, qcols] per (sequence, KV head) slot -> [S, B*N, 1] (the
    partials themselves are stored as rows). Head h of sequence b owns columns
    qoff .. qoff + G of its slot, qoff = (b * N + h * G) % 8 (a small XLA gather: S x B x N
    floats)."""
    S, B, K, N, G = (cfg.num_splits, cfg.num_seqs, cfg.num_kv_heads, cfg.num_q_heads, cfg.group)
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None]
    h = jnp.arange(K, dtype=jnp.int32)[None, :, None]
    cols = (b * N + h * G) % 8 + jnp.arange(G, dtype=jnp.int32)  # [B, K, G]
    lse = jnp.take_along_axis(lse_SCQ.reshape(S, B, K, -1), cols[None], axis=3)
    return lse.reshape(S, B * N, 1)


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
        out_type = jax.ShapeDtypeStruct((B * N, H), cfg.dtype)
    elif cfg.swap_ab:  # partial rows in q.dtype; the lse of qcols columns per (b, h) slot
        out_type = (
            jax.ShapeDtypeStruct((S, B * N, H), _partial_dtype(cfg)),
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
    if cfg.kernel_merge:
        name += "_km"  # splits merged in the kernel
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
    else:
        grid, grid_names = (K, S, B), ("h", "s", "b")
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
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
        return out.reshape(B, N, H)
    o_SRH, lse_SRL = out
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
        can hold more than 2048 tokens (``block_tables`` width x page size / splits).
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
        the launch; with ``swap_ab``, not with ``producer`` or ``persistent``) or ``"xla"`` (a
        small XLA epilogue, ``_split_merge.merge_splits``). Ignored without splits. Default
        (None): ``default_split_merge``.

    Returns:
      [B, N, H] in ``q.dtype``.

    Raises:
      ValueError: if the kernel cannot run these shapes/dtypes (``unsupported_reason``) or a
        tuning knob is out of range.
    """
    if block_kv is None:
        block_kv = default_block_kv(q.shape[-1])
    reason = unsupported_reason(
        q, k_pages, v_pages, block_tables, lengths, block_kv=block_kv, check_backend=False
    )
    if reason is not None:
        raise ValueError(f"paged_attention_pallas_gpu cannot run this call: {reason}")
    if block_kv not in (64, 128):
        raise ValueError(f"{block_kv=} must be 64 or 128")
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
    qcols = _qcols(B, N, K)
    if swap_ab is None:
        swap_ab = default_swap_ab(splits, H, qcols, producer, persistent)
    swap_ab = bool(swap_ab)
    if swap_ab and (producer or persistent):
        raise ValueError(
            "swap_ab=True needs producer=False and persistent=False (got "
            f"producer={producer}, persistent={persistent})"
        )
    if split_merge is not None and split_merge not in SPLIT_MERGES:
        raise ValueError(f"{split_merge=} must be one of {SPLIT_MERGES}")
    merge_ok = swap_ab and not (producer or persistent)
    if split_merge == "kernel" and splits > 1 and not merge_ok:
        raise ValueError(
            'split_merge="kernel" merges swap_ab partials: it needs swap_ab=True, '
            f"producer=False and persistent=False (got swap_ab={swap_ab}, producer={producer}, "
            f'persistent={persistent}); use split_merge="xla"'
        )
    if split_merge is None:
        split_merge = default_split_merge(splits, swap_ab, producer, persistent)
    kernel_merge = splits > 1 and split_merge == "kernel"
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
    if num_ctas is not None:
        num_ctas = _int_knob("num_ctas", num_ctas)
    if num_ctas is not None and (not (persistent or balanced) or num_ctas < 1):
        raise ValueError(f"{num_ctas=} must be >= 1 and needs persistent=True or balanced=True")
    if W == 0:  # no page to read: every length must be 0 (checked arguments, no launch)
        return jnp.zeros(q.shape, q.dtype)
    if persistent and num_ctas is None:
        from jpaged import _backend

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
            from jpaged import _backend

            per_sm = _balanced_ctas_per_sm(H, block_kv, stages, qcols, B)
            num_ctas = per_sm * _backend.gpu_num_sms()
        elif num_ctas > _MAX_BALANCED_CTAS:
            raise ValueError(f"{num_ctas=} must be at most {_MAX_BALANCED_CTAS} with balanced=True")
        # No more CTAs than the stream has tiles at most (the rest would only exit).
        num_ctas = min(int(num_ctas), B * K * max(1, -(-W * C // block_kv)))
    else:
        num_ctas = min(B * splits * K, int(num_ctas)) if persistent else 0
    if longest_first is None:
        lf = default_longest_first(B, K, splits, W * C)
    else:
        lf = bool(longest_first)
    if lf:  # the in-kernel count's limits matter only where there is an order to count
        _check_order_method(
            "order_method", order_method, B, _packed_order(B), producer, persistent,
            bool(slot_lengths),
        )  # fmt: skip
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
    )
    if profile_dir:
        os.makedirs(profile_dir, exist_ok=True)
    return _paged_attention(cfg, q, k_pages, v_pages, block_tables, lengths, layer)
