"""Bad input at the engine's doors: each case raises a clear error where it enters
(``add_request``, ``generate``, ``LLM(...)``, ``EngineOptions``) and leaves nothing behind, and a
step that raises fails only its own requests while the engine goes on serving.

Every engine here runs with ``debug=True`` (the allocator's invariants are checked after every
step) on the tiny llama2 checkpoint; the pool starts NaN-filled (``make_llm``).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from _engine_helpers import CKPT, make_llm, random_prompts
from test_engine import dense_greedy

import jpaged
from jpaged.engine.options import EngineOptions

GREEDY = jpaged.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def assert_idle(llm):
    """No request queued or running, no page held, and a step reports nothing."""
    assert not llm.has_unfinished_requests()
    assert llm.stats()["pages_used"] == 0
    assert llm.step() == []
    llm.alloc.check_invariants()


@pytest.fixture(scope="module")
def llm():
    return make_llm()


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize(
    "prompt,match",
    [
        ([5.0, 6.0], r"prompt\[0\]=5\.0 \(float\) is not a token id"),
        ([5, np.float32(6)], r"prompt\[1\]=np\.float32\(6\.0\) \(float32\) is not a token id"),
        ([5, True], r"prompt\[1\]=True \(bool\) is not a token id"),
        ([5, np.bool_(False)], r"prompt\[1\]=np\.False_ \(bool\) is not a token id"),
        (["12", "34"], r"prompt\[0\]='12' \(str\) is not a token id"),
        ([5, None], r"prompt\[1\]=None \(NoneType\) is not a token id"),
        ([5, [6]], r"prompt\[1\]=\[6\] \(list\) is not a token id"),
        (b"\x05\x06", r"prompt=b'\\x05\\x06' \(bytes\)"),
        (None, r"prompt=None \(NoneType\)"),
        (7, r"prompt=7 \(int\)"),
        ({5, 6}, r"prompt=\{5, 6\} \(set\)"),
        (np.array([5.0, 6.0]), r"prompt is an array of shape \(2,\) and dtype float64"),
        (np.array([[5, 6]]), r"prompt is an array of shape \(1, 2\)"),
        ("12 34", r"prompt is a string, which needs a tokenizer"),
    ],
)
def test_add_request_rejects_prompts_that_are_not_token_ids(llm, prompt, match):
    before = dict(llm._book.by_id)
    with pytest.raises(ValueError, match=match):
        llm.add_request(prompt, GREEDY)
    assert llm._book.by_id == before
    assert_idle(llm)


def test_token_ids_as_numpy_or_jax_integers_are_accepted(llm):
    prompt = random_prompts(30, (7,))[0]
    want = dense_greedy(prompt, 4)
    forms = [
        prompt,
        tuple(prompt),
        np.asarray(prompt, np.int64),
        np.asarray(prompt, np.uint16),
        [np.int32(t) for t in prompt],
        jnp.asarray(prompt, jnp.int32),
        [jnp.int32(t) for t in prompt],
    ]
    for form in forms:
        out = llm.generate(form, GREEDY)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want, type(form)
    two = llm.generate(np.asarray([prompt, prompt]), GREEDY)  # 2-D: one prompt a row
    assert [o.outputs[0].token_ids for o in two] == [want, want]


@pytest.mark.parametrize(
    "prompts,match",
    [
        (5, r"prompts=5 \(int\) must be a prompt or a list of prompts"),
        (None, r"prompts=None \(NoneType\) must be a prompt or a list of prompts"),
        (b"ab", r"prompts=b'ab' \(bytes\)"),
        ([None], r"prompts\[0\]\[0\]=None \(NoneType\) is not a token id"),
        ([[5, 6], [7, 8.5]], r"prompts\[1\]\[1\]=8\.5 \(float\) is not a token id"),
        ([[5, 6], None], r"prompts\[1\]=None \(NoneType\)"),
        ([[5, 6], "text"], r"prompts\[1\] is a string, which needs a tokenizer"),
        (np.zeros((1, 2, 3), np.int32), r"prompts is an array of shape \(1, 2, 3\)"),
    ],
)
def test_generate_names_the_bad_prompt_and_queues_nothing(llm, prompts, match):
    before = dict(llm._book.by_id)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY)
    assert llm._book.by_id == before
    assert_idle(llm)


def test_a_bad_third_prompt_queues_none_of_the_call(llm):
    good = random_prompts(31, (5, 9))
    for call in (
        lambda ps: llm.generate(ps, GREEDY),
        lambda ps: next(llm.stream(ps, GREEDY)),
        lambda ps: llm.beam_search(ps, jpaged.BeamSearchParams(beam_width=2, max_tokens=2)),
    ):
        before = dict(llm._book.by_id)
        with pytest.raises(ValueError, match=r"prompts\[2\]\[1\]=2\.5 \(float\)"):
            call([*good, [1, 2.5]])
        assert llm._book.by_id == before
        assert_idle(llm)
    outs = llm.generate(good, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(p, 4) for p in good]


def test_a_failure_while_adding_removes_the_requests_already_added(monkeypatch):
    """An error raised after some requests of a call were queued (here by the intake of the
    third): those requests leave no id behind, no step reports them, no page is held."""
    llm = make_llm()
    make = llm.intake.make_request
    calls = [0]

    def third_fails(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("simulated intake failure")
        return make(*args, **kwargs)

    monkeypatch.setattr(llm.intake, "make_request", third_fails)
    prompts = random_prompts(32, (5, 6, 7))
    with pytest.raises(RuntimeError, match="simulated intake failure"):
        llm.generate(prompts, GREEDY)
    assert llm._book.by_id == {}
    assert_idle(llm)
    outs = llm.generate(prompts, GREEDY)  # the fourth call on: nothing fails
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(p, 4) for p in prompts]


# ----------------------------------------------------------------------------- other arguments


@pytest.mark.parametrize("salt", [123, ["a"], b"tenant", 1.5])
def test_a_cache_salt_that_is_not_a_str_raises_and_does_not_block_later_calls(llm, salt):
    prompt = random_prompts(33, (17,))[0]
    with pytest.raises(ValueError, match=r"cache_salt=.* must be a str or None"):
        llm.add_request(prompt, GREEDY, cache_salt=salt)
    with pytest.raises(ValueError, match=r"cache_salt=.* must be a str or None"):
        llm.generate([prompt], GREEDY, cache_salt=salt)
    assert_idle(llm)
    out = llm.generate([prompt], GREEDY, cache_salt="tenant")[0]
    assert out.outputs[0].token_ids == dense_greedy(prompt, 4)


@pytest.mark.parametrize("request_id", [5, 1.0, ("a",), b"x"])
def test_request_ids_must_be_strings(llm, request_id):
    with pytest.raises(ValueError, match=r"request_id=.* must be a str or None"):
        llm.add_request([5, 6], GREEDY, request_id=request_id)
    assert_idle(llm)


@pytest.mark.parametrize("params", [{"max_tokens": 3}, "greedy", 0.0])
def test_params_of_the_wrong_type_raise(llm, params):
    with pytest.raises(ValueError, match="must be SamplingParams or BeamSearchParams"):
        llm.add_request([5, 6], params)
    with pytest.raises(ValueError, match=r"sampling_params\[0\] must be SamplingParams"):
        llm.generate([[5, 6]], [params])
    assert_idle(llm)


# ----------------------------------------------------------------------------- construction


def test_max_model_len_beyond_the_model_positions_raises():
    with pytest.raises(
        ValueError, match=r"max_model_len=400 exceeds the model's max_position_embeddings=128"
    ):
        jpaged.LLM(CKPT, max_model_len=400, num_pages=8)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dtype="int8"), r"dtype='int8' must be None or a float dtype"),
        (dict(dtype=jnp.int32), r"dtype=.*int32.* must be None or a float dtype"),
        (dict(dtype="fp8"), r"dtype='fp8' must be None or a float dtype"),
        (dict(dtype="float33"), r"dtype='float33' must be None or a float dtype"),
        (
            dict(cache_dtype="int4"),
            r"cache_dtype='int4' must be .* one of \('fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8'\) or a "
            r"quantized dtype \(float8_e4m3fn, float8_e5m2, int8\)",
        ),
        (dict(cache_dtype=jnp.int32), r"cache_dtype=.*int32.* must be None, a float dtype"),
        (dict(cache_dtype=jnp.float8_e4m3fnuz), r"cache_dtype=.*float8_e4m3fnuz.* must be None"),
        (dict(cache_dtype="fp4"), r"cache_dtype='fp4' must be None, a float dtype"),
        (dict(enable_prefix_caching="no"), r"enable_prefix_caching='no' must be a bool"),
        (dict(debug=1), r"debug=1 must be a bool"),
        (dict(chain_decode="yes"), r"chain_decode='yes' must be a bool"),
        (
            dict(chain_decode=False, num_decode_steps=4),
            r"num_decode_steps=4 needs chain_decode=True .* with chain_decode=False it must be 1",
        ),
        (dict(page_size=8.0), r"page_size=8\.0 must be an int >= 1"),
        (dict(max_model_len=True), r"max_model_len=True must be None or an int >= 1"),
        (dict(preemption_mode="never"), r"preemption_mode='never' must be one of"),
    ],
)
def test_engine_options_of_the_wrong_kind_raise_before_loading(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineOptions(**kw)
    with pytest.raises(ValueError, match=match):
        jpaged.LLM("/no/such/checkpoint", **kw)  # raised before the model is read


@pytest.mark.parametrize(
    "cache_dtype",
    ["fp8", "fp8_e4m3", "fp8_e5m2", "int8", jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2,
     "bfloat16", jnp.float16, "float32"],
)  # fmt: skip
def test_cache_dtypes_the_options_accept(cache_dtype):
    assert EngineOptions(cache_dtype=cache_dtype).cache_dtype is cache_dtype


# ----------------------------------------------------------------------------- failing steps


def _fail_on(monkeypatch, obj, name, call, *, after=False, message="simulated failure"):
    """Makes ``obj.name`` raise ``RuntimeError(message)`` on its ``call``-th call (after
    running it, when ``after``: a device call that had taken the donated pool)."""
    real = getattr(obj, name)
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call and not after:
            raise RuntimeError(message)
        out = real(*args, **kwargs)
        if calls[0] == call:
            raise RuntimeError(message)
        return out

    monkeypatch.setattr(obj, name, flaky)


@pytest.mark.parametrize("after", [False, True], ids=["before-donation", "pool-lost"])
def test_a_failed_ragged_step_fails_its_requests_only(monkeypatch, after):
    """The device call of a prefill step raises: the requests of that step fail (error
    message kept), a request queued behind them is served as it would be alone, the
    allocator stays consistent after every step (``debug=True``) and so does the next call."""
    llm = make_llm(max_num_seqs=2, chain_decode=False)
    _fail_on(monkeypatch, llm.runner, "step", 1, after=after, message="simulated step failure")
    prompts = random_prompts(34, (9, 11, 6))
    outs = llm.generate(prompts, GREEDY)
    for o in outs[:2]:  # the first step ran the two that fit
        assert o.error is not None and "simulated step failure" in o.error
        assert o.outputs[0].finish_reason == "error" and o.outputs[0].token_ids == []
    assert outs[2].error is None and outs[2].outputs[0].token_ids == dense_greedy(prompts[2], 4)
    assert_idle(llm)
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [dense_greedy(p, 4) for p in prompts]


def test_a_failed_copy_on_write_fails_the_request_whose_pages_move(monkeypatch):
    """n=2 completions fork and then copy their shared last page: the copy fails; that
    request fails, another running request is served unchanged."""
    llm = make_llm(chain_decode=False)
    _fail_on(monkeypatch, llm.kv, "copy", 1, message="simulated copy failure")
    forked, other = random_prompts(35, (5, 7))
    sampled = jpaged.SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3)
    outs = llm.generate([forked, other], [sampled, GREEDY])
    assert "simulated copy failure" in outs[0].error
    assert {c.finish_reason for c in outs[0].outputs} == {"error"}
    assert outs[1].error is None and outs[1].outputs[0].token_ids == dense_greedy(other, 4)
    assert_idle(llm)


def test_a_failure_in_the_appender_fails_that_step_and_not_the_next(monkeypatch):
    llm = make_llm(chain_decode=False)
    _fail_on(monkeypatch, llm.appender, "append", 3, message="simulated append failure")
    prompts = random_prompts(36, (4, 8))
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():  # never raises
            outs[o.request_id] = o
    # The third append is the second request's first token: both rows of that step fail.
    assert all("simulated append failure" in outs[i].error for i in ids)
    assert_idle(llm)
    assert llm.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids == dense_greedy(prompts[0], 4)


def test_an_interrupted_generate_leaves_none_of_its_requests_behind(monkeypatch):
    """An exception that reaches ``generate`` (an interrupt, a bug) aborts and forgets the
    call's unfinished requests: the caller never got their ids, so no later step runs them."""
    llm = make_llm()
    real, calls = llm._step, [0]

    def interrupted():
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(llm, "_step", interrupted)
    prompts = random_prompts(37, (5, 12))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY)
    assert llm._book.by_id == {}
    assert_idle(llm)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(p, 4) for p in prompts]


@pytest.mark.parametrize("stop", [300, 2**40, -1])
def test_stop_token_ids_outside_the_vocabulary_raise_where_they_enter(llm, stop):
    with pytest.raises(ValueError, match="stop_token_ids"):  # SamplingParams or add_request
        llm.add_request([5, 6], jpaged.SamplingParams(max_tokens=2, stop_token_ids=[7, stop]))
    assert_idle(llm)


def test_limits_beyond_int32_never_fail_a_decode_loop(llm):
    """``max_tokens``/``min_tokens`` past 2**31 (if ``SamplingParams`` takes them) run to
    ``max_model_len`` like any long limit (the loop's int32 step counts are clamped)."""
    prompt = random_prompts(38, (50,))[0]
    try:
        params = jpaged.SamplingParams(max_tokens=2**31 + 5, min_tokens=2**31 + 5,
                                       temperature=0.0)  # fmt: skip
    except ValueError as e:  # rejected where it enters: also fine
        assert "max_tokens" in str(e) or "min_tokens" in str(e)
        return
    out = llm.generate([prompt], params)[0]
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == dense_greedy(prompt, 64 - 50)


def test_a_failed_swap_in_leaves_no_unwritten_page_in_the_prefix_cache(monkeypatch):
    """Swap-in registers the pages' hashes again before the device copy runs: when that copy
    fails, the request fails and its pages must leave the prefix cache, or the next request
    with its prompt would read pages that were never written (the pool starts NaN)."""
    llm = make_llm(num_pages=8, watermark=0.0, preemption_mode="swap", chain_decode=False)
    _fail_on(monkeypatch, llm.kv, "swap_in", 1, message="simulated swap-in failure")
    a, b = random_prompts(39, (17, 17))
    long = jpaged.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate([a, b], long)
    assert llm.stats()["preemptions_swap"] >= 1
    failed = [o for o in outs if o.error is not None]
    assert len(failed) == 1 and "simulated swap-in failure" in failed[0].error
    served = next(o for o in outs if o.error is None)
    assert served.outputs[0].token_ids == dense_greedy(served.prompt_token_ids, 20)
    again = llm.generate([failed[0].prompt_token_ids], long)[0]
    assert again.outputs[0].token_ids == dense_greedy(failed[0].prompt_token_ids, 20)
    assert_idle(llm)
