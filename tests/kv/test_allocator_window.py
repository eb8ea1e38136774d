"""Sliding-window page release in `BlockAllocator`: which pages go, what the table then
holds, and how release meets sharing, the prefix cache, swap, truncation and the checker.

The random-sequence test (``test_allocator_stateful.py``) mixes releases with every other
operation; these are the hand-made cases.
"""

from __future__ import annotations

import numpy as np
import pytest

from jpaged import AllocatorError, AllocatorInvariantError, BlockAllocator
from jpaged.kv.seq_record import RELEASED
from jpaged.kv.window import releasable_pages

C = 4


@pytest.mark.parametrize(
    ("n", "window", "expected"),
    [(0, 8, 0), (8, 8, 0), (11, 8, 1), (12, 8, 1), (19, 8, 3), (32, 8, 6), (33, 8, 6),
     (9, 2, 1), (8, 1, 1), (12, 1, 2), (100, 200, 0)],
)  # fmt: skip
def test_releasable_pages(n, window, expected):
    assert releasable_pages(n, window, C) == expected
    # Every released page is unseen by a query at position n (keys j > n - window) ...
    assert expected * C - 1 <= n - window or expected == 0
    # ... and one full page stays to stand in for them.
    assert expected == 0 or (expected + 1) * C <= n


def test_release_gives_back_pages_and_keeps_positions():
    alloc = BlockAllocator(8, C)
    alloc.allocate("a", 19)  # pages 0..4
    assert alloc.release_outside_window("a", 19, 8) == 3
    assert alloc.num_released_pages("a") == 3
    assert alloc.block_table("a") == [3, 3, 3, 3, 4]  # released entries read page 3
    assert alloc.num_free_pages == 6
    assert alloc.slots("a", 12, 7).tolist() == list(range(12, 19))
    with pytest.raises(AllocatorError, match=r"positions must lie in \[12, 20\)"):
        alloc.slots("a", 11, 1)
    assert alloc.release_outside_window("a", 19, 8) == 0  # nothing more yet
    s = alloc.stats()
    assert (s.used_pages, s.window_released, s.live_tokens, s.logical_tokens) == (2, 3, 7, 19)
    alloc.append_slots("a", 6)  # 25 tokens on two fresh pages
    assert alloc.release_outside_window("a", 25, 8) == 1  # keys <= 17: page 3 goes too
    assert alloc.block_table("a")[:4] == [4, 4, 4, 4]
    alloc.check_invariants()
    alloc.free("a")
    assert alloc.num_free_pages == 8 and alloc.stats().used_pages == 0
    alloc.check_invariants()


def test_small_window_keeps_one_full_page():
    alloc = BlockAllocator(8, C)
    alloc.allocate("a", 9)  # pages 0, 1 full, page 2 holds position 8
    assert alloc.release_outside_window("a", 9, 2) == 1  # page 1 is unseen but stays
    assert alloc.block_table("a") == [1, 1, 2]
    alloc.check_invariants()


def test_shared_pages_lose_one_reference():
    alloc = BlockAllocator(8, C)
    alloc.allocate("p", 2 * C + 1)
    alloc.fork("p", "c")
    assert alloc.release_outside_window("p", 2 * C + 1, 2) == 1
    assert alloc.block_table("c") == [0, 1, 2] and alloc.block_table("p") == [1, 1, 2]
    assert alloc.stats().shared_pages == 2 and alloc._pool.refcount[0] == 1
    alloc.fork("p", "g")  # a fork of a released sequence shares its held pages only
    assert alloc.num_released_pages("g") == 1 and alloc._pool.refcount[0] == 1
    alloc.check_invariants()
    for seq in ("c", "p", "g"):
        alloc.free(seq)
    assert alloc.num_free_pages == 8
    alloc.check_invariants()


def test_released_cached_pages_stay_valid_prefix_hits():
    alloc = BlockAllocator(8, C)
    prompt = list(range(10, 10 + 3 * C + 1))
    alloc.allocate_with_prefix("a", prompt)
    assert alloc.commit_full_pages("a", prompt) == 3
    assert alloc.release_outside_window("a", len(prompt), 5) == 2
    s = alloc.stats()
    assert (s.cached_pages, s.evictable_pages) == (3, 2)  # parked with their contents
    # A new request with the same prompt gets all three full pages back.
    assert alloc.allocate_with_prefix("b", prompt) == 3 * C
    assert alloc.block_table("b")[:3] == [0, 1, 2]
    assert alloc.stats().evictable_pages == 0
    # Committing again after a release registers nothing for the released pages.
    more = prompt + list(range(50, 50 + 2 * C))
    alloc.append_slots("a", 2 * C)
    assert alloc.release_outside_window("a", len(more), 5) == 2
    assert alloc.commit_full_pages("a", more) == 1  # index 4 only: 3 went uncommitted
    assert RELEASED not in alloc._pool.cache.page_hash
    alloc.check_invariants()


def test_freed_sequence_leaves_its_released_head_pages_to_be_evicted_last():
    alloc = BlockAllocator(6, C)
    prompt = list(range(10, 10 + 4 * C + 1))
    alloc.allocate_with_prefix("a", prompt)  # pages 0..4
    alloc.commit_full_pages("a", prompt)
    assert alloc.release_outside_window("a", len(prompt), C + 1) == 3  # parked: 0, 1, 2
    alloc.free("a")  # 4 (partial) is freed, 3 parked: the LRU must end with the head page
    assert list(alloc._pool.cache.evictable) == [3, 2, 1, 0]
    alloc.allocate("b", 3 * C)  # the free page 5 and 4, then one eviction: page 3
    assert alloc._pool.cache.evictions == 1
    assert alloc.match_prefix(prompt) == (3 * C, [0, 1, 2])
    alloc.check_invariants()


def test_swap_moves_held_pages_only():
    alloc = BlockAllocator(8, C, num_host_pages=4)
    alloc.allocate("a", 4 * C + 2)  # pages 0..4
    alloc.release_outside_window("a", 4 * C + 2, C + 1)  # keys <= 12: pages 0..2
    assert alloc.num_released_pages("a") == 3
    out = alloc.swap_out(["a"])
    assert [page for page, _ in out] == [3, 4]
    host = alloc.host_block_table("a")
    assert host[:3] == [host[3]] * 3 and alloc.num_released_pages("a") == 3
    alloc.check_invariants()
    back = alloc.swap_in(["a"])
    assert len(back) == 2 and alloc.num_released_pages("a") == 3
    table = alloc.block_table("a")
    assert table[:3] == [table[3]] * 3 and table[3:] == [d for _, d in back]
    alloc.check_invariants()


def test_errors_and_truncation_limits():
    alloc = BlockAllocator(8, C, num_host_pages=4)
    with pytest.raises(AllocatorError, match=r"release_outside_window\('x'\): unknown sequence"):
        alloc.release_outside_window("x", 0, 4)
    alloc.allocate("a", 3 * C)
    with pytest.raises(AllocatorError, match=r"num_computed must lie in \[0, 12\]"):
        alloc.release_outside_window("a", 13, 4)
    for window in (0, True, 2.0):
        with pytest.raises(AllocatorError, match=r"window must be an int >= 1"):
            alloc.release_outside_window("a", 12, window)
    assert alloc.release_outside_window("a", 12, np.int64(9)) == 1
    with pytest.raises(AllocatorError, match=r"num_tokens must lie in \[8, 12\]"):
        alloc.truncate("a", 7)
    alloc.truncate("a", 8)
    assert alloc.block_table("a") == [1, 1] and alloc.num_tokens("a") == 8
    alloc.swap_out(["a"])
    with pytest.raises(AllocatorError, match=r"swapped out"):
        alloc.release_outside_window("a", 8, 1)
    alloc.check_invariants()


def test_checker_names_broken_released_entries():
    alloc = BlockAllocator(8, C)
    alloc.allocate("a", 3 * C)
    alloc.release_outside_window("a", 3 * C, 2)
    seq = alloc._seqs["a"]
    seq.pages[1], seq.released = RELEASED, 1  # a hole after the released prefix
    with pytest.raises(AllocatorInvariantError, match=r"released entries are not the first 1"):
        alloc.check_invariants()
    seq.pages[1], seq.released, seq.num_tokens = 1, 2, 2 * C + 3
    with pytest.raises(AllocatorInvariantError, match=r"first held page after 2 released"):
        alloc.check_invariants()


def test_prefix_hit_under_a_window_needs_only_the_window():
    alloc = BlockAllocator(8, C)
    prompt = list(range(100, 121))  # 21 tokens: 5 full pages may hit
    alloc.allocate_with_prefix("a", prompt)
    alloc.commit_full_pages("a", prompt)
    assert alloc.release_outside_window("a", 21, 4) == 4  # pages 0..3 parked, 4 and 5 held
    alloc.allocate("x", 12)  # the 2 free pages, then the oldest parked one: page 0
    assert alloc.match_prefix(prompt) == (0, [])  # the chain's head is gone
    # Queries at positions >= 20 under a window of 4 see keys 17..: page 4 only.
    assert alloc.match_prefix(prompt, window=4) == (20, [4])
    assert alloc.can_allocate(21, token_ids=prompt, window=4, keep_free=-alloc.watermark_pages)
    assert alloc.allocate_with_prefix("b", prompt, window=4) == 20
    assert alloc.num_released_pages("b") == 4 and alloc.block_table("b")[:5] == [4] * 5
    assert alloc.stats().shared_pages == 1 and alloc.stats().prefix_hit_tokens == 20
    alloc.check_invariants()
    assert alloc.slots("b", 16, 5).tolist()[:4] == [16, 17, 18, 19]  # page 4's slots
    with pytest.raises(AllocatorError, match=r"positions must lie in \[16, 24\)"):
        alloc.slots("b", 15, 1)
    alloc.free("b")
    alloc.free("a")
    alloc.check_invariants()
