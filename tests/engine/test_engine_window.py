"""Sliding-window page release in the engine, and the windowed checkpoints against transformers.

The Mistral checkpoint has a window of 8 on every layer: with pages of C = 4 tokens a
sequence generating 4x its window must hold at most ``8 / 4 + 2`` pages (its lookahead
reservation aside), and the tokens must not change: greedy equals transformers, and every
completion equals the same engine's with release switched off, also under prefix caching,
parallel sampling and preemption by recompute and by swap. Every engine runs with
``debug=True`` (allocator invariants after every step) on a NaN-poisoned pool: a released
entry that pointed at a page outside the sequence would poison the logits. Gemma 2 mixes
local and global layers: in one page group (``num_local_pages=0``) nothing is released, and
greedy equals transformers (``test_engine_page_groups.py`` runs it on two groups).
"""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from _engine_helpers import DECODE_PATHS, SWAP_SPACE, assert_took_path

import jpaged
from jpaged.engine.assembly import release_window

# Cases ``make test`` leaves out and ``make test-all`` runs (``tests/conftest.py``): swap
# preemption of sequences that released pages (released pages under preemption: [recompute];
# swap preemption: test_engine_sharing.py), and Mistral's greedy window bound on single steps
# (the bound with chains of loops: [chains-k4]; release on single steps: the parallel samples
# of test_outputs_unchanged_by_release_with_sharing_and_prefix_hits, which end chains, and
# [recompute], which runs single steps).
SLOW_CASES = {
    "test_preemption_with_released_pages[swap]",
    "test_mistral_greedy_matches_transformers_within_the_window_bound[single-steps]",
}
MISTRAL = "tests/checkpoints/mistral"
WINDOW, C = 8, 4
ENGINE = dict(
    page_size=C, num_pages=48, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32,
    debug=True, swap_space=SWAP_SPACE,
)  # fmt: skip


def _golden(name: str) -> dict:
    with open(f"tests/goldens/{name}.json") as f:
        return json.load(f)


def _engine(path: str = MISTRAL, *, release: bool = True, **kw) -> jpaged.LLM:
    llm = jpaged.LLM(path, **{**ENGINE, **kw})
    if not release:
        llm.appender.sliding_window = None
    nan = jnp.full_like(llm.cache.k_pages, jnp.nan)
    llm.cache = jpaged.PagedKVCache(k_pages=nan, v_pages=jnp.full_like(nan, jnp.nan))
    return llm


def _run(llm: jpaged.LLM, prompts, params) -> tuple[list, dict]:
    """Steps the requests to the end; returns their outputs and the most pages any decoding
    sequence held after a step: ``tokens`` (pages holding its tokens), ``all`` (with its
    lookahead reservation)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    peak = {"tokens": 0, "all": 0}
    while llm.has_unfinished_requests():
        llm.step()
        for req in llm.scheduler.running:
            for seq in req.live_seqs():
                sid = seq.seq_id
                if sid not in llm.alloc or seq.num_computed < len(req.prompt):
                    continue  # prefilling: admission allocated the whole prompt
                released = llm.alloc.num_released_pages(sid)
                tokens = math.ceil(llm.alloc.num_tokens(sid) / C) - released
                peak["tokens"] = max(peak["tokens"], tokens)
                peak["all"] = max(peak["all"], len(llm.alloc.block_table(sid)) - released)
    return [llm.get_output(i) for i in ids], peak


def test_release_window_only_when_every_layer_has_one():
    assert release_window(jpaged.models.load_config(MISTRAL)) == WINDOW
    assert release_window(jpaged.models.load_config("tests/checkpoints/gemma2")) is None
    assert release_window(jpaged.models.load_config("tests/checkpoints/llama2")) is None
    assert release_window(object()) is None  # a user's model without a ModelConfig


@pytest.mark.parametrize("decode", ["single-steps", "chains-k4"])
def test_mistral_greedy_matches_transformers_within_the_window_bound(decode):
    gold = _golden("mistral")
    prompt, expected = gold["prompt_ids"], gold["greedy"]["tokens"]
    assert len(expected) == 4 * WINDOW
    greedy = jpaged.SamplingParams(max_tokens=len(expected), temperature=0.0, ignore_eos=True)
    llm = _engine(**DECODE_PATHS[decode])
    (out,), peak = _run(llm, [prompt], greedy)
    assert out.outputs[0].token_ids == expected
    assert peak["tokens"] <= WINDOW // C + 2
    # A decode loop reserves up to 2k positions ahead (the loop in flight and the next).
    ahead = 0 if decode == "single-steps" else math.ceil(2 * llm.num_decode_steps / C)
    assert peak["all"] <= WINDOW // C + 2 + ahead
    s = llm.stats()
    # 50 computed tokens (the last one sampled is never computed): keys 0..42 are unseen by
    # any later query, pages 0..9.
    assert s["pages_released_by_window"] == 10 and s["pages_used"] == 0
    assert_took_path(s, decode)

    if decode == "chains-k4":  # without release the sequence keeps every page (13 at the end;
        # the last loop of a chain may finish before a step observes them all)
        ref, ref_peak = _run(_engine(release=False, **DECODE_PATHS[decode]),
                             [prompt], greedy)  # fmt: skip
        assert ref[0].outputs[0].token_ids == expected and ref_peak["tokens"] >= 12


def _mixed_requests(seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (1, 3, 4, 5, 19, 30)]
    params = [
        jpaged.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        jpaged.SamplingParams(max_tokens=25, temperature=0.8, seed=3, ignore_eos=True),
        jpaged.SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=4, n=3,
                              ignore_eos=True),
        jpaged.SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True),
        jpaged.SamplingParams(max_tokens=33, temperature=0.7, top_p=0.9, seed=5, n=2,
                              ignore_eos=True),
        jpaged.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    ]  # fmt: skip
    return prompts, params


def _tokens(outs) -> list[list[list[int]]]:
    for o in outs:
        assert o.error is None, o.error
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_outputs_unchanged_by_release_with_sharing_and_prefix_hits():
    prompts, params = _mixed_requests(0)
    ref, _ = _run(_engine(release=False), prompts, params)
    llm = _engine()
    first, peak = _run(llm, prompts, params)
    assert _tokens(first) == _tokens(ref)
    assert peak["tokens"] <= WINDOW // C + 2
    released = llm.stats()["pages_released_by_window"]
    assert released > 0
    # The 30-token prompt again: its full pages, released (and parked with their contents)
    # while the first run decoded, come back as prefix hits; the completion does not change.
    again, _ = _run(llm, prompts[5:], params[5:])
    assert _tokens(again) == _tokens(ref[5:])
    s = llm.stats()
    assert s["prefix_hit_tokens"] == 28 and again[0].num_cached_tokens == 28
    assert s["pages_released_by_window"] > released and s["pages_used"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_released_pages(mode):
    """16 pages of 4 tokens: eight short prompts are admitted at 1-3 pages each, then their
    windows (3-4 pages each) outgrow the pool together, so some are preempted (and some of
    those hold released pages); the outputs stay the same."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (1, 3, 4, 5, 6, 9, 2, 7)]
    params = [jpaged.SamplingParams(max_tokens=24 + i, temperature=0.0 if i % 2 else 0.9,
                                    seed=i, n=2 if i == 3 else 1, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    ref, _ = _run(_engine(), prompts, params)
    llm = _engine(num_pages=16, watermark=0.0, preemption_mode=mode, chain_decode=False)
    outs, _ = _run(llm, prompts, params)
    assert _tokens(outs) == _tokens(ref)
    s = llm.stats()
    assert s[f"preemptions_{mode}"] >= 1 and s["pages_released_by_window"] > 0
    if mode == "swap":
        assert s["swapped_out_bytes"] > 0 and s["swapped_in_bytes"] == s["swapped_out_bytes"]
    assert s["pages_used"] == 0


def test_gemma2_greedy_matches_transformers():
    """Beam search is in ``test_engine_sharing.py`` with the other checkpoints."""
    gold = _golden("gemma2")
    llm = _engine("tests/checkpoints/gemma2", num_local_pages=0)
    assert llm.appender.sliding_window is None  # global layers keep every page
    greedy = jpaged.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    (out,), _ = _run(llm, [gold["prompt_ids"]], greedy)
    assert out.outputs[0].token_ids == gold["greedy"]["tokens"]
    assert llm.stats()["pages_released_by_window"] == 0
