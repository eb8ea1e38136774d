"""A chain of decode loops started from a step with prefill
(`jpaged.engine.decode_chain.DecodeChain.start_from_step`).

With no chain running, a plan with prefill whose requests can all be in a decode loop runs as
the step before the chain's first loop, in one dispatch: the loop is on the device before the
host reads the step's tokens. The tokens are those of single steps (``join_running=False``
never takes this path); rows that finish with their first token do not join, and a plan in
which no row joins, or a request cannot be in a loop, runs as a single step.
"""

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
    return _run(make_llm(join_running=False), prompts, params)


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


@pytest.mark.parametrize("extra", [{"n": 2}, {"logprobs": 2}, {"presence_penalty": 0.5}])
def test_a_request_that_cannot_be_in_a_loop_runs_the_step_alone(extra):
    prompts = random_prompts(24, (5, 9))
    params = [_params(0), _params(1, **extra)]
    llm = make_llm()
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    llm.step()
    s = llm.stats()
    assert llm.chain.state is None and s["chains_from_steps"] == 0 and s["single_steps"] == 1
    while llm.has_unfinished_requests():
        llm.step()
    ref = make_llm(join_running=False)
    ref_ids = [ref.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while ref.has_unfinished_requests():
        ref.step()
    for r, q in zip(ids, ref_ids, strict=True):
        got, want = llm.get_output(r).outputs, ref.get_output(q).outputs
        assert [o.token_ids for o in got] == [o.token_ids for o in want]


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
