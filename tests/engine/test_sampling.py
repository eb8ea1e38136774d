"""On-device sampling: greedy, temperature, top-k, top-p, per-request seeds; parameter checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpaged
from jpaged.engine.sampling import sample, top_logprobs

V = 12
_sample = jax.jit(sample)


def _rows(logits, *, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None):
    logits = np.asarray(logits, np.float32)
    B = logits.shape[0]
    seeds = np.arange(B) if seeds is None else seeds
    positions = np.zeros(B) if positions is None else positions
    tok, lp = _sample(
        jnp.asarray(logits),
        jnp.full((B,), temperature, jnp.float32),
        jnp.full((B,), top_k, jnp.int32),
        jnp.full((B,), top_p, jnp.float32),
        jnp.asarray(seeds, jnp.int32),
        jnp.asarray(positions, jnp.int32),
    )
    return np.asarray(tok), np.asarray(lp)


def test_greedy_is_argmax_with_its_logprob():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, V)).astype(np.float32) * 3
    tok, lp = _rows(logits, temperature=0.0)
    np.testing.assert_array_equal(tok, logits.argmax(-1))
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(64), tok], atol=1e-5, rtol=1e-5)


def test_top_k_one_is_greedy_at_any_temperature():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(64, V)).astype(np.float32)
    tok, _ = _rows(logits, temperature=5.0, top_k=1)
    np.testing.assert_array_equal(tok, logits.argmax(-1))


def test_same_seed_same_token_whatever_the_batch():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(64, V)).astype(np.float32)
    seeds = rng.integers(0, 2**31 - 1, size=64)
    positions = rng.integers(0, 1000, size=64)
    batch, _ = _rows(logits, seeds=seeds, positions=positions)
    perm = rng.permutation(64)
    shuffled, _ = _rows(logits[perm], seeds=seeds[perm], positions=positions[perm])
    np.testing.assert_array_equal(shuffled, batch[perm])
    # Row 5 with other rows replaced by different logits, seeds and positions.
    other = rng.normal(size=(64, V)).astype(np.float32)
    other[7] = logits[5]
    s2 = rng.integers(0, 2**31 - 1, size=64)
    p2 = rng.integers(0, 1000, size=64)
    s2[7], p2[7] = seeds[5], positions[5]
    again, _ = _rows(other, seeds=s2, positions=p2)
    assert again[7] == batch[5]
    # A different position draws differently somewhere.
    moved, _ = _rows(logits, seeds=seeds, positions=positions + 1)
    assert (moved != batch).any()


def _empirical(logits_row, n, **kw):
    logits = np.repeat(np.asarray(logits_row, np.float32)[None], n, axis=0)
    tok, _ = _rows(logits, seeds=np.arange(n), **kw)
    return np.bincount(tok, minlength=V) / n


def test_temperature_top_k_top_p_distribution():
    n = 4096
    logits = np.linspace(2.0, -2.0, V).astype(np.float32)  # token 0 most likely
    # Temperature 2: frequencies match softmax(logits / 2).
    p = np.exp(logits / 2) / np.exp(logits / 2).sum()
    freq = _empirical(logits, n, temperature=2.0)
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(p.max() / n))
    # Top-k 3: only tokens 0..2, in proportion.
    freq = _empirical(logits, n, top_k=3)
    p3 = np.exp(logits[:3]) / np.exp(logits[:3]).sum()
    assert freq[3:].sum() == 0
    np.testing.assert_allclose(freq[:3], p3, atol=4 * np.sqrt(0.25 / n))
    # Top-p: the nucleus is the shortest prefix reaching top_p.
    probs = np.exp(logits) / np.exp(logits).sum()
    top_p = float(probs[:2].sum() + 1e-3)  # needs tokens 0, 1, 2
    freq = _empirical(logits, n, top_p=top_p)
    assert freq[3:].sum() == 0 and (freq[:3] > 0).all()


def test_top_logprobs_matches_numpy():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    vals, ids = jax.jit(top_logprobs, static_argnums=1)(jnp.asarray(logits), 3)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-ref, -1)[:, :3])
    np.testing.assert_allclose(np.asarray(vals), -np.sort(-ref, -1)[:, :3], atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"n": 0}, "n=0"),
        ({"seed": -1}, "seed=-1"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens=5"),
    ],
)
def test_invalid_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jpaged.SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beam_width": 0}, "beam_width=0"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_invalid_beam_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jpaged.BeamSearchParams(**kwargs)


def test_truncation_elsewhere_in_the_batch_does_not_change_a_row():
    # Row 0 samples without truncation; whether row 1 truncates (the sorting path runs) or
    # not, row 0 draws the same token.
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    for seed in range(32):
        seeds = np.array([seed, 4])
        plain, _ = _rows(logits, seeds=seeds, positions=np.array([7, 7]))
        trunc, _ = _sample(
            jnp.asarray(logits),
            jnp.ones(2, jnp.float32),
            jnp.asarray([0, 3], jnp.int32),
            jnp.asarray([1.0, 0.5], jnp.float32),
            jnp.asarray(seeds, jnp.int32),
            jnp.asarray([7, 7], jnp.int32),
        )
        assert int(plain[0]) == int(trunc[0])


@pytest.mark.parametrize(
    "temperature, top_k, top_p, mode",
    [
        ([0.0, 0.0, 0.0], [0, 3, 0], [1.0, 1.0, 0.5], "greedy"),  # knobs ignored when greedy
        ([0.0, 0.7, 1.3], [0, 0, V], [1.0, 1.0, 1.0], "random"),  # top_k = V truncates nothing
        ([0.0, 0.7, 1.3], [0, 3, 0], [1.0, 1.0, 0.6], "truncate"),
    ],
)
def test_static_mode_equals_the_device_choice(temperature, top_k, top_p, mode):
    """The decode loop's static modes (chosen on the host by ``sampling_mode``) give exactly
    the tokens and log-probabilities of the device-side choice."""
    from jpaged.engine.sampling import sampling_mode

    assert sampling_mode(temperature, top_k, top_p, V) == mode
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(3, V)).astype(np.float32))
    args = (logits, jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
            jnp.asarray(top_p, jnp.float32), jnp.asarray([3, 9, 27], jnp.int32),
            jnp.asarray([5, 6, 7], jnp.int32))  # fmt: skip
    for position in range(8):
        a = (*args[:5], args[5] + position)
        tok, lp = _sample(*a)
        tok_m, lp_m = jax.jit(sample, static_argnames="mode")(*a, mode=mode)
        np.testing.assert_array_equal(np.asarray(tok_m), np.asarray(tok))
        np.testing.assert_array_equal(np.asarray(lp_m), np.asarray(lp))
    with pytest.raises(ValueError, match="mode="):
        sample(*args, mode="nucleus")


@pytest.mark.parametrize(
    "module", ["jpaged.engine.sampling", "jpaged.engine.batches", "jpaged.engine.runner"]
)
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_default_compiler_options_is_public():
    assert jpaged.default_compiler_options("cpu") == {}
    assert jpaged.default_compiler_options("cuda")["xla_gpu_enable_triton_gemm"] is False
