"""Static tuning of the Mosaic GPU ragged kernel: tile sizes, the SMEM budget, and the
defaults with the measurements behind them (``TUNING``).

Everything here depends on static shapes only (no host sync, jit- and CUDA-graph safe).
"""

from __future__ import annotations

from pallas_kernels._gpu.config import ROWS as ROWS  # a warpgroup's query tokens x G heads
from pallas_kernels._gpu.config import SMEM_BYTES as SMEM_BYTES
from pallas_kernels._gpu.config import TWO_CTA_SMEM_BYTES as TWO_CTAS_BYTES
from pallas_kernels._gpu.tuning import Measured
from pallas_kernels.ragged_paged_attention import schedule

TUNING: dict[str, Measured] = {
    "default_fa3": Measured(
        knob="fa3",
        rule="the FA3-style body (producer warpgroup, register P, ping-pong) on a GPU; the "
        "SMEM body in the interpreter, which cannot run the other",
        evidence="with in-place Q/O and the tile order: 0.95-0.96x cuDNN dense causal wall "
        "at T = 4k-16k, against 0.57-0.67x before them",
        date="2026-11-29",
        commit="09f5565",
    ),
    "default_block_kv": Measured(
        knob="block_kv",
        rule="128 keys for the FA3 body up to head dim 128 where the page size allows, else 64",
        evidence="part of the FA3 configuration measured above (at 256 the f32 scores and "
        "accumulator do not fit the registers)",
        date="2026-11-29",
        commit="09f5565",
    ),
    "default_num_wgs": Measured(
        knob="num_wgs",
        rule="two compute warpgroups sharing a tile unless decode-heavy (T <= 2 B)",
        evidence="decode-heavy batches would hold padding rows in the second warpgroup; "
        "those run paired instead (default_paired)",
        date="2026-11-29",
        commit="be01e93",
    ),
    "default_tile_order": Measured(
        knob="tile_order",
        rule="longest first over the batch for decode-heavy batches, else by sequence (L2 "
        "reuse of each sequence's K/V)",
        evidence="part of the configuration measured at 0.95-0.96x cuDNN (prefill)",
        date="2026-11-29",
        commit="09f5565",
    ),
    "default_num_stages": Measured(
        knob="num_stages",
        rule="2 for the FA3 body (one CTA per SM, as JAX's FA3 example); else the deepest "
        "ring up to 4 that keeps two CTAs per SM",
        evidence="not timed against other depths for this kernel",
        device="(none)",
        date="2026-11-29",
        commit="be01e93",
    ),
    "default_paired": Measured(
        knob="paired",
        rule="one query tile per compute warpgroup for decode-heavy batches (T <= 2 B) where "
        "the two rings fit",
        evidence="decode batches at 0.89-1.05x the decode kernel",
        date="2026-11-29",
        commit="09f5565",
    ),
    "default_persistent": Measured(
        knob="persistent",
        rule="one CTA per SM with 64-key tiles and a 3-deep ring for prefill-heavy batches "
        "whose block table holds at most 1,024 keys a sequence (every work item short) and "
        "that fill the CTAs three times over; else one CTA per item",
        evidence="B x T = 32k prefill, wall against cuDNN (one-item grid, 128-key tiles -> "
        "this): T=512 0.68x -> 0.91x, 1k 0.77x -> 0.88x, 2k 0.86x -> 0.86x (an earlier "
        "run); persistent with 128-key tiles slower at 512-16k (2k 0.81x, 4k 0.89x, 16k "
        "0.89x against 0.87x, 0.93-0.94x, 0.93-0.94x one CTA per item)",
        device="NVIDIA H100 80GB HBM3",
        date="2026-12-07",
        commit="57a1e5c",
    ),
    "default_kv_splits": Measured(
        knob="kv_splits",
        rule="none from 3 x 132 (tile, KV head) units; else ~8 x 132 units, >= 4 tiles a "
        "split, at most 64",
        evidence="B=8 at 32k 239 us with 7 splits, 231 with 16; B=1 63 us with 22, 73 with 16",
        date="2026-11-29",
        commit="a065319",
    ),
}
BLOCK_KV_CHOICES = (64, 128)
FA3_DEFAULT = True  # the FA3-style body (kernel_gpu._kernel_body_fa3) as the GPU default


def tokens_per_tile(group: int, direct_io: bool = False) -> int:
    """Query tokens per 64-row warpgroup tile: ``64 // G`` (rows past ``tokens * G`` pad).

    With ``direct_io`` (Q loaded and O stored by TMA straight from/to ``[T, N, H]``, one
    ``tokens x H`` box per head) the tokens are rounded down to a multiple of 8, the row
    granularity of the (8, 64)-tiled SMEM tile; 0 (unsupported) for G > 8.
    """
    if direct_io:
        return ROWS // group // 8 * 8
    return max(1, ROWS // group)


def smem_bytes(
    head_dim: int,
    block_kv: int,
    num_stages: int,
    num_wgs: int = 1,
    fa3: bool = False,
    direct_io: bool = False,
    paired: bool = False,
    kv_splits: int = 1,
    quantized: bool = False,
    token_scales: int = 0,
    persistent: bool = False,
) -> int:
    """SMEM of one CTA (2-byte dtypes): Q tiles, the K/V ring (one per warpgroup with
    ``paired``), the P tiles (none with ``fa3``: P stays in registers), the untiled O staging
    tiles of ``direct_io`` (and with ``persistent`` as many Q staging tiles), and 3 KB for
    Mosaic GPU's own reduction scratch (2 KB), barriers and alignment (measured: 2.1 KB); with
    ``kv_splits`` > 1 a [64, 32] f32 LSE staging tile per warpgroup. ``quantized``: a ring of
    1-byte pages, a bf16 tile per warpgroup and ``token_scales`` rings of per-token f32
    scales."""
    q = num_wgs * ROWS * head_dim * 2
    kv = 2 * num_stages * block_kv * head_dim * 2 * (num_wgs if paired else 1)
    if quantized:
        kv = kv // 2 + num_wgs * block_kv * head_dim * 2 + token_scales * num_stages * block_kv * 4
    p = 0 if fa3 else num_wgs * ROWS * block_kv * 2
    o = num_wgs * ROWS * head_dim * 2 * ((2 if persistent else 1) if direct_io else 0)
    lse = num_wgs * ROWS * 32 * 4 if kv_splits > 1 else 0
    return q + kv + p + o + lse + 3 * 1024


def direct_io_supported(
    group: int,
    head_dim: int,
    block_kv: int,
    num_stages: int,
    num_wgs: int,
    fa3: bool,
    paired: bool = False,
    kv_splits: int = 1,
) -> bool:
    """Whether the kernel can read Q / write O in place: ``tokens_per_tile(.., True) > 0``,
    head dim at most 128, and the untiled O staging tiles fit the SMEM budget.

    At head dim 256 Mosaic GPU's layout inference for the staging tile's register load never
    finished (minutes of search, on CPU as on GPU): found by review, so 256 gathers Q / O.
    """
    return (
        tokens_per_tile(group, True) > 0
        and head_dim <= 128
        and smem_bytes(head_dim, block_kv, num_stages, num_wgs, fa3, True, paired, kv_splits)
        <= SMEM_BYTES
    )


PAIRED_STAGES = 2  # ring depth of each warpgroup's ring with ``paired``


def paired_block_kv(head_dim: int, page_size: int | None = None) -> int:
    """Keys per K/V tile with ``paired`` (two rings of ``PAIRED_STAGES`` in one CTA): 128 where
    both rings fit in SMEM (head dim 64) and the page size allows it, else 64."""
    if (page_size is None or page_size % 128 == 0 or 128 % page_size == 0) and smem_bytes(
        head_dim, 128, PAIRED_STAGES, 2, True, True, paired=True
    ) <= SMEM_BYTES:
        return 128
    return 64


def default_paired(num_tokens: int, num_seqs_max: int, group: int, head_dim: int) -> bool:
    """Whether the FA3-style body runs one query tile per compute warpgroup (``paired``): when
    the batch is decode-heavy (``T <= 2 B``, the batches that otherwise run one compute
    warpgroup per CTA, ``default_num_wgs``), where two warpgroups sharing one sequence's K/V
    would mostly compute padding, and the two rings, Q and O staging tiles fit in SMEM.

    Not for ``2 B < T``: B is the static bound of sequences (an engine's bucket), and a prefill
    chunk beside a few decodes would then run 64-key tiles without the ping-pong (unmeasured).
    """
    Tw = tokens_per_tile(group, True)
    if Tw == 0 or head_dim > 128 or num_tokens > 2 * num_seqs_max:
        return False
    bkv = paired_block_kv(head_dim)
    return smem_bytes(head_dim, bkv, PAIRED_STAGES, 2, True, True, True) <= SMEM_BYTES


NUM_SMS = 132  # H100 / H200 SXM


def persistent_supported(
    head_dim: int, block_kv: int, num_stages: int, num_wgs: int, kv_splits: int = 1
) -> bool:
    """Whether a persistent FA3 CTA (in-place Q/O, not paired) fits: its Q staging tiles on
    top of everything else."""
    return (
        smem_bytes(head_dim, block_kv, num_stages, num_wgs, True, True, False, kv_splits,
                   persistent=True)
        <= SMEM_BYTES
    )  # fmt: skip


MAX_KV_SPLITS = 64


def default_kv_splits(
    num_tiles: int,
    num_kv_heads: int,
    max_kv_len: int,
    block_kv: int,
    sliding_window: int | None = None,
    block_q: int = 0,
) -> int:
    """Split-KV factor from static shapes: 1 when there are at least ``3 * NUM_SMS``
    (query tile, KV head) work units; else enough splits for about ``8 * NUM_SMS`` units,
    each at least 4 K/V tiles of the longest possible sequence, at most ``MAX_KV_SPLITS``.
    (H200, decode batches through the paired kernel: B=8 at 32k ran 239 us with 7 splits,
    231 with 16; B=1 63 us of kernel time with 22, 73 with 16; B=32 at 2k without splits
    88 us of kernel time against the decode kernel's 80 with 4.)

    Small decode batches at long context (a B=8 decode has 8 x K units: a few SMs each
    streaming a whole sequence) and late chunks of a long chunked prefill need it; prefill
    batches of a few thousand tokens already have units enough. ``num_tiles`` is the static
    bound of query tiles (``schedule.num_tiles_bound``), ``max_kv_len`` the block table's
    capacity in keys; with a ``sliding_window`` a tile of ``block_q`` tokens reads at most
    ``sliding_window + block_q`` keys.
    """
    units = num_tiles * num_kv_heads
    if units >= 3 * NUM_SMS:
        return 1
    if sliding_window is not None:
        max_kv_len = min(max_kv_len, sliding_window + block_q)
    max_tiles = -(-max_kv_len // block_kv)
    return max(1, min(-(-8 * NUM_SMS // units), max_tiles // 4, MAX_KV_SPLITS))


PERSISTENT_MAX_KV = 1024  # keys a sequence may hold for the persistent default
PERSISTENT_BLOCK_KV, PERSISTENT_STAGES = 64, 3  # its K/V tile and ring depth


def default_persistent(
    num_tokens: int,
    num_seqs_max: int,
    max_kv_len: int,
    group: int,
    head_dim: int,
    page_size: int,
    num_kv_heads: int,
) -> bool:
    """Whether the FA3-style body runs a persistent grid by default (``TUNING``): a
    prefill-heavy batch (``T > 2 B``, not paired) whose block table holds at most
    ``PERSISTENT_MAX_KV`` keys a sequence (``max_kv_len``, static: every work item visits at
    most 16 K/V tiles, so the per-CTA start is a large part of it), with in-place Q/O, 64-key
    tiles the page size allows, and at least ``3 * NUM_SMS`` work items without splits.

    Static shapes only: an engine's block tables span the model's whole context, so its steps
    keep the one-item grid (a chunk of a long prompt would be slower persistent).
    """
    Tw = tokens_per_tile(group, True)
    if Tw == 0 or head_dim > 128 or num_tokens <= 2 * num_seqs_max:
        return False
    if max_kv_len > PERSISTENT_MAX_KV or (page_size % 64 and 64 % page_size):
        return False
    items = schedule.num_tiles_bound(num_tokens, num_seqs_max, 2 * Tw) * num_kv_heads
    return items >= 3 * NUM_SMS and persistent_supported(
        head_dim, PERSISTENT_BLOCK_KV, PERSISTENT_STAGES, 2
    )


def default_fa3(interpret: bool) -> bool:
    """Whether the FA3-style body is the default (never in the interpreter, which cannot run
    it)."""
    return FA3_DEFAULT and not interpret


def default_block_kv(head_dim: int, fa3: bool = False, page_size: int | None = None) -> int:
    """Keys per K/V tile: 64, or 128 for the FA3-style body up to head dim 128 (at 256 the
    f32 scores and accumulator would not fit the registers) when the page size divides or is
    a multiple of 128 (a page of 192 keeps 64-key tiles)."""
    if (
        fa3
        and head_dim <= 128
        and (page_size is None or page_size % 128 == 0 or 128 % page_size == 0)
    ):
        return 128
    return 64


def default_num_wgs(num_tokens: int, num_seqs_max: int) -> int:
    """Two compute warpgroups (128 query rows share each K/V tile) unless the batch is
    decode-heavy (T <= 2 B), where the second warpgroup would mostly hold padding rows."""
    return 2 if num_tokens > 2 * num_seqs_max else 1


def default_tile_order(num_tokens: int, num_seqs_max: int) -> str:
    """``longest_first`` for decode-heavy batches (T <= 2 B: few tiles, the tail matters),
    else ``by_sequence`` (L2 reuse of each sequence's K/V)."""
    return "longest_first" if num_tokens <= 2 * num_seqs_max else "by_sequence"


def default_num_stages(
    head_dim: int,
    block_kv: int,
    num_wgs: int = 1,
    fa3: bool = False,
    quantized: bool = False,
    token_scales: int = 0,
) -> int:
    """Deepest TMA ring (up to 4) that keeps two CTAs per SM, at least 2 (always 2 for the
    FA3-style body, one CTA per SM, as in JAX's FA3 example)."""
    if fa3:
        return 2
    q = dict(quantized=quantized, token_scales=token_scales)
    for stages in (4, 3):
        if smem_bytes(head_dim, block_kv, stages, num_wgs, **q) <= TWO_CTAS_BYTES:
            return stages
    return 2
