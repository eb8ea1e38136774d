"""Static tuning of the Mosaic GPU ragged kernel: tile sizes and the SMEM budget.

Everything here depends on static shapes only (no host sync, jit- and CUDA-graph safe).
"""

from __future__ import annotations

ROWS = 64  # wgmma M tile per warpgroup: query tokens x the G query heads of one KV head
SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on Hopper
TWO_CTAS_BYTES = 113 * 1024  # per-CTA budget that keeps two CTAs resident per SM
BLOCK_KV_CHOICES = (64, 128)


def tokens_per_tile(group: int) -> int:
    """Query tokens per 64-row warpgroup tile: ``64 // G`` (rows past ``tokens * G`` pad)."""
    return max(1, ROWS // group)


def smem_bytes(head_dim: int, block_kv: int, num_stages: int, num_wgs: int = 1) -> int:
    """SMEM of one CTA (2-byte dtypes): Q/O tiles, the K/V ring, the P tiles, barriers."""
    q = num_wgs * ROWS * head_dim * 2
    kv = 2 * num_stages * block_kv * head_dim * 2
    p = num_wgs * ROWS * block_kv * 2
    return q + kv + p + 1024


def default_block_kv(head_dim: int) -> int:
    """Keys per K/V tile."""
    del head_dim
    return 64


def default_num_wgs(num_tokens: int, num_seqs_max: int) -> int:
    """Two compute warpgroups (128 query rows share each K/V tile) unless the batch is
    decode-heavy (T <= 2 B), where the second warpgroup would mostly hold padding rows."""
    return 2 if num_tokens > 2 * num_seqs_max else 1


def default_num_stages(head_dim: int, block_kv: int, num_wgs: int = 1) -> int:
    """Deepest TMA ring (up to 4) that keeps two CTAs per SM, at least 2."""
    for stages in (4, 3):
        if smem_bytes(head_dim, block_kv, stages, num_wgs) <= TWO_CTAS_BYTES:
            return stages
    return 2
