"""A plan beside a running chain that cannot run (`jpaged.engine.beside_plan.schedule_beside`
blocked), and failures of the round beside a chain.

Requests C and D decode beside the chain (their joins' reservations fail, forced). In one
round C's next slot needs a copy-on-write of its last page (shared with a forked sequence,
as an ``n > 1`` completion shares it), and D, younger, cannot grow (forced): the plan is
blocked and the chain ends. C's copy was emitted only in that plan (its slot stays), so it
must run; with the pool NaN-poisoned (``make_llm``), a copy that never ran gives C NaN K/V.
"""

import pytest
from _engine_helpers import C, make_llm, random_prompts

import jpaged
from jpaged._errors import OutOfPagesError


def _params(n):
    return jpaged.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


PROMPTS = random_prompts(40, (5, 4, 6, 7))  # A, B (the chain), C, D (beside it)
PARAMS = [_params(40), _params(40), _params(20), _params(20)]


def _blocked_round(llm):
    """Starts a chain over A and B, adds C and D, and arms the blocked round (see the
    module docstring). Returns the request ids and ``fired``: ["shared"] once C's page is
    shared, then "blocked" once D failed to grow."""
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:2], PARAMS[:2], strict=True)]
    while llm.chain.state is None:
        llm.step()
    ids += [llm.add_request(p, sp) for p, sp in zip(PROMPTS[2:], PARAMS[2:], strict=True)]
    c, d = (llm._book.by_id[rid].seqs[0].seq_id for rid in ids[2:])
    alloc = llm.alloc
    reserve, append_slots = alloc.reserve, alloc.append_slots
    fired = []

    def holding_reserve(seq_id, n):
        if not fired[1:] and seq_id in (c, d):
            raise OutOfPagesError("simulated: no room to join")
        return reserve(seq_id, n)

    def blocking_append(seq_id, n=1):
        if llm.chain.state is not None and not fired[1:]:
            if seq_id == c and not fired and alloc.num_tokens(c) % C:
                alloc.fork(c, "ghost")  # C's last page is shared: its next slot copies it
                fired.append("shared")
            elif seq_id == d and fired:
                fired.append("blocked")
                raise OutOfPagesError("simulated: D cannot grow")
        return append_slots(seq_id, n)

    alloc.reserve, alloc.append_slots = holding_reserve, blocking_append
    return ids, fired


def _expected():
    ref = make_llm(join_running=False).generate(PROMPTS, PARAMS)
    return [o.outputs[0].token_ids for o in ref]


def test_the_copies_of_a_blocked_plan_beside_a_chain_run():
    llm = make_llm()
    ids, fired = _blocked_round(llm)
    starts = None
    while llm.has_unfinished_requests():
        before = list(fired)
        llm.step()
        if fired == ["shared", "blocked"] and before != fired:
            assert llm.chain.state is None  # blocked: the chain ended
            starts = llm.stats()["chain_starts"]
    assert starts is not None, "the blocked round did not happen"
    assert llm.stats()["chain_starts"] > starts  # the next step started a chain again
    assert [llm.get_output(r).outputs[0].token_ids for r in ids] == _expected()
    llm.alloc.free("ghost")
    llm.alloc.check_invariants()
    assert llm.stats()["pages_used"] == 0


def test_a_failure_after_planning_fails_the_requests_page_ops_name(monkeypatch):
    """The round fails after its plan beside the chain was made and before its page
    operations ran (as when the loop in flight failed): the requests its page operations
    name fail too, though none of them is scheduled (a blocked plan schedules nothing), so
    none keeps a page that never received its copy."""
    llm = make_llm()
    ids, fired = _blocked_round(llm)
    plan_next = llm.chain._plan_next

    def failing(*args, **kwargs):
        out = plan_next(*args, **kwargs)
        if fired == ["shared", "blocked"] and not failing.done:
            failing.done = True
            raise RuntimeError("simulated failure of the loop in flight")
        return out

    failing.done = False
    monkeypatch.setattr(llm.chain, "_plan_next", failing)
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o
    assert failing.done
    reasons = [outs[r].outputs[0].finish_reason for r in ids]
    assert reasons == ["error", "error", "error", "length"]  # A, B (the chain), C; D runs on
    assert "simulated failure" in outs[ids[2]].error
    assert outs[ids[3]].outputs[0].token_ids == _expected()[3]
    llm.alloc.free("ghost")
    llm.alloc.check_invariants()
    assert llm.stats()["pages_used"] == 0


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failed_step_beside_a_chain_fails_its_requests(monkeypatch, threaded):
    """The step beside the chain raises (in the dispatch thread, before the loop): the
    chain's rows and every request of that step fail, their pages are freed, and the engine
    serves the next requests as a fresh one would."""
    llm = make_llm()
    llm.chain.threaded_dispatch = threaded
    step = llm.runner.step
    failed = []

    def flaky(*args, **kwargs):
        if llm.chain.state is not None and not failed:
            failed.append(True)
            raise RuntimeError("simulated failure of the step beside the chain")
        return step(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "step", flaky)
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:2], PARAMS[:2], strict=True)]
    while llm.chain.state is None:
        llm.step()
    ids += [llm.add_request(p, sp) for p, sp in zip(PROMPTS[2:], PARAMS[2:], strict=True)]
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o
        llm.alloc.check_invariants()
    assert failed
    assert [outs[r].outputs[0].finish_reason for r in ids] == ["error"] * 4
    assert all("simulated failure" in outs[r].error for r in ids)
    assert llm.stats()["pages_used"] == 0
    again = llm.generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in again] == _expected()
