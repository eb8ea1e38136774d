"""BlockAllocator unit tests: each operation, each error path, stats, prefix cache, swap.

The random-sequence (stateful) test is in ``test_allocator_stateful.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import jpaged
from jpaged import (
    AllocatorError,
    AllocatorInvariantError,
    BlockAllocator,
    OutOfPagesError,
)

C = 4


def _state(alloc: BlockAllocator):
    seqs = {k: (list(s.pages), s.num_tokens, s.swapped) for k, s in alloc._seqs.items()}
    return seqs, list(alloc._pool.free), list(alloc._pool.refcount), alloc.stats()


# ----------------------------------------------------------------------------- basics


def test_allocate_slots_and_block_table():
    alloc = BlockAllocator(8, C)
    alloc.allocate("a", 0)
    alloc.allocate("b", 1)
    alloc.allocate("c", C + 1)
    assert alloc.block_table("a") == [] and alloc.num_tokens("a") == 0
    assert alloc.block_table("b") == [0]
    assert alloc.block_table("c") == [1, 2]
    assert alloc.slots("c", 0, C + 1).tolist() == [4, 5, 6, 7, 8]
    assert alloc.slots("c", 0, 0).dtype == np.int32
    assert alloc.num_free_pages == 5
    alloc.check_invariants()


def test_append_grows_on_demand_without_copies():
    alloc = BlockAllocator(8, C)
    alloc.allocate("a", C - 1)
    assert alloc.append_slots("a") == []  # fills page 0
    assert alloc.block_table("a") == [0]
    assert alloc.append_slots("a", C + 1) == []  # C+1 more: two new pages
    assert alloc.block_table("a") == [0, 1, 2] and alloc.num_tokens("a") == 2 * C + 1
    assert alloc.append_slots("a", 0) == []
    alloc.check_invariants()


def test_fork_shares_and_cow_copies_only_the_partial_last_page():
    alloc = BlockAllocator(8, C)
    alloc.allocate("p", 2 * C + 2)  # pages 0, 1 full, 2 partial
    alloc.fork("p", "c")
    assert alloc.block_table("c") == [0, 1, 2]
    s = alloc.stats()
    assert s.shared_pages == 3 and s.used_pages == 3 and s.logical_tokens == 2 * (2 * C + 2)
    assert s.live_tokens == 2 * C + 2
    assert alloc.append_slots("c") == [(2, 3)]  # copy the partial page, not the full ones
    assert alloc.block_table("c") == [0, 1, 3]
    assert alloc.append_slots("p") == []  # the parent now owns page 2 alone
    assert alloc.stats().cow_copies == 1
    alloc.check_invariants()


def test_fork_at_a_page_boundary_copies_nothing():
    alloc = BlockAllocator(8, C)
    alloc.allocate("p", C)
    alloc.fork("p", "c")
    assert alloc.append_slots("c") == [] and alloc.append_slots("p") == []
    assert alloc.block_table("c") == [0, 1] and alloc.block_table("p") == [0, 2]


def test_reserve_is_lookahead_without_length_change():
    alloc = BlockAllocator(8, C)
    alloc.allocate("p", C + 1)
    alloc.fork("p", "c")
    pairs = alloc.reserve("c", 2 * C)  # positions C+1 .. 3C: CoW page 1, two new pages
    assert pairs == [(1, 2)]
    assert alloc.num_tokens("c") == C + 1 and alloc.block_table("c") == [0, 2, 3, 4]
    assert alloc.slots("c", C + 1, 2 * C).tolist() == list(range(9, 12)) + list(range(12, 17))
    for _ in range(2 * C):  # the device ran 2C steps: nothing more to allocate or copy
        assert alloc.append_slots("c") == []
    assert alloc.block_table("c") == [0, 2, 3, 4]
    with pytest.raises(AllocatorError, match=r"positions must lie in \[0, 16\)"):
        alloc.slots("c", 3 * C, C + 1)
    alloc.check_invariants()


def test_reserve_then_fork_copies_again():
    """A fork after a reservation shares the partial page again: the next write copies it."""
    alloc = BlockAllocator(8, C)
    alloc.allocate("p", 2)
    alloc.reserve("p", 2 * C)
    alloc.fork("p", "c")
    assert alloc.block_table("c") == [0]  # reserved pages stay with the parent
    assert alloc.append_slots("p") == [(0, 3)]
    alloc.check_invariants()


def test_truncate_releases_pages_past_the_end():
    alloc = BlockAllocator(8, C)
    alloc.allocate("a", 3 * C)
    alloc.reserve("a", C)
    alloc.truncate("a", C + 1)
    assert alloc.block_table("a") == [0, 1] and alloc.num_tokens("a") == C + 1
    assert alloc.num_free_pages == 6
    alloc.truncate("a", 0)
    assert alloc.block_table("a") == [] and alloc.num_free_pages == 8
    alloc.check_invariants()


def test_truncate_of_a_shared_page_then_append_copies():
    alloc = BlockAllocator(8, C)
    alloc.allocate("p", 2 * C)
    alloc.fork("p", "c")
    alloc.truncate("c", C + 1)  # page 1 is shared and now partial for "c"
    assert alloc.append_slots("c") == [(1, 2)]
    alloc.check_invariants()


def test_free_returns_everything():
    alloc = BlockAllocator(8, C)
    alloc.allocate("a", 5)
    alloc.fork("a", "b")
    alloc.free("a")
    assert alloc.num_free_pages == 6
    alloc.free("b")
    assert alloc.num_free_pages == 8 and "b" not in alloc
    alloc.allocate("a", 1)  # an id can be reused after free
    alloc.check_invariants()


def test_stats():
    alloc = BlockAllocator(10, C)
    alloc.allocate("a", C + 1)
    alloc.fork("a", "b")
    alloc.append_slots("b", 2)
    s = alloc.stats()
    assert (s.total_pages, s.free_pages, s.used_pages, s.shared_pages) == (10, 7, 3, 1)
    assert s.live_tokens == (C + 1) + (C + 3) - C  # page 0 is shared
    assert s.allocated_slots == 3 * C
    assert s.page_fill == pytest.approx(s.live_tokens / s.allocated_slots)
    assert s.num_seqs == 2 and s.cow_copies == 1
    empty = BlockAllocator(4, C).stats()
    assert empty.page_fill == 0.0 and empty.used_pages == 0


def test_watermark_and_can_allocate():
    alloc = BlockAllocator(100, C, watermark=0.05)  # keeps 5 pages free
    assert alloc.watermark_pages == 5
    assert alloc.can_allocate(95 * C) and not alloc.can_allocate(95 * C + 1)
    alloc.allocate("a", 95 * C + 1)  # allocate itself does not apply the watermark
    assert alloc.num_free_pages == 4 and not alloc.can_allocate(1)
    assert alloc.can_append_slots("a", 3 * C - 1) and not alloc.can_append_slots("a", 5 * C)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda a: a.allocate("a", 1), r"allocate: sequence 'a' already exists"),
        (lambda a: a.allocate("z", -1), r"allocate: num_tokens=-1 must be an int >= 0"),
        (lambda a: a.append_slots("z"), r"append_slots\('z'\): unknown sequence 'z'"),
        (lambda a: a.append_slots("a", 1.5), r"num_tokens=1.5 must be an int"),
        (lambda a: a.reserve("z", 1), r"reserve\('z'\): unknown sequence"),
        (lambda a: a.truncate("a", 6), r"truncate\('a', 6\): num_tokens must lie in \[0, 5\]"),
        (lambda a: a.fork("z", "y"), r"fork\('z'\): unknown sequence 'z'"),
        (lambda a: a.fork("a", "a"), r"fork: sequence 'a' already exists"),
        (lambda a: a.free("z"), r"free\('z'\): unknown sequence 'z'"),
        (lambda a: a.block_table("z"), r"unknown sequence"),
        (lambda a: a.num_tokens("z"), r"unknown sequence"),
        (lambda a: a.slots("a", -1, 1), r"slots\('a', start=-1, count=1\): positions must lie"),
        (lambda a: a.host_block_table("a"), r"sequence is not swapped out"),
        (lambda a: a.swap_out(["a", "a"]), r"swap_out: repeated sequence ids"),
        (lambda a: a.swap_in(["a"]), r"swap_in\('a'\): sequence is not swapped out"),
        (lambda a: a.commit_full_pages("a", [1] * 5, salt="x"), r"salt='x' must equal"),
    ],
)
def test_misuse_raises_allocator_error(call, match):
    alloc = BlockAllocator(8, C, num_host_pages=4)
    alloc.allocate("a", 5)
    before = _state(alloc)
    with pytest.raises(AllocatorError, match=match):
        call(alloc)
    assert _state(alloc) == before
    assert issubclass(AllocatorError, ValueError)


def test_double_free():
    alloc = BlockAllocator(8, C)
    alloc.allocate("a", 5)
    alloc.free("a")
    with pytest.raises(AllocatorError, match=r"free\('a'\): double free"):
        alloc.free("a")


def test_swapped_sequence_rejects_device_operations():
    alloc = BlockAllocator(8, C, num_host_pages=4)
    alloc.allocate("a", 5)
    alloc.swap_out(["a"])
    for call in (
        lambda: alloc.append_slots("a"),
        lambda: alloc.block_table("a"),
        lambda: alloc.fork("a", "b"),
        lambda: alloc.slots("a", 0, 1),
    ):
        with pytest.raises(AllocatorError, match="sequence is swapped out; swap it in first"):
            call()
    with pytest.raises(AllocatorError, match="already swapped out"):
        alloc.swap_out(["a"])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda a: a.allocate("new", 3 * C + 1), r"allocate\('new', 13\) needs 4 pages but only 3"),
        (lambda a: a.append_slots("a", 3 * C + 1), r"append_slots\('a', 13\) needs 4 pages"),
        (lambda a: a.reserve("a", 4 * C), r"reserve\('a', 16\) needs 5 pages but only 3"),
        (lambda a: a.allocate_with_prefix("new", list(range(20))), r"needs 5 pages but only 3"),
    ],
)
def test_out_of_pages_is_all_or_nothing(call, match):
    alloc = BlockAllocator(6, C)
    alloc.allocate("a", 2 * C + 3)  # 3 pages, 3 free
    alloc.fork("a", "b")
    before = _state(alloc)
    with pytest.raises(OutOfPagesError, match=match) as info:
        call(alloc)
    assert _state(alloc) == before
    assert (info.value.free, info.value.total) == (3, 6) and info.value.needed > 3
    alloc.check_invariants()


def test_cow_needing_a_page_when_none_is_free_fails_cleanly():
    alloc = BlockAllocator(2, C)
    alloc.allocate("a", C + 1)
    alloc.fork("a", "b")
    before = _state(alloc)
    with pytest.raises(OutOfPagesError, match=r"needs 1 pages but only 0 of 2"):
        alloc.append_slots("b")
    assert _state(alloc) == before


def test_check_invariants_reports_corruption():
    alloc = BlockAllocator(6, C, num_host_pages=2)
    alloc.allocate("a", 5)
    alloc.check_invariants()
    alloc._pool.refcount[1] += 1  # a leaked reference
    alloc._pool.free.append(0)  # a page both free and referenced
    with pytest.raises(AllocatorInvariantError, match=r"page 1: refcount 2 != 1") as info:
        alloc.check_invariants()
    assert "free&referenced=[0]" in str(info.value)
    assert "!= pool 6" in str(info.value)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="num_pages=0 must be an int >= 1"):
        BlockAllocator(0, C)
    with pytest.raises(ValueError, match="page_size=0 must be an int >= 1"):
        BlockAllocator(4, 0)
    with pytest.raises(ValueError, match=r"watermark=1.5 must lie in \[0, 1\)"):
        BlockAllocator(4, C, watermark=1.5)


def test_take_dirty():
    alloc = BlockAllocator(8, C)
    alloc.allocate("a", 1)
    alloc.allocate("b", 1)
    assert alloc.take_dirty() == {"a", "b"}
    alloc.append_slots("a")
    alloc.free("b")
    assert alloc.take_dirty() == {"a", "b"} and alloc.take_dirty() == set()


# ----------------------------------------------------------------------------- prefix cache


def _prompt(n, base=0):
    return list(range(base, base + n))


def test_prefix_hit_reuses_full_pages_and_never_the_last_token():
    alloc = BlockAllocator(16, C)
    prompt = _prompt(3 * C)
    assert alloc.allocate_with_prefix("a", prompt) == 0
    assert alloc.commit_full_pages("a", prompt) == 3
    # The same prompt: the last token must be computed, so only 2 of 3 pages hit.
    assert alloc.match_prefix(prompt) == (2 * C, alloc.block_table("a")[:2])
    assert alloc.allocate_with_prefix("b", prompt) == 2 * C
    assert alloc.block_table("b")[:2] == alloc.block_table("a")[:2]
    assert alloc.block_table("b")[2] != alloc.block_table("a")[2]
    # A longer prompt with the same start hits all three pages.
    assert alloc.allocate_with_prefix("c", [*prompt, 99]) == 3 * C
    s = alloc.stats()
    assert (s.prefix_queries, s.prefix_query_tokens, s.prefix_hit_tokens) == (3, 37, 20)
    assert s.cached_pages == 3 and s.shared_pages == 3
    alloc.check_invariants()


def test_prefix_chain_and_salt():
    alloc = BlockAllocator(16, C)
    prompt = _prompt(2 * C + 1)
    alloc.allocate_with_prefix("a", prompt, salt="t1")
    alloc.commit_full_pages("a", prompt, salt="t1")
    assert alloc.match_prefix(prompt, salt="t1")[0] == 2 * C
    assert alloc.match_prefix(prompt)[0] == 0  # another tenant sees nothing
    assert alloc.match_prefix(prompt, salt="t2")[0] == 0
    changed_first_page = [1000, *prompt[1:]]  # the chain: page 1 hashes page 0 too
    assert alloc.match_prefix(changed_first_page, salt="t1")[0] == 0


def test_freed_cached_pages_are_evictable_and_reused_on_a_hit():
    alloc = BlockAllocator(4, C)
    prompt = _prompt(3 * C + 1)
    alloc.allocate_with_prefix("a", prompt)
    alloc.commit_full_pages("a", prompt)
    cached_pages = alloc.block_table("a")[:3]
    alloc.free("a")
    s = alloc.stats()
    assert (s.free_pages, s.evictable_pages, s.cached_pages, s.used_pages) == (1, 3, 3, 0)
    assert alloc.num_free_pages == 4 and alloc.can_allocate(4 * C)
    assert alloc.allocate_with_prefix("b", prompt) == 3 * C
    assert alloc.block_table("b")[:3] == cached_pages
    assert alloc.stats().evictable_pages == 0
    alloc.check_invariants()


def test_eviction_is_lru_tail_pages_first():
    alloc = BlockAllocator(6, C)
    p1, p2 = _prompt(2 * C + 1, 0), _prompt(2 * C + 1, 100)
    for seq, prompt in (("a", p1), ("b", p2)):
        alloc.allocate_with_prefix(seq, prompt)
        alloc.commit_full_pages(seq, prompt)
    a_pages, b_pages = alloc.block_table("a"), alloc.block_table("b")
    alloc.free("a")  # a's pages are released first: least recently used
    alloc.free("b")
    assert alloc.stats().evictable_pages == 4 and alloc.stats().free_pages == 2
    alloc.allocate("x", 3 * C)  # 2 free pages + 1 eviction: a's tail page goes first
    assert alloc.stats().evictions == 1
    assert alloc.match_prefix(p1)[1] == [a_pages[0]]  # a's head page survives
    assert alloc.match_prefix(p2)[0] == 2 * C
    alloc.allocate("y", 2 * C)
    assert alloc.match_prefix(p1)[0] == 0 and alloc.match_prefix(p2)[0] == C
    assert alloc.block_table("y") == [a_pages[0], b_pages[1]]
    alloc.check_invariants()


def test_cached_page_is_never_written():
    """Truncating into a shared cached page and appending copies it first."""
    alloc = BlockAllocator(8, C)
    prompt = _prompt(2 * C)
    alloc.allocate("a", 2 * C)
    alloc.commit_full_pages("a", prompt)
    alloc.fork("a", "b")
    alloc.truncate("b", 2 * C - 1)
    assert alloc.append_slots("b") == [(1, 2)]
    # Sole owner truncating into its cached page: the page leaves the cache instead.
    alloc.free("b")
    alloc.truncate("a", C + 1)
    assert alloc.stats().cached_pages == 1 and alloc.append_slots("a") == []
    alloc.check_invariants()


def test_can_allocate_counts_prefix_hits():
    alloc = BlockAllocator(5, C, watermark=0.0)
    prompt = _prompt(3 * C + 1)
    alloc.allocate_with_prefix("a", prompt)
    alloc.commit_full_pages("a", prompt)
    assert not alloc.can_allocate(len(prompt))  # 4 pages needed, 1 free
    assert alloc.can_allocate(len(prompt), token_ids=prompt)  # 3 hit, 1 to take
    assert not alloc.can_allocate(len(prompt) + 4, token_ids=[*prompt, 1, 2, 3, 4])


def test_duplicate_full_page_stays_uncached():
    alloc = BlockAllocator(8, C)
    prompt = _prompt(C)
    alloc.allocate("a", C)
    alloc.allocate("b", C)
    assert alloc.commit_full_pages("a", prompt) == 1
    assert alloc.commit_full_pages("b", prompt) == 0  # same hash: "b"'s page stays private
    assert alloc.stats().cached_pages == 1
    assert alloc.commit_full_pages("a", prompt) == 0  # idempotent
    alloc.allocate("c", C)
    alloc.fork("c", "d")
    alloc.commit_full_pages("c", _prompt(C, 50))
    with pytest.raises(AllocatorError, match="token ids of page 0 disagree"):
        alloc.commit_full_pages("d", _prompt(C, 60))


# ----------------------------------------------------------------------------- swap


def test_swap_out_and_in_preserves_sharing():
    alloc = BlockAllocator(8, C, num_host_pages=4, bytes_per_page=100)
    alloc.allocate("p", C + 2)  # pages 0, 1
    alloc.fork("p", "c")
    alloc.append_slots("c")  # CoW: c = [0, 2]
    alloc.reserve("p", 2 * C)  # p = [0, 1, 3]: the reserved page is released on swap-out
    assert alloc.can_swap_out(["p", "c"])
    out = alloc.swap_out(["p", "c"])
    assert [page for page, _ in out] == [0, 1, 2]  # shared page 0 moves once
    slot = dict(out)
    assert alloc.host_block_table("p") == [slot[0], slot[1]]
    assert alloc.host_block_table("c") == [slot[0], slot[2]]
    assert alloc.is_swapped("p") and alloc.num_free_pages == 8
    s = alloc.stats()
    assert (s.swapped_seqs, s.host_free_pages, s.swapped_out_pages) == (2, 1, 3)
    assert s.swapped_out_bytes == 300
    alloc.check_invariants()
    alloc.allocate("other", 2 * C)  # the device pages are reused meanwhile
    assert alloc.can_swap_in(["p", "c"])
    back = dict(alloc.swap_in(["c", "p"]))
    assert sorted(back) == sorted(slot.values())
    assert alloc.block_table("p") == [back[slot[0]], back[slot[1]]]
    assert alloc.block_table("c") == [back[slot[0]], back[slot[2]]]
    assert alloc.stats().shared_pages == 1 and alloc.stats().host_free_pages == 4
    assert alloc.num_tokens("p") == C + 2 and alloc.num_tokens("c") == C + 3
    alloc.check_invariants()


def test_swap_out_shared_with_a_running_sequence():
    alloc = BlockAllocator(8, C, num_host_pages=4)
    alloc.allocate("p", 2 * C)
    alloc.fork("p", "c")
    out = alloc.swap_out(["c"])
    assert len(out) == 2 and alloc.block_table("p") == [0, 1]  # p keeps its pages
    assert alloc.stats().shared_pages == 0
    alloc.free("c")  # freeing a swapped sequence frees its host slots
    assert alloc.stats().host_free_pages == 4
    alloc.check_invariants()


def test_swap_capacity_errors_are_all_or_nothing():
    alloc = BlockAllocator(4, C, num_host_pages=1)
    alloc.allocate("a", 2 * C)
    before = _state(alloc)
    assert not alloc.can_swap_out(["a"])
    with pytest.raises(OutOfPagesError, match=r"on the host pool needs 2 pages but only 1 of 1"):
        alloc.swap_out(["a"])
    assert _state(alloc) == before
    alloc = BlockAllocator(4, C, num_host_pages=4)
    alloc.allocate("a", 2 * C)
    alloc.swap_out(["a"])
    alloc.allocate("b", 3 * C)
    before = _state(alloc)
    assert not alloc.can_swap_in(["a"])
    with pytest.raises(OutOfPagesError, match=r"swap_in\(\['a'\]\) needs 2 pages but only 1"):
        alloc.swap_in(["a"])
    assert _state(alloc) == before


def test_swap_in_restores_prefix_cache_entries():
    alloc = BlockAllocator(4, C, num_host_pages=4)
    prompt = _prompt(2 * C + 1)
    alloc.allocate_with_prefix("a", prompt)
    alloc.commit_full_pages("a", prompt)
    alloc.swap_out(["a"])
    alloc.allocate("b", 4 * C)  # evicts the cached pages
    assert alloc.match_prefix(prompt)[0] == 0
    alloc.free("b")
    alloc.swap_in(["a"])
    assert alloc.match_prefix(prompt) == (2 * C, alloc.block_table("a")[:2])
    alloc.check_invariants()


def test_public_names_exported():
    assert jpaged.BlockAllocator is BlockAllocator
    assert jpaged.AllocatorStats is type(BlockAllocator(1, 1).stats())


@pytest.mark.parametrize(
    "module", ["jpaged.kv.allocator", "jpaged.kv.prefix_cache", "jpaged.kv.seq_record"]
)
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
