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
    jax.tree_util.register_dataclass, data_fields=["k_pages", "v_pages"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedKVCache:
    """The K/V page pool of every layer.

    Attributes:
      k_pages: [L, K, P, C, H] keys (layers, KV heads, pool pages, tokens per page, head dim).
      v_pages: [L, K, P, C, H] values, same shape and dtype as ``k_pages``.

    >>> cache = PagedKVCache.create(num_layers=2, num_kv_heads=1, num_pages=4, page_size=8,
    ...                             head_dim=16, dtype=jnp.bfloat16)
    >>> cache.k_pages.shape, cache.num_slots, cache.bytes
    ((2, 1, 4, 8, 16), 32, 4096)
    """

    k_pages: jax.Array
    v_pages: jax.Array

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

        Raises:
          ValueError: a size is not a positive int, or ``dtype`` is not a float dtype.
        """
        _check_sizes(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            num_pages=num_pages,
            page_size=page_size,
            head_dim=head_dim,
        )
        dtype = _float_dtype(dtype)
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        return cls(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype))

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
        """The largest pool (K and V together) that fits in ``budget_bytes``."""
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
    def num_slots(self) -> int:
        """Token slots of the pool: ``P * C``."""
        return self.num_pages * self.page_size

    @property
    def bytes(self) -> int:
        """Bytes of K and V together."""
        return 2 * self.k_pages.size * self.k_pages.dtype.itemsize

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
    """How many pages (K and V, all layers) fit in ``budget_bytes``.

    >>> pages_for_budget(1 << 20, num_layers=2, num_kv_heads=2, page_size=16, head_dim=64,
    ...                  dtype=jnp.bfloat16)
    64

    Raises:
      ValueError: the budget is below one page, or a size is not a positive int.
    """
    _check_sizes(
        num_layers=num_layers, num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim
    )
    dtype = _float_dtype(dtype)
    page_bytes = 2 * num_layers * num_kv_heads * page_size * head_dim * dtype.itemsize
    num_pages = int(budget_bytes) // page_bytes
    if num_pages < 1:
        raise ValueError(
            f"{budget_bytes=} must hold at least one page of {page_bytes} bytes "
            f"(2 * L * K * C * H * itemsize)"
        )
    return num_pages


# ----------------------------------------------------------------------------- validation


def _check_sizes(**sizes: int) -> None:
    bad = [
        f"{k}={v!r}"
        for k, v in sizes.items()
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1
    ]
    if bad:
        raise ValueError(f"{', '.join(bad)}: sizes must be positive ints")


def _float_dtype(dtype: Any) -> np.dtype:
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{dtype=} must be a floating dtype")
    return dtype


def _concrete(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array if its value is known now, else ``None`` (a tracer)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_int_vector(name: str, x: Any, ndim: int = 1) -> Any:
    """Checks rank and integer dtype; returns ``x`` (a list or tuple as a NumPy array)."""
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
    if x.ndim != ndim or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of rank {ndim}, got {x.shape} {x.dtype}")
    return x


def _check_range(name: str, x: Any, hi: int, validate: bool) -> None:
    """Eagerly checks that concrete ``x`` lies in ``[-1, hi)``."""
    if not validate:
        return
    values = _concrete(x)
    if values is None or values.size == 0:
        return
    lo_v, hi_v = int(values.min()), int(values.max())
    if lo_v < -1 or hi_v >= hi:
        raise ValueError(
            f"{name} must lie in [-1, {hi}) (-1 = skip), got values in [{lo_v}, {hi_v}]"
        )


def _check_distinct_slots(x: Any, validate: bool) -> None:
    """Eagerly checks that the written (non ``-1``) slots of concrete ``x`` are distinct."""
    values = _concrete(x) if validate else None
    if values is None:
        return
    written = values[values >= 0]
    unique, counts = np.unique(written, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"slots_T must be distinct (two tokens written to one slot leave either one), "
            f"repeated: {unique[counts > 1][:8].tolist()}"
        )


def _check_kv(name: str, x: Any, expected: tuple[int, ...], letters: str) -> None:
    if tuple(np.shape(x)) != expected:
        raise ValueError(f"{name} must have shape [{letters}] = {expected}, got {np.shape(x)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got {x.dtype}")


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


@functools.partial(jax.jit, donate_argnums=0)
def _write_kv(cache: PagedKVCache, k_LTKH, v_LTKH, slots_T) -> PagedKVCache:
    page_T, offset_T = _page_offset(cache, slots_T)
    # Advanced indices at dims 2, 3 (adjacent): the update is [L, K, T, H].
    k_LKTH = k_LTKH.astype(cache.dtype).transpose(0, 2, 1, 3)
    v_LKTH = v_LTKH.astype(cache.dtype).transpose(0, 2, 1, 3)
    return PagedKVCache(
        k_pages=cache.k_pages.at[:, :, page_T, offset_T].set(k_LKTH, mode="drop"),
        v_pages=cache.v_pages.at[:, :, page_T, offset_T].set(v_LKTH, mode="drop"),
    )


def _write_kv_layer_impl(cache: PagedKVCache, layer, k_TKH, v_TKH, slots_T) -> PagedKVCache:
    page_T, offset_T = _page_offset(cache, slots_T)
    layer = jnp.asarray(layer, jnp.int32)
    layer = jnp.where((layer >= 0) & (layer < cache.num_layers), layer, cache.num_layers)
    layer_T = jnp.broadcast_to(layer, page_T.shape)
    # Advanced indices at dims 0, 2, 3 (split by a slice) go first: the update is [T, K, H].
    return PagedKVCache(
        k_pages=cache.k_pages.at[layer_T, :, page_T, offset_T].set(
            k_TKH.astype(cache.dtype), mode="drop"
        ),
        v_pages=cache.v_pages.at[layer_T, :, page_T, offset_T].set(
            v_TKH.astype(cache.dtype), mode="drop"
        ),
    )


_write_kv_layer = jax.jit(_write_kv_layer_impl, donate_argnums=0)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_pages(cache: PagedKVCache, pairs_M2) -> PagedKVCache:
    pairs_M2 = pairs_M2.astype(jnp.int32)
    P = cache.num_pages
    valid = jnp.all((pairs_M2 >= 0) & (pairs_M2 < P), axis=1)
    src_M = jnp.where(valid, pairs_M2[:, 0], 0)
    dst_M = jnp.where(valid, pairs_M2[:, 1], P)

    def copy(pages):
        return pages.at[:, :, dst_M].set(pages[:, :, src_M], mode="drop")

    return PagedKVCache(k_pages=copy(cache.k_pages), v_pages=copy(cache.v_pages))


@jax.jit
def _gather_pages(cache: PagedKVCache, page_ids_M) -> tuple[jax.Array, jax.Array]:
    ids = _drop_invalid_pages(page_ids_M, cache.num_pages)

    def take(pages):
        return jnp.take(pages, ids, axis=2, mode="fill", fill_value=0)

    return take(cache.k_pages), take(cache.v_pages)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_pages(cache: PagedKVCache, page_ids_M, k_LKMCH, v_LKMCH) -> PagedKVCache:
    ids = _drop_invalid_pages(page_ids_M, cache.num_pages)
    return PagedKVCache(
        k_pages=cache.k_pages.at[:, :, ids].set(k_LKMCH.astype(cache.dtype), mode="drop"),
        v_pages=cache.v_pages.at[:, :, ids].set(v_LKMCH.astype(cache.dtype), mode="drop"),
    )


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
      k_LTKH: [L, T, K, H] keys (cast to the cache dtype).
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
    """
    L, K, _, _, H = cache.k_pages.shape
    slots_T = _check_int_vector("slots_T", slots_T)
    T = np.shape(slots_T)[0]
    _check_kv("k_LTKH", k_LTKH, (L, T, K, H), "L, T, K, H")
    _check_kv("v_LTKH", v_LTKH, (L, T, K, H), "L, T, K, H")
    _check_range("slots_T", slots_T, cache.num_slots, validate)
    _check_distinct_slots(slots_T, validate)
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
      k_TKH: [T, K, H] keys (cast to the cache dtype).
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
    slots_T = _check_int_vector("slots_T", slots_T)
    if np.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar, got shape {np.shape(layer)}")
    T = np.shape(slots_T)[0]
    _check_kv("k_TKH", k_TKH, (T, K, H), "T, K, H")
    _check_kv("v_TKH", v_TKH, (T, K, H), "T, K, H")
    _check_range("slots_T", slots_T, cache.num_slots, validate)
    _check_distinct_slots(slots_T, validate)
    if validate:
        layer_value = _concrete(layer)
        if layer_value is not None and not 0 <= int(layer_value) < L:
            raise ValueError(f"layer={int(layer_value)} must lie in [0, {L})")
    return _write_kv_layer(cache, layer, k_TKH, v_TKH, slots_T)


def copy_pages(cache: PagedKVCache, pairs_M2: jax.Array, *, validate: bool = True) -> PagedKVCache:
    """Copies pages ``src -> dst`` across all layers and heads (in place; ``cache`` donated).

    All sources are read before any destination is written. Rows holding a ``-1`` are
    skipped (pad ``pairs_M2`` to a bucketed M to avoid recompiles).

    Args:
      cache: the pool, [L, K, P, C, H].
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
    pairs_M2 = _check_int_vector("pairs_M2", pairs_M2, ndim=2)
    if np.shape(pairs_M2)[1] != 2:
        raise ValueError(f"pairs_M2 must have shape [M, 2], got {np.shape(pairs_M2)}")
    _check_range("pairs_M2", pairs_M2, cache.num_pages, validate)
    if validate:
        pairs = _concrete(pairs_M2)
        if pairs is not None:
            dst = pairs[np.all(pairs >= 0, axis=1), 1]
            if len(np.unique(dst)) != len(dst):
                raise ValueError(f"pairs_M2 destinations must be distinct, got {dst.tolist()}")
    return _copy_pages(cache, pairs_M2)


def gather_pages(
    cache: PagedKVCache, page_ids_M: jax.Array, *, validate: bool = True
) -> tuple[jax.Array, jax.Array]:
    """Reads M pages of every layer and head (to swap them out to host memory).

    Args:
      cache: the pool, [L, K, P, C, H] (not donated).
      page_ids_M: i32[M]; ``-1`` rows read as zeros.
      validate: check concrete ids eagerly.

    Returns:
      ``(k, v)``, each [L, K, M, C, H]; move them to the host with ``np.asarray`` or
      ``jax.device_put``.

    Raises:
      ValueError: ``page_ids_M`` is not an integer vector, or a concrete id is outside
        ``[-1, P)``.
    """
    page_ids_M = _check_int_vector("page_ids_M", page_ids_M)
    _check_range("page_ids_M", page_ids_M, cache.num_pages, validate)
    return _gather_pages(cache, page_ids_M)


def scatter_pages(
    cache: PagedKVCache,
    page_ids_M: jax.Array,
    k_LKMCH: jax.Array,
    v_LKMCH: jax.Array,
    *,
    validate: bool = True,
) -> PagedKVCache:
    """Writes M whole pages of every layer and head (swap-in); ``cache`` is donated.

    Args:
      cache: the pool, [L, K, P, C, H].
      page_ids_M: i32[M] destination pages; ``-1`` rows are skipped.
      k_LKMCH: [L, K, M, C, H] keys, e.g. from `gather_pages`.
      v_LKMCH: [L, K, M, C, H] values.
      validate: check concrete ids eagerly (in ``[-1, P)``, distinct).

    Returns:
      The updated cache.

    Raises:
      ValueError: wrong shapes, a concrete id outside ``[-1, P)``, or a repeated id.
    """
    L, K, _, C, H = cache.k_pages.shape
    page_ids_M = _check_int_vector("page_ids_M", page_ids_M)
    M = np.shape(page_ids_M)[0]
    _check_kv("k_LKMCH", k_LKMCH, (L, K, M, C, H), "L, K, M, C, H")
    _check_kv("v_LKMCH", v_LKMCH, (L, K, M, C, H), "L, K, M, C, H")
    _check_range("page_ids_M", page_ids_M, cache.num_pages, validate)
    if validate:
        ids = _concrete(page_ids_M)
        if ids is not None:
            ids = ids[ids >= 0]
            if len(np.unique(ids)) != len(ids):
                raise ValueError(f"page_ids_M must be distinct, got {ids.tolist()}")
    return _scatter_pages(cache, page_ids_M, k_LKMCH, v_LKMCH)
