"""The scheduler alone (host only, no device): chunked prefill, admission, preemption, abort,
and the plan it returns (page copies, swap-outs and swap-ins as data).

A fake "device" advances each scheduled sequence by its ``num_new`` tokens and appends a
token when it samples; the real ``BlockAllocator`` checks its invariants after every step.
"""

import itertools

import pytest

import jpaged
from jpaged.engine.requests import Request, Sequence, Status
from jpaged.engine.scheduler import Scheduler

C = 4
BYTES_PER_PAGE = 100


class Harness:
    def __init__(self, num_pages=32, budget=16, max_num_seqs=8, mode="recompute", watermark=0.0,
                 cheaper="recompute", max_preemptions=64, host_pages=64,
                 lookahead=0):  # fmt: skip
        self.alloc = jpaged.BlockAllocator(num_pages, C, watermark=watermark,
                                           num_host_pages=host_pages,
                                           bytes_per_page=BYTES_PER_PAGE)  # fmt: skip
        fast, slow = 1e12, 1e-3  # the cost model's rates: one option always wins
        self.sched = Scheduler(
            self.alloc,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            preemption_mode=mode,
            enable_prefix_caching=False,
            swap_bytes_per_s=fast if cheaper == "swap" else slow,
            recompute_tokens_per_s=fast if cheaper == "recompute" else slow,
            max_preemptions=max_preemptions,
            lookahead_tokens=lookahead,
        )
        self.ids = itertools.count()

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
    ("mode", "cheaper", "expected"),
    [
        ("recompute", "swap", "recompute"),
        ("swap", "recompute", "swap"),
        ("auto", "swap", "swap"),
        ("auto", "recompute", "recompute"),
    ],
)
def test_preemption_picks_the_youngest_and_the_mode_by_cost(mode, cheaper, expected):
    # 6 pages of 4 tokens; two sequences of 8 prompt tokens growing to 16 cannot both fit.
    h = Harness(num_pages=6, budget=64, mode=mode, cheaper=cheaper)
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


# ---------------------------------------------------------------------- the plan as data


def test_plain_steps_plan_no_page_operations():
    h = Harness(budget=16)
    h.add(10, max_tokens=3)
    while h.sched.has_unfinished():
        out = h.step()
        assert out.page_ops == [] and out.preempted == []


def test_a_swap_preemption_is_a_swap_out_in_the_plan_and_later_a_swap_in():
    # 6 pages of 4 tokens; the younger of two growing requests is swapped out, then back in.
    h = Harness(num_pages=6, budget=64, mode="swap")
    h.add(8, max_tokens=8)
    b = h.add(8, max_tokens=8)
    for _ in range(100):
        out = h.step()
        if out.preempted:
            break
    assert out.preempted == [("r2", "swap")]
    (op,) = [op for op in out.page_ops if op.kind == "swap_out"]
    assert op.request_id == "r2"
    host_slots = h.alloc.host_block_table(b.seqs[0].seq_id)
    # b's pages holding its 12 tokens moved, each once, to the slots it now holds.
    assert b.seqs[0].num_computed == 12
    assert sorted(slot for _, slot in op.pairs) == sorted(host_slots)
    assert len(op.pairs) == len({page for page, _ in op.pairs}) == 3
    assert out.pairs("swap_out") == list(op.pairs)
    assert b.status == Status.SWAPPED and b.swapped_pages == 3
    assert h.sched.swapped_bytes == 3 * BYTES_PER_PAGE
    while b.status == Status.SWAPPED:
        out = h.step()
    (op,) = [op for op in out.page_ops if op.kind == "swap_in"]
    assert op.request_id == "r2"
    assert [slot for slot, _ in op.pairs] == host_slots
    assert [page for _, page in op.pairs] == h.alloc.block_table(b.seqs[0].seq_id)[:3]
    assert h.sched.swapped_bytes == 0 and b.swapped_pages == 0


def test_copy_on_write_of_a_forked_sequence_is_a_copy_in_the_plan():
    h = Harness(budget=16)
    req = h.add(6, max_tokens=4)  # 6 prompt tokens: page 1 holds 2 of them
    h.step()  # prefill; one token sampled (7 tokens)
    seq0 = req.seqs[0]
    child = Sequence(999, 1, list(seq0.tokens), seq0.num_prompt, 0, seq0.num_computed)
    h.alloc.fork(seq0.seq_id, child.seq_id)  # as the engine forks n > 1 completions
    req.seqs.append(child)
    shared = h.alloc.block_table(seq0.seq_id)[1]
    out = h.step()  # both write position 6 of the shared page 1: the first to write copies
    copies = out.pairs("copy")
    assert len(copies) == 1 and copies[0][0] == shared
    assert [op.kind for op in out.page_ops] == ["copy"]
    dst = copies[0][1]
    tables = {h.alloc.block_table(s.seq_id)[1] for s in (seq0, child)}
    assert tables == {shared, dst}
