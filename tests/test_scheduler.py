"""The scheduler alone (host only, no device): chunked prefill, admission, preemption, abort.

A fake "device" advances each scheduled sequence by its ``num_new`` tokens and appends a
token when it samples; the real ``BlockAllocator`` checks its invariants after every step.
"""

import itertools

import pytest

import jpaged
from jpaged._scheduler import Request, Scheduler, Sequence, Status

C = 4


class Harness:
    def __init__(self, num_pages=32, budget=16, max_num_seqs=8, mode="recompute", watermark=0.0,
                 swap_s=1.0, recompute_s=2.0, max_preemptions=64, host_pages=64,
                 lookahead=0):  # fmt: skip
        self.alloc = jpaged.BlockAllocator(num_pages, C, watermark=watermark,
                                           num_host_pages=host_pages)  # fmt: skip
        self.swapped_out = []
        self.sched = Scheduler(
            self.alloc,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            preemption_mode=mode,
            swap_out=self._swap_out,
            swap_in=self._swap_in,
            swap_cost=lambda r: (100, swap_s),
            recompute_cost=lambda r: (10, recompute_s),
            on_copies=lambda pairs: None,
            on_admit=self._admit,
            max_preemptions=max_preemptions,
            lookahead_tokens=lookahead,
        )
        self.ids = itertools.count()

    def _admit(self, req):
        for s in req.live_seqs():
            self.alloc.allocate(s.seq_id, s.num_tokens)
            s.num_computed = 0

    def _swap_out(self, req):
        ids = [s.seq_id for s in req.live_seqs()]
        pairs = self.alloc.swap_out(ids)
        self.swapped_out.append(req.request_id)
        req.swapped = {"bytes": 0}
        return len(pairs)

    def _swap_in(self, req):
        ids = [s.seq_id for s in req.live_seqs()]
        if not self.alloc.can_swap_in(ids):
            raise jpaged.OutOfPagesError("later")
        self.alloc.swap_in(ids)

    def add(self, prompt_len, max_tokens=4, name=None):
        name = name or f"r{next(self.ids)}"
        params = jpaged.SamplingParams(max_tokens=max_tokens)
        req = Request(name, list(range(prompt_len)), params, arrival=0)
        req.seqs = [Sequence(next(self.ids) + 1000, 0, list(range(prompt_len)), prompt_len, 0)]
        self.sched.add(req)
        return req

    def step(self):
        out = self.sched.schedule()
        for s in out.scheduled:
            samples = s.samples
            s.seq.num_computed += s.num_new
            if samples:
                s.seq.tokens.append(7)
                if s.seq.num_generated >= s.request.params.max_tokens:
                    self.sched.finish_seq(s.request, s.seq, "length")
        self.alloc.check_invariants()
        return out


def test_chunked_prefill_under_the_token_budget_decodes_first():
    h = Harness(budget=16)
    a = h.add(40)
    b = h.add(5)
    out = h.step()
    assert [(s.request.request_id, s.num_new) for s in out.scheduled] == [("r0", 16)]
    out = h.step()
    assert [(s.request.request_id, s.num_new) for s in out.scheduled] == [("r0", 16)]
    out = h.step()  # a finishes its prompt (8 left), b is admitted with the rest of the budget
    assert [(s.request.request_id, s.num_new) for s in out.scheduled] == [("r0", 8), ("r2", 5)]
    assert a.seqs[0].num_generated == 1 and b.seqs[0].num_generated == 1
    out = h.step()  # both decode: one token each, the older first
    assert [(s.request.request_id, s.num_new) for s in out.scheduled] == [("r0", 1), ("r2", 1)]
    assert all(o.num_tokens <= 16 for o in [out])
    while h.sched.has_unfinished():
        h.step()
    assert a.finished and b.finished and h.alloc.stats().used_pages == 0


def test_admission_keeps_the_watermark_free():
    # 10 pages, watermark 30% = 3 pages: a 28-token prompt (7 pages) fits, a second does not.
    h = Harness(num_pages=10, budget=64, watermark=0.3)
    h.add(28, max_tokens=1)
    h.add(4, max_tokens=1)
    out = h.step()
    assert [s.request.request_id for s in out.scheduled] == ["r0"]
    assert h.sched.waiting[0].request_id == "r2"
    h.step()  # r0 finished and freed its pages: r2 is admitted
    assert not h.sched.waiting


@pytest.mark.parametrize(
    ("mode", "swap_s", "recompute_s", "expected"),
    [
        ("recompute", 1.0, 2.0, "recompute"),
        ("swap", 2.0, 1.0, "swap"),
        ("auto", 1.0, 2.0, "swap"),  # swapping is cheaper
        ("auto", 2.0, 1.0, "recompute"),  # recomputing is cheaper
    ],
)
def test_preemption_picks_the_youngest_and_the_mode_by_cost(mode, swap_s, recompute_s, expected):
    # 6 pages of 4 tokens; two sequences of 8 prompt tokens growing to 16 cannot both fit.
    h = Harness(num_pages=6, budget=64, mode=mode, swap_s=swap_s, recompute_s=recompute_s)
    a = h.add(8, max_tokens=8)
    b = h.add(8, max_tokens=8)
    preempted = []
    while h.sched.has_unfinished():
        out = h.step()
        preempted += out.preempted
    assert preempted and preempted[0] == ("r2", expected)  # the younger request
    assert {e.mode for e in h.sched.events} == {expected}
    assert h.sched.counters[f"preemptions_{expected}"] == len(preempted)
    assert a.seqs[0].num_generated == 8 and b.seqs[0].num_generated == 8
    assert a.error is None and b.error is None
    assert h.alloc.stats().used_pages == 0 and h.sched.swapped_bytes == 0


def test_a_request_that_outgrows_the_pool_alone_fails_without_harming_others():
    h = Harness(num_pages=4, budget=64)
    big = h.add(8, max_tokens=20)  # would need 7 pages
    while h.sched.has_unfinished():
        h.step()
    assert big.error is not None and "out of KV pages" in big.error
    assert big.seqs[0].finish_reason == "error"
    assert h.alloc.stats().used_pages == 0
    ok = h.add(4, max_tokens=3)
    while h.sched.has_unfinished():
        h.step()
    assert ok.error is None and ok.seqs[0].num_generated == 3


def test_max_preemptions_stops_thrashing():
    h = Harness(num_pages=6, budget=64, max_preemptions=0)
    h.add(8, max_tokens=8)
    b = h.add(8, max_tokens=8)
    while h.sched.has_unfinished():
        h.step()
    assert b.error is not None and "max_preemptions=0" in b.error


def test_abort_frees_pages_in_every_state():
    h = Harness(num_pages=6, budget=64, mode="swap")
    a = h.add(8, max_tokens=8)
    b = h.add(8, max_tokens=8)
    c = h.add(4, max_tokens=8)
    while b.status != Status.SWAPPED:
        h.step()
    h.sched.abort(b)  # swapped
    h.sched.abort(c)  # waiting
    h.sched.abort(a)  # running
    assert all(r.finished for r in (a, b, c))
    assert b.seqs[0].finish_reason == "abort"
    stats = h.alloc.stats()
    assert stats.used_pages == 0 and stats.host_free_pages == stats.host_pages
    h.alloc.check_invariants()
    assert not h.sched.has_unfinished()


@pytest.mark.parametrize("lookahead", [0, 4, 8])
def test_admission_keeps_the_running_sequences_lookahead_free(lookahead):
    # Multi-step decode reserves `lookahead` positions per running sequence: right after an
    # admission the pool holds the pages for them, and `can_admit_head` predicts `_admit`
    # exactly (swapped heads too).
    h = Harness(num_pages=16, budget=64, lookahead=lookahead, mode="swap")
    reqs = [h.add(6, max_tokens=10) for _ in range(8)]  # 2 pages each, 4 at the end
    admissions = 0
    for _ in range(400):
        predicted = h.sched.can_admit_head()
        waiting = list(h.sched.waiting)
        out = h.step()
        if out.preempted or not waiting:
            continue
        admitted = waiting[0] not in h.sched.waiting
        assert admitted == predicted
        if admitted:
            admissions += sum(r not in h.sched.waiting for r in waiting)
            assert h.alloc.num_free_pages >= h.sched.lookahead_pages()
        if not h.sched.has_unfinished():
            break
    assert not h.sched.has_unfinished() and admissions >= 8
    assert all(r.status == Status.FINISHED and r.error is None for r in reqs)


def test_lookahead_lowers_admission_and_is_validated():
    plain, ahead = Harness(num_pages=8, budget=64), Harness(num_pages=8, budget=64, lookahead=8)
    for h in (plain, ahead):
        for _ in range(4):
            h.add(7, max_tokens=5)  # 2 pages each
        h.step()
    assert len(plain.sched.running) == 4  # 8 pages, nothing kept
    assert len(ahead.sched.running) == 2  # 2 x (2 pages + 2 of lookahead: 7 -> 15 tokens)
    assert ahead.sched.lookahead_pages() == 2 * 2
    with pytest.raises(ValueError, match="lookahead_tokens"):
        Harness(lookahead=-1)
