"""Aborting a request while a chained decode loop is in flight leaves the others unchanged.

The loop in flight at the abort was dispatched with the aborted row's pages; it runs before any
later device call (one stream), so the pages' next owner writes after it. The loop dispatched
after the abort from the previous loop's device carry must not decode the aborted row (its
host block table is gone): the engine clears the row's ``active`` flag in the carry.
"""

import numpy as np
import pytest

import jpaged
from tests._engine_helpers import make_llm, random_prompts

MAX_TOKENS = 40


def _params(i):
    return jpaged.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i,
                                 ignore_eos=True)  # fmt: skip


def _reference(prompts):
    """Each request's tokens on a large pool, nothing aborted."""
    llm = make_llm()
    outs = llm.generate(prompts, [_params(i) for i in range(len(prompts))])
    return [o.outputs[0].token_ids for o in outs]


def _in_flight(llm, rid) -> bool:
    """True if a decode loop covering ``rid`` was dispatched and not yet processed."""
    chain = llm.chain.state
    return chain is not None and any(it.request.request_id == rid for it in chain[0])


def _run(llm, prompts, abort_at, *, second_wave=()):
    """Adds ``prompts``; aborts ``abort_at[i]`` (a prompt index) once a loop covering it is in
    flight and it has generated at least ``i + 1`` chunks; adds ``second_wave`` prompts (with
    indices after ``prompts``) right after the first abort. Returns the ids and how many aborts
    happened with a loop in flight."""
    ids = [llm.add_request(p, _params(i)) for i, p in enumerate(prompts)]
    pending = list(abort_at)
    hits = 0
    wave = list(second_wave)
    while llm.has_unfinished_requests():
        llm.step()
        if pending:
            rid = ids[pending[0]]
            out = llm.get_output(rid)
            if _in_flight(llm, rid) and len(out.outputs[0].token_ids) >= 4 * (hits + 1):
                assert not out.finished
                llm.abort(rid)
                pending.pop(0)
                hits += 1
                for j, p in enumerate(wave):
                    ids.append(llm.add_request(p, _params(len(prompts) + j)))
                wave = []
    return ids, hits


def _check(llm, ids, expected, aborted):
    for i, rid in enumerate(ids):
        out = llm.get_output(rid)
        if i in aborted:
            assert out.outputs[0].finish_reason == "abort", f"request {i}"
        else:
            assert out.outputs[0].finish_reason == "length", f"request {i}"
            assert out.outputs[0].token_ids == expected[i], f"request {i}"
    llm.alloc.check_invariants()
    s = llm.stats()
    assert s["pages_used"] == 0 and s["pages_shared"] == 0
    assert s["loop_decode_steps"] > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_abort_during_a_chain_leaves_the_others_unchanged(prefix_caching):
    # Nothing waits: the loop after the abort is chained from the in-flight loop's carry with
    # the aborted row still active on device.
    prompts = random_prompts(0, [5, 9, 12, 7])
    expected = _reference(prompts)
    llm = make_llm(enable_prefix_caching=prefix_caching)
    ids, hits = _run(llm, prompts, abort_at=[2, 1])
    assert hits == 2
    _check(llm, ids, expected, aborted={1, 2})


def test_abort_in_flight_with_a_tiny_pool_and_a_shared_prefix_wave():
    # A pool too small for all (24 pages, ~8 per request): requests wait, and the aborted
    # request's pages go to the waiting ones (and to a second wave sharing the aborted
    # request's prompt prefix; with 20 pages the waiting ones evict its cached prompt pages
    # before the wave is admitted, which depends on admission timing, not on correctness).
    rng = np.random.default_rng(1)
    prompts = random_prompts(2, [17, 6, 10, 8, 11])
    prefix = prompts[0][:16]
    wave = [prefix + rng.integers(3, 300, size=n).tolist() for n in (3, 9)]
    expected = _reference(prompts + wave)
    llm = make_llm(num_pages=24, watermark=0.0)
    ids, hits = _run(llm, prompts, abort_at=[0, 3], second_wave=wave)
    assert hits == 2
    _check(llm, ids, expected, aborted={0, 3})
    # The second wave reuses the aborted request's two full prompt pages from the prefix cache.
    assert [llm.get_output(r).num_cached_tokens for r in ids[5:]] == [16, 16]
