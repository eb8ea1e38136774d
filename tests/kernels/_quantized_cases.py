"""Quantized paged pools for the attention tests (``test_quantized_*.py``): fp8 / int8 pages with
f32 scales of each granularity, built from ``_paged_inputs.make_paged_kv``'s permuted pool, and
the f64 oracles run on the dequantized values (``page.astype(f64) * scale``).

Poison: fp8 pages hold NaN in free pages and past each sequence's end; int8 cannot, so those
hold +-127 garbage, and per-page and per-token scales of free pages and unused tails are NaN
(for fp8 too). A kernel that reads what it should not, or multiplies a masked probability by a
stale scale, returns NaN or a wrong value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from _paged_inputs import dense_attention, make_paged_kv
from _ragged_inputs import RaggedCase, dense_ragged_attention

DTYPES = ("float8_e4m3fn", "float8_e5m2", "int8")
GRANULARITIES = ("tensor", "head", "page", "token")
# Relative error bound of every implementation against the f64 oracle on the dequantized
# values: max |out - ref| / max |ref| (the output is bf16 in the GPU kernels).
REL_ERROR = 3e-2


def fmax(dtype) -> float:
    """The largest finite value of a quantized dtype (int8: 127)."""
    dtype = jnp.dtype(dtype)
    return 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)


def _reduce_axes(granularity: str) -> tuple[int, ...]:
    # over [L, K, P, C] of per-token amax: which axes a scale spans
    return {"tensor": (0, 1, 2, 3), "head": (2, 3), "page": (3,), "token": ()}[granularity]


def quantize_pool(rng, pool_LKPCH: np.ndarray, dtype, granularity: str, layered: bool):
    """(pages, scale) of an f32 pool [L, K, P, C, H] that holds NaN where it is poisoned: the
    scale is ``amax / fmax`` over the granularity's span (NaN where that span is all poison), a
    little jittered so each scale is its own, and the pages the saturated quotient. ``layered``:
    the scale keeps the L axis ([L, K, P', C']), else the 4-D form of a 4-D pool."""
    dtype = jnp.dtype(dtype)
    with np.errstate(invalid="ignore"), _quiet():
        amax = np.nanmax(np.abs(pool_LKPCH), axis=-1)  # [L, K, P, C]
        axes = _reduce_axes(granularity)
        if axes:
            amax = np.nanmax(amax, axis=axes, keepdims=True)
    scale = (amax / fmax(dtype)).astype(np.float32)
    scale = scale * rng.uniform(0.9, 1.1, size=scale.shape).astype(np.float32)
    scale = (
        np.where(scale > 0, scale, np.float32(1.0)) if granularity in ("tensor", "head") else scale
    )
    q = pool_LKPCH / scale[..., None]
    q = np.clip(q, -fmax(dtype), fmax(dtype))
    if dtype == jnp.int8:
        q = np.where(np.isnan(q), rng.choice([-127.0, 127.0], size=q.shape), np.round(q))
    pages = np.asarray(jnp.asarray(q, jnp.float32).astype(dtype))
    if granularity == "tensor":
        scale = scale.reshape(()) if not layered else scale.reshape(1, 1, 1, 1)
    elif not layered:
        scale = scale[0]
    return pages, scale


class _quiet:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *a):
        self._w.__exit__(*a)


@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """A quantized pool, its scales, and the dequantized dense K/V (zeros past each length).

    Attributes:
      k_pages, v_pages: [K, P, C, H] (or [L, ...]) in the quantized dtype.
      k_scale, v_scale: f32 of the granularity's shape.
      block_tables, lengths: as ``make_paged_kv``'s.
      k_dense, v_dense: f64 [B, S, K, H] (or [L, B, S, K, H]).
    """

    k_pages: Any
    v_pages: Any
    k_scale: Any
    v_scale: Any
    block_tables: np.ndarray
    lengths: np.ndarray
    k_dense: np.ndarray
    v_dense: np.ndarray


def make_quantized_kv(
    rng,
    lengths,
    *,
    num_kv_heads,
    head_dim,
    page_size,
    dtype,
    granularity,
    v_granularity=None,
    num_layers=None,
    width=None,
) -> QuantizedKV:
    """A quantized, permuted, poisoned pool holding sequences of ``lengths`` (keys with a
    spread of per-token magnitudes, so the granularities differ)."""
    kv = make_paged_kv(
        rng, lengths, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        num_layers=num_layers, width=width,
    )  # fmt: skip
    layered = num_layers is not None
    L = num_layers or 1
    pools = []
    for pool, gran in (
        (kv.k_pages, granularity),
        (kv.v_pages, v_granularity or granularity),
    ):
        pool = np.asarray(pool, np.float32).reshape(L, *np.shape(pool)[-4:])
        magnitude = rng.lognormal(0.0, 1.0, size=(*pool.shape[:-1], 1)).astype(np.float32)
        pages, scale = quantize_pool(rng, pool * magnitude, dtype, gran, layered)
        pools.append((pages, scale))
    (kq, ks), (vq, vs) = pools
    dense = [_dense(p, s, kv.block_tables, kv.lengths, page_size, L) for p, s in pools]
    shape = (L,) if layered else ()
    k_dense, v_dense = (d.reshape(*shape, *d.shape[1:]) for d in dense)
    if not layered:
        kq, vq = kq[0], vq[0]
    return QuantizedKV(
        k_pages=kq, v_pages=vq, k_scale=ks, v_scale=vs, block_tables=kv.block_tables,
        lengths=kv.lengths, k_dense=k_dense, v_dense=v_dense,
    )  # fmt: skip


def _dense(pages, scale, tables, lengths, C, L):
    """f64 [L, B, S, K, H] of the dequantized values each sequence holds, zero past its end."""
    pages = np.asarray(pages, np.float32).astype(np.float64).reshape(L, *np.shape(pages)[-4:])
    scale = np.asarray(scale, np.float64)
    scale = scale.reshape((1,) * (4 - scale.ndim) + scale.shape) if scale.ndim < 4 else scale
    deq = pages * np.broadcast_to(scale, pages.shape[:-1])[..., None]  # [L, K, P, C, H]
    B, W = tables.shape
    S = W * C
    out = np.zeros((L, B, S, pages.shape[1], pages.shape[-1]))
    for b, n in enumerate(lengths):
        for s in range(int(n)):
            out[:, b, s] = deq[:, :, tables[b, s // C], s % C]
    return out


def assert_matches(out, ref, what: str = "") -> None:
    """``out`` (any float dtype) within ``REL_ERROR`` of the f64 ``ref`` (max abs error over
    max |ref|), finite everywhere."""
    out = np.asarray(out, np.float32).astype(np.float64)
    assert np.all(np.isfinite(out)), f"non-finite output {what}"
    err = np.max(np.abs(out - ref), initial=0.0) / max(np.max(np.abs(ref), initial=0.0), 1e-30)
    assert err <= REL_ERROR, f"relative error {err:.3g} > {REL_ERROR} {what}"


def decode_case(rng, lengths, *, K=2, G=2, H=64, C=16, dtype="int8", granularity="token",
                v_granularity=None, num_layers=None, q_dtype=jnp.bfloat16):  # fmt: skip
    """(q, quantized pool) of a decode call: q [B, K * G, H] in ``q_dtype``."""
    kv = make_quantized_kv(
        rng, lengths, num_kv_heads=K, head_dim=H, page_size=C, dtype=dtype,
        granularity=granularity, v_granularity=v_granularity, num_layers=num_layers,
    )  # fmt: skip
    q = np.asarray(jnp.asarray(rng.standard_normal((len(lengths), K * G, H)), q_dtype))
    return q, kv


def decode_oracle(q, kv: QuantizedKV, layer=None, **kw) -> np.ndarray:
    """The f64 decode oracle on the dequantized values."""
    k = kv.k_dense if layer is None else kv.k_dense[int(layer)]
    v = kv.v_dense if layer is None else kv.v_dense[int(layer)]
    q64 = np.asarray(q, np.float32).astype(np.float64)
    return dense_attention(q64, k, v, kv.lengths, **kw)


def ragged_case(rng, kv_lens, q_lens, *, K=2, G=2, H=64, C=16, dtype="int8",
                granularity="token", num_layers=None, q_dtype=jnp.bfloat16, extra_rows=3):  # fmt: skip
    """(RaggedCase with quantized pages, k_scale, v_scale): one dead sequence after the live
    ones, ``extra_rows`` padding rows."""
    dead = [int(x) for x in rng.integers(0, 5, size=1)]
    kv = make_quantized_kv(
        rng, list(kv_lens) + dead, num_kv_heads=K, head_dim=H, page_size=C, dtype=dtype,
        granularity=granularity, num_layers=num_layers,
    )  # fmt: skip
    ns = len(kv_lens)
    lens = kv.lengths.copy()
    lens[ns:] = rng.integers(0, 1000, size=1)  # garbage past num_seqs
    T = sum(q_lens) + extra_rows
    q = np.asarray(jnp.asarray(rng.standard_normal((T, K * G, H)), q_dtype))
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    args = (q, kv.k_pages, kv.v_pages, kv.block_tables, lens.astype(np.int32), cu,
            np.asarray(ns, np.int32))  # fmt: skip
    case = RaggedCase(args=args, k_dense=kv.k_dense, v_dense=kv.v_dense, q_lens=tuple(q_lens))
    return case, kv.k_scale, kv.v_scale


def ragged_oracle(case: RaggedCase, **kw) -> np.ndarray:
    """The f64 ragged oracle on the dequantized values."""
    return dense_ragged_attention(case, **kw)
