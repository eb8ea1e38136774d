"""Static configuration of the Mosaic GPU decode kernel (``kernel_gpu``): the kernel instance
(``_Config``), SMEM sizes, the tuning defaults measured on the H200, the longest-first order's
host side, and ``unsupported_reason``."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any

import jax.numpy as jnp
from jax import lax

from pallas_kernels import _backend, _gpu_checks

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
SUPPORTED_DTYPES = _gpu_checks.SUPPORTED_DTYPES
SUPPORTED_HEAD_DIMS = _gpu_checks.SUPPORTED_HEAD_DIMS


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
    mosaic_merge: bool = False  # splits merged by a second kernel (``_merge_gpu.merge_partials``)
    # Pallas's automatic warpgroup barriers around every SMEM store and before every copy; off:
    # the few the kernel needs are placed by hand (``_gpu_tile.wg_barrier``).
    auto_barriers: bool = True
    # A sequence is split only into as many splits as keep this many tiles each (1: all
    # num_splits, however short; ``default_min_split_tiles``).
    min_split_tiles: int = 1
    # The first tile's max is every later tile's softmax reference: no max across the warps
    # in the loop; a unit whose scores rise more than ``fixed_max_headroom`` above it is redone
    # with the running max (``_gpu_tile._attend``).
    fixed_max: bool = False
    # The products' instructions: Hopper's wgmma (accumulators in registers) or Blackwell's
    # tcgen05 MMA (accumulators in tensor memory, read into registers; ``MMAS``).
    mma: str = "wgmma"
    # ``swap_ab``: each unit's output (or split partial) leaves as its whole ``qcols``-row block
    # into a staging array (one block per sequence and KV head), and XLA gathers the G real rows
    # after the kernel, instead of the G rows at ``qoff`` copied straight to their places: the
    # form newer Mosaic GPU lowers (``swap_ab_lowers``).
    out_blocks: bool = False
    # Only the last ``split_tail`` sequences of the dispatch order (the shortest, longest
    # first) are read by ``num_splits`` CTAs each, merged in the kernel; the others by one.
    # The grid's sequence axis holds B + split_tail * (num_splits - 1) slots (0: every
    # sequence has ``num_splits`` slots, the (B, S, K) grid).
    split_tail: int = 0
    # With the in-kernel order: the first ``order_head`` sequence slots take sequences 0 ..
    # order_head - 1 in batch order, without counting the order (the first wave starts
    # streaming at once); the later slots take the other sequences longest first.
    order_head: int = 0

    @property
    def tcgen05(self) -> bool:
        return self.mma == "tcgen05"

    @property
    def fixed_max_headroom(self) -> float:
        """``fixed_max``: how far (base 2) a score may rise above the first tile's max. P is
        at most 2^headroom (larger arguments of exp2 are clamped, and their unit redone), stored
        in q.dtype for P @ V: f16 holds up to 65504, so 15; bf16 has f32's range, and at 32
        the f32 sums stay finite for |v| up to about 1e22 over a million keys."""
        return 15.0 if self.dtype == jnp.float16 else 32.0

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
        aligned block), the N of both products (a multiple of 16 for tcgen05)."""
        return _qcols(self.num_seqs, self.num_q_heads, self.num_kv_heads, self.tcgen05)

    @property
    def q_rows(self) -> int:
        """Query rows of a CTA's Q and P tiles: ``qcols`` with ``swap_ab``, else the 64-row
        wgmma M tile."""
        return self.qcols if self.swap_ab else _ROWS

    @property
    def whole_blocks(self) -> bool:
        """``swap_ab``'s output (or split partial) leaves as whole ``qcols``-row blocks: asked
        for (``out_blocks``), or where the G heads fill the block (G == qcols), whose block is
        then exactly the unit's rows of the output: no gather follows."""
        return self.swap_ab and (self.out_blocks or self.qcols == self.group)


def _qcols(num_seqs: int, num_q_heads: int, num_kv_heads: int, tcgen05: bool = False) -> int:
    """Query columns of the ``swap_ab`` products: every unit's G heads from its 8-row aligned
    start, rounded up to 8 (a wgmma N), or to 16 for tcgen05 (an M=128 MMA's N: 16 to 256 in
    steps of 16)."""
    G = num_q_heads // num_kv_heads
    offs = {
        (b * num_q_heads + h * G) % 8 for b in range(min(num_seqs, 8)) for h in range(num_kv_heads)
    }
    step = 16 if tcgen05 else 8
    return -(-(max(offs) + G) // step) * step


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
    far below the ring; the in-kernel merge's buffers are sized to stay within this total,
    ``_split_merge_batch``)."""
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
        # SM) in 8 of 9 quick rows on the H200 (eighth session, decode_quick_s8_swap.json); 1
        # where 2 do not fit (tcgen05's 128-key tiles at H=256: 264 KB).
        return 2 if _smem_bytes(head_dim, block_kv, 2, qcols=qcols) <= _SMEM_BYTES else 1
    for stages in (4, 3):
        if _smem_bytes(head_dim, block_kv, stages, persistent=persistent) <= _TWO_CTA_SMEM_BYTES:
            return stages
    return 2


def swap_ab_lowers(version: str | None = None) -> bool:
    """Whether this JAX's Mosaic GPU lowers ``swap_ab``'s kernels (``version``: a JAX version
    string, default the installed one). On jax 0.12.0.1 its layout inference runs out of search
    fuel after 200-260 s on the CPU (``Layout inference failed to find a solution``) wherever an
    output tile written through a transposed SMEM view (O^T) is then copied out from a
    dynamic offset: the G rows of a unit at ``qoff``. jax 0.11.2 lowers it at once. Until that
    is solved, newer JAX runs the 64-row tile by default (``default_swap_ab`` is applied only
    where this holds, or in the interpreter, which lowers nothing) and refuses ``swap_ab=True``
    at once. Since then swap_ab stores whole blocks there (``out_blocks``), which that version
    lowers in about a second; only the kernel merge and the balanced kernel stay refused. A
    static slice of fewer rows than the tile fails the same way, and the whole tile lowers:
    where the unit's G heads fill it (G == ``qcols``: 8 or 16) the direct store is that whole
    tile, and it is taken on any JAX (the kernel merge and balanced kernel stay refused)."""
    if version is None:
        import jax

        version = jax.__version__
    major, minor = (int(x) for x in version.split(".")[:2])
    return (major, minor) < (0, 12)


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
    """With ``swap_ab`` (and neither ``producer`` nor ``persistent``): ``"mosaic"`` (a second
    Mosaic GPU kernel, ``_merge_gpu.merge_partials``) at 2 to ``_MOSAIC_MERGE_MAX_SPLITS``
    splits; else ``"xla"``. The in-kernel merge (``"kernel"``) is opt-in, and what
    ``split_tail`` takes.

    H200, twenty-second session (2026-12-03, JAX 0.11.2): at 2-16 splits the second kernel was
    faster than the in-kernel merge on CUPTI in all 15 comparisons of 10 batches
    (``decode_cases_s22_splits.json``, ``decode_quick_s22_mm*.json``, ``decode_cases_s22_mm
    .json``: 0.2-2.6%; B=4 / 32k 138.3 vs 142.0 us, B=8 / 32k 210.0-223.1 vs 210.5-225.0, B=32
    / 2k 67.5-67.8 vs 68.6-68.8, B=32 / 4k 126.6 vs 128.0, B=16 / 8k 118.8 vs 119.6; the
    twenty-first session's two included), and faster or tied on wall in 11 of 15 (slower: B=2 /
    32k by 1.8 us, host-bound; B=8 / 8k at 32 KV heads by 0.6 us; the twenty-first session's
    B=8 / 32k and B=32 / 2k rows by 0.8%). The in-kernel merge needs an XLA
    memset of its counters before the kernel and leaves the last split CTA of a pair the merge
    after its own tiles; the second kernel needs neither. It also takes whole output blocks
    (``out_blocks``, newer JAX's ``swap_ab`` form, where the in-kernel merge does not lower):
    with them, against the XLA merge, B=1 / 32k 46.8 vs 50.3 us, B=8 / 32k 216.2 vs 219.4,
    B=32 / 2k 69.2 vs 71.9 (``decode_cases_s22_ob.json``).

    Twenty-first session (``decode_quick_s21_mm3.json``): at B=1 / 32k (32 splits) 47.0 us
    CUPTI for the pair of kernels against 48.8 for the attention kernel and the XLA epilogue's
    three (83.8% of the roofline against 80.8%), and the call's wall time 61.3 us against
    73.3: the host dispatches two kernels, not four. An earlier form (two copies a split,
    ``decode_cases_s21_mm2.json``) took 20.6 -> 28.3 us at 64 splits (two rounds): past 32
    splits, XLA. Thirteenth session (``decode_cases_s13_merge*.json``): the in-kernel merge
    tied the XLA merge at 4-16 splits on CUPTI and was 12-14% slower at 32."""
    if num_splits < 2 or not swap_ab or producer or persistent:
        return "xla"
    return "mosaic" if num_splits <= _MOSAIC_MERGE_MAX_SPLITS else "xla"


def default_auto_barriers(
    producer: bool = False, persistent: bool = False, balanced: bool = False, staged: bool = False
) -> bool:
    """Pallas's automatic warpgroup barriers only where the kernel does not place its own: the
    ``producer``, ``persistent`` and ``balanced`` bodies and the staging ring of small pages by
    TMA. Elsewhere (the default kernel) they are off and ``_gpu_tile.wg_barrier`` places the
    three it needs: 45 -> 14 ``bar.sync`` in the lowered kernel at B=128 / 2k (one barrier
    before every page copy, 8 a tile at 16-token pages, and two around every SMEM store gone).

    H200, fifteenth session (CUPTI us, automatic / own barriers, same inputs): a lone CTA
    (B=1 / 32k, one split, 8 CTAs) 522.5 / 509.6 at 16-token pages and 255.4 / 243.5 at 64;
    the quick table in three calls 0.1-0.8% faster in 17 of 27 rows, within 0.1% in 6 and
    0.02-0.22% slower in 4 (B=8 / 32k 214.5 / 213.4, 214.7 / 213.6 and 210.9 / 209.2; head dim
    64 69.9 / 69.6, 70.1 / 69.6 and 68.4 / 68.1; ``decode_quick_s15_nab.json``,
    ``..._same_size.json``, ``..._default.json``)."""
    return bool(producer or persistent or balanced or staged)


def default_fixed_max(
    dtype, producer: bool = False, persistent: bool = False, balanced: bool = False
) -> bool:
    """``fixed_max`` (the first tile's max as every later tile's softmax reference, no max
    across the warps in the loop) in the default kernel at bf16, whose headroom of 32 doublings
    (22 nats above a unit's first tile's max) makes the exact second pass rare. Not at f16,
    where P in f16 leaves 15 (10 nats), so a sharp head redoes its units more often.

    H200, seventeenth session: a CTA streaming alone 702 -> 599 ns a 64-token tile from L2
    (736 -> 629 from HBM; ``benchmarks/chain_ablation.py``: the max's reduction was 137 of
    707 ns); the quick table's CUPTI times 0.3-0.6% lower in its HBM-bound rows and unchanged
    elsewhere (``lone_cta_s17_fm.json``, ``decode_quick_s17_fm.json``)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and not (producer or persistent or balanced)


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


# (Sequence, KV head) pairs of about one wave of CTAs (132 SMs x 2-3): from here to twice this,
# splits depend on the table's reach (``default_num_splits``); past it, none.
_ONE_WAVE_PROGRAMS = 256


def _one_wave_of_pairs(programs: int) -> bool:
    """About one wave of (sequence, KV head) pairs: the regime where ``default_num_splits``
    splits by the table's reach and ``default_longest_first`` orders any split."""
    return _ONE_WAVE_PROGRAMS <= programs < 2 * _ONE_WAVE_PROGRAMS


# About one wave of pairs: tables of this many tiles or more (3k tokens at T=64) get 2+ splits.
_ONE_WAVE_SPLIT_MIN_TILES = 48


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

    About one wave of (sequence, KV head) pairs (256-511) split by ``default_num_splits``: on,
    whatever the units' tokens. H200, fourteenth session (``decode_cases_s14_rule.json``,
    CUPTI us, in the kernel order, split partials merged in the kernel): B=32 / 4k at 3 splits
    130.6 with the order against 135.4 without it; B=32 / 2k at 2 splits 71.2 and 71.6 against
    72.3 and 73.8 unsplit (two calls), B=48 / 2k 102.3 against 106.9.
    """
    if num_seqs <= 1 or num_seqs * num_kv_heads * num_splits <= _WAVE_CTAS:
        return False
    if num_splits > 1 and _one_wave_of_pairs(num_seqs * num_kv_heads):
        return True  # a wave of pairs split into two or three waves (default_num_splits)
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

# How split partials are merged (``split_merge``): by the last split CTA of each pair, by an
# XLA epilogue, or by a second Mosaic GPU kernel (``_merge_gpu.merge_partials``); by default by
# the second kernel up to this many splits (one round), past them by XLA
# (``default_split_merge``).
SPLIT_MERGES = ("kernel", "xla", "mosaic")
_MOSAIC_MERGE_MAX_SPLITS = 32

# The products' instructions (``mma``): Hopper's wgmma, or Blackwell's tcgen05 MMA.
MMAS = ("wgmma", "tcgen05")
# Compute capabilities with tcgen05 (sm100 B200/GB200, sm103 B300/GB300, sm110 Thor); sm120
# (consumer Blackwell) has neither tcgen05 nor wgmma.
TCGEN05_MAJORS = (10, 11)
# tcgen05 runs the ``swap_ab`` form at 128-key tiles: every product has M = 128 (the keys; 128
# rows of the head dim, two such products at H = 256) and N = the query columns, so the
# accumulators fill TMEM's 128 lanes. M = 64 (a 64-key tile, or head dim 64) does not lower
# through Pallas on jax 0.11.2 (its TMEM slice of the kernel's 128-lane allocation gets no
# layout).
TCGEN05_BLOCK_KV = 128
TCGEN05_HEAD_DIMS = (128, 256)


def default_mma(interpret: bool = False) -> str:
    """``"tcgen05"`` on a Blackwell GPU (``TCGEN05_MAJORS``), else ``"wgmma"`` (Hopper, and the
    interpreter, which runs either when asked)."""
    if interpret:
        return "wgmma"
    cc = _backend.gpu_compute_capability()
    return "tcgen05" if cc is not None and cc[0] in TCGEN05_MAJORS else "wgmma"


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
      (2k tokens at T=64), at least 2 where the table reaches 48 tiles (3k tokens), else
      none: a wave of whole sequences is balanced badly (lengths vary) only when they are long
      enough for splits to pay for the merge; such splits run longest first
      (``default_longest_first``);
    - fewer: enough for ~512 CTAs (two waves: sequences of different lengths split into
      units of different sizes, which the second wave evens out), but ~256 (one wave) for one
      or two sequences; >= 4 tiles per split; at most 64.

    H200, sixth session (BENCHMARKS.md), with the grid longest first over every CTA: no split
    beat 2 at B=64 / 4k and at head dim 64, and 4 at B=32 / 2k (two runs); 4 splits beat none
    at B=32 / 8k (3.81 vs 3.36 TB/s) and B=8, 32 KV heads / 8k (3.91 vs 3.77); 8 tie 16 at
    B=8 / 32k (4 and 32 were slower). Seventh session, B=1: one wave beat two in all three
    cases (CUPTI 44.9 vs 49.2 us at 8 KV heads / 32k; 94.3 vs 99.6 at 32 / 32k; 48.8 vs 53.8 at
    32 / 8k). Thirteenth session, B=2 / 32k at 8 KV heads: 16 splits (one wave) beat 32 in all
    three runs (CUPTI 46.8-47.7 us merged in the kernel and 48.4-49.1 by XLA, against 49.6-49.7
    at 32 splits merged by XLA; 83.9 against 88.6 on other random lengths). Fourteenth session
    (one wave, splits merged in the kernel, longest first; ``decode_cases_s14_onewave.json``,
    ``decode_cases_s14_rule.json``, CUPTI us): 2 splits beat none at B=32 / 2k (71.6 vs 73.8,
    71.2 vs 72.3) and B=48 / 2k (102.3 vs 106.9), within 1% of 3; 3 splits at B=32 / 4k 130.6
    vs 135.4 unordered; at 1k-token sequences (32-tile tables) every split lost (B=32 / 1k
    40.7-42.6 vs 38.6, B=40 / 1k 49.7-51.7 vs 48.9), as at head dim 64 (B=128 / 2k, 512 pairs:
    74.3-85.0 vs 69.2); B=12 / 2k at 32 KV heads (G = 1) lost 1.0% at 2 splits, within noise.
    """
    programs = num_seqs * num_kv_heads
    max_tiles = -(-max_tokens // block_kv)
    if programs >= 2 * _ONE_WAVE_PROGRAMS:
        return 1
    if _one_wave_of_pairs(programs):
        long_units = max_tiles // 32
        if max_tiles >= _ONE_WAVE_SPLIT_MIN_TILES:
            long_units = max(long_units, 2)
        return max(1, min(-(-1024 // programs), long_units))
    target = 256 if num_seqs <= 2 else 512
    return max(1, min(-(-target // programs), max_tiles // 4, 64))


def default_min_split_tiles(num_seqs: int, num_kv_heads: int, num_splits: int) -> int:
    """Tiles a split must keep (``min_split_tiles``): a sequence of ``tiles`` tiles is read by
    ``clip(tiles // min_split_tiles, 1, num_splits)`` CTAs, the rest of its splits exit.

    The split count is static (from the block table's width, ``default_num_splits``), so a
    table as wide as an engine's ``max_model_len`` splits short sequences as if they were
    long. About one wave of pairs (256-511) is split only for long sequences (2k+ tokens a
    split), and there the floor is 8 tiles: on the H200 (sixteenth session,
    ``decode_cases_s16_table*.json``, CUPTI us, floor 8 / every split / floor 4) B=32 at 512
    tokens ran 22.4-22.9 in 8k- and 32k-token tables against 26.2-26.8 with every split
    reading (25.1 at 4; 20.6 in a table as wide as its sequences), B=48 / 1k 55.1 / 57.2-57.4
    / 58.1 and B=40 / 1k 46.1 / 49.7 / 49.2 in 8k tables, and the quick table's B=32 / 2k
    (1k-3k tokens, 16+ tiles: still two splits) 68.7 against 69.1. It lost at B=32 / 2k in an
    8k table (4 splits: 69.6-70.2 / 67.6-67.8 / 68.2), where 16-31-tile sequences now take 2-3
    CTAs instead of 4. With fewer pairs the splits are what fills the GPU, and short
    ones still pay: a floor of 4 lost 5-8% at B=4 / 2k, B=8 / 2k and B=16 / 1k in 32k tables
    (8 lost up to 35%), so there every split reads (1)."""
    if num_splits > 1 and _one_wave_of_pairs(num_seqs * num_kv_heads):
        return 8
    return 1


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
      block_kv: the token tile T the kernel would use (default ``default_block_kv(H)``, or
        ``TCGEN05_BLOCK_KV`` on Blackwell).
      check_backend: also require a Hopper (sm90) or Blackwell (sm100 / sm103 / sm110, head dims
        128 and 256: ``mma="tcgen05"``) GPU as the default backend.
    """
    del sm_scale, logits_soft_cap, sliding_window, layer, block_tables, lengths
    reasons = _gpu_checks.device_and_dtype_reasons(
        q, k_pages, v_pages, check_backend=check_backend, majors=(9, *TCGEN05_MAJORS)
    )
    *_, C, H = k_pages.shape
    blackwell = check_backend and default_mma() == "tcgen05"
    if blackwell and H not in TCGEN05_HEAD_DIMS:
        reasons.append(f"on Blackwell (tcgen05) head_dim={H} must be one of {TCGEN05_HEAD_DIMS}")
    if block_kv is None:
        block_kv = TCGEN05_BLOCK_KV if blackwell else default_block_kv(H)
    if C < 1 or (block_kv % C and C % block_kv):
        reasons.append(f"page_size={C} must divide or be a multiple of the tile {block_kv=}")
    N = q.shape[1]
    K = k_pages.shape[-4]
    G = N // K if K else 0
    if G > _ROWS or (G % 8 and G > _ROWS - 7):
        reasons.append(f"group size G={G} must be <= 56 (or a multiple of 8 up to 64)")
    reasons += _gpu_checks.pool_rows_reasons(k_pages)
    return "; ".join(reasons) if reasons else None


_TMA_MAX_DIM = 256  # elements a TMA copy spans along one dimension, at most

# Pieces whose partials one round of the balanced merge loads at once (``_balanced_body``), at
# most: fewer where 16 would not fit in the ring's SMEM, which the merge buffers share.
_MERGE_BATCH = 16


# The balanced grid's semaphores and partial slots scale with its CTAs: keep them bounded.
_MAX_BALANCED_CTAS = 65535


def _ring_bytes(head_dim: int, block_kv: int, stages: int) -> int:
    """SMEM of the balanced kernel's K and V rings (``stages`` tiles each, 16-bit)."""
    return 2 * stages * block_kv * head_dim * 2


def _merge_piece_bytes(head_dim: int, qcols: int) -> int:
    """SMEM of one merge piece: its qcols x H rows (16-bit) and its lse row, 128-byte aligned."""
    return qcols * head_dim * 2 + _lse_row_step(qcols) * qcols * 4


def _merge_batch(head_dim: int, block_kv: int, stages: int, qcols: int) -> int:
    """Pieces a round of the balanced merge loads: ``_MERGE_BATCH``, or as many as fit in the
    ring's SMEM, which its buffers share (a ``RefUnion``; at least 1: the ring holds at least
    two 64-row tiles, a piece at most 64 rows)."""
    ring = _ring_bytes(head_dim, block_kv, stages)
    return max(1, min(_MERGE_BATCH, ring // _merge_piece_bytes(head_dim, qcols)))


def _split_merge_batch(cfg: _Config) -> int:
    """Pieces a round of the in-kernel split merge loads (``_gpu_bodies._merge_split``): at most
    ``_MERGE_BATCH`` and the splits, and as many as keep its scope (after the loop: the output
    and lse tiles, the merge buffers and 1 KB of barriers and alignment) within the SMEM of
    the loop's scope (``_smem_bytes``), so merging never costs occupancy; at least 1."""
    R, H = cfg.q_rows, cfg.head_dim
    loop = _smem_bytes(
        H, cfg.block_kv, cfg.num_stages, cfg.dtype.itemsize, k_stages=cfg.k_stages, qcols=R,
        staged=cfg.staged,
    )  # fmt: skip
    tiles = R * H * cfg.dtype.itemsize + _ROWS * R * 4 + 1024
    fit = (loop - tiles) // _merge_piece_bytes(H, R)
    return max(1, min(_MERGE_BATCH, cfg.num_splits, fit))


def _lse_row_step(qcols: int) -> int:
    """Rows of ``qcols`` f32 a piece's lse row is placed apart in SMEM: the fewest whose bytes
    are a multiple of 128, so every piece's row starts 128-byte aligned (a TMA destination)."""
    return 128 // math.gcd(128, 4 * qcols)
