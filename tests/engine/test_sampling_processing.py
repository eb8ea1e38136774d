"""Logits processing on device against plain NumPy: penalties, bias, processors, min-p,
log-probabilities and ranks; transformers' repetition-penalty scores and min-p masks
(tests/goldens/llama2_sampling.json); stop-string search and hold-back."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpaged
from jpaged.engine import stop_strings
from jpaged.engine.logits_process import (
    apply_processing,
    logits_inputs,
    penalty_state,
    prompt_logprobs,
    rank_of,
    update_penalty_state,
)
from jpaged.engine.outputs import logprob_entry
from jpaged.engine.sampling import sample, sample_rows

GOLDEN = json.loads(pathlib.Path("tests/goldens/llama2_sampling.json").read_text())
V, S = 40, 24


def np_process(logits, tokens, num_prompt, p: jpaged.SamplingParams, procs_np=()):
    """The reference: processors, bias, repetition (prompt + generated), presence and
    frequency (generated), in f64."""
    x = np.asarray(logits, np.float64).copy()
    for f in procs_np:
        x = f(tokens, x)
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    seen = sorted(set(tokens))
    r = p.repetition_penalty
    x[seen] = np.where(x[seen] < 0, x[seen] * r, x[seen] / r)
    counts = np.bincount(tokens[num_prompt:], minlength=len(x)).astype(np.float64)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def ban_even(token_ids, logits):
    return jnp.where(jnp.arange(logits.shape[0]) % 2 == 0, -1e9, logits)


def ban_last(token_ids, logits):
    last = token_ids[jnp.sum(token_ids >= 0) - 1]
    return logits.at[last].set(-1e9)


def np_ban_even(tokens, x):
    return np.where(np.arange(len(x)) % 2 == 0, -1e9, x)


def np_ban_last(tokens, x):
    x = x.copy()
    x[tokens[-1]] = -1e9
    return x


def _random_rows(rng, R):
    rows, params, procs = [], [], []
    choices = [(), (ban_even,), (ban_last, ban_even)]
    np_choices = [(), (np_ban_even,), (np_ban_last, np_ban_even)]
    for _ in range(R):
        n = int(rng.integers(1, S + 1))
        num_prompt = int(rng.integers(1, n + 1))
        tokens = rng.integers(0, V, size=n).tolist()
        c = int(rng.integers(0, 3))
        use = rng.random(4) < 0.7
        p = jpaged.SamplingParams(
            repetition_penalty=float(rng.uniform(0.5, 2.0)) if use[0] else 1.0,
            presence_penalty=float(rng.uniform(-2, 2)) if use[1] else 0.0,
            frequency_penalty=float(rng.uniform(-2, 2)) if use[2] else 0.0,
            logit_bias={int(t): float(rng.normal()) for t in rng.choice(V, 3, replace=False)}
            if use[3] else None,
            logits_processors=choices[c],
        )  # fmt: skip
        rows.append((p, tokens, num_prompt))
        params.append(p)
        procs.append(np_choices[c])
    return rows, params, procs


@pytest.mark.parametrize("seed", [0, 1])
def test_processing_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    R = 8
    rows, _, procs = _random_rows(rng, R - 2)
    inputs, chains = logits_inputs(rows, R, S)
    logits = rng.normal(size=(R, V)).astype(np.float32) * 3
    got = jax.jit(apply_processing, static_argnames="processors")(
        jnp.asarray(logits), inputs, processors=chains
    )
    got = np.asarray(got)
    for r, ((p, tokens, n), pr) in enumerate(zip(rows, procs, strict=True)):
        ref = np_process(logits[r], tokens, n, p, pr)
        np.testing.assert_allclose(got[r], ref, rtol=1e-5, atol=1e-4, err_msg=f"row {r}")
    # Padding rows (neutral values) keep their logits bit for bit.
    np.testing.assert_array_equal(got[R - 2 :], logits[R - 2 :])


def test_neutral_rows_are_bit_identical_and_no_feature_means_no_inputs():
    rng = np.random.default_rng(2)
    plain = jpaged.SamplingParams()
    used = jpaged.SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5,
                                 logit_bias={1: 2.0}, logits_processors=[ban_even])  # fmt: skip
    toks = rng.integers(0, V, size=10).tolist()
    assert logits_inputs([(plain, toks, 3)], 8, S) == (None, ())
    inputs, chains = logits_inputs([(plain, toks, 3), (used, toks, 3)], 8, S)
    logits = rng.normal(size=(8, V)).astype(np.float32)
    got = np.asarray(apply_processing(jnp.asarray(logits), inputs, processors=chains))
    np.testing.assert_array_equal(got[0], logits[0])
    assert not np.array_equal(got[1], logits[1])


def test_penalty_state_and_its_update_match_counts():
    rng = np.random.default_rng(3)
    R = 4
    hist = np.full((R, S), -1, np.int32)
    lens = [5, 9, 1, 0]
    num_prompt = np.array([2, 9, 1, 0], np.int32)
    for r, n in enumerate(lens):
        hist[r, :n] = rng.integers(0, V, size=n)
    seen, counts = penalty_state(jnp.asarray(hist), jnp.asarray(num_prompt), V)
    new = np.array([3, 4, 5, 6], np.int32)
    active = np.array([True, False, True, True])
    seen2, counts2 = update_penalty_state((seen, counts), jnp.asarray(new), jnp.asarray(active))
    for r, n in enumerate(lens):
        ref_seen = np.zeros(V, bool)
        ref_seen[hist[r, :n]] = True
        ref_counts = np.bincount(hist[r, num_prompt[r] : n], minlength=V)
        np.testing.assert_array_equal(np.asarray(seen)[r], ref_seen)
        np.testing.assert_array_equal(np.asarray(counts)[r], ref_counts)
        if active[r]:
            ref_seen[new[r]] = True
            ref_counts[new[r]] += 1
        np.testing.assert_array_equal(np.asarray(seen2)[r], ref_seen)
        np.testing.assert_array_equal(np.asarray(counts2)[r], ref_counts)


def test_repetition_penalty_matches_transformers_scores():
    g = GOLDEN["repetition"]
    prompt, tokens = g["prompt_ids"], g["tokens"]
    logits = np.asarray(g["logits"], np.float32)
    p = jpaged.SamplingParams(repetition_penalty=g["repetition_penalty"])
    rows = [(p, prompt + tokens[:i], len(prompt)) for i in range(len(tokens))]
    inputs, _ = logits_inputs(rows, len(rows), 64)
    got = np.asarray(apply_processing(jnp.asarray(logits), inputs))
    np.testing.assert_allclose(got, np.asarray(g["scores"]), rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got.argmax(-1), tokens)


def _sample_np(logits, **kw):
    R = logits.shape[0]
    args = dict(temperature=np.ones(R, np.float32), top_k=np.zeros(R, np.int32),
                top_p=np.ones(R, np.float32), seed=np.arange(R, dtype=np.int32),
                position=np.zeros(R, np.int32))  # fmt: skip
    args.update(kw)
    min_p = args.pop("min_p", None)
    return jax.jit(sample, static_argnames="mode")(
        jnp.asarray(logits), *(jnp.asarray(args[k]) for k in ("temperature", "top_k", "top_p",
                                                              "seed", "position")),
        min_p_B=None if min_p is None else jnp.asarray(min_p),
    )  # fmt: skip


def test_min_p_keeps_what_transformers_keeps():
    g = GOLDEN["min_p"]
    logits = np.asarray(g["logits"], np.float32)
    R = logits.shape[0]
    n = 512  # draws per row
    rep = np.repeat(logits, n, axis=0)
    t = np.full(R * n, g["temperature"], np.float32)
    tok, _ = _sample_np(rep, temperature=t, seed=np.arange(R * n, dtype=np.int32),
                        min_p=np.full(R * n, g["min_p"], np.float32))  # fmt: skip
    tok = np.asarray(tok).reshape(R, n)
    for r in range(R):
        kept = set(g["kept"][r])
        assert set(tok[r].tolist()) <= kept, f"row {r}: sampled outside the min-p set"
        scaled = logits[r] / g["temperature"]
        probs = np.exp(scaled - scaled.max())
        assert kept == set(np.nonzero(probs >= g["min_p"])[0].tolist())


def test_min_p_distribution_and_greedy_rows_ignore_it():
    n = 4096
    logits = np.linspace(2.0, -2.0, 12).astype(np.float32)
    probs = np.exp(logits - logits.max())
    min_p = 0.3
    keep = probs >= min_p
    ref = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
    tok, _ = _sample_np(np.repeat(logits[None], n, 0), min_p=np.full(n, min_p, np.float32),
                         seed=np.arange(n, dtype=np.int32))  # fmt: skip
    freq = np.bincount(np.asarray(tok), minlength=12) / n
    np.testing.assert_allclose(freq, ref, atol=4 * np.sqrt(ref.max() / n))
    # min_p = 0 draws exactly what no min_p draws; greedy rows take the argmax.
    base, base_lp = _sample_np(np.repeat(logits[None], 64, 0), seed=np.arange(64, dtype=np.int32))
    zero, zero_lp = _sample_np(np.repeat(logits[None], 64, 0), seed=np.arange(64, dtype=np.int32),
                               min_p=np.zeros(64, np.float32))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(base), np.asarray(zero))
    np.testing.assert_array_equal(np.asarray(base_lp), np.asarray(zero_lp))
    g, _ = _sample_np(logits[None] * np.ones((2, 1), np.float32), temperature=np.zeros(2, np.float32),
                      min_p=np.ones(2, np.float32))  # fmt: skip
    assert np.asarray(g).tolist() == [0, 0]


def test_sample_rows_logprobs_top_and_rank_are_raw():
    rng = np.random.default_rng(4)
    R = 6
    logits = (rng.normal(size=(R, V)) * 2).astype(np.float32)
    p = jpaged.SamplingParams(temperature=0.0, repetition_penalty=3.0, logit_bias={0: 50.0})
    inputs, _ = logits_inputs([(p, [1, 2, 3], 2)] * R, R, S)

    class Rows:
        temperature = jnp.zeros(R, jnp.float32)
        top_k = jnp.zeros(R, jnp.int32)
        top_p = jnp.ones(R, jnp.float32)
        seed = jnp.zeros(R, jnp.int32)
        position = jnp.zeros(R, jnp.int32)

    tok, lp, (vals, ids, rank) = sample_rows(jnp.asarray(logits), Rows, inputs, num_top=5)
    assert np.asarray(tok).tolist() == [0] * R  # the bias decides the token
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), ref[:, 0], rtol=1e-5, atol=1e-5)  # raw, not biased
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-ref, -1, kind="stable")[:, :5])
    np.testing.assert_allclose(np.asarray(vals), -np.sort(-ref, -1)[:, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(rank), 1 + (ref > ref[:, :1]).sum(-1))
    # Prompt log-probabilities: each row scores its target.
    targets = rng.integers(0, V, size=R).astype(np.int32)
    plp, _, _, prank = prompt_logprobs(jnp.asarray(logits), jnp.asarray(targets), 5)
    np.testing.assert_allclose(np.asarray(plp), ref[np.arange(R), targets], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(prank), np.asarray(rank_of(jnp.asarray(logits),
                                                                         jnp.asarray(targets))))  # fmt: skip


def test_logprob_entry_shape():
    vals = np.array([-0.1, -2.0, -3.0])
    ids = np.array([7, 4, 9])
    e = logprob_entry(4, -2.0, (vals, ids, 2), 2, None)
    assert list(e) == [4, 7] and e[4].rank == 2 and e[7].rank == 1 and e[7].logprob == -0.1
    e = logprob_entry(5, -4.0, (vals, ids, 11), 2, None)
    assert list(e) == [5, 7, 4] and e[5].rank == 11
    assert list(logprob_entry(5, -4.0, (vals, ids, 11), 0, None)) == [5]


@pytest.mark.parametrize(
    ("text", "old", "stops", "found"),
    [
        ("abc", 0, ("b",), (1, "b")),
        ("abcab", 3, ("ab",), (3, "ab")),  # the first "ab" was in the old text: not again
        ("abcab", 2, ("ab",), (3, "ab")),
        ("xbc", 2, ("bc",), (1, "bc")),  # spans the old and new text
        ("hello", 5, ("l",), None),
        ("aXYb", 2, ("XY", "aX", "b"), (1, "XY")),  # "aX" ended in the old text
    ],
)
def test_find_stop(text, old, stops, found):
    assert stop_strings.find_stop(text, old, stops) == found


@pytest.mark.parametrize(
    ("text", "stops", "shown"),
    [
        ("Hello wor", ("world",), "Hello "),
        ("Hello w", ("world", "wx"), "Hello "),
        ("Hello", ("xyz",), "Hello"),
        ("ab", ("abc", "b!"), ""),
        ("", ("a",), ""),
        ("aaa", ("aab",), "a"),
    ],
)
def test_held_back(text, stops, shown):
    assert stop_strings.held_back(text, stops) == shown


@pytest.mark.parametrize(
    "module", ["jpaged.engine.stop_strings", "jpaged.engine.tokenizer_adapter",
               "jpaged.engine.params"],
)  # fmt: skip
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
