"""Hypothesis throws malformed requests (and failing steps) at a running engine between valid
ones: every malformed request raises where it enters or finishes at once with an error, a
step that raises fails only its own requests, the allocator's invariants hold after every
step, and every valid request that was not in a failed step produces exactly the tokens it
produces alone.

One engine (tiny llama2 checkpoint, a small pool so requests are preempted) serves every
example in turn: what one example leaves behind would show up in the next.
"""

import functools

import numpy as np
import pytest
from _engine_helpers import make_llm, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jpaged

MAX_LEN = 64  # the helpers' max_model_len
VOCAB = 300  # the checkpoint's vocabulary

_PROMPTS = random_prompts(40, (1, 7, 8, 9, 20, 13))
VALID = [  # (prompt, params, cache_salt)
    (_PROMPTS[0], jpaged.SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True), None),
    (_PROMPTS[1], jpaged.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), None),
    (_PROMPTS[2], jpaged.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), "t1"),
    (
        _PROMPTS[3],
        jpaged.SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=11, ignore_eos=True),
        None,
    ),
    (
        _PROMPTS[4],
        jpaged.SamplingParams(max_tokens=24, temperature=0.8, n=2, seed=5, ignore_eos=True),
        None,
    ),
    (_PROMPTS[5], jpaged.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "t2"),
]
GREEDY = jpaged.SamplingParams(max_tokens=3, temperature=0.0)

# Malformed requests that must raise ValueError at add_request: (prompt, kwargs).
RAISING = [
    ([1.0, 2.0], {}),
    ([5, True], {}),
    (["12", "7"], {}),
    (b"\x05\x06", {}),
    (None, {}),
    ([5, None], {}),
    ([[5, 6]], {}),
    ({5, 6}, {}),
    (np.array([5.0, 6.0]), {}),
    ("text without a tokenizer", {}),
    ([5, 6], {"cache_salt": 123}),
    ([5, 6], {"cache_salt": ["a"]}),
    ([5, 6], {"request_id": 7}),
    ([5, 6], {"params": {"max_tokens": 3}}),
    ([5, 6], {"params": "greedy"}),
]
# Requests the engine takes and finishes at once with finish reason "error".
UNSERVABLE = [
    [],
    list(range(3, 3 + MAX_LEN)),
    [5, VOCAB],
    [5, -1],
    [5, 2**40],
]


@functools.cache
def _solo():
    """Each valid request's completions when it runs alone on a roomy engine."""
    llm = make_llm(num_decode_steps=4)
    return [
        [c.token_ids for c in llm.generate([p], sp, cache_salt=salt)[0].outputs]
        for p, sp, salt in VALID
    ]


class _Injector:
    """One-shot failures of the engine's device calls and page copies (before the call, or
    after it took the donated pool)."""

    TARGETS = (
        ("runner", "step"),
        ("runner", "decode_loop"),
        ("kv", "copy"),
        ("kv", "swap_out"),
        ("kv", "swap_in"),
    )

    def __init__(self, llm):
        self.armed = None  # (target name, after) or None
        for owner, name in self.TARGETS:
            obj = getattr(llm, owner)
            setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            armed = self.armed
            if armed is None or armed[0] != name:
                return real(*args, **kwargs)
            self.armed = None
            if armed[1]:
                real(*args, **kwargs)
            raise RuntimeError(f"injected failure in {name}")

        return call


@functools.cache
def _engine():
    llm = make_llm(num_pages=12, max_num_seqs=4, num_decode_steps=4, watermark=0.0)
    return llm, _Injector(llm)


_actions = st.one_of(
    st.tuples(st.just("valid"), st.integers(0, len(VALID) - 1)),
    st.tuples(st.just("raising"), st.integers(0, len(RAISING) - 1)),
    st.tuples(st.just("unservable"), st.integers(0, len(UNSERVABLE) - 1)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("duplicate_id"), st.just(0)),
    st.tuples(
        st.just("inject"),
        st.tuples(
            st.sampled_from(["step", "decode_loop", "copy", "swap_out", "swap_in"]), st.booleans()
        ),
    ),
)


def _run(actions):
    llm, injector = _engine()
    solo = _solo()
    valid: dict[str, int] = {}  # request id -> index into VALID
    unservable: set[str] = set()
    outs = {}

    def step():
        for o in llm.step():  # a failing step raises nothing
            outs[o.request_id] = o
        llm.alloc.check_invariants()

    for kind, arg in actions:
        if kind == "valid":
            p, sp, salt = VALID[arg]
            valid[llm.add_request(p, sp, cache_salt=salt)] = arg
        elif kind == "raising":
            prompt, kw = RAISING[arg]
            kw = dict(kw)
            params = kw.pop("params", GREEDY)
            before = set(llm._book.by_id)
            with pytest.raises(ValueError):
                llm.add_request(prompt, params, **kw)
            assert set(llm._book.by_id) == before
        elif kind == "unservable":
            unservable.add(llm.add_request(UNSERVABLE[arg], GREEDY))
        elif kind == "duplicate_id" and valid:
            with pytest.raises(ValueError, match="already in use"):
                llm.add_request([5, 6], GREEDY, request_id=next(iter(valid)))
        elif kind == "inject":
            injector.armed = arg
        elif kind == "step":
            for _ in range(arg):
                step()
    while llm.has_unfinished_requests():
        step()
    injector.armed = None
    for rid in unservable:
        out = llm.get_output(rid)
        assert out.finished and out.error and out.outputs[0].finish_reason == "error"
    for rid, i in valid.items():
        out = llm.get_output(rid)
        assert out.finished
        if out.error is not None:  # in a step that failed: only an injected failure
            assert "injected failure" in out.error, out.error
            assert {c.finish_reason for c in out.outputs} == {"error"}
        else:
            assert [c.token_ids for c in out.outputs] == solo[i], (rid, VALID[i])
    assert llm.stats()["pages_used"] == 0
    llm.alloc.check_invariants()


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@settings(max_examples=8, **_SETTINGS)
@given(st.lists(_actions, min_size=1, max_size=14))
def test_malformed_requests_never_change_valid_ones(actions):
    _run(actions)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_actions, min_size=1, max_size=30))
def test_malformed_requests_never_change_valid_ones_long(actions):
    _run(actions)
