"""`PageGroups`: the global and the local page group of one pool.

The local group mirrors the global one and also releases pages outside the window; page
operations come back as pool ids (local pages and host slots numbered after the global
ones); growth, allocation and swaps are all or nothing across both groups; the invariant
checker covers both groups and their agreement.
"""

from __future__ import annotations

import doctest

import pytest

from jpaged import AllocatorError, AllocatorInvariantError, OutOfPagesError
from jpaged.kv import layer_groups, page_groups, prefix_plan
from jpaged.kv.allocator import BlockAllocator
from jpaged.kv.layer_groups import group_layer_indices, local_window, pool_layers
from jpaged.kv.page_groups import PageGroups, default_local_pages

C = 4
P_G, P_L = 16, 8


def _groups(**kw) -> PageGroups:
    return PageGroups(P_G, P_L, C, watermark=0.0, **kw)


@pytest.mark.parametrize(
    "module", [page_groups, layer_groups, prefix_plan], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_layer_patterns():
    gemma2 = (8, None) * 2
    assert local_window(gemma2) == 8 and pool_layers(gemma2) == 2
    assert group_layer_indices(gemma2) == (0, 0, 1, 1)
    assert local_window((8, 4, None, None)) == 8 and pool_layers((8, 4, None, None)) == 2
    assert group_layer_indices((8, 4, None, None)) == (0, 1, 0, 1)
    # Every layer windowed (Mistral), none (Llama), or unequal counts per period: one group.
    for windows in ((8, 8), (None, None), (8, 8, None) * 2, (), None):
        assert pool_layers(windows or (None,)) is None
    assert local_window(None) is None
    assert default_local_pages(4, 10, window=9, page_size=4) == 4 * (3 + 2) + 10


def test_local_group_releases_and_global_keeps_the_history():
    g = _groups()
    g.allocate("a", 19)  # 5 pages in each group
    assert g.block_table("a") == [0, 1, 2, 3, 4]
    assert g.local_block_table("a") == [16, 17, 18, 19, 20]
    assert g.slots("a", 17, 2).tolist() == [17, 18]
    assert g.local_slots("a", 17, 2).tolist() == [16 * C + 17, 16 * C + 18]
    assert g.release_outside_window("a", 19, 8) == 3
    assert g.num_released_pages("a") == 3
    assert g.local_block_table("a") == [19, 19, 19, 19, 20]  # released entries: first held
    assert g.block_table("a") == [0, 1, 2, 3, 4]
    assert g.local_group.num_free_pages == P_L - 2 and g.global_group.num_free_pages == P_G - 5
    s = g.stats()
    assert (s.total_pages, s.used_pages, s.window_released) == (P_G + P_L, 7, 3)
    assert s.logical_tokens == 19  # tokens counted once (the global group's)
    g.check_invariants()
    g.free("a")
    assert g.stats().used_pages == 0 and g.stats().free_pages == P_G + P_L
    g.check_invariants()


def test_fork_copies_the_shared_last_page_in_both_groups():
    g = _groups()
    g.allocate("a", 6)
    g.fork("a", "b")
    pairs = g.append_slots("b")  # position 6 of the shared page 1 of each group
    assert pairs == [(1, 2), (16 + 1, 16 + 2)]
    assert g.block_table("b") == [0, 2] and g.local_block_table("b") == [16, 18]
    assert g.stats().shared_pages == 2
    g.check_invariants()


def test_growth_is_all_or_nothing_across_the_groups():
    g = _groups()
    g.allocate("a", 6 * C)  # 6 of the 8 local pages
    g.fork("a", "b")
    g.append_slots("a", 1)
    before = (g.global_group.num_free_pages, g.local_group.num_free_pages, g.num_tokens("b"))
    # "b" needs 3 more local pages (1 free): neither group changes.
    with pytest.raises(OutOfPagesError, match="local group"):
        g.append_slots("b", 2 * C + 1)
    with pytest.raises(OutOfPagesError, match="local group"):
        g.reserve("b", 2 * C + 1)
    assert not g.can_append_slots("b", 2 * C + 1) and g.can_append_slots("b", C)
    assert (g.global_group.num_free_pages, g.local_group.num_free_pages,
            g.num_tokens("b")) == before  # fmt: skip
    # Allocation: the local group is full, so the global pages go back too.
    with pytest.raises(OutOfPagesError):
        g.allocate("c", 3 * C)
    assert "c" not in g and g.global_group.num_free_pages == before[0]
    assert not g.can_allocate(3 * C) and g.can_allocate(C)
    g.check_invariants()


def test_tighter_group_bounds_the_free_count():
    g = PageGroups(P_G, P_L, C, watermark=0.25)  # watermarks of 4 and 2 pages
    assert g.watermark_pages == 4
    assert g.num_pages - g.watermark_pages == P_L - 2  # the local group's room
    g.allocate("a", 5 * C)
    assert g.num_free_pages - g.watermark_pages == (P_L - 5) - 2
    assert g.release_outside_window("a", 5 * C, 4) == 4  # back to the local group
    assert g.num_free_pages - g.watermark_pages == (P_L - 1) - 2
    assert g.growth_pages("a", C + 1) == 2


@pytest.mark.parametrize("window", [None, 4])
def test_local_prefix_hits_need_only_the_window(window):
    g = PageGroups(P_G, 8, C, watermark=0.0, window=window)
    prompt = list(range(100, 121))  # 21 tokens: 5 full pages may hit
    g.allocate_with_prefix("a", prompt)
    g.commit_full_pages("a", prompt)
    g.release_outside_window("a", 21, 4)  # local pages 0..3 parked, 4 and 5 held
    g.allocate("x", 12)  # the local group's 2 free pages, then its oldest parked page: 0
    hit = g.cached_pages(prompt)
    assert len(g.global_group.match_prefix(prompt)[1]) == 5  # "a" holds the global chain
    if window is None:  # the local chain lost its head: no hit, and 6 fresh local pages
        assert hit == 0 and not g.can_allocate(21, token_ids=prompt)  # do not fit (3 left)
        with pytest.raises(OutOfPagesError, match="local group"):
            g.allocate_with_prefix("b", prompt)
        return
    # Queries at positions >= 20 see keys 17..: the local group needs its page 4 only.
    assert hit == 5 and g.match_prefix(prompt) == (20, g.block_table("a")[:5])
    assert g.allocate_with_prefix("b", prompt) == 20
    assert g.block_table("b")[:5] == g.block_table("a")[:5]
    assert g.num_released_pages("b") == 4
    assert g.local_block_table("b")[:5] == [P_G + 4] * 5 == g.local_block_table("a")[:5]
    g.check_invariants()


def test_prefix_hits_without_a_window_need_both_chains():
    g = PageGroups(P_G, 6, C, watermark=0.0)
    prompt = list(range(100, 121))  # 21 tokens: 5 full pages may hit (the last is computed)
    g.allocate_with_prefix("a", prompt)
    g.commit_full_pages("a", prompt)
    assert g.match_prefix(prompt)[0] == 20
    g.release_outside_window("a", 21, 4)  # local pages 0..3 parked with their contents
    g.free("a")
    assert g.allocate_with_prefix("b", prompt) == 20  # parked local pages still hit
    g.free("b")
    g.allocate("filler", 5 * C)  # evicts parked local pages (least recently used first)
    hit = g.cached_pages(prompt)
    assert hit == 1 and len(g.global_group.match_prefix(prompt)[1]) == 5  # the head survives
    g.free("filler")
    assert g.allocate_with_prefix("c", prompt) == hit * C  # the shorter hit, in both groups
    assert g.block_table("c")[:hit] == g.global_group.match_prefix(prompt)[1][:hit]
    g.check_invariants()


def test_swap_moves_both_groups_as_pool_ids_and_host_slots():
    g = _groups(num_host_pages=8, num_local_host_pages=4)
    assert g.num_host_pages == 12
    g.allocate("a", 19)
    g.release_outside_window("a", 19, 8)  # the local group holds 2 pages
    out = g.swap_out(["a"])
    assert out == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (16 + 3, 8 + 0), (16 + 4, 8 + 1)]
    assert g.is_swapped("a") and g.global_group.num_free_pages == P_G
    back = g.swap_in(["a"])
    assert sorted(h for h, _ in back) == [0, 1, 2, 3, 4, 8, 9]
    local_pages = [d for h, d in back if h >= 8]
    assert all(d >= P_G for d in local_pages)
    assert g.local_block_table("a")[3:] == local_pages
    g.check_invariants()


def test_swap_out_pages_counts_what_a_swap_out_moves_in_both_groups():
    g = _groups(num_host_pages=16, num_local_host_pages=8)
    g.allocate("a", 19)
    g.fork("a", "b")  # shares every page with "a": counted once
    g.release_outside_window("a", 19, 8)  # "a" holds 2 local pages, "b" all 5
    assert page_groups.swap_out_pages(g, ["a"]) == 5 + 2
    assert page_groups.swap_out_pages(g, ["a", "b"]) == 5 + 5
    assert page_groups.swap_out_pages(g, ["a", "b"]) == len(g.swap_out(["a", "b"]))
    plain = BlockAllocator(8, C, num_host_pages=8)  # one group: its block tables
    plain.allocate("x", 9)
    plain.fork("x", "y")
    plain.append_slots("y", 4)  # "y" copies its last page: 3 shared + 1 + "y"'s new one
    assert page_groups.swap_out_pages(plain, ["x", "y"]) == len(plain.swap_out(["x", "y"])) == 5


def test_swap_is_all_or_nothing_when_a_group_lacks_host_slots():
    g = _groups(num_host_pages=8, num_local_host_pages=1)
    g.allocate("a", 9)  # 3 pages each; the local group has 1 host slot
    assert not g.can_swap_out(["a"])
    with pytest.raises(OutOfPagesError, match="host slots"):
        g.swap_out(["a"])
    assert not g.is_swapped("a") and g.stats().host_free_pages == 9
    g.check_invariants()


def test_truncate_and_reset_reach_both_groups():
    g = _groups()
    g.allocate("a", 19)
    g.release_outside_window("a", 19, 8)  # local pages 0..2 released: 16 tokens stay
    g.truncate("a", 17)
    assert len(g.block_table("a")) == len(g.local_block_table("a")) == 5
    g.truncate("a", 16)
    assert len(g.block_table("a")) == len(g.local_block_table("a")) == 4
    with pytest.raises(AllocatorError, match="num_tokens must lie in"):
        g.truncate("a", 15)  # into the local group's first held page
    assert g.num_tokens("a") == 16
    g.commit_full_pages("a", list(range(16)))
    g.reset_prefix_cache()
    assert g.stats().cached_pages == 0
    g.check_invariants()


def test_invariant_checker_covers_both_groups():
    g = _groups()
    g.allocate("a", 9)
    g.local_group.truncate("a", 4)  # the groups disagree on the length
    with pytest.raises(AllocatorInvariantError, match="length or swap state differs"):
        g.check_invariants()
    g = _groups()
    g.allocate("a", 9)
    g.local_group.allocate("stray", 1)  # a sequence the global group does not hold
    with pytest.raises(AllocatorInvariantError, match="different sequences"):
        g.check_invariants()
    g = _groups()
    g.allocate("a", 9)
    g.local_group._pool.refcount[0] += 1  # a local page's refcount off by one
    with pytest.raises(AllocatorInvariantError, match="local group: page 0: refcount 2 != 1"):
        g.check_invariants()
    g = _groups()
    g.allocate("a", 19)
    g.global_group.release_outside_window("a", 19, 8)  # the global group must keep histories
    with pytest.raises(AllocatorInvariantError, match="the global group released pages"):
        g.check_invariants()
