"""Quantized pages (fp8 / int8 with f32 scales) in the Mosaic GPU kernels, decode and ragged.

The pages are copied as stored (8-bit: half the bytes of bf16) into an SMEM ring of their own
dtype; each tile is dequantized in registers into one bf16 tile (``dequantize_tile``: fp8 via
f16, int8 directly) that the bf16 wgmma products read. The scales never touch the pages:

- the key scale of a key row multiplies that row's scores (``S = (K Q^T) * k_scale``);
- the value scale of a key row multiplies that row of P before ``P @ V`` (P is bf16, whose
  exponent range is f32's, so ``P * v_scale`` neither overflows nor flushes), while the
  softmax denominators sum the unscaled P; per KV head (or tensor) it multiplies the output.

Each scale array reaches the kernel flattened, in one of three modes (``MODES``): ``"head"``
(per tensor scales broadcast to one per KV head), ``"page"`` (one per page and KV head) or
``"token"`` (one per token and KV head), with its layer's base index in ``scale_bases``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _quant

MODES = ("head", "page", "token")
# The per-token scale copies land at multiples of 32 bytes in their ring slot. With the default
# out-of-bounds mode (zeros) Mosaic GPU issues a tensor-map TMA copy, whose SMEM destination
# must be 128-byte aligned: misaligned-address faults on sm90. The copies stay inside the scale
# array (page ids and the layer are clamped), so they promise in-bounds instead, which makes
# them plain bulk copies (``cp.async.bulk``: 16-byte alignment, which every offset here has).
IN_BOUNDS = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
COMPUTE_DTYPE = jnp.dtype(jnp.bfloat16)  # what the products read: q and the dequantized tile


def scale_mode(scale: Any, pool_shape: tuple[int, ...]) -> str:
    """The kernel's mode of a scale (``MODES``): per tensor becomes per head."""
    g = _quant.granularity(tuple(scale.shape), tuple(pool_shape))
    return "head" if g == "tensor" else str(g)


def is_quantized_pool(k_pages) -> bool:
    """Whether ``k_pages`` (anything with a dtype) holds quantized pages."""
    return _quant.is_quantized(k_pages.dtype)


def config_fields(q, k_pages, k_scale, v_scale) -> dict[str, Any]:
    """The ``AttentionConfig`` fields of a quantized call (``kv_dtype``, ``k_scales``,
    ``v_scales`` and the compute ``dtype``), or {} for an unquantized pool."""
    if not _quant.is_quantized(k_pages.dtype):
        return {}
    shape = tuple(k_pages.shape)
    return dict(
        dtype=COMPUTE_DTYPE,
        kv_dtype=jnp.dtype(k_pages.dtype),
        k_scales=scale_mode(k_scale, shape),
        v_scales=scale_mode(v_scale, shape),
    )


def flat_scales(cfg, k_pages, layer, k_scale, v_scale) -> list[jax.Array]:
    """The kernel's scale inputs (in XLA, before the launch): the key and value scales
    flattened (per head: broadcast to ``[L', K]`` first, ``L'`` in {1, L}) and i32[2], each
    one's base index for ``layer`` (0 where the scales have no layer axis)."""
    K, P, C = cfg.num_kv_heads, cfg.num_pages, cfg.page_size
    flats, bases = [], []
    for mode, scale in ((cfg.k_scales, k_scale), (cfg.v_scales, v_scale)):
        s = _quant.layered_scale(scale, k_pages.ndim)
        per_layer = {"head": K, "page": K * P, "token": K * P * C}[mode]
        if mode == "head":
            s = jnp.broadcast_to(s[:, :, 0, 0], (s.shape[0], K))
        flats.append(s.reshape(-1))
        layered = s.shape[0] > 1
        # Clamped: the per-token copies promise in-bounds reads (``IN_BOUNDS``) whatever
        # ``layer`` holds (validation reports a bad one where it can).
        index = jnp.clip(jnp.asarray(layer, jnp.int32).reshape(()), 0, s.shape[0] - 1)
        bases.append(index * per_layer if layered else 0)
    return [*flats, jnp.stack([jnp.asarray(b, jnp.int32) for b in bases])]


def ring_transforms(dtype, head_dim: int):
    """The SMEM tiling and swizzle of a ring of ``dtype`` rows of ``head_dim`` elements: the
    widest swizzle (up to 128 bytes) a row holds, its tile that many bytes wide."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, head_dim * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


@plgpu.inline_mgpu()
def _warpgroup_barrier(ctx):
    del ctx
    mgpu_utils.warpgroup_barrier()


def dequantize_tile(src, dst, kv_dtype, valid_rows=None, barrier_first: bool = False) -> None:
    """``dst[...] = src`` in ``COMPUTE_DTYPE`` (a tile [T, H] of 8-bit pages into the tiled
    bf16 tile the products read; fp8 through f16, which holds every fp8 value exactly, int8
    directly), then a fence and warpgroup barrier. ``valid_rows``: rows from this one on are
    written as zeros (a tile past the sequence end: stale or NaN page tails).
    ``barrier_first``: a warpgroup barrier before the stores, so no warp overwrites the tile
    while another's product still reads it (not in the interpreter, which runs a warpgroup as
    one thread and cannot run inline Mosaic GPU code)."""
    x = plgpu.load(src, layout=plgpu.Layout.WGMMA_8BIT)
    if jnp.dtype(kv_dtype) != jnp.int8:
        x = x.astype(jnp.float16).astype(jnp.float32)
    x = x.astype(COMPUTE_DTYPE)
    if valid_rows is not None:
        rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA_8BIT)
        x = jnp.where(rows < valid_rows, x, jnp.zeros_like(x))
    if barrier_first:
        _warpgroup_barrier()
    dst[...] = x
    plgpu.commit_smem()


def tile_operand(src, kv_dtype):
    """A tile [T, H] of 8-bit pages (a ring slot) as a bf16 wgmma A operand in registers:
    loaded in the layout whose 2x upcast is one warp shuffle from wgmma's (``WGMMA_UPCAST_2X``),
    converted as in ``dequantize_tile``, then re-laid into ``WGMMA``. No SMEM store, fence or
    barrier: the product reads the registers."""
    x = plgpu.load(src, layout=plgpu.Layout.WGMMA_UPCAST_2X)
    if jnp.dtype(kv_dtype) != jnp.int8:
        x = x.astype(jnp.float16).astype(jnp.float32)
    x = x.astype(COMPUTE_DTYPE)
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def row_scales(scalars: list, rows_per_scalar: int, layout, size: int):
    """A [size] vector in ``layout`` whose rows ``[j * rows_per_scalar, (j + 1) *
    rows_per_scalar)`` hold ``scalars[j]`` (a tile's per-page scales); the scalar itself when
    there is one."""
    if len(scalars) == 1:
        return scalars[0]
    rows = plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=layout)
    vec = jnp.where(rows < rows_per_scalar * (len(scalars) - 1), scalars[-2], scalars[-1])
    for j in range(len(scalars) - 3, -1, -1):
        vec = jnp.where(rows < rows_per_scalar * (j + 1), scalars[j], vec)
    return vec


def factor(mode: str, head, ring, slot, page_scalars, page_size: int, layout, size: int):
    """One scale a key row of a tile of ``size`` keys: a scalar (per head, or per page with one
    page a tile) or a [size] vector in ``layout`` (per page: ``row_scales``; per token: slot
    ``slot`` of the SMEM ring the scales were copied into)."""
    if mode == "head":
        return head
    if mode == "page":
        return row_scales(list(page_scalars), page_size, layout, size)
    return plgpu.load(ring.at[slot], layout=layout, optimized=False)


def times(x, factor_, keys_axis: int):
    """``x`` times a per-key factor (``factor``) along its ``keys_axis``."""
    if getattr(factor_, "shape", ()) == ():
        return x * factor_
    return x * jax.lax.broadcast_in_dim(factor_, x.shape, [keys_axis])


def masked_factor(factor_, keys_hi, layout, size: int):
    """A per-token factor with its rows from ``keys_hi`` on set to 0: past a sequence's end the
    scales are stale (maybe NaN), and ``0 * NaN`` would poison P @ V."""
    rows = plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=layout)
    return jnp.where(rows < keys_hi, factor_, 0.0)
