"""Block sizes of the Mosaic TPU ragged kernel (unmeasured heuristic; see the decode table).

A query tile holds ``block_q`` tokens of one sequence times the G query heads of one KV
head, i.e. ``block_q * G`` MXU rows. The default aims at 256 rows (the v6e/v7x MXU height),
at most 32 tokens, and never more tokens than T. KV blocks use the decode heuristic of
``pallas_kernels/paged_attention/tuning_tpu.py``. In the TPU interpreter (CPU) tiles are
8 rows so interpreted grids stay small. A program streams ``tiles_per_program`` tiles (4; 2
in the interpreter) through one DMA pipeline. Nothing here was measured (no TPU available).
"""

from __future__ import annotations

from pallas_kernels.paged_attention.tuning_tpu import (
    INTERPRET,
    Generation,
    current_generation,
    decode_block_sizes,
)


def ragged_block_sizes(
    *,
    page_size: int,
    head_dim: int,
    itemsize: int,
    width: int,
    group: int,
    num_tokens: int,
    gen: Generation | None = None,
) -> dict[str, int]:
    """Default knobs of the ragged kernel: query tokens per tile and pages per KV block.

    Args:
      page_size: C.
      head_dim: H.
      itemsize: bytes per K/V element.
      width: W.
      group: G, query heads per KV head.
      num_tokens: T, rows of q.
      gen: the generation; the current device's by default.

    Returns:
      ``{"block_q": bq, "tiles_per_program": tb, "pages_per_compute_block": n}``.
    """
    gen = current_generation() if gen is None else gen
    kv = decode_block_sizes(
        page_size=page_size, head_dim=head_dim, itemsize=itemsize, width=width, gen=gen
    )
    target_rows, max_tokens = (8, 8) if gen is INTERPRET else (256, 32)
    block_q = max(1, min(target_rows // max(group, 1), max_tokens, num_tokens))
    return {
        "block_q": block_q,
        "tiles_per_program": 2 if gen is INTERPRET else 4,
        "pages_per_compute_block": kv["pages_per_compute_block"],
    }
