"""The KV manager runs a plan's page operations on the device, in the planned order."""

import concurrent.futures

import jax.numpy as jnp
import numpy as np
import pytest

import jpaged
from jpaged.engine.kv_manager import KVManager
from jpaged.engine.scheduler import PageOp

L, K, P, C, H = 2, 1, 6, 2, 4


def _manager():
    """A manager whose page p holds the value p + 1 everywhere (K) and -(p + 1) (V)."""
    alloc = jpaged.BlockAllocator(P, C, num_host_pages=4, bytes_per_page=1)
    fill = jnp.arange(1, P + 1, dtype=jnp.float32)[None, None, :, None, None]
    k = jnp.broadcast_to(fill, (L, K, P, C, H))
    return KVManager(alloc, jpaged.PagedKVCache(k_pages=k, v_pages=-k))


def _page_values(kv):
    k = np.asarray(kv.cache.k_pages)
    v = np.asarray(kv.cache.v_pages)
    assert (k == k[:1, :1, :, :1, :1]).all() and (v == -k).all()  # pages stay uniform
    return k[0, 0, :, 0, 0].tolist()


def test_a_swap_out_reads_its_page_before_a_later_copy_overwrites_it():
    kv = _manager()
    kv.apply([
        PageOp("swap_out", ((1, 0), (4, 1)), "a"),  # pages 1 and 4 to host slots 0 and 1
        PageOp("copy", ((2, 1),)),  # page 1 is reused: page 2's contents go there
        PageOp("swap_in", ((0, 3), (1, 5)), "a"),  # host slots back to pages 3 and 5
    ])  # fmt: skip
    # Page 3 holds what page 1 held before the copy (2), page 5 what page 4 held (5).
    assert _page_values(kv) == [1.0, 3.0, 3.0, 2.0, 5.0, 5.0]
    assert kv.host_pages == {}


def test_copies_alone_and_empty_swaps():
    kv = _manager()
    kv.apply([PageOp("copy", ((0, 5), (3, 4))), PageOp("swap_out", ()), PageOp("swap_in", ())])
    assert _page_values(kv) == [1.0, 2.0, 3.0, 4.0, 4.0, 1.0]


def test_an_unknown_page_operation_raises():
    with pytest.raises(ValueError, match="unknown page operation 'move'"):
        _manager().apply([PageOp("move", ((0, 1),))])


def test_replacing_the_pool_while_a_loop_dispatches_is_refused():
    kv = _manager()
    kv.pending = concurrent.futures.Future()
    with pytest.raises(AssertionError, match="while a decode loop was dispatching"):
        kv.cache = kv._cache


def test_a_quantized_pool_swaps_its_scales_with_its_pages():
    alloc = jpaged.BlockAllocator(P, C, num_host_pages=4, bytes_per_page=1)
    fill = jnp.arange(1, P + 1, dtype=jnp.float32)[None, None, :, None, None]
    k = jnp.broadcast_to(fill, (L, K, P, C, H))
    cache = jpaged.PagedKVCache.create(L, K, P, C, H, "int8")
    cache = jpaged.scatter_pages(cache, np.arange(P, dtype=np.int32), k, -k)  # quantizes
    kv = KVManager(alloc, cache)
    kv.apply([
        PageOp("swap_out", ((1, 0), (4, 1)), "a"),
        PageOp("copy", ((2, 1), (0, 4))),  # both pages reused, scales and codes overwritten
        PageOp("swap_in", ((0, 3), (1, 5)), "a"),
    ])  # fmt: skip
    assert len(kv.host_pages) == 0
    c = kv.cache
    assert c.k_pages.dtype == jnp.int8 and (np.asarray(c.k_pages) == 127).all()
    k_deq = np.asarray(c.k_pages, np.float32) * np.asarray(c.k_scale)[..., None]
    v_deq = np.asarray(c.v_pages, np.float32) * np.asarray(c.v_scale)[..., None]
    np.testing.assert_allclose(k_deq[0, 0, :, 0, 0], [1, 3, 3, 2, 1, 5], rtol=1e-6)
    np.testing.assert_allclose(v_deq, -k_deq, rtol=1e-6)
