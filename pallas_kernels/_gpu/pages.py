"""TMA page copies into an SMEM ring, shared by the GPU decode and ragged kernels.

A K/V tile of ``block_kv`` keys is gathered page by page: ``block_kv / C`` whole pages, or a
``block_kv``-row slice of one page when ``C > block_kv``; each copy moves ``rows_per_copy``
rows and is one arrival on the slot's barrier.
"""

from __future__ import annotations

from collections.abc import Iterable

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def copy_pages(rows: Iterable, streams, slot, rows_per_copy: int) -> None:
    """For copy j of a tile (first pool row ``rows[j]``), one TMA copy per ``(gmem, smem ring,
    barrier)`` stream into ``ring[slot]`` at rows ``[j * r, (j + 1) * r)``, arriving on
    ``barrier[slot]``. ``rows`` may be a generator: each row is computed just before its
    copies."""
    r = rows_per_copy
    for j, row in enumerate(rows):
        for src, ring, bar in streams:
            plgpu.copy_gmem_to_smem(
                src.at[pl.ds(row, r)], ring.at[slot, pl.ds(j * r, r)], bar.at[slot]
            )
