"""The sampling features through the engine, single steps and decode loops: penalties, bias
and logits processors against a NumPy greedy decode over the dense forward; logprobs and
prompt logprobs against the dense log-softmax; transformers goldens (repetition penalty,
greedy log-probabilities); rows without features unchanged beside rows with them; nothing
compiles again for new values; stop strings (text, tokens, streaming)."""

import functools
import itertools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_helpers import CKPT, DECODE_PATHS, ENGINE, assert_took_path, make_llm, random_prompts
from _engine_helpers import model as _model
from test_sampling_processing import ban_even, ban_last, np_ban_even, np_ban_last, np_process

import jpaged

# Slow cases (left out of `make test`): the loop path of each is covered by a default case.
SLOW_CASES = (
    "test_seeded_sampling_with_every_feature_loop_equals_single_steps",
    "test_greedy_with_processing_matches_numpy[penalties-single-steps]",
    "test_greedy_with_processing_matches_numpy[bias-single-steps]",
    "test_stop_strings_cut_text_and_tokens[single-steps]",
    # processors on single steps (processors: processors-chains-k4; single steps' processing
    # and raw log-probabilities: test_repetition_penalty_and_logprobs_match_transformers[single-
    # steps])
    "test_greedy_with_processing_matches_numpy[processors-single-steps]",
)
GOLDEN = json.loads(pathlib.Path("tests/goldens/llama2_sampling.json").read_text())


@functools.cache
def _dense():
    model = _model()
    return jax.jit(lambda t: model.forward_dense(t)[0])


def dense_logits(tokens, S=64):
    """f64[len(tokens), V] logits of the dense (non-paged) forward."""
    padded = np.zeros((1, S), np.int32)
    padded[0, : len(tokens)] = tokens
    return np.asarray(_dense()(jnp.asarray(padded)), np.float64)[: len(tokens)]


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def reference_greedy(prompt, n, params, procs_np=()):
    """Greedy tokens and raw log-probabilities of a NumPy decode with the processing."""
    toks, lps = list(prompt), []
    for _ in range(n):
        raw = dense_logits(toks)[-1]
        t = int(np.argmax(np_process(raw, toks, len(prompt), params, procs_np)))
        lps.append(log_softmax(raw)[t])
        toks.append(t)
    return toks[len(prompt) :], lps


FEATURES = [
    ("penalties", dict(repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.4), ()),
    ("bias", dict(logit_bias={7: 4.0, 11: 3.5, 200: -50.0}), ()),
    ("processors", dict(logits_processors=[ban_last, ban_even], repetition_penalty=1.2),
     (np_ban_last, np_ban_even)),
]  # fmt: skip


@pytest.mark.parametrize("path", ["single-steps", "chains-k4"])
@pytest.mark.parametrize(("name", "kw", "procs_np"), FEATURES, ids=[f[0] for f in FEATURES])
def test_greedy_with_processing_matches_numpy(path, name, kw, procs_np):
    prompts = random_prompts(20, (3, 9))
    params = jpaged.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0,
                                   **kw)  # fmt: skip
    llm = make_llm(**DECODE_PATHS[path])
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        ref, ref_lps = reference_greedy(p, 10, params, procs_np)
        c = o.outputs[0]
        assert c.token_ids == ref, name
        got = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        np.testing.assert_allclose(got, ref_lps, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(c.cumulative_logprob, sum(ref_lps), rtol=1e-4, atol=1e-3)
        if name == "processors":
            assert all(t % 2 == 1 for t in c.token_ids)
            assert all(a != b for a, b in zip(c.token_ids, c.token_ids[1:], strict=False))
    if path == "chains-k4":
        assert llm.stats()["loop_decode_steps"] > 0


@pytest.mark.parametrize("path", ["single-steps", "chains-k4"])
def test_repetition_penalty_and_logprobs_match_transformers(path):
    g = GOLDEN["repetition"]
    llm = make_llm(**DECODE_PATHS[path])
    params = jpaged.SamplingParams(max_tokens=g["max_new_tokens"], temperature=0.0,
                                   ignore_eos=True, repetition_penalty=g["repetition_penalty"],
                                   logprobs=5)  # fmt: skip
    c = llm.generate([g["prompt_ids"]], params)[0].outputs[0]
    assert c.token_ids == g["tokens"]
    assert_took_path(llm.stats(), path)
    ref = log_softmax(np.asarray(g["logits"]))
    for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        top = np.argsort(-ref[i], kind="stable")[:5]
        assert next(iter(entry)) == t
        assert set(top) <= set(entry) and len(entry) <= 6
        for tok, lp in entry.items():
            np.testing.assert_allclose(lp.logprob, ref[i, tok], rtol=1e-4, atol=1e-4)
            assert lp.rank == 1 + int((ref[i] > ref[i, tok] + 1e-6).sum())


def test_prompt_logprobs_match_the_dense_forward_and_skip_the_prefix_cache():
    llm = make_llm()
    prompt = random_prompts(21, (45,))[0]  # > the 32-token budget: chunked prefill
    llm.generate([prompt], jpaged.SamplingParams(max_tokens=2, temperature=0.0))  # cached now
    params = jpaged.SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3, n=2,
                                   seed=0)  # fmt: skip
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 0
    ref = log_softmax(dense_logits(prompt))
    pl = out.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None
    for pos in range(1, len(prompt)):
        entry, row = pl[pos], ref[pos - 1]
        assert next(iter(entry)) == prompt[pos]
        assert set(np.argsort(-row, kind="stable")[:3]) <= set(entry)
        for tok, lp in entry.items():
            np.testing.assert_allclose(lp.logprob, row[tok], rtol=1e-4, atol=1e-4)
    assert all(c.logprobs is None for c in out.outputs)


def test_plain_rows_unchanged_beside_feature_rows_and_no_recompiles():
    llm = make_llm(num_decode_steps=4, enable_prefix_caching=False)  # same buckets each call
    prompts = random_prompts(22, (5, 11, 7))
    plain = [jpaged.SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
             jpaged.SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=5,
                                   ignore_eos=True)]  # fmt: skip
    alone = llm.generate(prompts[:2], plain)

    def fancy(seed):
        return jpaged.SamplingParams(
            max_tokens=9, temperature=0.7, min_p=0.05 * seed, seed=seed, ignore_eos=True,
            repetition_penalty=1.0 + 0.1 * seed, frequency_penalty=0.1 * seed,
            logit_bias={seed: 1.0, 9: -1.0}, logits_processors=[ban_even], logprobs=seed,
            prompt_logprobs=1,
        )  # fmt: skip

    mixed = llm.generate(prompts, [*plain, fancy(1)])
    for a, b in zip(alone, mixed, strict=False):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].cumulative_logprob,
                                   b.outputs[0].cumulative_logprob, rtol=1e-5, atol=1e-5)  # fmt: skip
    assert all(t % 2 == 1 for t in mixed[2].outputs[0].token_ids)
    # New values and prompts with the same features and processors (and shape buckets):
    # nothing compiles.
    warm = llm.stats()["recompiles"]
    llm.generate(random_prompts(23, (5, 11, 7)), [*plain, fancy(2)])
    llm.generate(random_prompts(24, (6, 10, 8)), [*plain, fancy(4)])
    assert llm.stats()["recompiles"] == warm


def test_seeded_sampling_with_every_feature_loop_equals_single_steps():
    prompts = random_prompts(25, (6, 10))
    params = jpaged.SamplingParams(max_tokens=12, temperature=0.8, top_k=20, min_p=0.02, seed=3,
                                   repetition_penalty=1.3, presence_penalty=0.3,
                                   logit_bias={4: 2.0}, logits_processors=[ban_last],
                                   logprobs=2, ignore_eos=True)  # fmt: skip
    outs = []
    for path in ("single-steps", "chains-k4"):
        llm = make_llm(**DECODE_PATHS[path])
        outs.append(llm.generate(prompts, params))
        assert_took_path(llm.stats(), path)
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(ea) == list(eb)
            np.testing.assert_allclose([x.logprob for x in ea.values()],
                                       [x.logprob for x in eb.values()], rtol=1e-5, atol=1e-5)  # fmt: skip


def _text_llm(**kw):
    return jpaged.LLM(CKPT, **{**ENGINE, **kw})


@pytest.mark.parametrize("path", ["single-steps", "chains-k4"])
def test_stop_strings_cut_text_and_tokens(path):
    llm = _text_llm(**DECODE_PATHS[path])
    prompt = "The quick brown fox jumps"
    base = jpaged.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate(prompt, base)[0].outputs[0]
    tok = llm.tokenizer
    # A stop string that starts inside the text, first seen at index a.
    a = next(i for i in range(3, len(full.text) - 3) if full.text.find(full.text[i : i + 3]) == i)
    stop = full.text[a : a + 3]
    n = next(k for k in range(1, 25) if stop in tok.decode(full.token_ids[:k]))
    params = jpaged.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                   stop=["\u2603", stop])  # fmt: skip
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.text == full.text[:a]
    assert out.token_ids == full.token_ids[:n]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # Streaming: every snapshot extends the previous one and never shows the stop string.
    seen = [o.outputs[0].text for o in llm.stream([prompt], params)]
    assert seen[-1] == full.text[:a]
    for x, y in itertools.pairwise(seen):
        assert y.startswith(x) and stop not in x
    # Before min_tokens a stop string does not stop generation.
    late = llm.generate(prompt, jpaged.SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop, min_tokens=n + 1))[0]  # fmt: skip
    assert late.outputs[0].token_ids[:n] == full.token_ids[:n]
    assert len(late.outputs[0].token_ids) > n
    assert llm.stats()["pages_used"] == 0
    assert_took_path(llm.stats(), path)


def test_engine_level_checks():
    llm = make_llm()
    with pytest.raises(ValueError, match=r"stop=.* needs a tokenizer"):
        llm.add_request([1, 2, 3], jpaged.SamplingParams(stop="x"))
    with pytest.raises(ValueError, match=r"logit_bias token ids \[300\] must be < vocab_size=300"):
        llm.add_request([1, 2, 3], jpaged.SamplingParams(logit_bias={300: 1.0}))
    assert not llm.has_unfinished_requests()


def test_beam_search_still_matches_transformers_beside_logprob_rows():
    g = json.loads(pathlib.Path("tests/goldens/llama2.json").read_text())["beam_search"]
    llm = make_llm()
    bp = jpaged.BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=1.0,
                                 early_stopping=True)  # fmt: skip
    llm.eos_token_ids = frozenset()
    rid = llm.add_request(g["prompt_ids"], bp)
    other = llm.add_request([5, 6, 7], jpaged.SamplingParams(max_tokens=6, logprobs=3,
                                                             temperature=0.0))  # fmt: skip
    while llm.has_unfinished_requests():
        llm.step()
    del other
    # Not the golden's EOS here: compare with a beam run alone in a fresh engine.
    ref = make_llm().beam_search([g["prompt_ids"]], bp)[0]
    got = llm.get_output(rid)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]
