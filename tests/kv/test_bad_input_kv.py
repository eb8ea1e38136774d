"""Bad input to the KV layer: token ids that disagree with pages already cached, repeated
write slots, and the prefix-cache reset that follows a lost device pool."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import AllocatorError, BlockAllocator, PagedKVCache, write_kv, write_kv_layer

C = 4


def _prompt(n, base=0):
    return list(range(base, base + n))


def _state(alloc):
    """What a failed call must leave unchanged."""
    return dataclasses.asdict(alloc.stats()), {s: alloc.block_table(s) for s in ("a", "b")
                                               if s in alloc}  # fmt: skip


def test_commit_rejects_token_ids_that_disagree_with_a_prefix_hit():
    alloc = BlockAllocator(16, C)
    prompt = _prompt(3 * C + 1)
    alloc.allocate_with_prefix("a", prompt)
    alloc.commit_full_pages("a", prompt)
    assert alloc.allocate_with_prefix("b", prompt) == 3 * C  # pages 0-2 are hits
    other = [*prompt[:5], 999, *prompt[6:]]  # page 1 differs
    before = _state(alloc)
    with pytest.raises(AllocatorError, match=r"commit_full_pages\('b'\): token ids of page 1 "):
        alloc.commit_full_pages("b", other)
    assert _state(alloc) == before
    alloc.check_invariants()
    assert alloc.commit_full_pages("b", prompt) == 0  # the right ids: nothing new, no error
    alloc.commit_full_pages("b", other, verify=False)  # unchecked: the known hashes are kept
    assert alloc.match_prefix(prompt)[0] == 3 * C


def test_commit_rejects_token_ids_that_disagree_with_its_earlier_commit():
    alloc = BlockAllocator(16, C)
    prompt = _prompt(2 * C)
    alloc.allocate("a", 2 * C)
    assert alloc.commit_full_pages("a", prompt[:C]) == 1
    before = _state(alloc)
    with pytest.raises(AllocatorError, match="token ids of page 0 disagree"):
        alloc.commit_full_pages("a", [7, *prompt[1:]])
    assert _state(alloc) == before
    assert alloc.commit_full_pages("a", prompt) == 1


def test_commit_rejects_a_fork_that_rewrites_its_shared_pages():
    alloc = BlockAllocator(16, C)
    prompt = _prompt(2 * C)
    alloc.allocate("a", 2 * C)
    alloc.fork("a", "b")
    alloc.commit_full_pages("a", prompt)  # registers the pages "b" shares
    with pytest.raises(AllocatorError, match="token ids of page 0 disagree"):
        alloc.commit_full_pages("b", _prompt(2 * C, base=50))
    alloc.check_invariants()


def test_reset_prefix_cache_frees_evictable_pages_and_forgets_every_hash():
    alloc = BlockAllocator(8, C)
    prompt = _prompt(3 * C + 1)
    alloc.allocate_with_prefix("a", prompt)
    alloc.commit_full_pages("a", prompt)
    alloc.allocate_with_prefix("b", prompt)
    alloc.free("a")
    alloc.reset_prefix_cache()
    s = alloc.stats()
    assert s.cached_pages == 0 and s.evictable_pages == 0
    assert s.used_pages == 4 and s.free_pages == 4  # "b" keeps its pages
    assert alloc.match_prefix(prompt)[0] == 0
    alloc.check_invariants()
    assert alloc.commit_full_pages("b", prompt) == 3  # registers them again, from scratch


def _cache():
    return PagedKVCache.create(2, 1, 4, C, 8, jnp.float32)


@pytest.mark.parametrize("slots", [[3, 5, 3], [0, 0], [15, -1, 7, 15]])
def test_write_kv_rejects_repeated_slots(slots):
    T = len(slots)
    k = jnp.ones((2, T, 1, 8), jnp.float32)
    repeated = sorted({s for s in slots if s >= 0 and slots.count(s) > 1})
    match = r"slots_T must be distinct .*repeated: " + re.escape(str(repeated))
    with pytest.raises(ValueError, match=match):
        write_kv(_cache(), k, k, np.asarray(slots, np.int32))
    with pytest.raises(ValueError, match=match):
        write_kv_layer(_cache(), 1, k[0], k[0], jnp.asarray(slots, jnp.int32))


def test_write_kv_accepts_repeated_skips_and_unchecked_or_traced_slots():
    k = jnp.ones((2, 3, 1, 8), jnp.float32)
    out = write_kv(_cache(), k, 2 * k, np.asarray([-1, 6, -1], np.int32))
    assert float(out.v_pages[1, 0, 1, 2, 0]) == 2.0
    write_kv(_cache(), k, k, np.asarray([2, 2, 2], np.int32), validate=False)  # not checked

    @jax.jit
    def traced(cache, slots):  # under jit the allocator is the check
        return write_kv(cache, k, k, slots)

    traced(_cache(), jnp.asarray([1, 1, 2], jnp.int32))
