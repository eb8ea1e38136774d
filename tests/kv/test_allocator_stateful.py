"""Hypothesis stateful test of `BlockAllocator` against a model that tracks page contents.

The model plays the device: it holds a token value per slot of the pool (and of the host
swap pool), applies the allocator's copy-on-write pairs and swap mappings exactly as the
engine would, and writes each sequence's new tokens into the slots the allocator gives.
After every step it checks the allocator's invariants and that every sequence still reads
its own tokens through its block table: a write that reached a page shared with another
sequence, or a cached page, shows up as a changed token. Reserved lookahead slots are
filled with junk to prove they are private. One run makes at least 10^4 steps (asserted).
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

from jpaged import AllocatorError, BlockAllocator, OutOfPagesError

C = 4  # page size
P = 24  # device pages
HOST = 12  # host pages
PROMPTS = [[7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 1, 2], [7, 7, 1, 2, 5, 5, 5, 5, 0, 0]]
SALTS = [None, "tenant-b"]


def _snapshot(alloc: BlockAllocator):
    seqs = {
        k: (list(s.pages), s.num_tokens, list(s.hashes), s.swapped) for k, s in alloc._seqs.items()
    }
    stats = dataclasses.replace(alloc.stats(), page_fill=0.0)
    return (
        seqs,
        stats,
        list(alloc._pool.free),
        list(alloc._pool.cache.evictable),
        dict(alloc._pool.cache.page_hash),
    )


class AllocatorMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")
    steps = 0  # steps run (invariant checks), summed over examples

    @initialize()
    def setup(self):
        self.alloc = BlockAllocator(P, C, watermark=0.1, num_host_pages=HOST, bytes_per_page=8)
        self.content = np.full(P * C, -1, np.int64)  # token value per device slot
        self.host = np.full(HOST * C, -1, np.int64)
        self.tokens: dict[int, list[int]] = {}  # expected tokens per live sequence
        self.salts: dict[int, str | None] = {}
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
        """The device writing ``values`` at positions ``start..``: pages must be private."""
        slots = self.alloc.slots(seq_id, start, len(values))
        for slot in slots.tolist():
            page = slot // C
            assert self.alloc._pool.refcount[page] == 1, f"write to shared page {page}"
            assert not self.alloc._pool.cache.is_cached(page), f"write to cached page {page}"
        self.content[slots] = values

    def _copy(self, pairs) -> None:
        srcs = [self.content[s * C : (s + 1) * C].copy() for s, _ in pairs]
        for (_, dst), data in zip(pairs, srcs, strict=True):
            self.content[dst * C : (dst + 1) * C] = data

    def _expect_unchanged(self, before, call):
        with pytest.raises(OutOfPagesError, match=r"needs .* pages but only"):
            call()
        assert _snapshot(self.alloc) == before

    def _grow(self, seq_id, n: int, reserve: bool):
        before = _snapshot(self.alloc)
        op = self.alloc.reserve if reserve else self.alloc.append_slots
        if not self.alloc.can_append_slots(seq_id, n):
            self._expect_unchanged(before, lambda: op(seq_id, n))
            return
        start = self.alloc.num_tokens(seq_id)
        self._copy(op(seq_id, n))
        if reserve:  # lookahead slots are private: scribble junk into them
            self._write(seq_id, start, [-7] * n)
        else:
            new = self._fresh_tokens(n)
            self._write(seq_id, start, new)
            self.tokens[seq_id] += new

    # ---------------------------------------------------------------- rules

    @rule(target=seqs, n=st.integers(0, 3 * C + 1))
    def allocate(self, n):
        seq_id = self._new_id()
        before = _snapshot(self.alloc)
        if self.alloc.num_free_pages < -(-n // C):
            self._expect_unchanged(before, lambda: self.alloc.allocate(seq_id, n))
            return multiple()
        self.alloc.allocate(seq_id, n)
        self.tokens[seq_id] = self._fresh_tokens(n)
        self.salts[seq_id] = None
        self._write(seq_id, 0, self.tokens[seq_id])
        return seq_id

    @rule(target=seqs, which=st.integers(0, 1), cut=st.integers(1, 13), salt=st.sampled_from(SALTS))
    def allocate_with_prefix(self, which, cut, salt):
        prompt = PROMPTS[which][:cut]
        seq_id = self._new_id()
        before = _snapshot(self.alloc)
        hit_tokens, hit_pages = self.alloc.match_prefix(prompt, salt)
        fits = self.alloc.can_allocate(len(prompt), token_ids=prompt, salt=salt)
        try:
            cached = self.alloc.allocate_with_prefix(seq_id, prompt, salt)
        except OutOfPagesError:
            assert not fits, "can_allocate promised room"
            assert _snapshot(self.alloc) == before
            return multiple()
        assert cached == hit_tokens < max(len(prompt), 1)
        assert self.alloc.block_table(seq_id)[: len(hit_pages)] == hit_pages
        # The cached pages already hold exactly the prompt's tokens.
        got = self.content[self.alloc.slots(seq_id, 0, cached)].tolist()
        assert got == prompt[:cached]
        self._write(seq_id, cached, prompt[cached:])
        self.tokens[seq_id] = list(prompt)
        self.salts[seq_id] = salt
        return seq_id

    @rule(seq_id=seqs, n=st.integers(0, C + 2))
    def append(self, seq_id, n):
        if seq_id in self.tokens and not self.alloc.is_swapped(seq_id):
            self._grow(seq_id, n, reserve=False)

    @rule(seq_id=seqs, n=st.integers(0, 2 * C))
    def reserve(self, seq_id, n):
        if seq_id in self.tokens and not self.alloc.is_swapped(seq_id):
            self._grow(seq_id, n, reserve=True)

    @rule(seq_id=seqs, data=st.data())
    def truncate(self, seq_id, data):
        if seq_id in self.tokens and not self.alloc.is_swapped(seq_id):
            n = data.draw(st.integers(0, len(self.tokens[seq_id])))
            self.alloc.truncate(seq_id, n)
            del self.tokens[seq_id][n:]

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent not in self.tokens or self.alloc.is_swapped(parent):
            return multiple()
        child = self._new_id()
        self.alloc.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.salts[child] = self.salts[parent]
        return child

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        if seq_id in self.tokens:
            self.alloc.free(seq_id)
            del self.tokens[seq_id]
        else:  # freed by an earlier consume of a duplicate bundle entry
            with pytest.raises(AllocatorError, match="double free"):
                self.alloc.free(seq_id)

    @rule(seq_id=seqs)
    def commit(self, seq_id):
        if seq_id in self.tokens and not self.alloc.is_swapped(seq_id):
            toks = self.tokens[seq_id]
            self.alloc.commit_full_pages(seq_id, toks, self.salts[seq_id])

    @precondition(lambda self: any(not self.alloc.is_swapped(s) for s in self.tokens))
    @rule(data=st.data())
    def swap_out(self, data):
        running = sorted(s for s in self.tokens if not self.alloc.is_swapped(s))
        group = data.draw(st.lists(st.sampled_from(running), min_size=1, max_size=3, unique=True))
        before = _snapshot(self.alloc)
        if not self.alloc.can_swap_out(group):
            with pytest.raises(OutOfPagesError, match="host pool"):
                self.alloc.swap_out(group)
            assert _snapshot(self.alloc) == before
            return
        for page, slot in self.alloc.swap_out(group):  # gather before anything else writes
            self.host[slot * C : (slot + 1) * C] = self.content[page * C : (page + 1) * C]

    @precondition(lambda self: any(self.alloc.is_swapped(s) for s in self.tokens))
    @rule(data=st.data())
    def swap_in(self, data):
        swapped = sorted(s for s in self.tokens if self.alloc.is_swapped(s))
        group = data.draw(st.lists(st.sampled_from(swapped), min_size=1, max_size=3, unique=True))
        before = _snapshot(self.alloc)
        fits = self.alloc.can_swap_in(group)
        try:
            mapping = self.alloc.swap_in(group)
        except OutOfPagesError:
            assert not fits, "can_swap_in promised room"
            assert _snapshot(self.alloc) == before
            return
        for slot, page in mapping:
            self.content[page * C : (page + 1) * C] = self.host[slot * C : (slot + 1) * C]

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "alloc"):
            return
        AllocatorMachine.steps += 1
        self.alloc.check_invariants()
        for seq_id, expected in self.tokens.items():
            n = len(expected)
            assert self.alloc.num_tokens(seq_id) == n
            if self.alloc.is_swapped(seq_id):
                table, pool = self.alloc.host_block_table(seq_id), self.host
            else:
                table, pool = self.alloc.block_table(seq_id), self.content
            pos = np.arange(n)
            slots = np.asarray(table, np.int64)[pos // C] * C + pos % C
            assert pool[slots].tolist() == expected, f"sequence {seq_id} lost its tokens"
        s = self.alloc.stats()
        assert s.free_pages + s.used_pages + s.evictable_pages == P
        assert 0.0 <= s.page_fill <= 1.0


def test_allocator_machine():
    """At least 10^4 random operations, invariants and contents checked after each."""
    AllocatorMachine.steps = 0
    run_state_machine_as_test(
        AllocatorMachine,
        settings=settings(
            max_examples=120,
            stateful_step_count=160,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert AllocatorMachine.steps >= 10_000, AllocatorMachine.steps
