"""jpaged.LLM core: greedy equals a dense decode, seeded sampling, recompiles, bad input.

Every engine here runs with ``debug=True``: the allocator's invariants are checked after
every step. Engines share one shape configuration (page size 8, 8 sequences, 64 tokens,
32-token step budget) so the jitted step programs compile once for the whole file.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_helpers import (
    CKPT,
    DECODE_PATHS,
    ENGINE,
    C,
    assert_took_path,
    make_llm,
    random_prompts,
)
from _engine_helpers import model as _model

import jpaged


@functools.cache
def _dense_logits():
    model = _model()

    @jax.jit
    def last_logits(tokens_1S, n):
        return jnp.take(model.forward_dense(tokens_1S)[0], n - 1, axis=0)

    return last_logits


def dense_greedy(prompt, max_tokens, S=64):
    """Greedy decode with the model's dense (non-paged, no cache) forward."""
    f = _dense_logits()
    toks = list(prompt)
    for _ in range(max_tokens):
        padded = np.zeros((1, S), np.int32)
        padded[0, : len(toks)] = toks
        toks.append(int(jnp.argmax(f(jnp.asarray(padded), len(toks)))))
    return toks[len(prompt) :]


LENGTHS = (1, C - 1, C, C + 1, 21)  # 0 is a bad-input case below


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_greedy_matches_dense_decode(path):
    llm = make_llm(**DECODE_PATHS[path], enable_prefix_caching=False)
    prompts = random_prompts(0, LENGTHS)
    greedy = jpaged.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    for p, o in zip(prompts, outs, strict=True):
        assert o.finished and o.error is None
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == dense_greedy(p, 10), f"prompt length {len(p)}"
    s = llm.stats()
    assert s["pages_used"] == 0 and s["pages_free"] + s["pages_evictable"] == 64
    if path == "chains-k4":
        assert s["device_calls"] < s["tokens_generated"] // len(prompts) + len(prompts)
    if path != "single-steps":  # some steps advanced a loop in flight without scheduling
        assert llm.scheduler.step_index < s["steps"] and s["loop_decode_steps"] > 0
    else:
        assert s["loop_decode_steps"] == 0


def test_text_prompt_and_tokenizer_roundtrip():
    llm = jpaged.LLM(CKPT, **ENGINE)
    out = llm.generate("The quick brown fox jumps", jpaged.SamplingParams(max_tokens=5,
                                                                          temperature=0.0))[0]  # fmt: skip
    assert out.prompt == "The quick brown fox jumps"
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt).ids
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert len(out.outputs[0].token_ids) <= 5


def test_seeded_sampling_same_alone_and_in_a_batch():
    prompts = random_prompts(1, (5, 12, 17))
    params = [
        jpaged.SamplingParams(max_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=s,
                              ignore_eos=True)
        for s in (11, 12, 13)
    ]  # fmt: skip
    batch = make_llm().generate(prompts, params)
    for p, sp, b in zip(prompts, params, batch, strict=True):
        alone = make_llm().generate([p], sp)[0]
        assert alone.outputs[0].token_ids == b.outputs[0].token_ids
    # A different seed gives a different sample (overwhelmingly likely over 3 x 8 tokens).
    other = make_llm().generate(prompts, [dataclasses_replace(sp, seed=99) for sp in params])
    assert [o.outputs[0].token_ids for o in other] != [b.outputs[0].token_ids for b in batch]


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_no_recompiles_after_warmup():
    llm = make_llm(num_decode_steps=4)
    # One row bucket (8): decode, the loop in 3 sampling modes, ragged at 32 tokens (the
    # budget); the page programs of copy-on-write and swap at one page-count bucket.
    report = llm.warmup()
    assert [p.name for p in report.programs] == [
        "decode B=8", "loop B=8 greedy", "loop B=8 random", "loop B=8 truncate",
        "ragged T=32 B=8", "join B=8 R=8",  # rows joining a running chain
    ]  # fmt: skip
    assert report.num_programs == 9  # + copy_pages, gather_pages, scatter_pages at 8 pages
    assert report.cache_dir is None and report.cache_hits == 0  # the suite runs without
    warm = llm.stats()["recompiles"]  # 0 if an earlier test compiled the same programs
    lengths = (3, 20, 9, 1, 15, 30)
    llm.generate(random_prompts(2, lengths), jpaged.SamplingParams(max_tokens=6, seed=0))
    # New tokens, sampling knobs, n > 1, stop tokens, lengths permuted: nothing compiles.
    params = jpaged.SamplingParams(max_tokens=6, temperature=0.0, top_k=5, top_p=0.5)
    llm.generate(random_prompts(3, lengths[::-1]), params)
    llm.generate(random_prompts(4, lengths[:3]),
                 jpaged.SamplingParams(max_tokens=9, seed=7, n=2, stop_token_ids=[5, 6]))  # fmt: skip
    llm.generate(random_prompts(5, lengths[:2]),  # a truncating loop (top-p) beside a greedy row
                 [jpaged.SamplingParams(max_tokens=9, seed=1, temperature=0.8, top_p=0.9),
                  jpaged.SamplingParams(max_tokens=9, temperature=0.0)])  # fmt: skip
    assert llm.stats()["recompiles"] == warm


def test_bad_requests_fail_alone_and_others_are_served():
    llm = make_llm(watermark=0.5)  # 32 of the 64 pages usable by one request
    good = random_prompts(5, (6,))[0]
    greedy = jpaged.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[], good, list(range(3, 67)), [5, 400], random_prompts(6, (10,))[0]]
    too_many = jpaged.SamplingParams(max_tokens=50, n=8)  # 8 x 50 tokens > 32 pages of 8
    params = [greedy, greedy, greedy, greedy, too_many]
    outs = llm.generate(prompts, params)
    errors = [o.error for o in outs]
    assert "empty prompt" in errors[0]
    assert errors[1] is None and outs[1].outputs[0].token_ids == dense_greedy(good, 5)
    assert "max_model_len=64" in errors[2]
    assert "vocab_size=300" in errors[3]
    assert "cannot fit even alone" in errors[4]
    for i in (0, 2, 3, 4):
        assert outs[i].finished and outs[i].outputs[0].finish_reason == "error"
    with pytest.raises(ValueError, match="temperature"):
        llm.add_request([1, 2], jpaged.SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.add_request("text without a tokenizer")
    assert llm.stats()["pages_used"] == 0


def test_abort_frees_everything_and_others_finish():
    llm = make_llm()
    prompts = random_prompts(7, (10, 11))
    greedy = jpaged.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a = llm.add_request(prompts[0], greedy)
    b = llm.add_request(prompts[1], greedy)
    llm.step()
    llm.step()
    llm.abort(a)
    assert llm.get_output(a).outputs[0].finish_reason == "abort"
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.get_output(b).outputs[0].token_ids == dense_greedy(prompts[1], 12)
    assert llm.stats()["pages_used"] == 0


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_stream_yields_growing_outputs(path):
    """Every snapshot has more tokens than the one before (the step that starts a decode chain
    reports none of its rows); one token a step unless a loop makes several."""
    llm = make_llm(**DECODE_PATHS[path])
    prompt = random_prompts(8, (9,))[0]
    seen = []
    for out in llm.stream([prompt], jpaged.SamplingParams(max_tokens=4, temperature=0.0,
                                                          ignore_eos=True)):  # fmt: skip
        seen.append(list(out.outputs[0].token_ids))
    expected = [1, 4] if path == "chains-k4" else [1, 2, 3, 4]
    assert [len(s) for s in seen] == expected
    assert seen[-1] == dense_greedy(prompt, 4)
    assert_took_path(llm.stats(), path)


@pytest.mark.parametrize("path", ["single-steps", "chains-k4"])
def test_stop_tokens_and_min_tokens(path):
    prompt = random_prompts(9, (11,))[0]
    full = dense_greedy(prompt, 16)
    # A token whose first occurrence is at index k >= 2.
    k = next(i for i in range(2, 16) if full[i] not in full[:i])
    stop = full[k]
    llm = make_llm(**DECODE_PATHS[path])
    out = llm.generate([prompt], jpaged.SamplingParams(max_tokens=16, temperature=0.0,
                                                       stop_token_ids=[stop]))[0]  # fmt: skip
    assert out.outputs[0].token_ids == full[: k + 1]
    assert out.outputs[0].finish_reason == "stop"
    if path == "chains-k4":  # the loop stopped on device at the stop token
        assert llm.stats()["loop_decode_steps"] == k
    # With min_tokens past k, the first occurrence does not stop generation.
    sp = jpaged.SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop],
                               min_tokens=k + 2)  # fmt: skip
    out = llm.generate([prompt], sp)[0]
    later = [i for i in range(k + 1, 16) if full[i] == stop]
    end = later[0] + 1 if later else 16
    assert out.outputs[0].token_ids == full[:end]
    assert out.outputs[0].finish_reason == ("stop" if later else "length")


def test_model_as_config_plus_params_or_module_plus_state():
    from flax import nnx

    model = _model()
    prompt = random_prompts(10, (6,))[0]
    greedy = jpaged.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = dense_greedy(prompt, 5)
    params = jpaged.models.load_params(CKPT, model.config)
    from_config = jpaged.LLM(model.config, params=params, **ENGINE)
    assert from_config.generate([prompt], greedy)[0].outputs[0].token_ids == expected
    other = jpaged.models.LlamaForCausalLM(model.config, rngs=nnx.Rngs(1))
    from_state = jpaged.LLM(other, params=nnx.state(model), **ENGINE)
    assert from_state.generate([prompt], greedy)[0].outputs[0].token_ids == expected
    with pytest.raises(ValueError, match="needs params="):
        jpaged.LLM(model.config, **ENGINE)


def test_decode_loop_matches_single_steps_at_length_limits_and_truncated_sampling():
    """Loops (greedy rows; top-k / top-p rows, which take the loop's truncating branch) give
    the tokens, finish reasons and log-probabilities of single steps, up to ``max_tokens``
    and ``max_model_len`` (64 here) in the middle of a loop."""
    prompts = random_prompts(12, (5, 50, C + 1, 3))
    params = [
        jpaged.SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
        jpaged.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),  # 64 at 14
        jpaged.SamplingParams(max_tokens=11, temperature=1.0, top_k=7, seed=3, ignore_eos=True),
        jpaged.SamplingParams(max_tokens=9, temperature=0.8, top_p=0.6, seed=4, ignore_eos=True),
    ]
    outs = {}
    for path in ("single-steps", "chains-k4"):
        llm = make_llm(**DECODE_PATHS[path], enable_prefix_caching=False)
        outs[path] = llm.generate(prompts, params)
        assert_took_path(llm.stats(), path)
    for a, b, p in zip(outs["single-steps"], outs["chains-k4"], params, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids
        assert cb.finish_reason == ca.finish_reason == "length"
        assert len(ca.token_ids) == min(p.max_tokens, 64 - len(a.prompt_token_ids))
        np.testing.assert_allclose(cb.cumulative_logprob, ca.cumulative_logprob, rtol=1e-4,
                                   atol=1e-4)  # fmt: skip


def test_auto_request_ids_skip_user_ids():
    llm = make_llm()
    greedy = jpaged.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    p0, p1, p2 = random_prompts(11, (5, 6, 7))
    assert llm.add_request(p0, greedy, request_id="0") == "0"
    assert llm.add_request(p0, greedy, request_id="2") == "2"
    outs = llm.generate([p1, p2], greedy)
    ids = [o.request_id for o in outs]
    assert ids == ["1", "3"]
    assert all(o.finished and o.error is None for o in outs)
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.get_output(r).finished for r in ("0", "2")] == [True, True]
    assert llm.stats()["pages_used"] == 0


def _assert_idle_and_no_leak(llm):
    assert not llm.has_unfinished_requests()
    llm.alloc.check_invariants()
    s = llm.stats()
    assert s["pages_used"] == 0 and s["running"] == 0 and s["waiting"] == 0


def test_rejected_prompt_aborts_earlier_prompts_of_the_same_call():
    llm = make_llm()
    greedy = jpaged.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    good = random_prompts(12, (9,))[0]
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([good, "text without a tokenizer"], greedy)
    _assert_idle_and_no_leak(llm)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.beam_search([good, "text"], jpaged.BeamSearchParams(beam_width=2, max_tokens=2))
    _assert_idle_and_no_leak(llm)
    with pytest.raises(ValueError, match="tokenizer"):
        next(llm.stream([good, "text"], greedy))
    _assert_idle_and_no_leak(llm)
    # The engine still serves afterwards.
    out = llm.generate([good], greedy)[0]
    assert out.outputs[0].token_ids == dense_greedy(good, 3)
    _assert_idle_and_no_leak(llm)


def test_stream_broken_early_aborts_its_requests():
    llm = make_llm()
    prompts = random_prompts(13, (9, 10))
    params = jpaged.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    gen = llm.stream(prompts, params)
    first = next(gen)
    assert not first.finished
    assert llm.has_unfinished_requests() and llm.stats()["pages_used"] > 0
    gen.close()
    _assert_idle_and_no_leak(llm)
    for out in llm.stream(prompts, params):
        if len(out.outputs[0].token_ids) == 2:
            break
    _assert_idle_and_no_leak(llm)
    reasons = {llm.get_output(r).outputs[0].finish_reason for r in ("0", "1", "2", "3")}
    assert reasons == {"abort"}


def test_beam_search_rejects_sampling_params():
    llm = make_llm()
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([[5, 6, 7]], jpaged.SamplingParams(max_tokens=2))
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("name", ["max_model_len", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_engine_rejects_non_positive_lengths(name, value):
    with pytest.raises(ValueError, match=rf"{name}={value} must be None or an int >= 1"):
        jpaged.LLM(_model(), **{**ENGINE, name: value})


def test_sampling_params_seed_plus_n_and_non_numeric_values():
    jpaged.SamplingParams(seed=2**31 - 2, n=2)  # completion 1 uses seed 2**31 - 1: fine
    with pytest.raises(ValueError, match=r"seed \+ n - 1 must be <= 2\*\*31 - 1"):
        jpaged.SamplingParams(seed=2**31 - 1, n=2)
    with pytest.raises(ValueError, match="temperature='hot' must be a finite float"):
        jpaged.SamplingParams(temperature="hot")
    with pytest.raises(ValueError, match="top_p='all' must be in"):
        jpaged.SamplingParams(top_p="all")
    with pytest.raises(ValueError, match="length_penalty='x' must be finite"):
        jpaged.BeamSearchParams(length_penalty="x")


def test_finished_requests_are_kept_only_up_to_keep_finished():
    """A long-running engine keeps at most ``keep_finished`` finished requests (oldest dropped
    first); in-flight requests and every output ``generate`` started are never lost."""
    llm = make_llm(keep_finished=2)
    greedy = jpaged.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(11, (5, 6, 7, 8, 9))
    outs = llm.generate(prompts, greedy)  # 5 finish, only 2 may stay: generate still has all
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(p, 3) for p in prompts]
    slow = llm.add_request(random_prompts(12, (4,))[0], jpaged.SamplingParams(
        max_tokens=56, temperature=0.0, ignore_eos=True))  # fmt: skip
    one = jpaged.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(3):  # each finishes in its prefill step
        llm.generate(random_prompts(13, (5,)), one)
    assert not llm.get_output(slow).finished  # in flight: kept
    with pytest.raises(ValueError, match=r"unknown request_id='0' \(finished requests are kept"):
        llm.get_output("0")
    with pytest.raises(ValueError, match="keep_finished=2"):
        llm.abort("1")
    while llm.has_unfinished_requests():
        llm.step()
    assert len(llm._book.by_id) <= 2 + 1  # the cap, plus those finished in the last step
    assert llm.get_output(slow).outputs[0].token_ids == dense_greedy(
        llm.get_output(slow).prompt_token_ids, 56
    )
    # Arrival order survives the drops (FCFS admission uses it): ids are fresh and in order.
    a = llm.add_request([1, 2, 3], greedy)
    b = llm.add_request([1, 2, 3], greedy)
    assert llm._book.by_id[a].arrival < llm._book.by_id[b].arrival
    llm.keep_finished = 0  # settable: the next steps drop every finished request
    while llm.has_unfinished_requests():
        llm.step()
    llm.step()
    assert llm._book.by_id == {}
    with pytest.raises(ValueError, match="keep_finished=-1 must be an int >= 0"):
        make_llm(keep_finished=-1)


def test_preemption_events_are_bounded():
    from jpaged.engine.scheduler import PreemptionEvent

    llm = make_llm()
    for i in range(5000):
        llm.scheduler.events.append(PreemptionEvent(str(i), "swap", 1, i))
    events = llm.preemption_events
    assert len(events) == 4096 and events[-1].request_id == "4999"


def test_page_tables_and_utilisation_follow_the_pool():
    llm = make_llm(chain_decode=False)
    stats = llm.stats()
    assert stats["kv_utilisation"] == 0.0 and stats["kv_page_fill"] == 0.0
    assert llm.page_tables() == {}
    llm.add_request(list(range(1, 10)), jpaged.SamplingParams(max_tokens=8, n=3, seed=0))
    llm.add_request([3, 4], jpaged.SamplingParams(max_tokens=8, temperature=0.0))
    llm.step()
    tables = llm.page_tables()
    assert sorted(tables) == [("0", 0), ("0", 1), ("0", 2), ("1", 0)]
    prompt_pages = {tuple(tables["0", i][: 9 // llm.page_size]) for i in range(3)}
    assert len(prompt_pages) == 1  # the n=3 samples share the prompt's full pages
    held = {p for pages in tables.values() for p in pages}
    stats = llm.stats()
    assert stats["pages_used"] == len(held)
    assert stats["kv_utilisation"] == len(held) / stats["pages_total"]
    assert 0.0 < stats["kv_page_fill"] <= 1.0
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.page_tables() == {} and llm.stats()["kv_utilisation"] == 0.0
