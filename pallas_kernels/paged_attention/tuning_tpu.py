"""Block sizes of the Mosaic TPU attention kernels, keyed by TPU generation.

No TPU was available while these kernels were written, so nothing here is measured: the
table holds each generation's VMEM budget (from public chip specs) and the heuristic turns
it into block sizes. Replace the heuristic by measured entries (``_MEASURED``) once
``benchmarks/`` has been run on a TPU.

The heuristic (``decode_block_sizes``; the ragged kernel's tiles are in
``pallas_kernels/ragged_paged_attention/tuning_tpu.py``):

* Decode is bound by HBM bandwidth, so a KV block should be large enough to amortise the
  ~0.35 us per-grid-step and per-DMA-batch overhead, but the double buffer (2 slots x K and
  V) must fit a quarter of the scoped VMEM budget. The target is ``kv_tokens_per_block``
  tokens per block (512 on v5e/v6e, 256 on v4 and unknown chips), rounded down to whole
  pages and capped at the block-table width W (a block never spans more pages than a
  sequence can own).
* A program streams ``seqs_per_program`` sequences (up to 8) through one double-buffered
  DMA pipeline, so a short sequence's first fetch overlaps the previous one's compute;
  fewer when the grid would drop below 4 programs (two TensorCores share them).
* On CPU (the TPU interpreter) the defaults are tiny so interpreted grids stay cheap.
"""

from __future__ import annotations

import dataclasses
import functools

import jax


@dataclasses.dataclass(frozen=True)
class Generation:
    """What the heuristic needs to know about a TPU generation.

    Attributes:
      name: short name ("v4", "v5e", "v5p", "v6e", "v7x").
      vmem_bytes: scoped VMEM budget per TensorCore that a kernel may use by default.
      kv_tokens_per_block: target KV tokens per compute block (a heuristic, not measured).
      smem_bytes: SMEM per TensorCore (scalar memory: prefetched block tables live there).
    """

    name: str
    vmem_bytes: int
    kv_tokens_per_block: int
    smem_bytes: int = 1 << 20


_MiB = 1 << 20

# Default scoped-VMEM limits (not the physical VMEM size) per TensorCore.
GENERATIONS: dict[str, Generation] = {
    "v4": Generation("v4", 16 * _MiB, 256),
    "v5e": Generation("v5e", 16 * _MiB, 512),
    "v5p": Generation("v5p", 16 * _MiB, 512),
    "v6e": Generation("v6e", 32 * _MiB, 512),
    "v7x": Generation("v7x", 32 * _MiB, 512),
}
DEFAULT = Generation("default", 16 * _MiB, 256)
# The TPU interpreter on CPU: small blocks keep the number of interpreted DMAs low.
INTERPRET = Generation("interpret", 16 * _MiB, 16)

# Measured overrides: (generation, dtype name, page size C, head dim H) -> pages per block.
# Empty until the benchmarks run on a TPU; the heuristic applies meanwhile.
_MEASURED: dict[tuple[str, str, int, int], int] = {}


def max_scalar_prefetch_entries(gen: Generation | None = None) -> int:
    """How many i32 scalars a kernel may prefetch into SMEM: half of it, the rest is Mosaic's.

    The flattened block tables ``[B * W]`` are the bulk of it; the decode kernel splits a
    larger batch into several calls, the ragged kernel reports it as unsupported.
    """
    gen = current_generation() if gen is None else gen
    return gen.smem_bytes // 2 // 4


def _generation_from_kind(kind: str) -> Generation:
    kind = kind.lower().replace(" ", "")
    for key, names in (
        ("v7x", ("tpu7x", "tpuv7")),
        ("v6e", ("v6lite", "v6e")),
        ("v5e", ("v5lite", "v5e")),
        ("v5p", ("v5p", "v5")),
        ("v4", ("v4",)),
    ):
        if any(n in kind for n in names):
            return GENERATIONS[key]
    return DEFAULT


@functools.cache
def current_generation() -> Generation:
    """The generation of the default device; ``INTERPRET`` when the backend is not a TPU."""
    if jax.default_backend() != "tpu":
        return INTERPRET
    return _generation_from_kind(jax.devices()[0].device_kind)


def seqs_per_program(*, batch: int, num_kv_heads: int, gen: Generation | None = None) -> int:
    """Sequences one program streams through: up to 8 (2 in the interpreter), fewer when
    that would leave fewer than 4 programs (two TensorCores need work to share)."""
    gen = current_generation() if gen is None else gen
    bb = max(1, min(batch, 2 if gen is INTERPRET else 8))
    while bb > 1 and -(-batch // bb) * num_kv_heads < 4:
        bb = -(-bb // 2)
    return bb


def decode_block_sizes(
    *,
    page_size: int,
    head_dim: int,
    itemsize: int,
    width: int,
    batch: int = 1,
    num_kv_heads: int = 1,
    gen: Generation | None = None,
) -> dict[str, int]:
    """Default knobs of the decode kernel for one shape.

    Args:
      page_size: C.
      head_dim: H.
      itemsize: bytes per K/V element.
      width: W, pages per block table row.
      batch: B.
      num_kv_heads: K.
      gen: the generation; the current device's by default.

    Returns:
      ``{"pages_per_compute_block": n, "seqs_per_program": bb}`` with ``1 <= n <= width``.
    """
    gen = current_generation() if gen is None else gen
    bb = seqs_per_program(batch=batch, num_kv_heads=num_kv_heads, gen=gen)
    measured = _MEASURED.get((gen.name, f"{itemsize}B", page_size, head_dim))
    if measured is not None:
        return {"pages_per_compute_block": max(1, min(measured, width)), "seqs_per_program": bb}
    pages = max(1, gen.kv_tokens_per_block // page_size)
    # 2 slots x (K and V) x pages x C x H must fit a quarter of the VMEM budget.
    page_bytes = page_size * max(head_dim, 128) * itemsize  # VMEM pads lanes to 128
    pages = min(pages, max(1, (gen.vmem_bytes // 4) // (4 * page_bytes)))
    return {"pages_per_compute_block": max(1, min(pages, width)), "seqs_per_program": bb}
