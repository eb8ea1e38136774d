"""Static tuning of the Mosaic GPU ragged kernel: tile sizes and the SMEM budget.

Everything here depends on static shapes only (no host sync, jit- and CUDA-graph safe).
"""

from __future__ import annotations

ROWS = 64  # wgmma M tile: query tokens x the G query heads of one KV head
SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on Hopper
TWO_CTAS_BYTES = 113 * 1024  # per-CTA budget that keeps two CTAs resident per SM
BLOCK_KV_CHOICES = (64, 128)


def tokens_per_tile(group: int) -> int:
    """Query tokens per 64-row tile: ``64 // G`` (rows past ``tokens * G`` are padding)."""
    return max(1, ROWS // group)


def smem_bytes(head_dim: int, block_kv: int, num_stages: int, itemsize: int = 2) -> int:
    """SMEM of one CTA: Q/O tile, the K/V ring, the P tile, barriers."""
    q = ROWS * head_dim * itemsize
    kv = 2 * num_stages * block_kv * head_dim * itemsize
    p = ROWS * block_kv * itemsize
    return q + kv + p + 1024


def default_block_kv(head_dim: int) -> int:
    """Keys per K/V tile: 64 (two CTAs per SM fit at every supported head dim)."""
    del head_dim
    return 64


def default_num_stages(head_dim: int, block_kv: int) -> int:
    """Deepest TMA ring that keeps two CTAs per SM, at least 2."""
    for stages in (4, 3):
        if smem_bytes(head_dim, block_kv, stages) <= TWO_CTAS_BYTES:
            return stages
    return 2
