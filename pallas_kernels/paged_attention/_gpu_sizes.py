"""Static sizes of the Mosaic GPU decode kernel: the ``swap_ab`` tiles' query columns and the
SMEM a CTA needs."""

from __future__ import annotations

from pallas_kernels._gpu.config import ROWS


def qcols(num_seqs: int, num_q_heads: int, num_kv_heads: int, tcgen05: bool = False) -> int:
    """Query columns of the ``swap_ab`` products: every unit's G heads from its 8-row aligned
    start, rounded up to 8 (a wgmma N), or to 16 for tcgen05 (an M=128 MMA's N: 16 to 256 in
    steps of 16)."""
    G = num_q_heads // num_kv_heads
    offs = {
        (b * num_q_heads + h * G) % 8 for b in range(min(num_seqs, 8)) for h in range(num_kv_heads)
    }
    step = 16 if tcgen05 else 8
    return -(-(max(offs) + G) // step) * step


def smem_bytes(
    head_dim: int,
    block_kv: int,
    num_stages: int,
    itemsize: int = 2,
    qcols: int | None = None,
    staged: bool = False,
    kv_itemsize: int | None = None,
    token_scales: int = 0,
) -> int:
    """SMEM of one CTA; ``qcols`` set: the ``swap_ab`` kernel, whose Q and P tiles hold
    ``qcols`` query rows instead of 64; ``staged`` (pages below 8 tokens by TMA): the ring is
    the untiled staging ring and one tiled K and one V tile come on top. Output tiles reuse the
    ring's SMEM (a later scope; the split path's partial and lse tiles are far below it).
    Quantized pages (``kv_itemsize`` 1): the ring holds the 8-bit pages and one tile of
    ``itemsize`` (the one K and V are dequantized into) comes on top, with ``token_scales``
    (0, 1 or 2) rings of per-token f32 scales."""
    if kv_itemsize is not None and kv_itemsize != itemsize:
        ring = 2 * num_stages * block_kv * head_dim * kv_itemsize
        kv = ring + block_kv * head_dim * itemsize + token_scales * num_stages * block_kv * 4
    else:
        kv = (2 * num_stages + 2 * staged) * block_kv * head_dim * itemsize
    if qcols is not None:
        return qcols * (head_dim + block_kv) * itemsize + kv + 1024
    q = ROWS * head_dim * itemsize
    p = ROWS * block_kv * itemsize
    return q + kv + p + 1024  # barriers and alignment
