"""A chain of decode loops started from a step with prefill
(`jpaged.engine.decode_chain.DecodeChain.start_from_step`).

With no chain running, a plan with prefill whose requests can all be in a decode loop runs as
the step before the chain's first loop, in one dispatch: the loop is on the device before the
host reads the step's tokens. The tokens are those of single steps (``chain_decode=False``);
rows that finish with their first token do not join, and a plan in which no row joins, a
request cannot be in a loop, or a request outside the plan would end the chain at once runs
as a single step.
"""

import threading

import pytest

import jpaged
from jpaged._errors import OutOfPagesError
from tests._engine_helpers import make_llm, random_prompts


def _params(i, **kw):
    kw = {"max_tokens": 9 + i, "temperature": 0.0, "seed": 50 + i, "ignore_eos": True, **kw}
    return jpaged.SamplingParams(**kw)


def _run(llm, prompts, params):
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while llm.has_unfinished_requests():
        llm.step()
    llm.alloc.check_invariants()
    assert llm.stats()["pages_used"] == 0
    return [llm.get_output(r).outputs[0].token_ids for r in ids]


def _reference(prompts, params):
    return _run(make_llm(chain_decode=False), prompts, params)  # one synchronous step a call


def _completions(llm, ids):
    """Every completion's (or beam's) tokens of each request ``ids``."""
    return [[o.token_ids for o in llm.get_output(r).outputs] for r in ids]


def _reference_completions(prompts, params):
    """`_completions` of the requests run by single steps alone."""
    ref = make_llm(chain_decode=False)
    ids = [ref.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while ref.has_unfinished_requests():
        ref.step()
    return _completions(ref, ids)


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
@pytest.mark.parametrize("kw", [{}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}])
def test_the_first_step_starts_the_chain_with_single_step_tokens(kw, threaded):
    prompts = random_prompts(21, (7, 3, 11))
    params = [_params(i, **kw) for i in range(3)]
    llm = make_llm()
    llm.chain.threaded_dispatch = threaded  # True: the GPU's dispatch from a worker thread
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outs = {o.request_id: o for o in llm.step()}
    # One engine step: the prefill's first tokens are out, and the chain's loop is dispatched.
    assert [len(outs[r].outputs[0].token_ids) for r in ids] == [1, 1, 1]
    assert llm.chain.state is not None
    assert sorted(it.request.request_id for it in llm.chain.state[0]) == sorted(ids)
    s = llm.stats()
    assert (s["chain_starts"], s["chains_from_steps"], s["single_steps"]) == (1, 1, 0)
    assert s["chain_joins"] == 0 and s["steps_beside_chain"] == 0  # beside a running chain only
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.get_output(r).outputs[0].token_ids for r in ids] == _reference(prompts, params)
    assert llm.stats()["pages_used"] == 0


def test_a_prompt_in_chunks_starts_the_chain_at_its_last_chunk():
    prompts = random_prompts(22, (50,))  # 32-token budget: two chunks
    params = [_params(0)]
    llm = make_llm()
    rid = llm.add_request(prompts[0], params[0])
    llm.step()  # the first chunk samples nothing: a single step
    assert llm.chain.state is None and llm.stats()["single_steps"] == 1
    llm.step()
    assert llm.chain.state is not None and llm.stats()["chains_from_steps"] == 1
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.get_output(rid).outputs[0].token_ids] == _reference(prompts, params)


def test_rows_done_after_their_first_token_do_not_join():
    prompts = random_prompts(23, (6, 8))
    params = [_params(0, max_tokens=1), _params(1)]
    llm = make_llm()
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    llm.step()
    assert llm.get_output(ids[0]).finished
    assert [it.request.request_id for it in llm.chain.state[0]] == [ids[1]]
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.get_output(r).outputs[0].token_ids for r in ids] == _reference(prompts, params)
    alone = make_llm()
    alone.add_request(prompts[0], params[0])
    alone.step()  # nothing would join: a single step, no chain
    assert alone.chain.state is None and alone.stats()["chains_from_steps"] == 0
    assert alone.stats()["single_steps"] == 1 and not alone.has_unfinished_requests()


def test_a_partial_prompt_chunk_beside_sampled_rows_decodes_beside_the_chain():
    prompts = random_prompts(28, (6, 40))  # 6 + the first 26 of 40 fill the 32-token budget
    params = [_params(0), _params(1)]
    llm = make_llm()
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    llm.step()
    assert [it.request.request_id for it in llm.chain.state[0]] == [ids[0]]
    assert llm.get_output(ids[1]).outputs[0].token_ids == []  # its rest runs beside the chain
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.stats()["steps_beside_chain"] > 0 and llm.stats()["chains_from_steps"] == 1
    assert [llm.get_output(r).outputs[0].token_ids for r in ids] == _reference(prompts, params)


_NOT_IN_A_LOOP = {
    "n=2": {"n": 2, "temperature": 1.0},
    "logprobs": {"logprobs": 2},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "presence_penalty": {"presence_penalty": 0.5},
    "logit_bias": {"logit_bias": {7: 2.0}},
    "min_p": {"min_p": 0.2, "temperature": 1.0},
    "random_beside_top_p": {"temperature": 1.0},  # the other row truncates: modes differ
}


@pytest.mark.parametrize("extra", list(_NOT_IN_A_LOOP.values()), ids=list(_NOT_IN_A_LOOP))
def test_a_request_that_cannot_be_in_a_loop_runs_the_step_alone(extra):
    prompts = random_prompts(24, (5, 9))
    first = {"temperature": 0.7, "top_p": 0.9} if "temperature" in extra else {}
    params = [_params(0, **first), _params(1, **extra)]
    llm = make_llm()
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    llm.step()
    s = llm.stats()
    assert llm.chain.state is None and s["chains_from_steps"] == 0 and s["single_steps"] == 1
    while llm.has_unfinished_requests():
        llm.step()
    assert _completions(llm, ids) == _reference_completions(prompts, params)


def test_beam_search_runs_its_prefill_as_a_single_step():
    prompts = random_prompts(29, (5, 7))
    llm = make_llm()
    llm.add_request(prompts[0], _params(0))
    beam = llm.add_request(prompts[1], jpaged.BeamSearchParams(beam_width=2, max_tokens=4))
    llm.step()
    assert llm.chain.state is None and llm.stats()["chains_from_steps"] == 0
    while llm.has_unfinished_requests():
        llm.step()
    beam_params = jpaged.BeamSearchParams(beam_width=2, max_tokens=4)
    assert _completions(llm, [beam]) == _reference_completions(prompts[1:], [beam_params])


def test_a_request_outside_the_step_that_would_end_the_chain_keeps_it_a_single_step():
    """A running request the step leaves out (the budget) that cannot join: a chain started
    here would end after its first loop, and that request would wait the loop."""
    prompts = random_prompts(30, (32, 6))
    params = [_params(0), _params(1, logprobs=1)]
    llm = make_llm(num_decode_steps=8)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    llm.step()  # the 32-token prompt takes the whole budget; the other waits
    assert llm.chain.state is None and llm.stats()["chains_from_steps"] == 0
    llm.step()
    assert len(llm.get_output(ids[1]).outputs[0].token_ids) == 1  # no loop before its step
    while llm.has_unfinished_requests():
        llm.step()
    assert _completions(llm, ids) == _reference_completions(prompts, params)


def test_a_pool_too_short_for_the_first_loop_runs_the_step_alone(monkeypatch):
    prompts = random_prompts(25, (6, 4))
    params = [_params(0), _params(1)]
    llm = make_llm()
    reserve = llm.alloc.reserve

    def short(seq_id, n):  # the joined rows' reservations fail, once each
        if calls.setdefault(seq_id, 0) == 0:
            calls[seq_id] = 1
            raise OutOfPagesError("pool short (test)")
        return reserve(seq_id, n)

    calls = {}
    monkeypatch.setattr(llm.alloc, "reserve", short)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    llm.step()
    s = llm.stats()
    assert llm.chain.state is None and s["chains_from_steps"] == 0 and s["single_steps"] == 1
    assert len(calls) == 2  # both rows tried to join
    # The allocator is as one single step leaves it: nothing reserved, no copies.
    ref = make_llm(chain_decode=False)
    ref_ids = [ref.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    ref.step()
    for key in ("pages_used", "pages_free", "cow_copies"):
        assert s[key] == ref.stats()[key], key
    for r, q in zip(ids, ref_ids, strict=True):
        seq, ref_seq = llm._book[r].seqs[0].seq_id, ref._book[q].seqs[0].seq_id
        assert llm.alloc.num_tokens(seq) == ref.alloc.num_tokens(ref_seq)
        assert len(llm.alloc.block_table(seq)) == len(ref.alloc.block_table(ref_seq))
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.get_output(r).outputs[0].token_ids for r in ids] == _reference(prompts, params)
    assert llm.stats()["pages_used"] == 0


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_a_failed_dispatch_fails_the_steps_requests_and_the_engine_serves_on(monkeypatch,
                                                                            threaded):  # fmt: skip
    prompts = random_prompts(26, (6, 4, 5))
    params = [_params(i) for i in range(3)]
    llm = make_llm()
    llm.chain.threaded_dispatch = threaded
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2], strict=True)]
    loop = llm.runner.decode_loop

    def broken(*a, **k):
        raise RuntimeError("device call failed (test)")

    monkeypatch.setattr(llm.runner, "decode_loop", broken)
    llm.step()  # the step and the loop in one dispatch: the loop fails in it, or (dispatched
    while not all(llm.get_output(r).finished for r in ids):  # from a thread) at the next step
        llm.step()
    monkeypatch.setattr(llm.runner, "decode_loop", loop)
    for r in ids:
        out = llm.get_output(r)
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert "device call failed (test)" in out.error
    assert llm.chain.state is None and llm.stats()["pages_used"] == 0
    assert _run(llm, prompts[2:], params[2:]) == _reference(prompts[2:], params[2:])


def test_a_step_that_fails_in_the_dispatch_thread_ends_the_chain_at_once(monkeypatch):
    prompts = random_prompts(31, (6, 4, 5))
    params = [_params(i) for i in range(3)]
    llm = make_llm()
    llm.chain.threaded_dispatch = True
    step = llm.runner.step

    def broken(*a, **k):
        if threading.current_thread().name.startswith("jpaged-dispatch"):
            raise RuntimeError("step failed in the dispatch thread (test)")
        return step(*a, **k)

    monkeypatch.setattr(llm.runner, "step", broken)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2], strict=True)]
    llm.step()
    for r in ids:
        out = llm.get_output(r)
        assert out.outputs[0].finish_reason == "error" and "dispatch thread" in out.error
    assert llm.chain.state is None and llm.stats()["pages_used"] == 0
    monkeypatch.setattr(llm.runner, "step", step)
    new = llm.add_request(prompts[2], params[2])
    assert llm.step() and len(llm.get_output(new).outputs[0].token_ids) == 1  # served at once
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.get_output(new).outputs[0].token_ids] == _reference(prompts[2:], params[2:])
