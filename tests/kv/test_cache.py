"""PagedKVCache: creation, sizing, donated in-place updates, round trips, validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import dense_attention
from _tolerances import assert_close

import jpaged
from jpaged import (
    BlockAllocator,
    PagedKVCache,
    copy_pages,
    gather_pages,
    pages_for_budget,
    scatter_pages,
    write_kv,
    write_kv_layer,
)
from jpaged.kv import cache as _cache

L, K, P, C, H = 2, 2, 16, 4, 8
DTYPES = [jnp.float32, jnp.bfloat16]


def _poisoned_cache(dtype, num_pages: int = P) -> PagedKVCache:
    """A pool full of NaN: any slot that is read but was never written shows up."""
    shape = (L, K, num_pages, C, H)
    return PagedKVCache(
        k_pages=jnp.full(shape, jnp.nan, dtype), v_pages=jnp.full(shape, jnp.nan, dtype)
    )


def _rand(rng, shape, dtype):
    return np.asarray(jnp.asarray(rng.standard_normal(shape, np.float32), dtype))


# ----------------------------------------------------------------------------- creation


def test_create_and_properties():
    cache = PagedKVCache.create(3, 2, 10, 16, 64, jnp.bfloat16)
    assert cache.k_pages.shape == cache.v_pages.shape == (3, 2, 10, 16, 64)
    assert (cache.num_layers, cache.num_kv_heads, cache.num_pages) == (3, 2, 10)
    assert (cache.page_size, cache.head_dim, cache.num_slots) == (16, 64, 160)
    assert cache.dtype == jnp.bfloat16
    assert cache.bytes == 2 * 3 * 2 * 10 * 16 * 64 * 2
    assert cache.bytes_per_page * cache.num_pages == cache.bytes
    assert not np.any(np.asarray(cache.k_pages, np.float32))


def test_pages_for_budget_and_create_from_budget():
    page_bytes = 2 * 3 * 2 * 16 * 64 * 2  # K and V, L=3, K=2, C=16, H=64, bf16
    assert pages_for_budget(10 * page_bytes + 5, 3, 2, 16, 64, jnp.bfloat16) == 10
    assert pages_for_budget(10 * page_bytes, 3, 2, 16, 64, jnp.float32) == 5
    cache = PagedKVCache.create_from_budget(7 * page_bytes, 3, 2, 16, 64, jnp.bfloat16)
    assert cache.num_pages == 7 and cache.bytes == 7 * page_bytes
    with pytest.raises(ValueError, match="budget_bytes=100 must hold at least one page"):
        pages_for_budget(100, 3, 2, 16, 64, jnp.bfloat16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_pages": 0}, r"num_pages=0.*positive ints"),
        ({"head_dim": 2.0}, r"head_dim=2.0.*positive ints"),
        ({"dtype": jnp.int32}, r"dtype=dtype\('int32'\) must be a floating dtype"),
    ],
)
def test_create_rejects_bad_arguments(kwargs, match):
    args = {"num_layers": 1, "num_kv_heads": 1, "num_pages": 2, "page_size": 4, "head_dim": 8}
    with pytest.raises(ValueError, match=match):
        PagedKVCache.create(**(args | kwargs))


def test_mismatched_pages_rejected():
    with pytest.raises(ValueError, match=r"same \[L, K, P, C, H\] shape and dtype"):
        PagedKVCache(k_pages=jnp.zeros((1, 1, 2, 4, 8)), v_pages=jnp.zeros((1, 1, 3, 4, 8)))


def test_cache_is_a_pytree():
    cache = PagedKVCache.create(1, 1, 2, 4, 8, jnp.float32)
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 2
    again = jax.tree.unflatten(treedef, leaves)
    assert isinstance(again, PagedKVCache) and again.k_pages is cache.k_pages


# ----------------------------------------------------------------------------- round trips


def _shuffled_allocator(rng) -> BlockAllocator:
    """An allocator whose free list is in random order, so block tables are permuted."""
    alloc = BlockAllocator(P, C)
    for page in range(P):
        alloc.allocate(("tmp", page), 1)
    for page in rng.permutation(P).tolist():
        alloc.free(("tmp", page))
    return alloc


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_round_trip_through_block_tables(dtype):
    """Writes whole sequences of lengths 0, 1, C-1, C, C+1 and long through the allocator's
    (permuted) slots, then reads every token back through the block tables."""
    rng = np.random.default_rng(0)
    lengths = [0, 1, C - 1, C, C + 1, 8 * C + 3]
    alloc = _shuffled_allocator(rng)
    for b in rng.permutation(len(lengths)).tolist():
        alloc.allocate(b, lengths[b])
    assert sorted(alloc.block_table(5)) != alloc.block_table(5)  # permuted, not a run
    T = sum(lengths)
    slots = np.concatenate([alloc.slots(b, 0, n) for b, n in enumerate(lengths)])
    perm = rng.permutation(T)  # token order does not matter
    k = _rand(rng, (L, T, K, H), dtype)
    v = _rand(rng, (L, T, K, H), dtype)
    cache = write_kv(_poisoned_cache(dtype), k[:, perm], v[:, perm], slots[perm])
    k_pages = np.asarray(cache.k_pages, np.float32)
    v_pages = np.asarray(cache.v_pages, np.float32)
    start = 0
    for b, n in enumerate(lengths):
        table = np.asarray(alloc.block_table(b), np.int64)
        pos = np.arange(n)
        got_k = k_pages[:, :, table[pos // C], pos % C]  # [L, K, n, H]
        got_v = v_pages[:, :, table[pos // C], pos % C]
        want = slice(start, start + n)
        np.testing.assert_array_equal(got_k, k[:, want].astype(np.float32).transpose(0, 2, 1, 3))
        np.testing.assert_array_equal(got_v, v[:, want].astype(np.float32).transpose(0, 2, 1, 3))
        start += n
    # Exactly the written slots changed; everything else is still NaN.
    written = np.zeros(P * C, bool)
    written[slots] = True
    flat = k_pages.reshape(L, K, P * C, H)
    assert not np.isnan(flat[:, :, written]).any()
    assert np.isnan(flat[:, :, ~written]).all()


def test_write_kv_skips_minus_one_slots():
    rng = np.random.default_rng(1)
    k = _rand(rng, (L, 3, K, H), jnp.float32)
    cache = write_kv(_poisoned_cache(jnp.float32), k, k, np.array([-1, 9, -1], np.int32))
    flat = np.asarray(cache.k_pages).reshape(L, K, P * C, H)
    np.testing.assert_array_equal(flat[:, :, 9], k[:, 1])
    assert np.isnan(np.delete(flat, 9, axis=2)).all()


@jax.jit
def _model_like_loop(cache, k_LTKH, v_LTKH, slots_T):
    """A scanned layer loop writing each layer with a traced layer index."""

    def body(cache, inputs):
        layer, k_TKH, v_TKH = inputs
        return write_kv_layer(cache, layer, k_TKH, v_TKH, slots_T), None

    cache, _ = jax.lax.scan(body, cache, (jnp.arange(L), k_LTKH, v_LTKH))
    return cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_layer_matches_write_kv(dtype):
    rng = np.random.default_rng(2)
    T = 7
    slots = rng.permutation(P * C)[:T].astype(np.int32)
    slots[3] = -1
    k = _rand(rng, (L, T, K, H), dtype)
    v = _rand(rng, (L, T, K, H), dtype)
    want = write_kv(_poisoned_cache(dtype), k, v, slots)
    traced = _model_like_loop(_poisoned_cache(dtype), jnp.asarray(k), jnp.asarray(v), slots)
    eager = _poisoned_cache(dtype)
    for layer in range(L):
        eager = write_kv_layer(eager, layer, k[layer], v[layer], slots)
    for got in (traced, eager):
        for a, b in ((got.k_pages, want.k_pages), (got.v_pages, want.v_pages)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_write_kv_layer_in_a_scan_does_not_copy_the_pool():
    cache = PagedKVCache.create(L, K, 64, C, H, jnp.float32)
    k = jnp.ones((L, 3, K, H), jnp.float32)
    jitted = jax.jit(_model_like_loop.__wrapped__, donate_argnums=0)
    stats = jitted.lower(cache, k, k, jnp.zeros(3, jnp.int32)).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= cache.bytes
    assert stats.temp_size_in_bytes < cache.bytes // 8, (stats.temp_size_in_bytes, cache.bytes)


def test_write_kv_layer_touches_only_its_layer():
    rng = np.random.default_rng(3)
    k = _rand(rng, (2, K, H), jnp.float32)
    cache = write_kv_layer(_poisoned_cache(jnp.float32), 1, k, k, np.array([0, 5], np.int32))
    pages = np.asarray(cache.k_pages)
    assert np.isnan(pages[0]).all()
    np.testing.assert_array_equal(pages[1, :, 1, 1], k[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_pages(dtype):
    rng = np.random.default_rng(4)
    shape = (L, K, P, C, H)
    k0, v0 = _rand(rng, shape, dtype), _rand(rng, shape, dtype)
    cache = PagedKVCache(k_pages=jnp.asarray(k0), v_pages=jnp.asarray(v0))
    # 3 -> 7 and 7 -> 2 in one call: sources are read before destinations are written.
    pairs = np.array([[3, 7], [-1, -1], [7, 2], [5, -1], [-1, 9]], np.int32)
    cache = copy_pages(cache, pairs)
    want_k, want_v = k0.copy(), v0.copy()
    for src, dst in [(3, 7), (7, 2)]:
        want_k[:, :, dst], want_v[:, :, dst] = k0[:, :, src], v0[:, :, src]
    np.testing.assert_array_equal(np.asarray(cache.k_pages), want_k)
    np.testing.assert_array_equal(np.asarray(cache.v_pages), want_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_round_trip(dtype):
    """Swap three pages out to host memory and back into other pages."""
    rng = np.random.default_rng(5)
    shape = (L, K, P, C, H)
    k0, v0 = _rand(rng, shape, dtype), _rand(rng, shape, dtype)
    cache = PagedKVCache(k_pages=jnp.asarray(k0), v_pages=jnp.asarray(v0))
    k_host, v_host = jax.device_get(gather_pages(cache, np.array([4, -1, 11, 0], np.int32)))
    assert k_host.shape == (L, K, 4, C, H)
    np.testing.assert_array_equal(k_host[:, :, [0, 2, 3]], k0[:, :, [4, 11, 0]])
    assert not np.asarray(k_host[:, :, 1], np.float32).any()  # -1 reads zeros
    dst = np.array([9, -1, 1, 14], np.int32)
    cache = scatter_pages(cache, dst, k_host, v_host)
    want_k, want_v = k0.copy(), v0.copy()
    for i, d in enumerate(dst.tolist()):
        if d >= 0:
            want_k[:, :, d], want_v[:, :, d] = k_host[:, :, i], v_host[:, :, i]
    np.testing.assert_array_equal(np.asarray(cache.k_pages), want_k)
    np.testing.assert_array_equal(np.asarray(cache.v_pages), want_v)


# ----------------------------------------------------------------------------- donation


def _update_calls(dtype=jnp.float32):
    """(name, jitted function, args) for every donated update, with fixed shapes."""
    k_LTKH = jnp.ones((L, 5, K, H), dtype)
    slots = jnp.array([0, 1, 2, -1, 40], jnp.int32)
    pairs = jnp.array([[0, 3], [-1, -1]], jnp.int32)
    ids = jnp.array([2, -1], jnp.int32)
    pages = jnp.ones((L, K, 2, C, H), dtype)
    return [
        ("write_kv", write_kv, _cache._write_kv, (k_LTKH, k_LTKH, slots)),
        (
            "write_kv_layer",
            write_kv_layer,
            _cache._write_kv_layer,
            (1, k_LTKH[0], k_LTKH[0], slots),
        ),
        ("copy_pages", copy_pages, _cache._copy_pages, (pairs,)),
        ("scatter_pages", scatter_pages, _cache._scatter_pages, (ids, pages, pages)),
    ]


@pytest.mark.parametrize("index", range(4), ids=[c[0] for c in _update_calls()])
def test_updates_donate_the_pool(index):
    _, public, jitted, args = _update_calls()[index]
    cache = PagedKVCache.create(L, K, P, C, H, jnp.float32)
    old_k, old_v = cache.k_pages, cache.v_pages
    new = public(cache, *args)
    jax.block_until_ready(new)
    assert old_k.is_deleted() and old_v.is_deleted()
    # No second pool-sized buffer: the compiled update aliases the pool and its scratch
    # memory is a small fraction of it.
    stats = jitted.lower(new, *args).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= new.bytes
    assert stats.temp_size_in_bytes < new.bytes // 4, (stats.temp_size_in_bytes, new.bytes)


@pytest.mark.parametrize("index", range(4), ids=[c[0] for c in _update_calls()])
def test_second_call_compiles_nothing(index):
    _, public, jitted, args = _update_calls()[index]
    cache = public(PagedKVCache.create(L, K, P, C, H, jnp.float32), *args)
    size = jitted._cache_size()
    cache = public(cache, *args)  # same shapes, fresh values
    cache = public(cache, *jax.tree.map(lambda x: x, args))
    jax.block_until_ready(cache)
    assert jitted._cache_size() == size


def test_gather_compiles_once():
    cache = PagedKVCache.create(L, K, P, C, H, jnp.float32)
    gather_pages(cache, np.array([1, 2], np.int32))
    size = _cache._gather_pages._cache_size()
    gather_pages(cache, np.array([5, -1], np.int32))
    assert _cache._gather_pages._cache_size() == size


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c: write_kv(c, jnp.ones((L, 2, K, H)), jnp.ones((L, 2, K, H)), np.array([0, P * C])),
         r"slots_T must lie in \[-1, 64\) \(-1 = skip\), got values in \[0, 64\]"),
        (lambda c: write_kv(c, jnp.ones((L, 2, K, H)), jnp.ones((L, 2, K, H)), np.array([-2, 0])),
         r"slots_T must lie in \[-1, 64\)"),
        (lambda c: write_kv(c, jnp.ones((L, 3, K, H)), jnp.ones((L, 3, K, H)), np.array([0, 1])),
         r"k_LTKH must have shape \[L, T, K, H\] = \(2, 2, 2, 8\), got \(2, 3, 2, 8\)"),
        (lambda c: write_kv(c, jnp.ones((L, 2, K, H)), jnp.ones((L, 2, K, H)), np.array([0.0, 1])),
         r"slots_T must be an integer array of rank 1"),
        (lambda c: write_kv(c, jnp.ones((L, 1, K, H), jnp.int32), jnp.ones((L, 1, K, H)), np.array([0])),
         r"k_LTKH must be a floating array"),
        (lambda c: write_kv_layer(c, L, jnp.ones((1, K, H)), jnp.ones((1, K, H)), np.array([0])),
         r"layer=2 must lie in \[0, 2\)"),
        (lambda c: write_kv_layer(c, 0, jnp.ones((1, K, H)), jnp.ones((1, K, 4)), np.array([0])),
         r"v_TKH must have shape \[T, K, H\]"),
        (lambda c: copy_pages(c, np.array([[0, 1, 2]])), r"pairs_M2 must have shape \[M, 2\]"),
        (lambda c: copy_pages(c, np.array([[0, P]])), r"pairs_M2 must lie in \[-1, 16\)"),
        (lambda c: copy_pages(c, np.array([[0, 3], [1, 3]])),
         r"pairs_M2 destinations must be distinct, got \[3, 3\]"),
        (lambda c: gather_pages(c, np.array([P])), r"page_ids_M must lie in \[-1, 16\)"),
        (lambda c: scatter_pages(c, np.array([1, 1]), *[jnp.ones((L, K, 2, C, H))] * 2),
         r"page_ids_M must be distinct, got \[1, 1\]"),
    ],
)  # fmt: skip
def test_bad_inputs_raise(call, match):
    cache = PagedKVCache.create(L, K, P, C, H, jnp.float32)
    with pytest.raises(ValueError, match=match):
        call(cache)
    assert not cache.k_pages.is_deleted()  # rejected before donation


def test_validate_false_drops_out_of_range_slots():
    """With validation off (or under tracing), out-of-range slots are dropped like -1."""
    k = jnp.ones((L, 2, K, H))
    cache = write_kv(_poisoned_cache(jnp.float32), k, k, np.array([3, P * C + 5]), validate=False)
    flat = np.asarray(cache.k_pages).reshape(L, K, P * C, H)
    assert not np.isnan(flat[:, :, 3]).any()
    assert np.isnan(np.delete(flat, 3, axis=2)).all()


def test_public_names_exported():
    for name in ("PagedKVCache", "write_kv", "write_kv_layer", "copy_pages", "pages_for_budget"):
        assert getattr(jpaged, name) is getattr(_cache, name)


def test_empty_updates_and_python_lists():
    rng = np.random.default_rng(6)
    cache = _poisoned_cache(jnp.float32)
    empty = jnp.zeros((L, 0, K, H), jnp.float32)
    cache = write_kv(cache, empty, empty, np.zeros(0, np.int32))
    cache = copy_pages(cache, np.zeros((0, 2), np.int32))
    assert np.isnan(np.asarray(cache.k_pages)).all()
    k = _rand(rng, (L, 2, K, H), jnp.float32)
    cache = write_kv(cache, k, k, [6, -1])  # a list works like an array
    cache = copy_pages(cache, [[1, 3]])
    pages = np.asarray(cache.k_pages)
    np.testing.assert_array_equal(pages[:, :, 1, 2], k[:, 0])
    np.testing.assert_array_equal(pages[:, :, 3, 2], k[:, 0])


def test_written_cache_feeds_paged_attention():
    """K/V written through the allocator's slots, read by `jpaged.paged_attention` for each
    layer of the stacked pool, equal dense attention over the same tokens. Free pages and
    last-page tails are NaN."""
    rng = np.random.default_rng(7)
    lengths = [1, C - 1, C, C + 1, 6 * C + 1]
    N = 2 * K
    alloc = _shuffled_allocator(rng)
    for b, n in enumerate(lengths):
        alloc.allocate(b, n)
    T, W = sum(lengths), max(len(alloc.block_table(b)) for b in range(len(lengths)))
    slots = np.concatenate([alloc.slots(b, 0, n) for b, n in enumerate(lengths)])
    k = _rand(rng, (L, T, K, H), jnp.float32)
    v = _rand(rng, (L, T, K, H), jnp.float32)
    cache = write_kv(_poisoned_cache(jnp.float32), k, v, slots)
    tables = np.zeros((len(lengths), W), np.int32)
    for b in range(len(lengths)):
        tables[b, : len(alloc.block_table(b))] = alloc.block_table(b)
    q = _rand(rng, (len(lengths), N, H), jnp.float32)
    starts = np.cumsum([0, *lengths])
    for layer in range(L):
        dense_k = np.zeros((len(lengths), W * C, K, H), np.float32)
        dense_v = np.zeros_like(dense_k)
        for b, n in enumerate(lengths):
            dense_k[b, :n] = k[layer, starts[b] : starts[b] + n]
            dense_v[b, :n] = v[layer, starts[b] : starts[b] + n]
        out = jpaged.paged_attention(
            q, cache.k_pages, cache.v_pages, tables, np.asarray(lengths, np.int32),
            layer=layer, implementation="xla",
        )  # fmt: skip
        want = dense_attention(q, dense_k, dense_v, lengths)
        assert_close(out, want, jnp.float32, err_msg=f"layer {layer}")


@pytest.mark.parametrize("module", ["jpaged.kv.cache", "jpaged.kv.block_table"])
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
