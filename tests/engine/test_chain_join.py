"""Admission beside a running chain of decode loops (`jpaged.engine.chain_join`).

Requests arrive while a chain runs (``add_request`` between ``step`` calls): with
``join_running`` their prefills run between two loops and their rows join the chain, which
goes on; without it each admission ends the chain and runs as a single step. Either way every
request gets the same tokens (greedy and seeded sampling are batch-invariant), and nothing
compiles after warm-up.
"""

import pytest

import jpaged
from jpaged._errors import OutOfPagesError
from tests._engine_helpers import ENGINE, make_llm, random_prompts

LENGTHS = (5, 12, 40, 3, 50, 9, 17, 2)  # 40 and 50 run in chunks (32-token budget)
# Left out of ``make test``, run by ``make test-all`` (``tests/conftest.py``): joins under
# swap preemption (in CI: tests/engine/test_warmup.py's test_no_compiles_after_warmup_through_
# swaps_joins_and_a_replaced_pool; swap preemption without joins: test_engine_sharing.py).
SLOW_CASES = {"test_preemption_while_rows_join[swap]"}


def _params(i, *, temperature=0.0, **kw):
    return jpaged.SamplingParams(max_tokens=14 + i, temperature=temperature, seed=100 + i,
                                 ignore_eos=True, **kw)  # fmt: skip


def _stream(llm, prompts, params, *, abort=None, every=2):
    """Adds the first request, then one more every ``every`` steps while a chain runs (or
    when nothing runs); ``abort(llm, ids)`` runs after each step. Returns the ids."""
    ids = [llm.add_request(prompts[0], params[0])]
    steps = 0
    while llm.has_unfinished_requests() or len(ids) < len(prompts):
        if len(ids) < len(prompts) and (
            (llm.chain.state is not None and steps % every == 0)
            or not llm.has_unfinished_requests()
        ):
            ids.append(llm.add_request(prompts[len(ids)], params[len(ids)]))
        llm.step()
        steps += 1
        if abort is not None:
            abort(llm, ids)
    return ids


def _tokens(llm, ids):
    return [llm.get_output(r).outputs[0].token_ids for r in ids]


def _reasons(llm, ids):
    return [llm.get_output(r).outputs[0].finish_reason for r in ids]


def _check_released(llm):
    llm.alloc.check_invariants()
    s = llm.stats()
    assert s["pages_used"] == 0 and s["running"] == 0 and s["waiting"] == 0


def test_same_tokens_with_joining_on_and_off_and_fewer_single_steps():
    prompts = random_prompts(7, LENGTHS)
    for kw in (dict(), dict(temperature=1.0), dict(temperature=0.8, top_k=20)):
        params = [_params(i, **kw) for i in range(len(prompts))]
        on, off = make_llm(), make_llm(join_running=False)
        ids_on = _stream(on, prompts, params)
        ids_off = _stream(off, prompts, params)
        assert _tokens(on, ids_on) == _tokens(off, ids_off), kw
        assert _reasons(on, ids_on) == ["length"] * len(prompts)
        s_on, s_off = on.stats(), off.stats()
        assert s_on["chain_joins"] > 0 and s_on["steps_beside_chain"] > 0
        assert s_off["chain_joins"] == 0 and s_off["steps_beside_chain"] == 0
        # Admissions do not end chains: fewer chains, fewer host-synchronous steps.
        assert s_on["single_steps"] < s_off["single_steps"], (s_on, s_off)
        assert s_on["chain_starts"] < s_off["chain_starts"]
        assert s_on["tokens_generated"] == s_off["tokens_generated"]
        for llm in (on, off):
            _check_released(llm)


def test_an_admission_does_not_end_the_chain():
    llm = make_llm()
    prompts = random_prompts(8, (6, 9, 4))
    ids = [llm.add_request(p, _params(i)) for i, p in enumerate(prompts[:2])]
    llm.step()  # the prefill and the chain's first loop, in one dispatch
    llm.step()  # the next loop
    assert llm.chain.state is not None
    starts, singles = llm.stats()["chain_starts"], llm.stats()["single_steps"]
    ids.append(llm.add_request(prompts[2], _params(2)))
    outs = {o.request_id: o for o in llm.step()}
    # The new request was prefilled beside the chain, which runs on with its row.
    assert llm.chain.state is not None
    assert len(outs[ids[2]].outputs[0].token_ids) == 1
    assert any(it.request.request_id == ids[2] for it in llm.chain.state[0])
    s = llm.stats()
    assert (s["chain_starts"], s["single_steps"]) == (starts, singles)
    assert s["chain_joins"] == 1 and s["steps_beside_chain"] == 1
    while llm.has_unfinished_requests():
        llm.step()
    ref = make_llm(join_running=False).generate(prompts, [_params(i) for i in range(3)])
    assert _tokens(llm, ids) == [o.outputs[0].token_ids for o in ref]
    _check_released(llm)


def test_no_compiles_after_warmup_and_the_carry_grows():
    # Two row buckets (16, 20): a chain of 16 rows grows to 20 for rows that join it.
    kw = dict(num_pages=256, max_num_seqs=20)
    llm = make_llm(**kw)
    report = llm.warmup(threads=2)
    names = [p.name for p in report.programs]
    assert "grow B=16->20" in names and "join B=20 R=16" in names
    warm = llm.stats()["recompiles"]
    prompts = random_prompts(9, [3 + i % 7 for i in range(20)])
    params = [_params(i % 5) for i in range(20)]
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts[:16], params[:16], strict=True)]
    while llm.chain.state is None:
        llm.step()
    ids += [llm.add_request(p, sp) for p, sp in zip(prompts[16:], params[16:], strict=True)]
    while llm.has_unfinished_requests():
        llm.step()
    s = llm.stats()
    assert s["recompiles"] == warm
    assert s["chain_grows"] > 0 and s["chain_joins"] >= 4
    off = make_llm(join_running=False, **kw)
    ref = off.generate(prompts, params)
    assert _tokens(llm, ids) == [o.outputs[0].token_ids for o in ref]
    _check_released(llm)


def test_abort_mid_prefill_beside_a_chain():
    prompts = random_prompts(10, (5, 7, 50, 6))  # 50 tokens: two chunks beside the chain
    params = [_params(i, temperature=1.0) for i in range(4)]
    hits = []

    def abort(llm, ids):
        if len(ids) > 2 and not hits:
            req = llm._book.by_id[ids[2]]
            seq = req.seqs[0]
            if 0 < seq.num_computed < len(req.prompt) and llm.chain.state is not None:
                llm.abort(ids[2])
                hits.append(seq.num_computed)

    llm = make_llm()
    ids = _stream(llm, prompts, params, abort=abort, every=1)
    assert hits, "the long prompt was not caught mid-prefill beside a chain"
    assert _reasons(llm, ids) == ["length", "length", "abort", "length"]
    off = make_llm(join_running=False)
    ref = off.generate([prompts[i] for i in (0, 1, 3)], [params[i] for i in (0, 1, 3)])
    got = _tokens(llm, ids)
    assert [got[i] for i in (0, 1, 3)] == [o.outputs[0].token_ids for o in ref]
    assert llm.stats()["steps_beside_chain"] > 0
    _check_released(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_while_rows_join(mode):
    # A pool too small for every request: chains end when they cannot reserve ahead, and
    # the scheduler preempts; requests keep arriving while chains run.
    prompts = random_prompts(11, (20, 9, 30, 14, 25, 11, 18, 6))
    params = [jpaged.SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    results = {}
    for join in (True, False):
        llm = make_llm(num_pages=14, preemption_mode=mode, join_running=join)
        ids = _stream(llm, prompts, params, every=1)
        assert _reasons(llm, ids) == ["length"] * len(prompts)
        results[join] = _tokens(llm, ids)
        s = llm.stats()
        assert s[f"preemptions_{mode}"] > 0, (mode, join)
        assert (s["chain_joins"] > 0) == join
        _check_released(llm)
    ref = make_llm().generate(prompts, params)  # 64 pages hold all eight: no preemption
    expected = [o.outputs[0].token_ids for o in ref]
    assert all(r == expected for r in results.values())


def _chain_of_two(llm, prompts):
    """Starts a chain over two requests; returns their ids."""
    ids = [llm.add_request(p, _params(i)) for i, p in enumerate(prompts[:2])]
    while llm.chain.state is None:
        llm.step()
    return ids


def _finish(llm, ids):
    while llm.has_unfinished_requests():
        llm.step()
    return [llm.get_output(r).outputs[0] for r in ids]


def _reference(prompts, params):
    ref = make_llm(join_running=False).generate(prompts, params)
    return [o.outputs[0].token_ids for o in ref]


def test_a_first_token_stop_joins_with_its_row_inactive():
    prompts = random_prompts(12, (6, 8, 5))
    t = _reference(prompts[2:], [_params(2)])[0][0]  # its first greedy token
    params = [_params(0), _params(1), _params(2, stop_token_ids=[t])]
    llm = make_llm()
    ids = _chain_of_two(llm, prompts)
    ids.append(llm.add_request(prompts[2], params[2]))
    llm.step()  # its prefill beside the chain, its row joins the next loop
    items, _, fut = llm.chain.state
    (slot,) = [b for b, it in enumerate(items) if it.request.request_id == ids[2]]
    carry = fut.result()[0][4]
    assert not bool(carry.active[slot])  # stopped on device by its first token
    assert llm.stats()["chain_joins"] == 1
    outs = _finish(llm, ids)
    assert (outs[2].token_ids, outs[2].finish_reason) == ([t], "stop")
    assert [o.token_ids for o in outs] == _reference(prompts, params)
    _check_released(llm)


def test_requests_that_cannot_join_end_the_chain():
    # Log-probabilities (a plain chain's loop lacks them); n = 2 (two sequences).
    prompts = random_prompts(13, (6, 8, 5, 7))
    params = [_params(0), _params(1), _params(2, logprobs=2), _params(3, n=2, temperature=1.0)]
    got = {}
    for join in (True, False):
        llm = make_llm(join_running=join)
        ids = _chain_of_two(llm, prompts)
        for i in (2, 3):
            while llm.chain.state is None:  # a chain runs when the request arrives
                llm.step()
            starts = llm.stats()["chain_starts"]
            ids.append(llm.add_request(prompts[i], params[i]))
            llm.step()
            assert llm.chain.state is None  # the chain ended for it
            while llm.chain.state is None and llm.has_unfinished_requests():
                llm.step()
            assert llm.stats()["chain_starts"] > starts
        assert llm.stats()["chain_joins"] == 0
        _finish(llm, ids)
        outs = [llm.get_output(r) for r in ids]
        got[join] = [[(c.token_ids, c.finish_reason, c.logprobs is not None) for c in o.outputs]
                     for o in outs]  # fmt: skip
        _check_released(llm)
    assert got[True] == got[False]
    assert got[True][2][0][2] and len(got[True][3]) == 2


def test_max_tokens_1_beside_a_chain_finishes_without_joining():
    prompts = random_prompts(14, (6, 8, 5))
    params = [_params(0), _params(1), jpaged.SamplingParams(max_tokens=1, temperature=0.0)]
    llm = make_llm()
    ids = _chain_of_two(llm, prompts)
    ids.append(llm.add_request(prompts[2], params[2]))
    outs = {o.request_id: o for o in llm.step()}
    assert outs[ids[2]].finished and outs[ids[2]].outputs[0].finish_reason == "length"
    assert llm.chain.state is not None  # the chain goes on
    s = llm.stats()
    assert s["chain_joins"] == 0 and s["steps_beside_chain"] == 1
    assert [o.token_ids for o in _finish(llm, ids)] == _reference(prompts, params)
    _check_released(llm)


def test_a_join_out_of_pages_decodes_beside_and_joins_next_time(monkeypatch):
    prompts = random_prompts(15, (6, 8, 5))
    params = [_params(i) for i in range(3)]
    llm = make_llm()
    ids = _chain_of_two(llm, prompts)
    ids.append(llm.add_request(prompts[2], params[2]))
    seq_id = llm._book.by_id[ids[2]].seqs[0].seq_id
    reserve, refused = llm.alloc.reserve, []

    def short_once(sid, n):
        if sid == seq_id and not refused:
            refused.append(n)
            raise OutOfPagesError("simulated: no room for the join's first loop")
        return reserve(sid, n)

    monkeypatch.setattr(llm.alloc, "reserve", short_once)
    llm.step()  # its prefill beside the chain; its join's reservation fails
    assert refused and llm.stats()["chain_joins"] == 0
    llm.step()  # it decodes one token beside the chain, then joins
    s = llm.stats()
    assert s["chain_joins"] == 1 and s["steps_beside_chain"] == 2
    assert llm.chain.state is not None
    assert any(it.request.request_id == ids[2] for it in llm.chain.state[0])
    assert [o.token_ids for o in _finish(llm, ids)] == _reference(prompts, params)
    _check_released(llm)


def test_a_stop_string_on_a_joined_rows_first_token():
    llm = jpaged.LLM("tests/checkpoints/llama2", **{**ENGINE, "debug": True})
    greedy = jpaged.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The quick brown fox", "Once upon a time", "Hello there, my"]
    first = llm.generate(prompts[2], greedy)[0].outputs[0]
    stop = llm.tokenizer.decode(first.token_ids[:1]).strip()
    assert stop
    params = [greedy, greedy, jpaged.SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True, stop=[stop])]  # fmt: skip
    got = {}
    for join in (True, False):
        llm = jpaged.LLM("tests/checkpoints/llama2", **ENGINE, join_running=join)
        ids = [llm.add_request(p, greedy) for p in prompts[:2]]
        while llm.chain.state is None:
            llm.step()
        ids.append(llm.add_request(prompts[2], params[2]))
        llm.step()
        assert llm.stats()["chain_joins"] == int(join)
        _finish(llm, ids)
        outs = [llm.get_output(r).outputs[0] for r in ids]
        got[join] = [(o.token_ids, o.text, o.finish_reason) for o in outs]
        _check_released(llm)
    assert got[True] == got[False]
    assert got[True][2][2] == "stop" and len(got[True][2][0]) == 1  # its first token
