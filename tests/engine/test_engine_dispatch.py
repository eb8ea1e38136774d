"""The decode-loop dispatch thread (used on GPU, forced on here): tokens, retirement of
finished requests mid-chain, failures in the thread, thread-local JAX settings."""

import threading

import jax
import numpy as np
import pytest
from _engine_helpers import make_llm, random_prompts
from test_engine import dense_greedy

import jpaged
from jpaged.engine.requests import Status

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ``make test`` (CPU CI) runs the first parameter set of the slowest test here (35-45 s each on
# 2 cores); ``make test-all`` both (``tests/conftest.py``).
SLOW_CASES = {"test_a_chain_ends_for_a_waiting_request_only_if_the_next_step_admits_it[24-8-16-2]"}


def serve_through_failures(llm, message, check):
    """Steps ``llm`` until done; every ``RuntimeError`` must carry ``message`` and pass
    ``check()``. Returns (failures, the last output of each request)."""
    raised, outs = 0, {}
    while llm.has_unfinished_requests():
        try:
            for o in llm.step():
                outs[o.request_id] = o
        except RuntimeError as e:
            assert message in str(e)
            raised += 1
            check()
    return raised, outs


def threaded_llm(**kw):
    llm = make_llm(num_decode_steps=4, enable_prefix_caching=False, **kw)
    llm.chain.threaded_dispatch = True  # the GPU's setting
    return llm


@pytest.mark.parametrize("blocking", [False, True])
def test_loops_run_in_the_dispatch_thread_and_tokens_are_unchanged(monkeypatch, blocking):
    """Also when the dispatch blocks (CPU with async dispatch off, as a GPU loop's call)."""
    llm = threaded_llm()
    threads = []
    loop = llm.runner.decode_loop

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return loop(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "decode_loop", spy)
    prompts = random_prompts(14, (3, 9, 17))
    old = jax.config.read("jax_cpu_enable_async_dispatch")
    jax.config.update("jax_cpu_enable_async_dispatch", not blocking)
    try:
        outs = llm.generate(prompts, jpaged.SamplingParams(max_tokens=14, **GREEDY))
    finally:
        jax.config.update("jax_cpu_enable_async_dispatch", old)
    assert len(threads) >= 2 and all(t.startswith("jpaged-dispatch") for t in threads)
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(p, 14) for p in prompts]
    assert llm.stats()["pages_used"] == 0


@pytest.mark.parametrize("threaded", [False, True])
def test_rows_finished_mid_chain_are_reported_once_even_with_keep_finished_0(threaded):
    llm = threaded_llm(keep_finished=0)
    llm.chain.threaded_dispatch = threaded
    prompts = random_prompts(15, (4, 5, 6))
    ids = [llm.add_request(p, jpaged.SamplingParams(max_tokens=n, **GREEDY))
           for p, n in zip(prompts, (5, 30, 30), strict=True)]  # fmt: skip
    finals = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id not in finals  # nothing after its final output
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    assert finals == {i: dense_greedy(p, n) for i, p, n in zip(ids, prompts, (5, 30, 30),
                                                               strict=True)}  # fmt: skip
    outs = list(llm.stream(prompts, jpaged.SamplingParams(max_tokens=12, **GREEDY)))
    done = [o for o in outs if o.finished]
    assert [o.outputs[0].token_ids for o in done] == [dense_greedy(p, 12) for p in prompts]


def test_a_failed_loop_ends_its_chain_and_the_engine_keeps_serving(monkeypatch):
    llm = threaded_llm()
    loop = llm.runner.decode_loop
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # the first chained loop, before it takes the pool
            raise RuntimeError("RESOURCE_EXHAUSTED: simulated")
        return loop(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "decode_loop", flaky)
    prompts = random_prompts(16, (3, 11))
    for p in prompts:
        llm.add_request(p, jpaged.SamplingParams(max_tokens=20, **GREEDY))

    def check():
        assert llm.chain.state is None
        llm.alloc.check_invariants()

    raised, outs = serve_through_failures(llm, "simulated", check)
    assert raised == 1
    assert [outs[str(i)].outputs[0].token_ids for i in range(2)] == [
        dense_greedy(p, 20) for p in prompts
    ]
    assert llm.stats()["pages_used"] == 0


def test_the_callers_matmul_precision_follows_the_loop():
    llm = threaded_llm()
    prompts = random_prompts(17, (3, 7))
    params = jpaged.SamplingParams(max_tokens=10, **GREEDY)
    with jax.default_matmul_precision("highest"):
        llm.warmup()
        warm = llm.stats()["recompiles"]
        outs = llm.generate(prompts, params)
        assert llm.stats()["recompiles"] == warm  # the loop traced under the same setting
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(p, 10) for p in prompts]


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failure_while_processing_a_loop_raises_itself_and_keeps_the_pool_consistent(
    monkeypatch, threaded
):
    """An error after some rows' tokens were taken (lengths not yet caught up in the
    allocator) is raised as itself; rows keep exactly their computed tokens and the engine
    finishes every request correctly."""
    llm = threaded_llm()
    llm.chain.threaded_dispatch = threaded
    append = llm.appender.append_many
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # the second row of the first loop processed
            raise RuntimeError("simulated host failure")
        return append(*args, **kwargs)

    monkeypatch.setattr(llm.appender, "append_many", flaky)
    prompts = random_prompts(18, (3, 6, 10))
    ids = [llm.add_request(p, jpaged.SamplingParams(max_tokens=20, **GREEDY)) for p in prompts]

    def check():
        llm.alloc.check_invariants()
        for rid in ids:
            seq = llm._requests[rid].seqs[0]
            assert llm.alloc.num_tokens(seq.seq_id) == seq.num_computed

    raised, outs = serve_through_failures(llm, "simulated host failure", check)
    assert raised == 1
    assert [outs[i].outputs[0].token_ids for i in ids] == [dense_greedy(p, 20) for p in prompts]
    assert llm.stats()["pages_used"] == 0


def test_a_failure_after_the_loop_took_the_pool_says_the_pool_is_lost(monkeypatch):
    llm = threaded_llm()
    loop = llm.runner.decode_loop
    calls = [0]

    def fails_after(*args, **kwargs):
        out = loop(*args, **kwargs)  # the pool is donated and gone
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("simulated device failure")
        return out

    monkeypatch.setattr(llm.runner, "decode_loop", fails_after)
    for p in random_prompts(19, (3, 11)):
        llm.add_request(p, jpaged.SamplingParams(max_tokens=20, **GREEDY))
    with pytest.raises(RuntimeError, match="simulated device failure"):
        for _ in range(20):
            llm.step()
    with pytest.raises(RuntimeError, match=r"K/V pool was lost.*build a new jpaged\.LLM"):
        llm.step()


def test_a_chain_of_loops_compiles_nothing_after_warmup():
    """Chained loops (the next dispatched from the previous one's carry, aborted rows masked)
    run no program that warm-up did not compile: not even a small eager op. A row bucket
    (24) no other test uses, so nothing was compiled for it before."""
    compiles = [0]

    def count(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    llm = make_llm(num_decode_steps=4, max_num_seqs=24, enable_prefix_caching=False)
    llm.warmup()
    before = compiles[0]
    prompts = random_prompts(20, [3] * 20)
    ids = [llm.add_request(p, jpaged.SamplingParams(max_tokens=13, **GREEDY)) for p in prompts]
    llm.step()  # prefill
    llm.step()  # starts a loop
    llm.abort(ids[0])  # the chain's next loop masks this row
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.stats()["loop_decode_steps"] > 0
    assert compiles[0] == before


@pytest.mark.parametrize("full", ["seats", "pages"])
def test_a_waiting_request_that_cannot_be_admitted_does_not_end_the_chain(monkeypatch, full):
    # With every seat taken (or the pool full), the head of the queue waits whether the chain
    # ends or not: ending it per loop would only start a new chain per loop (a wait for the
    # pool, a scheduling step and a fresh upload of the loop's inputs each time). Tokens are
    # unchanged either way.
    kw = {"max_num_seqs": 2} if full == "seats" else {"num_pages": 8, "watermark": 0.0}
    prompts = random_prompts(2, (5, 9, 14))
    params = jpaged.SamplingParams(max_tokens=24, **GREEDY)
    chains = []
    llm = threaded_llm(**kw)
    start = llm.chain.start

    def counting(plan):
        chains.append(1)
        return start(plan)

    monkeypatch.setattr(llm.chain, "start", counting)
    outs = llm.generate(prompts, params)
    for o, p in zip(outs, prompts, strict=True):
        assert o.error is None and o.outputs[0].token_ids == dense_greedy(p, 24)
    # Chains started: with the chain ended at every loop for the waiting request, 7 (seats)
    # and 8 (pages: 8 pages of 8 tokens for 4 + 5 + 5 pages, one swap) here.
    assert len(chains) <= (3 if full == "seats" else 5), len(chains)


@pytest.mark.parametrize("pages,k,C,seed", [(64, 4, 8, 1), (24, 8, 16, 2)])
def test_a_chain_ends_for_a_waiting_request_only_if_the_next_step_admits_it(pages, k, C, seed):
    # `can_admit_head(k + 1)` at the end of each loop predicts the admission of the step
    # after the chain ends (no chain ended for nothing), under a pool that keeps requests
    # waiting; every request still gets the tokens of an unconstrained run. (Predicting from
    # the lengths before the loop in flight, `can_admit_head(1)`, ends chains for nothing in
    # both cases.)
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for _ in range(40):
        n, max_tokens = int(rng.integers(3, 40)), int(rng.integers(8, 60))
        prompts.append(rng.integers(3, 300, n).tolist())
        params.append(jpaged.SamplingParams(max_tokens=max_tokens, **GREEDY))
    kw = dict(num_decode_steps=k, page_size=C, enable_prefix_caching=False, max_model_len=128,
              max_num_seqs=16, max_num_batched_tokens=64)  # fmt: skip
    expected = [
        o.outputs[0].token_ids for o in make_llm(num_pages=512, **kw).generate(prompts, params)
    ]
    llm = make_llm(num_pages=pages, watermark=0.0, **kw)
    ended_for = []
    may_chain = llm.chain._may_chain

    def watching(items):
        ok = may_chain(items)
        if not ok and 2 * sum(not it.seq.finished for it in items) >= len(items):
            ended_for.append(llm.scheduler.waiting[0])  # ended for the head of the queue
        return ok

    llm.chain._may_chain = watching
    try:
        ids = [llm.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        checked = 0
        while llm.has_unfinished_requests():
            llm.step()
            if ended_for and llm.chain.state is None:  # the chain ended: the next step admits
                head = ended_for.pop()
                preempted = llm.stats()["preemptions_recompute"] + llm.stats()["preemptions_swap"]
                llm.step()
                after = llm.stats()["preemptions_recompute"] + llm.stats()["preemptions_swap"]
                if after == preempted:
                    assert head.status not in (Status.WAITING, Status.SWAPPED)
                    checked += 1
    finally:
        del llm.chain._may_chain
    assert checked >= 2
    assert [llm.get_output(rid).outputs[0].token_ids for rid in ids] == expected
