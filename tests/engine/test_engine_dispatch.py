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


def serve_through_failures(llm, check):
    """Steps ``llm`` until done (a failing step raises nothing), running ``check()`` after
    every step. Returns the last output of each request."""
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o
        check()
    return outs


def assert_failed_by(out, message):
    """``out`` failed in a step that raised ``message``: finish reason "error", the
    exception in ``RequestOutput.error``."""
    assert out.finished and out.error is not None and message in out.error, out
    assert {c.finish_reason for c in out.outputs} == {"error"}


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


def test_a_failed_loop_fails_its_rows_and_the_engine_keeps_serving(monkeypatch):
    """A loop that raises in the dispatch thread before taking the pool: its rows fail
    ("error", the exception's message), their pages are freed, and the engine serves the
    next call as a fresh one would."""
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
        llm.alloc.check_invariants()

    outs = serve_through_failures(llm, check)
    assert llm.chain.state is None
    for rid in ("0", "1"):
        assert_failed_by(outs[rid], "RESOURCE_EXHAUSTED: simulated")
        assert 0 < len(outs[rid].outputs[0].token_ids) < 20  # the first loop's tokens kept
    assert llm.stats()["pages_used"] == 0
    again = llm.generate(prompts, jpaged.SamplingParams(max_tokens=20, **GREEDY))
    assert [o.outputs[0].token_ids for o in again] == [dense_greedy(p, 20) for p in prompts]


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
def test_a_failure_while_processing_a_loop_fails_its_rows_and_keeps_the_pool_consistent(
    monkeypatch, threaded
):
    """An error after some rows' tokens were taken (lengths not yet caught up in the
    allocator): the loop's rows fail with the error, their pages are freed (invariants
    hold after every step) and the engine then serves every request correctly."""
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
    outs = serve_through_failures(llm, llm.alloc.check_invariants)
    for rid in ids:
        assert_failed_by(outs[rid], "simulated host failure")
    assert llm.stats()["pages_used"] == 0 and llm.chain.state is None
    again = llm.generate(prompts, jpaged.SamplingParams(max_tokens=20, **GREEDY))
    assert [o.outputs[0].token_ids for o in again] == [dense_greedy(p, 20) for p in prompts]


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failure_after_the_loop_took_the_pool_replaces_the_pool(monkeypatch, threaded):
    """The failed loop had taken (donated) the pool: its rows fail, a zero-filled pool
    replaces the lost one, a running request that was not in the loop starts again from
    its tokens, and the prefix cache (whose pages were lost) is emptied: later requests
    get the tokens of a fresh engine."""
    llm = make_llm(num_decode_steps=4, max_num_seqs=2)
    llm.chain.threaded_dispatch = threaded
    loop = llm.runner.decode_loop
    calls = [0]

    def fails_after(*args, **kwargs):
        out = loop(*args, **kwargs)  # the pool is donated and gone
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("simulated device failure")
        return out

    cached, solo, pair = random_prompts(19, (17, 3, 5))
    greedy = jpaged.SamplingParams(max_tokens=6, **GREEDY)
    assert llm.generate([cached], greedy)[0].outputs[0].token_ids == dense_greedy(cached, 6)
    monkeypatch.setattr(llm.runner, "decode_loop", fails_after)
    sampled = jpaged.SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=7)
    a = llm.add_request(solo, jpaged.SamplingParams(max_tokens=20, **GREEDY))
    # n=2 forks into two sequences: with max_num_seqs=2 it waits (running, unscheduled)
    # while `a` decodes alone in a loop.
    b = llm.add_request(pair, sampled)
    restarted = []
    restart = llm.scheduler.restart_running
    monkeypatch.setattr(llm.scheduler, "restart_running",
                        lambda: restarted.extend(restart()) or restarted)  # fmt: skip
    outs = serve_through_failures(llm, llm.alloc.check_invariants)
    assert [r.request_id for r in restarted] == [b]
    assert_failed_by(outs[a], "simulated device failure")
    alone = make_llm(num_decode_steps=4).generate([pair], sampled)[0]
    assert outs[b].error is None
    assert [c.token_ids for c in outs[b].outputs] == [c.token_ids for c in alone.outputs]
    assert llm.stats()["pages_used"] == 0
    out = llm.generate([cached], greedy)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == dense_greedy(cached, 6)


def test_a_chain_of_loops_compiles_nothing_after_warmup():
    """Chained loops (the next dispatched from the previous one's carry, aborted rows masked)
    run no program that warm-up did not compile: not even a small eager op. A row bucket
    (12, the only one of this configuration) no other test uses, so nothing was compiled for
    it before."""
    compiles = [0]

    def count(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    llm = make_llm(num_decode_steps=4, max_num_seqs=12, enable_prefix_caching=False)
    llm.warmup()
    before = compiles[0]
    prompts = random_prompts(20, [3] * 12)
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
    # Admissions that end the chain (joining off: tests/engine/test_chain_join.py).
    llm = make_llm(num_pages=pages, watermark=0.0, join_running=False, **kw)
    ended_for = []
    may_chain = llm.chain._may_chain

    def watching(items, *rest):
        ok = may_chain(items, *rest)
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
