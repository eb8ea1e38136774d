"""Hypothesis stateful test of `PageGroups` against a model that plays the device.

The model holds a token value per slot of the one pool (global pages, then local pages) and
of the host swap slots (the global group's, then the local group's), applies the copy and
swap pairs exactly as the engine would (pool ids), and writes each sequence's new tokens
into both groups' slots. Local pages outside a window of ``WINDOW`` are released along the
way, and prefix hits need only the window's pages in the local group. After every step both groups' invariants hold, every sequence reads all its tokens
through its global table and, from its first held local page on, through its local table
(released local entries point at that page, full of its tokens), and a call that raised
``OutOfPagesError`` changed neither group.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from jpaged import AllocatorError, OutOfPagesError, PageGroups
from jpaged.kv.window import releasable_pages

C = 4  # page size
P_G, P_L = 24, 16  # pages of the global and the local group
H_G, H_L = 10, 6  # their host slots
WINDOW = 6
PROMPTS = [[7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 1, 2], [7, 7, 1, 2, 5, 5, 5, 5, 0, 0],
           [7, 7, 1, 2, 3, 4, 5, 6, 3, 3, 3, 3, 9, 8, 7, 6, 5, 4, 3, 2, 1]]  # fmt: skip


def _snapshot(groups: PageGroups):
    def one(alloc):
        seqs = {k: (list(s.pages), s.num_tokens, list(s.hashes), s.swapped, s.released)
                for k, s in alloc._seqs.items()}  # fmt: skip
        stats = dataclasses.replace(alloc.stats(), page_fill=0.0)
        return seqs, stats, list(alloc._pool.free), list(alloc._pool.cache.evictable)

    return one(groups.global_group), one(groups.local_group)


class PageGroupsMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")
    steps = 0

    @initialize()
    def setup(self):
        self.groups = PageGroups(P_G, P_L, C, watermark=0.1, num_host_pages=H_G,
                                 num_local_host_pages=H_L, bytes_per_page=8,
                                 window=WINDOW)  # fmt: skip
        self.content = np.full((P_G + P_L) * C, -1, np.int64)
        self.host = np.full((H_G + H_L) * C, -1, np.int64)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.next_token = 1000

    # ---------------------------------------------------------------- helpers

    def _fresh_tokens(self, n: int) -> list[int]:
        out = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return out

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _write(self, seq_id, start: int, values) -> None:
        """The device writing ``values`` at positions ``start..`` of both groups."""
        g = self.groups
        for slots, alloc, offset in (
            (g.slots(seq_id, start, len(values)), g.global_group, 0),
            (g.local_slots(seq_id, start, len(values)), g.local_group, P_G),
        ):
            for page in {s // C - offset for s in slots.tolist()}:
                assert alloc._pool.refcount[page] == 1, f"write to shared page {page}"
                assert not alloc._pool.cache.is_cached(page), f"write to cached page {page}"
            self.content[slots] = values

    def _copy(self, pairs) -> None:
        srcs = [self.content[s * C : (s + 1) * C].copy() for s, _ in pairs]
        for (_, dst), data in zip(pairs, srcs, strict=True):
            self.content[dst * C : (dst + 1) * C] = data

    def _expect_unchanged(self, call):
        before = _snapshot(self.groups)
        with pytest.raises(OutOfPagesError):
            call()
        assert _snapshot(self.groups) == before

    def _grow(self, seq_id, n: int, reserve: bool):
        op = self.groups.reserve if reserve else self.groups.append_slots
        if not self.groups.can_append_slots(seq_id, n):
            self._expect_unchanged(lambda: op(seq_id, n))
            return
        start = self.groups.num_tokens(seq_id)
        self._copy(op(seq_id, n))
        if reserve:  # lookahead slots are private in both groups: scribble junk into them
            self._write(seq_id, start, [-7] * n)
        else:
            new = self._fresh_tokens(n)
            self._write(seq_id, start, new)
            self.tokens[seq_id] += new

    def _running(self, seq_id) -> bool:
        return seq_id in self.tokens and not self.groups.is_swapped(seq_id)

    # ---------------------------------------------------------------- rules

    @rule(target=seqs, n=st.integers(0, 3 * C + 1))
    def allocate(self, n):
        seq_id = self._new_id()
        free = min(a.num_free_pages for a in (self.groups.global_group, self.groups.local_group))
        if free < -(-n // C):
            self._expect_unchanged(lambda: self.groups.allocate(seq_id, n))
            return multiple()
        self.groups.allocate(seq_id, n)
        self.tokens[seq_id] = self._fresh_tokens(n)
        self._write(seq_id, 0, self.tokens[seq_id])
        return seq_id

    @rule(target=seqs, which=st.integers(0, 2), cut=st.integers(1, 21))
    def allocate_with_prefix(self, which, cut):
        prompt = PROMPTS[which][:cut]
        seq_id = self._new_id()
        before = _snapshot(self.groups)
        hit_tokens, hit_pages = self.groups.match_prefix(prompt)
        try:
            cached = self.groups.allocate_with_prefix(seq_id, prompt)
        except OutOfPagesError:
            assert _snapshot(self.groups) == before
            return multiple()
        assert (
            cached == hit_tokens and self.groups.block_table(seq_id)[: len(hit_pages)] == hit_pages
        )
        # The cached pages of both groups already hold exactly the prompt's tokens (the local
        # group's from its first held page: the window of the first computed position).
        first = self.groups.num_released_pages(seq_id) * C
        assert first <= max(cached - C, 0) and first <= max(cached - WINDOW + 1, 0)
        for slots, start in ((self.groups.slots(seq_id, 0, cached), 0),
                             (self.groups.local_slots(seq_id, first, cached - first), first)):  # fmt: skip
            assert self.content[slots].tolist() == prompt[start:cached]
        self._write(seq_id, cached, prompt[cached:])
        self.tokens[seq_id] = list(prompt)
        return seq_id

    @rule(seq_id=seqs, n=st.integers(0, C + 2))
    def append(self, seq_id, n):
        if self._running(seq_id):
            self._grow(seq_id, n, reserve=False)

    @rule(seq_id=seqs, n=st.integers(0, 2 * C))
    def reserve(self, seq_id, n):
        if self._running(seq_id):
            self._grow(seq_id, n, reserve=True)

    @rule(seq_id=seqs, data=st.data())
    def truncate(self, seq_id, data):
        if self._running(seq_id):
            released = self.groups.num_released_pages(seq_id)
            n = data.draw(st.integers(0, len(self.tokens[seq_id])))
            if released and n < (released + 1) * C:  # the first held local page stays full
                before = _snapshot(self.groups)
                with pytest.raises(AllocatorError, match=r"num_tokens must lie in \["):
                    self.groups.truncate(seq_id, n)
                assert _snapshot(self.groups) == before
                return
            self.groups.truncate(seq_id, n)
            del self.tokens[seq_id][n:]

    @rule(seq_id=seqs)
    def release_window(self, seq_id):
        if self._running(seq_id):
            n = len(self.tokens[seq_id])
            before = self.groups.num_released_pages(seq_id)
            count = self.groups.release_outside_window(seq_id, n, WINDOW)
            after = max(before, releasable_pages(n, WINDOW, C))
            assert count == after - before == self.groups.num_released_pages(seq_id) - before

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if not self._running(parent):
            return multiple()
        child = self._new_id()
        self.groups.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        return child

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        if seq_id in self.tokens:
            self.groups.free(seq_id)
            del self.tokens[seq_id]
        else:
            with pytest.raises(AllocatorError, match="double free"):
                self.groups.free(seq_id)

    @rule(seq_id=seqs)
    def commit(self, seq_id):
        if self._running(seq_id):
            self.groups.commit_full_pages(seq_id, self.tokens[seq_id])

    @precondition(lambda self: any(not self.groups.is_swapped(s) for s in self.tokens))
    @rule(data=st.data())
    def swap_out(self, data):
        running = sorted(s for s in self.tokens if not self.groups.is_swapped(s))
        group = data.draw(st.lists(st.sampled_from(running), min_size=1, max_size=3, unique=True))
        if not self.groups.can_swap_out(group):
            self._expect_unchanged(lambda: self.groups.swap_out(group))
            return
        for page, slot in self.groups.swap_out(group):  # gather before anything else writes
            self.host[slot * C : (slot + 1) * C] = self.content[page * C : (page + 1) * C]

    @precondition(lambda self: any(self.groups.is_swapped(s) for s in self.tokens))
    @rule(data=st.data())
    def swap_in(self, data):
        swapped = sorted(s for s in self.tokens if self.groups.is_swapped(s))
        group = data.draw(st.lists(st.sampled_from(swapped), min_size=1, max_size=3, unique=True))
        before = _snapshot(self.groups)
        try:
            mapping = self.groups.swap_in(group)
        except OutOfPagesError:
            assert _snapshot(self.groups) == before
            return
        for slot, page in mapping:
            self.content[page * C : (page + 1) * C] = self.host[slot * C : (slot + 1) * C]

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "groups"):
            return
        PageGroupsMachine.steps += 1
        g = self.groups
        g.check_invariants()
        for seq_id, expected in self.tokens.items():
            n = len(expected)
            assert g.num_tokens(seq_id) == n
            released = g.num_released_pages(seq_id)
            if g.is_swapped(seq_id):
                tables = [(g.global_group.host_block_table(seq_id), 0),
                          (g.local_group.host_block_table(seq_id), H_G)]  # fmt: skip
                pool = self.host
            else:
                tables = [(g.block_table(seq_id), 0), (g.local_block_table(seq_id), 0)]
                pool = self.content
            for i, (table, offset) in enumerate(tables):
                first = released if i else 0  # the global group keeps every page
                pos = np.arange(first * C, n)
                ids = np.asarray(table, np.int64) + offset
                slots = ids[pos // C] * C + pos % C
                assert pool[slots].tolist() == expected[first * C :], f"{seq_id} lost tokens"
                if i and released:  # released entries read the first held page, full
                    assert table[:released] == [table[released]] * released
                    held = ids[released] * C
                    assert pool[held : held + C].tolist() == expected[released * C :][:C]
        s = g.stats()
        assert s.free_pages + s.used_pages + s.evictable_pages == P_G + P_L


def test_page_groups_machine():
    """At least 10^4 random operations, invariants and contents checked after each."""
    PageGroupsMachine.steps = 0
    run_state_machine_as_test(
        PageGroupsMachine,
        settings=settings(
            max_examples=120,
            stateful_step_count=160,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert PageGroupsMachine.steps >= 10_000, PageGroupsMachine.steps
