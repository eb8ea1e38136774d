"""Defaults of the Mosaic GPU decode kernel (``kernel_gpu``), from static shapes only (no host
sync: jit- and CUDA-graph safe), and the measurements behind them (``TUNING``).

Every rule below was chosen on an H200 with JAX 0.11.2 by ``benchmarks/decode_attention.py``
(CUPTI kernel time and wall time, same call against the alternative); ``TUNING`` names the
commit that recorded each measurement.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels._gpu.config import SMEM_BYTES, TWO_CTA_SMEM_BYTES
from pallas_kernels._gpu.tuning import Measured
from pallas_kernels.paged_attention import _gpu_sizes
from pallas_kernels.paged_attention._gpu_order import kernel_order_reason, packed_order

TUNING: dict[str, Measured] = {
    "default_block_kv": Measured(
        knob="block_kv",
        rule="128 keys at head dim 64 (the bytes of 64 at 128), else 64",
        evidence="H=64: 2.22 -> 2.72 TB/s with 128; H=128: 128 keys 1-14% slower",
        date="2026-11-29",
        commit="cef9b2b",
    ),
    "default_num_stages": Measured(
        knob="num_stages",
        rule="swap_ab: 2 (three CTAs per SM by SMEM at H=128); 64-row tile: the deepest ring "
        "that keeps two CTAs per SM; small pages staged by TMA: 2 (1 where 2 do not fit); "
        "quantized pages: the deepest ring up to 4 that keeps three CTAs per SM, else two, else one",
        evidence="swap_ab: 2 stages beat 3 in 8 of 9 quick rows; the quantized rule is not timed "
        "(chosen from SMEM sizes; tools/gpu_quantized.sh times 2, 3 and 4 stages)",
        date="2026-11-30",
        commit="19f6d89",
    ),
    "default_swap_ab": Measured(
        knob="swap_ab",
        rule="scores as K Q^T at head dims 64 / 128 / 256 and 8 query columns, with or without "
        "splits",
        evidence="no splits: 0.4-4.7% faster in all seven split-free quick rows (G = 1, 4, 8); "
        "splits: -4.8% at B=1 / 32k, -3.0% at B=1 / 8k x 32 KV heads, +0.9% / +1.8% at "
        "B=8 / 32k and 8k (2026-11-30, 31231e3). Head dim 256 (B=32, N=16, K=8, 4k, G=2): "
        "265.2 vs 462.8 us wall, 251.7 vs 446.1 us CUPTI (4.16 vs 2.38 TB/s; cuDNN non-paged "
        "2.58). 16+ columns correct but not timed",
        date="2026-12-06",
        commit="f106a1c",
    ),
    "default_split_merge": Measured(
        knob="split_merge",
        rule='"mosaic" (a second Mosaic GPU kernel) at 2-32 swap_ab splits, else "xla"',
        evidence="B=1 / 32k: 47.0 us CUPTI and 61.3 us wall against 48.8 and 73.3 for the XLA "
        "epilogue's three kernels; past 32 splits (two rounds) slower than XLA",
        date="2026-12-03",
        commit="9c0a300",
    ),
    "default_auto_barriers": Measured(
        knob="(internal) auto_barriers",
        rule="the kernel's own three warpgroup barriers; Pallas's automatic ones only for the "
        "staging ring of small pages by TMA",
        evidence="45 -> 14 bar.sync at B=128 / 2k; a lone CTA 2.5-4.7% faster, the quick "
        "table 0.1-0.8% faster in 17 of 27 rows and within 0.22% in the rest",
        date="2026-12-02",
        commit="a9061c1",
    ),
    "default_fixed_max": Measured(
        knob="fixed_max",
        rule="the first tile's max as every tile's reference at bf16 (headroom 32 doublings); "
        "not at f16 (15)",
        evidence="a lone CTA 702 -> 599 ns a 64-token tile; the quick table 0.3-0.6% faster "
        "in its HBM-bound rows",
        date="2026-12-02",
        commit="6d15c32",
    ),
    "default_deferred_sum": Measured(
        knob="(internal) deferred_sum",
        rule="swap_ab at 8 query columns sums the softmax denominators once after the loop",
        evidence="a lone CTA 42 GB/s instead of 36; 0.1-2.4% faster in all nine quick rows",
        date="2026-11-30",
        commit="112e056",
    ),
    "default_longest_first": Measured(
        knob="longest_first",
        rule="on past one wave of CTAs where a unit can exceed 2048 tokens, or where about one "
        "wave of pairs is split",
        evidence="paid at 3k-6k-token tables (B=128 / 2k 265.5 vs 271.0 us wall), lost at "
        "1k-2k (B=256 / 512 144.4 vs 136.4); one wave split: B=32 / 4k 130.6 vs 135.4 us",
        date="2026-12-02",
        commit="df9ff31",
    ),
    "default_order_method": Measured(
        knob="order_method",
        rule='"kernel" (each CTA counts its place) for a multiple of 4 up to 256 sequences, '
        'else "rank" up to 1024, else "sort"',
        evidence="counting beat the sort at 8-1024 sequences (1.0 vs 2.1 us at B=8, 4.4 vs "
        "8.8 at 1024); the in-kernel count needs no XLA kernel",
        date="2026-11-30",
        commit="81e0b7d",
    ),
    "default_num_splits": Measured(
        knob="num_splits",
        rule="none from 512 (sequence, KV head) pairs; about one wave (256-511): splits only "
        "for tables of 48+ tiles; fewer: ~512 CTAs (~256 for one or two sequences), >= 4 "
        "tiles a split, at most 64",
        evidence="4 splits beat none at B=32 / 8k (3.81 vs 3.36 TB/s); one wave beat two at "
        "B=1 and B=2 / 32k (46.8-47.7 vs 49.6 us); one wave of pairs: 2 splits 71.6 vs 73.8 "
        "us at B=32 / 2k, every split lost at 1k-token tables",
        date="2026-12-02",
        commit="df9ff31",
    ),
    "default_min_split_tiles": Measured(
        knob="min_split_tiles",
        rule="8 tiles a split for about one wave of pairs, else 1 (every split reads)",
        evidence="B=32 at 512 tokens in 8k / 32k tables 22.4-22.9 us against 26.2-26.8; a "
        "floor of 4 lost 5-8% at B=4-16 in 32k tables",
        date="2026-12-02",
        commit="c28f7a7",
    ),
    "default_k_registers": Measured(
        knob="k_registers",
        rule="quantized pages with swap_ab: the converted K tile stays in registers as the "
        "scores' A operand",
        evidence="fp8 per-token scales, CUPTI us with / without: B=128 ctx=2048 K=8 "
        "208.4 / 233.9, B=64 ctx=4096 K=8 206.7 / 235.5, B=128 ctx=2048 K=4 H=64 73.3 / 77.5 "
        "(benchmarks/results/decode_fp8_kregisters_h100.json)",
        device="H100",
        date="2026-12-06",
        commit="159b838",
    ),
    "default_mma": Measured(
        knob="mma",
        rule='"tcgen05" on Blackwell (sm100-sm110), else "wgmma"',
        evidence="checked in the interpreter and by lowering for sm100; not timed on Blackwell",
        device="(none)",
        date="2026-12-02",
        commit="3f74e52",
    ),
}

# CTAs resident at once on an H100/H200 (132 SMs x 2 CTAs of the default ring): below one such
# wave the dispatch order cannot matter.
_WAVE_CTAS = 2 * 132
# (Sequence, KV head) pairs of about one wave of CTAs (132 SMs x 2-3).
_ONE_WAVE_PROGRAMS = 256
# About one wave of pairs: tables of this many tiles or more (3k tokens at T=64) get 2+ splits.
_ONE_WAVE_SPLIT_MIN_TILES = 48
# Longest first pays only where a unit (a sequence's split) can hold more tokens than this.
_LONGEST_FIRST_MIN_TOKENS = 2048
# Up to this many splits the second merge kernel takes them in one round.
MOSAIC_MERGE_MAX_SPLITS = 32
# Up to this many sequences the order can be computed by counting (two O(B^2) reductions).
RANK_ORDER_MAX_SEQS = 1024
# Compute capabilities with tcgen05 (sm100, sm103, sm110); sm120 has neither tcgen05 nor wgmma.
TCGEN05_MAJORS = (10, 11)


def default_block_kv(head_dim: int) -> int:
    """Tokens per K/V tile (``TUNING["default_block_kv"]``)."""
    return 128 if head_dim == 64 else 64


def default_num_stages(
    head_dim: int,
    block_kv: int = 64,
    qcols: int | None = None,
    staged: bool = False,
    quantized: bool = False,
) -> int:
    """Depth of the K/V ring (``TUNING["default_num_stages"]``); ``qcols``: the ``swap_ab``
    tiles' query columns; ``staged``: pages below 8 tokens by TMA; ``quantized``: 8-bit pages
    (the deepest ring, up to 4, that keeps three CTAs per SM, else two, else one)."""
    if quantized:
        for ctas in (3, 2, 1):
            for stages in (4, 3, 2):
                need = _gpu_sizes.smem_bytes(
                    head_dim, block_kv, stages, qcols=qcols, kv_itemsize=1, token_scales=2
                )
                if need <= SMEM_BYTES // ctas - 1024:
                    return stages
        return 1
    if staged:
        fits = _gpu_sizes.smem_bytes(head_dim, block_kv, 2, qcols=qcols, staged=True)
        return 2 if fits <= SMEM_BYTES else 1
    if qcols is not None:
        return 2 if _gpu_sizes.smem_bytes(head_dim, block_kv, 2, qcols=qcols) <= SMEM_BYTES else 1
    for stages in (4, 3):
        if _gpu_sizes.smem_bytes(head_dim, block_kv, stages) <= TWO_CTA_SMEM_BYTES:
            return stages
    return 2


def default_swap_ab(head_dim: int, qcols: int) -> bool:
    """Scores as K Q^T (``TUNING["default_swap_ab"]``)."""
    return head_dim in (64, 128, 256) and qcols == 8


def default_split_merge(num_splits: int, swap_ab: bool) -> str:
    """How split partials are merged (``TUNING["default_split_merge"]``)."""
    if num_splits < 2 or not swap_ab:
        return "xla"
    return "mosaic" if num_splits <= MOSAIC_MERGE_MAX_SPLITS else "xla"


def default_k_registers(swap_ab: bool) -> bool:
    """Quantized K tiles as register operands (``TUNING["default_k_registers"]``)."""
    return bool(swap_ab)


def default_auto_barriers(staged: bool = False) -> bool:
    """Pallas's automatic warpgroup barriers only for the staging ring
    (``TUNING["default_auto_barriers"]``)."""
    return bool(staged)


def default_fixed_max(dtype) -> bool:
    """The first tile's max as the softmax reference (``TUNING["default_fixed_max"]``)."""
    return jnp.dtype(dtype) == jnp.bfloat16


def default_deferred_sum(qcols: int = 8) -> bool:
    """``swap_ab`` tiles sum the softmax denominators once, at 8 query columns (where it was
    timed; ``TUNING["default_deferred_sum"]``)."""
    return qcols == 8


def _one_wave_of_pairs(programs: int) -> bool:
    """About one wave of (sequence, KV head) pairs (256-511)."""
    return _ONE_WAVE_PROGRAMS <= programs < 2 * _ONE_WAVE_PROGRAMS


def default_longest_first(
    num_seqs: int, num_kv_heads: int, num_splits: int, max_tokens: int | None = None
) -> bool:
    """Order the sequences longest first (``TUNING["default_longest_first"]``): the hardware
    hands out CTAs in grid order as slots free up, so with the longest work first (LPT) the
    last wave holds the shortest. ``max_tokens``: the block table's width x page size."""
    if num_seqs <= 1 or num_seqs * num_kv_heads * num_splits <= _WAVE_CTAS:
        return False
    if num_splits > 1 and _one_wave_of_pairs(num_seqs * num_kv_heads):
        return True  # a wave of pairs split into two or three waves (default_num_splits)
    return max_tokens is None or max_tokens > _LONGEST_FIRST_MIN_TOKENS * num_splits


def default_order_method(num_seqs: int) -> str:
    """How the longest-first order is computed (``TUNING["default_order_method"]``)."""
    if kernel_order_reason(num_seqs) is None:
        return "kernel"
    return "rank" if num_seqs <= RANK_ORDER_MAX_SEQS and packed_order(num_seqs) else "sort"


def default_num_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, block_kv: int) -> int:
    """Split-KV factor from static shapes (``TUNING["default_num_splits"]``); ``max_tokens``:
    the block table's width x page size."""
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
    """Tiles a split must keep (``TUNING["default_min_split_tiles"]``): a sequence of ``tiles``
    tiles is read by ``clip(tiles // min_split_tiles, 1, num_splits)`` CTAs."""
    if num_splits > 1 and _one_wave_of_pairs(num_seqs * num_kv_heads):
        return 8
    return 1


def default_mma(interpret: bool = False) -> str:
    """The products' instructions (``TUNING["default_mma"]``); the interpreter runs wgmma."""
    if interpret:
        return "wgmma"
    cc = _backend.gpu_compute_capability()
    return "tcgen05" if cc is not None and cc[0] in TCGEN05_MAJORS else "wgmma"
