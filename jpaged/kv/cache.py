"""The paged KV pool as device state, and the pure donated functions that update it.

`PagedKVCache` holds the K and V pages of every layer stacked, ``[L, K, P, C, H]`` (layers,
KV heads, pool pages, tokens per page, head dim; see ``docs/architecture.md``). A token's
*slot* is ``page * C + offset``; slot ``-1`` means "no write". Every update is a pure function
jitted with the cache donated, so XLA updates the pool in place: scatters use
``mode="drop"`` with skipped rows mapped to an out-of-range index, never a copy of the pool.

Updates:

- `write_kv`: write new tokens' K/V of all layers into their slots.
- `write_kv_layer`: the same for one layer (``layer`` may be traced), for use inside a
  jitted model's layer loop.
- `copy_pages`: ``(src, dst)`` page pairs over all layers and heads (copy-on-write).
- `gather_pages` / `scatter_pages`: read pages out (to swap them to host memory) and write
  them back.

A quantized pool (``dtype`` ``"fp8"`` / ``float8_e4m3fn``, ``float8_e5m2`` or ``"int8"``)
holds f32 scales beside its pages, one per token and KV head: ``k_scale`` / ``v_scale``
``[L, K, P, C]``, part of the pytree, passed to the attention ops as they are (with
``layer``). The writes quantize on the fly (``jpaged.kv.quantize.quantize_tokens``: each
token's scale from its own values, saturating casts, no NaN from all-zero tokens); copies and
swaps move every page's scales with it. The same memory holds about twice the pages of bf16
(``pages_for_budget`` counts the scales).

Value checks (slot, page and layer ranges) run eagerly whenever the argument is concrete
(NumPy, Python or a committed `jax.Array`); pass ``validate=False`` to skip them (a
committed `jax.Array` is then not read back to the host). Under tracing only the static
checks (shapes, dtypes) run and out-of-range indices are dropped like ``-1``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.kv import cache_checks as checks
from jpaged.kv import quantize

__all__ = [
    "PagedKVCache",
    "copy_pages",
    "gather_pages",
    "pages_for_budget",
    "scatter_pages",
    "write_kv",
    "write_kv_layer",
]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_pages", "v_pages", "k_scale", "v_scale"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedKVCache:
    """The K/V page pool of every layer.

    Attributes:
      k_pages: [L, K, P, C, H] keys (layers, KV heads, pool pages, tokens per page, head dim):
        floating, or quantized codes (fp8 e4m3 / e5m2, int8).
      v_pages: [L, K, P, C, H] values, same shape and dtype as ``k_pages``.
      k_scale: quantized pools: f32[L, K, P, C], one scale per token and KV head (the keys
        are ``k_pages * k_scale[..., None]``); None otherwise.
      v_scale: like ``k_scale``, for ``v_pages``.

    >>> cache = PagedKVCache.create(num_layers=2, num_kv_heads=1, num_pages=4, page_size=8,
    ...                             head_dim=16, dtype=jnp.bfloat16)
    >>> cache.k_pages.shape, cache.num_slots, cache.bytes
    ((2, 1, 4, 8, 16), 32, 4096)
    >>> fp8 = PagedKVCache.create(2, 1, 4, 8, 16, dtype="fp8")
    >>> fp8.k_pages.dtype, fp8.k_scale.shape, fp8.bytes
    (dtype(float8_e4m3fn), (2, 1, 4, 8), 2560)
    """

    k_pages: jax.Array
    v_pages: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_kv_heads: int,
        num_pages: int,
        page_size: int,
        head_dim: int,
        dtype: Any = jnp.bfloat16,
    ) -> PagedKVCache:
        """A zero-filled pool of ``num_pages`` pages of ``page_size`` tokens per layer.

        ``dtype``: a floating dtype, or a quantized one (``"fp8"``, ``"fp8_e5m2"``, ``"int8"``
        or the dtype itself; ``quantize.KV_DTYPES``), which adds scales of ones.

        Raises:
          ValueError: a size is not a positive int, or ``dtype`` is neither floating nor
            quantized.
        """
        checks.check_sizes(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            num_pages=num_pages,
            page_size=page_size,
            head_dim=head_dim,
        )
        dtype = checks.pool_dtype(dtype)
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        scales = {}
        if quantize.is_quantized(dtype):
            ones = jnp.ones(shape[:-1], quantize.SCALE_DTYPE)
            scales = dict(k_scale=ones, v_scale=jnp.ones_like(ones))
        return cls(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype), **scales)

    @classmethod
    def create_from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: Any = jnp.bfloat16,
    ) -> PagedKVCache:
        """The largest pool (K and V together, with their scales) that fits in
        ``budget_bytes``."""
        num_pages = pages_for_budget(
            budget_bytes, num_layers, num_kv_heads, page_size, head_dim, dtype
        )
        return cls.create(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype)

    def __post_init__(self):
        k, v = self.k_pages, self.v_pages
        if not hasattr(k, "shape") or not hasattr(v, "shape"):
            return  # pytree unflattening with placeholders (e.g. jax.tree.map to None)
        if len(k.shape) != 5 or k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(
                f"k_pages and v_pages must have the same [L, K, P, C, H] shape and dtype, got "
                f"k_pages={k.shape} {k.dtype}, v_pages={v.shape} {v.dtype}"
            )
        scales = (self.k_scale, self.v_scale)
        if quantize.is_quantized(k.dtype):
            for name, sc in zip(("k_scale", "v_scale"), scales, strict=True):
                if not hasattr(sc, "shape"):
                    if sc is None:
                        raise ValueError(f"{name} must be given with {k.dtype} pages")
                    continue  # a pytree placeholder
                if tuple(sc.shape) != tuple(k.shape[:-1]) or sc.dtype != quantize.SCALE_DTYPE:
                    raise ValueError(
                        f"{name} must be float32 of shape [L, K, P, C] = {k.shape[:-1]}, got "
                        f"{sc.shape} {sc.dtype}"
                    )
        elif any(hasattr(sc, "shape") for sc in scales):
            raise ValueError(f"k_scale / v_scale go with quantized pages, not {k.dtype} ones")

    @property
    def num_layers(self) -> int:
        return self.k_pages.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[4]

    @property
    def dtype(self) -> np.dtype:
        return self.k_pages.dtype

    @property
    def quantized(self) -> bool:
        """Quantized pages (fp8 / int8) with per-token scales."""
        return quantize.is_quantized(self.k_pages.dtype)

    @property
    def scales(self) -> dict[str, jax.Array]:
        """``k_scale`` and ``v_scale`` as keyword arguments of the attention ops (empty for an
        unquantized pool): ``jpaged.paged_attention(q, c.k_pages, c.v_pages, ..., layer=l,
        **c.scales)``."""
        if not self.quantized:
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    @property
    def num_slots(self) -> int:
        """Token slots of the pool: ``P * C``."""
        return self.num_pages * self.page_size

    @property
    def bytes(self) -> int:
        """Bytes of K and V together, with their scales."""
        scales = 2 * self.k_scale.size * 4 if self.quantized else 0
        return 2 * self.k_pages.size * self.k_pages.dtype.itemsize + scales

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers and heads, K and V together."""
        return self.bytes // self.num_pages


def pages_for_budget(
    budget_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    dtype: Any = jnp.bfloat16,
) -> int:
    """How many pages (K and V, all layers, with their scales) fit in ``budget_bytes``.

    >>> pages_for_budget(1 << 20, num_layers=2, num_kv_heads=2, page_size=16, head_dim=64,
    ...                  dtype=jnp.bfloat16)
    64
    >>> pages_for_budget(1 << 20, num_layers=2, num_kv_heads=2, page_size=16, head_dim=64,
    ...                  dtype="fp8")
    120

    Raises:
      ValueError: the budget is below one page, or a size is not a positive int.
    """
    checks.check_sizes(
        num_layers=num_layers, num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim
    )
    dtype = checks.pool_dtype(dtype)
    scale_bytes = quantize.SCALE_DTYPE.itemsize if quantize.is_quantized(dtype) else 0
    token_bytes = head_dim * dtype.itemsize + scale_bytes
    page_bytes = 2 * num_layers * num_kv_heads * page_size * token_bytes
    num_pages = int(budget_bytes) // page_bytes
    if num_pages < 1:
        raise ValueError(
            f"{budget_bytes=} must hold at least one page of {page_bytes} bytes "
            f"(2 * L * K * C * (H * itemsize + scale bytes))"
        )
    return num_pages


def _page_offset(cache: PagedKVCache, slots_T: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Slots -> (page, offset); slot -1 (or out of range) -> page P, which scatters drop."""
    C, P = cache.page_size, cache.num_pages
    slots_T = slots_T.astype(jnp.int32)
    valid = (slots_T >= 0) & (slots_T < P * C)
    page = jnp.where(valid, slots_T // C, P)
    offset = jnp.where(valid, slots_T % C, 0)
    return page, offset


def _drop_invalid_pages(page_ids: jax.Array, num_pages: int) -> jax.Array:
    page_ids = page_ids.astype(jnp.int32)
    return jnp.where((page_ids >= 0) & (page_ids < num_pages), page_ids, num_pages)


# ----------------------------------------------------------------------------- jitted updates


def _encode(cache: PagedKVCache, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """New K or V [..., K, H] as the pool stores it: (codes, f32 scales [..., K]) for a
    quantized pool (``quantize.quantize_tokens``), else (x in the pool dtype, None)."""
    if cache.quantized:
        return quantize.quantize_tokens(x, cache.dtype)
    return x.astype(cache.dtype), None


def _updated(cache: PagedKVCache, index, k, v) -> PagedKVCache:
    """``cache`` with the new K and V (``[..., K, H]``, encoded with ``_encode``) set at
    ``index`` of the pages (and, quantized, of the scales); out-of-range rows dropped.
    ``index`` maps ``[L, K, P, C, H]`` pages and ``[L, K, P, C]`` scales alike."""
    kq, ks = _encode(cache, k)
    vq, vs = _encode(cache, v)
    scales = {}
    if cache.quantized:
        scales = dict(
            k_scale=cache.k_scale.at[index].set(ks, mode="drop"),
            v_scale=cache.v_scale.at[index].set(vs, mode="drop"),
        )
    return PagedKVCache(
        k_pages=cache.k_pages.at[index].set(kq, mode="drop"),
        v_pages=cache.v_pages.at[index].set(vq, mode="drop"),
        **scales,
    )


@functools.partial(jax.jit, donate_argnums=0)
def _write_kv(cache: PagedKVCache, k_LTKH, v_LTKH, slots_T) -> PagedKVCache:
    page_T, offset_T = _page_offset(cache, slots_T)
    # Advanced indices at dims 2, 3 (adjacent): the update is [L, K, T, H] ([L, K, T] scales).
    index = (slice(None), slice(None), page_T, offset_T)
    return _updated(cache, index, k_LTKH.transpose(0, 2, 1, 3), v_LTKH.transpose(0, 2, 1, 3))


def _write_kv_layer_impl(cache: PagedKVCache, layer, k_TKH, v_TKH, slots_T) -> PagedKVCache:
    page_T, offset_T = _page_offset(cache, slots_T)
    layer = jnp.asarray(layer, jnp.int32)
    layer = jnp.where((layer >= 0) & (layer < cache.num_layers), layer, cache.num_layers)
    layer_T = jnp.broadcast_to(layer, page_T.shape)
    # Advanced indices at dims 0, 2, 3 (split by a slice) go first: the update is [T, K, H]
    # ([T, K] scales).
    return _updated(cache, (layer_T, slice(None), page_T, offset_T), k_TKH, v_TKH)


_write_kv_layer = jax.jit(_write_kv_layer_impl, donate_argnums=0)


def _map_pages(cache: PagedKVCache, fn) -> PagedKVCache:
    """``fn`` applied to the pages and (quantized) the scales, page axis 2 in each."""
    return jax.tree.map(fn, cache)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_pages(cache: PagedKVCache, pairs_M2) -> PagedKVCache:
    pairs_M2 = pairs_M2.astype(jnp.int32)
    P = cache.num_pages
    valid = jnp.all((pairs_M2 >= 0) & (pairs_M2 < P), axis=1)
    src_M = jnp.where(valid, pairs_M2[:, 0], 0)
    dst_M = jnp.where(valid, pairs_M2[:, 1], P)

    def copy(pages):  # the scales move with their pages
        return pages.at[:, :, dst_M].set(pages[:, :, src_M], mode="drop")

    return _map_pages(cache, copy)


@jax.jit
def _gather_pages(cache: PagedKVCache, page_ids_M) -> tuple[jax.Array, ...]:
    ids = _drop_invalid_pages(page_ids_M, cache.num_pages)

    def take(pages):
        return jnp.take(pages, ids, axis=2, mode="fill", fill_value=0)

    got = _map_pages(cache, take)
    return (got.k_pages, got.v_pages, *got.scales.values())


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_pages(
    cache: PagedKVCache, page_ids_M, k_LKMCH, v_LKMCH, k_scale=None, v_scale=None
) -> PagedKVCache:
    ids = _drop_invalid_pages(page_ids_M, cache.num_pages)
    if cache.quantized and k_scale is None:  # floating pages into a quantized pool
        k_LKMCH, k_scale = quantize.quantize_tokens(k_LKMCH, cache.dtype)
        v_LKMCH, v_scale = quantize.quantize_tokens(v_LKMCH, cache.dtype)
    pages = PagedKVCache(
        k_pages=k_LKMCH.astype(cache.dtype), v_pages=v_LKMCH.astype(cache.dtype),
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return jax.tree.map(lambda old, new: old.at[:, :, ids].set(new, mode="drop"), cache, pages)


# ----------------------------------------------------------------------------- public API


def write_kv(
    cache: PagedKVCache,
    k_LTKH: jax.Array,
    v_LTKH: jax.Array,
    slots_T: jax.Array,
    *,
    validate: bool = True,
) -> PagedKVCache:
    """Writes T new tokens' keys and values of every layer into their slots (in place).

    ``cache`` is donated: do not use it after the call.

    Args:
      cache: the pool, [L, K, P, C, H].
      k_LTKH: [L, T, K, H] floating keys (cast to the cache dtype; a quantized pool
        quantizes them, one scale a token and head: ``quantize.quantize_tokens``).
      v_LTKH: [L, T, K, H] values.
      slots_T: i32[T], ``page * C + offset`` per token; ``-1`` skips the token.
      validate: check concrete ``slots_T`` values eagerly (in range, distinct).

    Returns:
      The updated cache.

    Raises:
      ValueError: wrong shapes or dtypes, or a concrete slot outside ``[-1, P * C)`` or
        repeated.

    >>> cache = PagedKVCache.create(1, 1, 2, 2, 4, jnp.float32)
    >>> k = jnp.ones((1, 2, 1, 4), jnp.float32)
    >>> cache = write_kv(cache, k, 2 * k, np.array([3, -1], np.int32))
    >>> cache.v_pages[0, 0, 1, 1].tolist()
    [2.0, 2.0, 2.0, 2.0]
    >>> q8 = write_kv(PagedKVCache.create(1, 1, 2, 2, 4, "int8"), k, 2 * k, np.array([3, -1]))
    >>> q8.v_pages[0, 0, 1, 1].tolist(), q8.v_scale[0, 0, 1, 1].tolist()
    ([127, 127, 127, 127], 0.015748031437397003)
    """
    L, K, _, _, H = cache.k_pages.shape
    slots_T = checks.check_int_vector("slots_T", slots_T)
    T = np.shape(slots_T)[0]
    checks.check_kv("k_LTKH", k_LTKH, (L, T, K, H), "L, T, K, H", pool=cache.dtype)
    checks.check_kv("v_LTKH", v_LTKH, (L, T, K, H), "L, T, K, H", pool=cache.dtype)
    checks.check_range("slots_T", slots_T, cache.num_slots, validate)
    checks.check_distinct_slots(slots_T, validate)
    return _write_kv(cache, k_LTKH, v_LTKH, slots_T)


def write_kv_layer(
    cache: PagedKVCache,
    layer: int | jax.Array,
    k_TKH: jax.Array,
    v_TKH: jax.Array,
    slots_T: jax.Array,
    *,
    validate: bool = True,
) -> PagedKVCache:
    """Writes T new tokens' keys and values of one layer into their slots (in place).

    Usable inside a jitted model's layer loop: ``layer`` may be a traced i32 scalar, and only
    the T written rows are touched (the layer is never sliced out of the pool). Called
    eagerly, ``cache`` is donated.

    Args:
      cache: the pool, [L, K, P, C, H].
      layer: the layer index, an int or i32[].
      k_TKH: [T, K, H] floating keys (cast to the cache dtype; a quantized pool quantizes
        them, one scale a token and head: ``quantize.quantize_tokens``).
      v_TKH: [T, K, H] values.
      slots_T: i32[T], ``page * C + offset``; ``-1`` skips the token.
      validate: check concrete ``layer`` and ``slots_T`` values eagerly (slots in range
        and distinct).

    Returns:
      The updated cache.

    Raises:
      ValueError: wrong shapes or dtypes, a concrete slot outside ``[-1, P * C)`` or
        repeated, or a concrete layer outside ``[0, L)``.
    """
    L, K, _, _, H = cache.k_pages.shape
    slots_T = checks.check_int_vector("slots_T", slots_T)
    if np.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar, got shape {np.shape(layer)}")
    T = np.shape(slots_T)[0]
    checks.check_kv("k_TKH", k_TKH, (T, K, H), "T, K, H", pool=cache.dtype)
    checks.check_kv("v_TKH", v_TKH, (T, K, H), "T, K, H", pool=cache.dtype)
    checks.check_range("slots_T", slots_T, cache.num_slots, validate)
    checks.check_distinct_slots(slots_T, validate)
    if validate:
        layer_value = checks.concrete(layer)
        if layer_value is not None and not 0 <= int(layer_value) < L:
            raise ValueError(f"layer={int(layer_value)} must lie in [0, {L})")
    return _write_kv_layer(cache, layer, k_TKH, v_TKH, slots_T)


def copy_pages(cache: PagedKVCache, pairs_M2: jax.Array, *, validate: bool = True) -> PagedKVCache:
    """Copies pages ``src -> dst`` across all layers and heads (in place; ``cache`` donated).

    All sources are read before any destination is written. Rows holding a ``-1`` are
    skipped (pad ``pairs_M2`` to a bucketed M to avoid recompiles).

    Args:
      cache: the pool, [L, K, P, C, H] (a quantized pool's scales move with their pages).
      pairs_M2: i32[M, 2] ``(src, dst)`` page ids.
      validate: check concrete pairs eagerly (ids in ``[-1, P)``, destinations distinct).

    Returns:
      The updated cache.

    Raises:
      ValueError: ``pairs_M2`` is not [M, 2] integers, a concrete page id is outside
        ``[-1, P)``, or a destination repeats.

    >>> cache = PagedKVCache.create(1, 1, 3, 2, 2, jnp.float32)
    >>> cache = write_kv(cache, jnp.ones((1, 1, 1, 2)), jnp.ones((1, 1, 1, 2)), np.array([0]))
    >>> cache = copy_pages(cache, np.array([[0, 2], [-1, -1]], np.int32))
    >>> cache.k_pages[0, 0, 2, 0].tolist()
    [1.0, 1.0]
    """
    pairs_M2 = checks.check_int_vector("pairs_M2", pairs_M2, ndim=2)
    if np.shape(pairs_M2)[1] != 2:
        raise ValueError(f"pairs_M2 must have shape [M, 2], got {np.shape(pairs_M2)}")
    checks.check_range("pairs_M2", pairs_M2, cache.num_pages, validate)
    if validate:
        pairs = checks.concrete(pairs_M2)
        if pairs is not None:
            dst = pairs[np.all(pairs >= 0, axis=1), 1]
            if len(np.unique(dst)) != len(dst):
                raise ValueError(f"pairs_M2 destinations must be distinct, got {dst.tolist()}")
    return _copy_pages(cache, pairs_M2)


def gather_pages(
    cache: PagedKVCache, page_ids_M: jax.Array, *, validate: bool = True
) -> tuple[jax.Array, ...]:
    """Reads M pages of every layer and head (to swap them out to host memory).

    Args:
      cache: the pool, [L, K, P, C, H] (not donated).
      page_ids_M: i32[M]; ``-1`` rows read as zeros.
      validate: check concrete ids eagerly.

    Returns:
      ``(k, v)``, each [L, K, M, C, H]; a quantized pool's ``(k, v, k_scale, v_scale)``, the
      codes as stored and the scales [L, K, M, C] (``scatter_pages(cache, ids, *parts)`` writes
      them back). Move them to the host with ``np.asarray`` or ``jax.device_put``.

    Raises:
      ValueError: ``page_ids_M`` is not an integer vector, or a concrete id is outside
        ``[-1, P)``.
    """
    page_ids_M = checks.check_int_vector("page_ids_M", page_ids_M)
    checks.check_range("page_ids_M", page_ids_M, cache.num_pages, validate)
    return _gather_pages(cache, page_ids_M)


def scatter_pages(
    cache: PagedKVCache,
    page_ids_M: jax.Array,
    k_LKMCH: jax.Array,
    v_LKMCH: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    validate: bool = True,
) -> PagedKVCache:
    """Writes M whole pages of every layer and head (swap-in); ``cache`` is donated.

    Args:
      cache: the pool, [L, K, P, C, H].
      page_ids_M: i32[M] destination pages; ``-1`` rows are skipped.
      k_LKMCH: [L, K, M, C, H] keys, e.g. from `gather_pages`: floating (a quantized pool
        quantizes them), or a quantized pool's own codes with ``k_scale``.
      v_LKMCH: [L, K, M, C, H] values, like ``k_LKMCH``.
      k_scale: quantized pools: f32[L, K, M, C] scales of the codes ``k_LKMCH``, as
        `gather_pages` returns them; None for floating pages.
      v_scale: like ``k_scale``, for ``v_LKMCH``.
      validate: check concrete ids eagerly (in ``[-1, P)``, distinct).

    Returns:
      The updated cache.

    Raises:
      ValueError: wrong shapes or dtypes, scales with an unquantized pool (or only one of
        them), a concrete id outside ``[-1, P)``, or a repeated id.
    """
    L, K, _, C, H = cache.k_pages.shape
    page_ids_M = checks.check_int_vector("page_ids_M", page_ids_M)
    M = np.shape(page_ids_M)[0]
    if (k_scale is None) != (v_scale is None) or (k_scale is not None and not cache.quantized):
        raise ValueError(
            "k_scale and v_scale go together, and only with a quantized pool's codes (pool "
            f"dtype {cache.dtype})"
        )
    codes = None if k_scale is None else cache.dtype
    checks.check_kv("k_LKMCH", k_LKMCH, (L, K, M, C, H), "L, K, M, C, H", codes, pool=cache.dtype)
    checks.check_kv("v_LKMCH", v_LKMCH, (L, K, M, C, H), "L, K, M, C, H", codes, pool=cache.dtype)
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None and (tuple(np.shape(sc)) != (L, K, M, C) or sc.dtype != np.float32):
            raise ValueError(
                f"{name} must be float32 [L, K, M, C] = {(L, K, M, C)}, got {np.shape(sc)} "
                f"{sc.dtype}"
            )
    checks.check_range("page_ids_M", page_ids_M, cache.num_pages, validate)
    if validate:
        ids = checks.concrete(page_ids_M)
        if ids is not None:
            ids = ids[ids >= 0]
            if len(np.unique(ids)) != len(ids):
                raise ValueError(f"page_ids_M must be distinct, got {ids.tolist()}")
    return _scatter_pages(cache, page_ids_M, k_LKMCH, v_LKMCH, k_scale, v_scale)
