"""Quantized pages (fp8 / int8 with f32 scales) in the Pallas-Triton kernels, decode and ragged.

The pages' tiles are loaded as stored, one byte an element (fp8 pools are viewed as uint8 in
XLA, a free bitcast, so a masked load's zero fill is an integer; ``pool_view``), and converted
in registers to the query's dtype (``dequantize``: exact, every fp8 and int8 value is a bf16,
f16 and f32 value), which the products read with f32 accumulation. The scales never touch the
tiles:

- the key scale of a key multiplies its column of the scores (``S = (Q K^T) * k_scale``),
  before the soft cap;
- the value scale of a key multiplies its column of P before ``P @ V`` while the softmax
  denominators sum the unscaled P; per KV head (or tensor) it multiplies the output.

Each scale reaches the kernel flattened, in one of three modes (``MODES``): ``"head"`` (per
tensor scales broadcast to one per KV head), ``"page"`` (one per page and KV head) or
``"token"`` (one per token and KV head), with its layer's base index (``flat_scales``). Per-key
factors of keys a program must not read load as 0 (masked: never fetched), so a stale or NaN
scale of a free page or page tail never meets a zero probability.

Triton converts ``float8_e4m3fn`` only from sm89 (Ada) on (JAX's Pallas-Triton lowering
refuses the cast below it): ``generation_reason`` says so on sm80 and sm86, where
``float8_e5m2`` and ``int8`` pages run.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _backend, _quant

MODES = ("head", "page", "token")
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
# The first compute capability whose Triton converts float8_e4m3fn (cvt ... e4m3x2).
E4M3_MIN_CAPABILITY = (8, 9)


def scale_mode(scale: Any, pool_shape: tuple[int, ...]) -> str:
    """The kernel's mode of a scale (``MODES``): per tensor becomes per head."""
    g = _quant.granularity(tuple(scale.shape), tuple(pool_shape))
    return "head" if g == "tensor" else str(g)


def config_fields(k_pages, k_scale, v_scale) -> dict[str, Any]:
    """The kernel configs' quantization fields: ``kv_dtype`` (the pages' dtype name, None for
    an unquantized pool), ``k_scales`` and ``v_scales`` (``MODES``, None unquantized)."""
    if not _quant.is_quantized(k_pages.dtype):
        return dict(kv_dtype=None, k_scales=None, v_scales=None)
    shape = tuple(k_pages.shape)
    return dict(
        kv_dtype=jnp.dtype(k_pages.dtype).name,
        k_scales=scale_mode(k_scale, shape),
        v_scales=scale_mode(v_scale, shape),
    )


def scales_reason(k_pages, v_pages, k_scale, v_scale) -> str | None:
    """Why a call's pages and scales do not go together (None if they do): quantized pages
    without both scales, scales of a wrong shape or dtype, scales with unquantized pages."""
    errors = _quant.check_scales(k_pages, v_pages, k_scale, v_scale)
    return "; ".join(errors) if errors else None


def generation_reason(k_pages) -> str | None:
    """Why this GPU's Triton cannot convert the pages' dtype (None if it can, or where the
    GPU is unknown: the interpreter and cross-lowering)."""
    if jnp.dtype(k_pages.dtype) != E4M3:
        return None
    cc = _backend.gpu_compute_capability()
    if cc is None or cc >= E4M3_MIN_CAPABILITY:
        return None
    return (
        f"k_pages.dtype=float8_e4m3fn needs sm89 or newer in Triton (this GPU is "
        f"sm{cc[0]}{cc[1]}): use float8_e5m2 or int8 pages here, or implementation='xla'"
    )


def pool_view(pages: jax.Array) -> jax.Array:
    """The pool as the kernels load it: fp8 as uint8 (a free bitcast), others unchanged."""
    if jnp.issubdtype(pages.dtype, jnp.floating) and jnp.dtype(pages.dtype).itemsize == 1:
        return jax.lax.bitcast_convert_type(pages, jnp.uint8)
    return pages


def dequantize(x, kv_dtype: str, dtype):
    """A tile loaded from ``pool_view`` ([T, H] uint8 bits of fp8, or int8) as ``dtype``."""
    if jnp.dtype(kv_dtype) == jnp.int8:
        return x.astype(jnp.float32).astype(dtype)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(kv_dtype)).astype(dtype)


def flat_scales(modes, k_pages, layer, k_scale, v_scale) -> list[jax.Array]:
    """The kernels' scale inputs (in XLA, before the launch): the key and value scales
    flattened (per head: broadcast to ``[L', K]`` first, ``L'`` in {1, L}) and i32[2], each
    one's base index for ``layer`` (0 where the scales have no layer axis).

    Args:
      modes: (key mode, value mode) of ``MODES``.
      k_pages: the pool [K, P, C, H] or [L, K, P, C, H].
      layer: the layer index (int, i32[] or None for a 4-D pool).
      k_scale, v_scale: the call's scales (``_quant.granularity``).
    """
    K, P, C = k_pages.shape[-4:-1]
    flats, bases = [], []
    for mode, scale in zip(modes, (k_scale, v_scale), strict=True):
        s = _quant.layered_scale(scale, k_pages.ndim)
        per_layer = {"head": K, "page": K * P, "token": K * P * C}[mode]
        if mode == "head":
            s = jnp.broadcast_to(s[:, :, 0, 0], (s.shape[0], K))
        flats.append(s.reshape(-1))
        at = 0 if layer is None else layer
        bases.append(jnp.asarray(at, jnp.int32).reshape(()) * per_layer if s.shape[0] > 1 else 0)
    return [*flats, jnp.stack([jnp.asarray(b, jnp.int32) for b in bases])]


def factor(mode: str, ref, base, kvh, page_T, pos_T, *, num_pages, page_size, valid=None):
    """The scale of each key of a tile: a scalar (``"head"``) or [T] (``"page"``,
    ``"token"``: a masked load where ``valid`` is given, 0 where it is False).

    Args:
      mode: of ``MODES``.
      ref: the flat scales (``flat_scales``).
      base: i32[] the layer's base index.
      kvh: the KV head.
      page_T, pos_T: i32[T] each key's page id and position in its sequence.
      num_pages, page_size: P, C.
      valid: None (every key read) or bool[T].
    """
    if mode == "head":
        return ref[base + kvh]
    idx = kvh * num_pages + page_T
    if mode == "token":
        idx = idx * page_size + pos_T % page_size
    idx = base + idx
    if valid is None:
        return ref[idx]
    from jax.experimental.pallas import triton as plt

    return plt.load(ref.at[idx], mask=valid, other=0.0)
