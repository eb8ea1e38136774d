"""The static configuration every Mosaic GPU attention kernel shares: constants of the Hopper
SM, the frozen config base (``AttentionConfig``) and the checks each kernel's ``make_config``
runs on its options (pool shape, integer knobs, the SMEM budget)."""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
ROWS = 64  # a wgmma M tile: the query rows one warpgroup computes
TILE_ROWS = 8  # rows of the (8, 64) SMEM tiling: a TMA copy into a tiled ref starts on one
LSE_COLS = 32  # split lse rows are 32 f32 = 128 B: TMA needs 128-byte-aligned SMEM row slices
SMEM_BYTES = 227 * 1024  # usable shared memory of a CTA on Hopper
TWO_CTA_SMEM_BYTES = 113 * 1024  # a CTA's budget that keeps two resident per SM (1 KB reserved)
PRODUCER_REGISTERS = 40  # setmaxnreg of a warpgroup that only issues copies


def smem_transforms():
    """The (8, 64) tiling and 128-byte swizzle of every wgmma operand in SMEM."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """What every GPU attention kernel instance knows statically (hashable: a jit static
    argument). Each kernel's ``_Config`` extends it with its own fields.

    Attributes:
      num_q_heads: N.
      num_kv_heads: K.
      num_pages: P, pages of one layer and KV head.
      page_size: C.
      head_dim: H.
      dtype: q's (and the pools') dtype; with quantized pools the products' (bf16: q is
        converted, each tile dequantized).
      sm_scale: the logit scale.
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      sliding_window: if set, a query sees only the last ``sliding_window`` keys.
      block_kv: T, keys per K/V tile.
      num_stages: depth of the K/V ring.
      interpret: False, or how to run in the Mosaic GPU interpreter.
      kv_dtype: quantized pools: the pages' dtype (fp8 or int8); None otherwise.
      k_scales: quantized pools: the key scales' mode (``_gpu.quant.MODES``); "" otherwise.
      v_scales: like ``k_scales``, the value scales'.
    """

    num_q_heads: int
    num_kv_heads: int
    num_pages: int
    page_size: int
    head_dim: int
    dtype: Any
    sm_scale: float
    logits_soft_cap: float | None
    sliding_window: int | None
    block_kv: int
    num_stages: int
    interpret: Any
    kv_dtype: Any = None
    k_scales: str = ""
    v_scales: str = ""

    @property
    def quantized(self) -> bool:
        """Quantized pages: 8-bit in the ring, dequantized a tile at a time (``_gpu.quant``)."""
        return self.kv_dtype is not None

    @property
    def group(self) -> int:
        """G = N / K, the query heads that share a KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def copies_per_tile(self) -> int:
        """Page copies a K/V tile takes (1 where a page holds the whole tile)."""
        return max(1, self.block_kv // self.page_size)

    @property
    def rows_per_copy(self) -> int:
        """Rows one page copy moves: a whole page, or the tile's slice of a larger one."""
        return min(self.page_size, self.block_kv)


def pool_dims(k_pages, layer) -> tuple[int, int, int, Any]:
    """(K, P, C, layer) of a [K, P, C, H] pool (layer 0) or an [L, K, P, C, H] one, which needs
    ``layer``."""
    if k_pages.ndim == 5:
        if layer is None:
            raise ValueError("layer must be given with a 5-D [L, K, P, C, H] pool")
        _, K, P, C, _ = k_pages.shape
        return K, P, C, layer
    K, P, C, _ = k_pages.shape
    return K, P, C, 0


def common_fields(q, k_pages, *, sm_scale, logits_soft_cap, sliding_window) -> dict[str, Any]:
    """``AttentionConfig``'s shape and semantics fields for these arguments (q: [..., N, H])."""
    K, P, C, _ = pool_dims(k_pages, 0)
    return dict(
        num_q_heads=q.shape[-2],
        num_kv_heads=K,
        num_pages=P,
        page_size=C,
        head_dim=q.shape[-1],
        dtype=jnp.dtype(q.dtype),
        sm_scale=float(sm_scale),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
    )


def int_knob(name: str, value) -> int:
    """An integer tuning argument (Python or NumPy int, not bool), else a ValueError naming it."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be an integer, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be an integer") from None


def check_smem(needed: int, **knobs) -> None:
    """A ValueError naming ``knobs`` unless ``needed`` bytes fit in a CTA's SMEM."""
    if needed > SMEM_BYTES:
        what = ", ".join(f"{k}={v}" for k, v in knobs.items())
        raise ValueError(
            f"this configuration needs {needed} bytes of SMEM, over the {SMEM_BYTES} a CTA has "
            f"({what}): lower num_stages or block_kv"
            + (", or pass persistent=False" if knobs.get("persistent") else "")
        )
