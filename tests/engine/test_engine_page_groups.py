"""Two page groups in the engine: the Gemma 2 checkpoint (local layers with a window of 8,
global layers) releases its local group's pages outside the window while the global group
keeps whole histories.

With pages of C = 4 tokens a decoding sequence holds at most ``8 / 4 + 2`` local pages (its
lookahead reservation aside) and the tokens do not change: greedy and beam search equal the
transformers goldens, and every completion equals the same engine's with one page group
(``num_local_pages=0``, nothing released), also under parallel sampling, prefix hits and
preemption by recompute and by swap. Every engine runs with ``debug=True`` (both groups'
invariants after every step) on a NaN-poisoned pool: a released local entry that pointed at
a page outside the sequence would poison the logits.
"""

from __future__ import annotations

import functools
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from _engine_helpers import DECODE_PATHS, assert_took_path
from flax import nnx

import jpaged
from jpaged.kv.page_groups import PageGroups

GEMMA2 = "tests/checkpoints/gemma2"
WINDOW, C = 8, 4
ENGINE = dict(
    page_size=C, num_pages=48, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32,
    debug=True,
)  # fmt: skip
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Cases ``make test`` leaves out and ``make test-all`` runs (``tests/conftest.py``): forks and
# prefix hits on single steps (CI: [chains-k4]; single steps' release:
# test_greedy_matches_transformers_within_the_window_bound[single-steps]), preemption with both
# groups short (CI: recompute with the local group short, [recompute-local-bound]; swap out and
# back in with two groups, test_a_swapped_sequence_comes_back_when_each_group_has_room), and
# the fp8 pool's two groups (CI: an fp8 pool's scales move with their pages in
# test_engine_quantized.py, the groups' pages here).
SLOW_CASES = {
    "test_outputs_unchanged_with_forks_and_prefix_hits[single-steps]",
    "test_preemption_with_released_pages[recompute]",
    "test_preemption_with_released_pages[swap]",
    "test_quantized_pool_with_two_groups",
}


def _golden() -> dict:
    with open("tests/goldens/gemma2.json") as f:
        return json.load(f)


@functools.cache
def _model():
    return jpaged.models.from_pretrained(GEMMA2)


def _engine(**kw) -> jpaged.LLM:
    llm = jpaged.LLM(_model(), **{**ENGINE, **kw})
    nan = jnp.full_like(llm.cache.k_pages, jnp.nan)
    llm.cache = jpaged.PagedKVCache(k_pages=nan, v_pages=jnp.full_like(nan, jnp.nan))
    return llm


def _run(llm: jpaged.LLM, prompts, params) -> tuple[list, dict]:
    """Steps the requests to the end; returns their outputs and the most pages any decoding
    sequence held after a step: ``local`` (local pages holding its tokens), ``local_all``
    (with its lookahead reservation) and ``global`` (global pages); all 0 with one group."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    peak = {"local": 0, "local_all": 0, "global": 0}
    while llm.has_unfinished_requests():
        llm.step()
        if not isinstance(llm.alloc, PageGroups):
            continue
        for req in llm.scheduler.running:
            for seq in req.live_seqs():
                sid = seq.seq_id
                if sid not in llm.alloc or llm.alloc.is_swapped(sid):
                    continue
                if seq.num_computed < len(req.prompt):
                    continue  # prefilling: admission allocated the whole prompt
                local = llm.alloc.local_group
                released = local.num_released_pages(sid)
                tokens = math.ceil(local.num_tokens(sid) / C) - released
                peak["local"] = max(peak["local"], tokens)
                peak["local_all"] = max(peak["local_all"], len(local.block_table(sid)) - released)
                peak["global"] = max(peak["global"], len(llm.alloc.block_table(sid)))
    return [llm.get_output(i) for i in ids], peak


def _tokens(outs) -> list[list[list[int]]]:
    for o in outs:
        assert o.error is None, o.error
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("decode", ["single-steps", "chains-k4"])
def test_greedy_matches_transformers_within_the_window_bound(decode):
    gold = _golden()
    prompt, expected = gold["prompt_ids"], gold["greedy"]["tokens"]
    assert len(expected) == 4 * WINDOW
    llm = _engine(**DECODE_PATHS[decode])
    assert isinstance(llm.alloc, PageGroups) and llm.appender.sliding_window == WINDOW
    # One layer slice per global layer for a global page, per local layer for a local one.
    assert llm.cache.k_pages.shape[:3] == (2, 1, 48 + 48)
    assert (llm.alloc.global_group.num_pages, llm.alloc.local_group.num_pages) == (48, 48)
    sp = jpaged.SamplingParams(max_tokens=len(expected), **GREEDY)
    (out,), peak = _run(llm, [prompt], sp)
    assert out.outputs[0].token_ids == expected
    assert peak["local"] <= WINDOW // C + 2
    ahead = 0 if decode == "single-steps" else math.ceil(2 * llm.num_decode_steps / C)
    assert peak["local_all"] <= WINDOW // C + 2 + ahead
    # The global group holds the whole history (50 computed tokens: 13 pages at the end; the
    # last loop of a chain may finish before a step observes it).
    assert peak["global"] >= 12
    s = llm.stats()
    # 50 computed tokens: keys 0..42 are unseen by any later query, local pages 0..9.
    assert s["pages_released_by_window"] == 10 == llm.alloc.local_group.stats().window_released
    assert llm.alloc.global_group.stats().window_released == 0
    assert s["pages_used"] == 0 and s["pages_total"] == 96
    assert_took_path(s, decode)


def test_one_group_keeps_every_page():
    gold = _golden()
    llm = _engine(num_local_pages=0, num_pages=96)  # the one-group references' pool
    assert not isinstance(llm.alloc, PageGroups) and llm.cache.k_pages.shape[0] == 4
    sp = jpaged.SamplingParams(max_tokens=32, **GREEDY)
    out = llm.generate([gold["prompt_ids"]], sp)[0]
    assert out.outputs[0].token_ids == gold["greedy"]["tokens"]
    assert llm.stats()["pages_released_by_window"] == 0


def test_beam_search_matches_transformers():
    gold = _golden()["beam_search"]
    llm = _engine(eos_token_id=gold["eos_token_id"])
    params = jpaged.BeamSearchParams(
        beam_width=gold["num_beams"],
        max_tokens=gold["max_new_tokens"],
        length_penalty=gold["length_penalty"],
        early_stopping=gold["early_stopping"],
    )
    (out,), _ = _run(llm, [gold["prompt_ids"]], params)
    assert [c.token_ids for c in out.outputs] == gold["sequences"]
    np.testing.assert_allclose(
        [c.score for c in out.outputs], gold["sequence_scores"], atol=1e-4, rtol=1e-4
    )
    s = llm.stats()
    assert s["pages_released_by_window"] > 0 and s["cow_copies"] > 0 and s["pages_used"] == 0


def _mixed_requests(seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (1, 3, 4, 5, 19, 30)]
    params = [
        jpaged.SamplingParams(max_tokens=30, **GREEDY),
        jpaged.SamplingParams(max_tokens=25, temperature=0.8, seed=3, ignore_eos=True),
        jpaged.SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=4, n=3,
                              ignore_eos=True),
        jpaged.SamplingParams(max_tokens=28, **GREEDY),
        jpaged.SamplingParams(max_tokens=33, temperature=0.7, top_p=0.9, seed=5, n=2,
                              ignore_eos=True),
        jpaged.SamplingParams(max_tokens=30, **GREEDY),
    ]  # fmt: skip
    return prompts, params


@pytest.mark.parametrize("decode", ["single-steps", "chains-k4"])
def test_outputs_unchanged_with_forks_and_prefix_hits(decode):
    prompts, params = _mixed_requests(0)
    # A global group of 96 pages keeps every history cached; the local group has 56.
    ref, _ = _run(_engine(num_local_pages=0, num_pages=96, **DECODE_PATHS[decode]), prompts,
                  params)  # fmt: skip
    llm = _engine(num_pages=96, **DECODE_PATHS[decode])
    first, peak = _run(llm, prompts, params)
    assert _tokens(first) == _tokens(ref)
    assert peak["local"] <= WINDOW // C + 2
    released = llm.stats()["pages_released_by_window"]
    assert released > 0
    # The 30-token prompt again: its full pages are cached in the global group and, parked
    # with their contents after release, in the local group: a prefix hit, same tokens.
    again, _ = _run(llm, prompts[5:], params[5:])
    assert _tokens(again) == _tokens(ref[5:])
    s = llm.stats()
    assert again[0].num_cached_tokens == 28 and s["prefix_hit_tokens"] == 28
    assert s["pages_released_by_window"] > released and s["pages_used"] == 0


@pytest.mark.parametrize(
    ("mode", "pages"),
    [("recompute", dict(num_pages=16, num_local_pages=16)),
     ("swap", dict(num_pages=16, num_local_pages=16)),
     ("recompute", dict(num_pages=80, num_local_pages=16))],  # only the local group binds
    ids=["recompute", "swap", "recompute-local-bound"],
)  # fmt: skip
def test_preemption_with_released_pages(mode, pages):
    """Eight short prompts are admitted at 1-3 pages each, then their windows (3-4 local
    pages each) and histories outgrow the pools together, so some are preempted (and some
    of those hold released pages); the outputs stay the same."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (1, 3, 4, 5, 6, 9, 2, 7)]
    params = [jpaged.SamplingParams(max_tokens=24 + i, temperature=0.0 if i % 2 else 0.9,
                                    seed=i, n=2 if i == 3 else 1, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    ref, _ = _run(_engine(num_local_pages=0, num_pages=96), prompts, params)
    llm = _engine(**pages, watermark=0.0, preemption_mode=mode, chain_decode=False)
    outs, _ = _run(llm, prompts, params)
    assert _tokens(outs) == _tokens(ref)
    s = llm.stats()
    assert s[f"preemptions_{mode}"] >= 1 and s["pages_released_by_window"] > 0
    if mode == "swap":
        assert s["swapped_out_bytes"] > 0 and s["swapped_in_bytes"] == s["swapped_out_bytes"]
    assert s["pages_used"] == 0


def test_no_compiles_after_warmup_through_releases_swaps_and_joins(backend_compiles):
    # Pools small enough for swaps, large enough for rows to join running chains.
    llm = _engine(num_decode_steps=4, max_num_seqs=7, num_pages=40, num_local_pages=32,
                  watermark=0.0, preemption_mode="swap", enable_prefix_caching=False)  # fmt: skip
    llm.warmup(threads=2)
    before = backend_compiles()
    rng = np.random.default_rng(32)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (20, 3, 17, 9, 1, 30, 12)]
    sp = jpaged.SamplingParams(max_tokens=24, **GREEDY)
    ids = [llm.add_request(p, sp) for p in prompts[:3]]
    for _ in range(3):  # two steps of prefill, then a chain runs when the others arrive
        llm.step()
    ids += [llm.add_request(p, sp) for p in prompts[3:]]
    while llm.has_unfinished_requests():
        llm.step()
    outs = [llm.get_output(i) for i in ids]
    s = llm.stats()
    assert s["preemptions_swap"] >= 1 and s["chain_joins"] > 0
    assert s["pages_released_by_window"] > 0
    assert backend_compiles() == before
    ref = _engine(num_local_pages=0, num_pages=96).generate(prompts, sp)
    assert _tokens(outs) == _tokens(ref)


def test_bad_configurations_fail_early():
    with pytest.raises(ValueError, match=r"num_local_pages=-1 must be None or an int >= 0"):
        jpaged.LLM(GEMMA2, num_local_pages=-1)
    for path in ("tests/checkpoints/llama2", "tests/checkpoints/mistral"):
        with pytest.raises(ValueError, match="num_local_pages=32 needs a model mixing"):
            jpaged.LLM(path, **ENGINE, num_local_pages=32)
    # max_model_len 64 in pages of 4: the local group must hold a whole 16-page sequence.
    with pytest.raises(ValueError, match="group must hold one sequence of max_model_len, 16 pa"):
        jpaged.LLM(_model(), **ENGINE, num_local_pages=15)
    with pytest.raises(ValueError, match="leaves no global pages"):
        jpaged.LLM(_model(), **{**ENGINE, "num_pages": None}, kv_cache_memory=1 << 20,
                   num_local_pages=1 << 20)  # fmt: skip


def test_pool_sizes():
    # num_pages is the global group's; the local group by default takes what 8 windows and
    # their loops' reservations need plus one whole sequence: 8 * (2 + 2 + 1) + 16 = 56.
    llm = jpaged.LLM(_model(), **{**ENGINE, "num_pages": 96})
    assert (llm.alloc.global_group.num_pages, llm.alloc.local_group.num_pages) == (96, 56)
    # A budget of 1 MiB holds 64 pages of L / 2 = 2 f32 slices: the local group takes half.
    llm = jpaged.LLM(_model(), **{**ENGINE, "num_pages": None}, kv_cache_memory=1 << 20)
    assert (llm.alloc.global_group.num_pages, llm.alloc.local_group.num_pages) == (32, 32)
    assert llm.cache.bytes == 1 << 20
    llm = jpaged.LLM(_model(), **ENGINE, num_local_pages=20, swap_space=68 * 16384)
    assert (llm.alloc.global_group.num_pages, llm.alloc.local_group.num_pages) == (48, 20)
    assert llm.alloc.local_host_offset == 48 and llm.alloc.num_host_pages == 68
    # Host slots follow the pages, the local group's capped at what its swapped sequences
    # hold: 8 windows of 2 + 2 pages and one whole sequence, 48 of 1,000 (not 806).
    llm = jpaged.LLM(_model(), **ENGINE, num_local_pages=200, chain_decode=False,
                     swap_space=1000 * 16384)  # fmt: skip
    assert llm.alloc.local_host_offset == 1000 - 48 and llm.alloc.num_host_pages == 1000


def test_models_that_are_not_mixed_keep_one_group():
    for path in ("tests/checkpoints/llama2", "tests/checkpoints/mistral"):
        llm = jpaged.LLM(path, **ENGINE)
        assert isinstance(llm.alloc, jpaged.BlockAllocator)
        assert llm.cache.k_pages.shape[:3] == (llm.model.num_layers, llm.model.num_kv_heads, 48)


def test_quantized_pool_with_two_groups():
    """An fp8 pool: each page's scales live in its group's layer slices and move with it."""
    prompts, params = _mixed_requests(2)
    kw = {**ENGINE, "num_pages": 96, "cache_dtype": "fp8"}
    ref = jpaged.LLM(_model(), **kw, num_local_pages=0).generate(prompts, params)
    llm = jpaged.LLM(_model(), **kw)
    assert llm.cache.k_scale.shape[:3] == (2, 1, 96 + 56)
    assert _tokens(llm.generate(prompts, params)) == _tokens(ref)
    assert llm.stats()["pages_released_by_window"] > 0 and llm.stats()["cow_copies"] > 0


def test_a_swapped_sequence_comes_back_when_each_group_has_room():
    """A 60-token prompt is swapped out beside a 1-token one in pools of 16 pages a group:
    its 15 global and 2 local pages fit back (each group checked on its own, not the two
    groups' pages summed against one), and both requests finish with the tokens of an
    unconstrained one-group engine."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, size=1).tolist(), rng.integers(3, 300, size=60).tolist()]
    params = [jpaged.SamplingParams(max_tokens=n, **GREEDY) for n in (20, 4)]
    ref, _ = _run(_engine(num_local_pages=0, num_pages=96), prompts, params)
    llm = _engine(num_pages=16, watermark=0.0, preemption_mode="swap", chain_decode=False,
                  enable_prefix_caching=False, num_local_pages=16)  # fmt: skip
    outs, _ = _run(llm, prompts, params)
    assert _tokens(outs) == _tokens(ref)
    assert llm.stats()["preemptions_swap"] >= 1


def test_a_chunked_prompt_resumes_after_its_local_pages_were_released():
    """A 50-token prompt in chunks of 16 tokens: after each chunk the local pages its later
    queries never see return to the pool, and the next chunk's keys attend over the kept
    window; the tokens equal the one-group engine's (a released page read by mistake holds
    NaN here)."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 300, size=50).tolist()
    sp = jpaged.SamplingParams(max_tokens=8, **GREEDY)
    kw = dict(max_num_batched_tokens=16, enable_prefix_caching=False)
    ref, _ = _run(_engine(**kw, num_local_pages=0), [prompt], sp)
    llm = _engine(**kw)
    outs, _ = _run(llm, [prompt], sp)
    assert _tokens(outs) == _tokens(ref)
    assert llm.stats()["pages_released_by_window"] >= 8


class _GemmaWithoutGroups(jpaged.models.LlamaForCausalLM):
    """A model of Gemma 2's layers that does not read the local group's metadata."""

    supports_page_groups = False


def test_a_model_that_does_not_read_the_local_group_keeps_one():
    model = _GemmaWithoutGroups(_model().config, rngs=nnx.Rngs(0))
    llm = jpaged.LLM(model, **ENGINE)
    assert isinstance(llm.alloc, jpaged.BlockAllocator)
    assert llm.cache.k_pages.shape[0] == model.num_layers
    with pytest.raises(ValueError, match="num_local_pages=16 needs a model that reads the local"):
        jpaged.LLM(model, **ENGINE, num_local_pages=16)


def test_a_request_too_large_for_either_group_names_both_sizes():
    llm = _engine(num_pages=16, num_local_pages=16, watermark=0.0)
    rng = np.random.default_rng(4)
    (out,) = llm.generate(
        [rng.integers(3, 300, size=60).tolist()],
        jpaged.SamplingParams(max_tokens=4, n=2, **GREEDY),
    )
    assert out.error is not None and "cannot fit even alone" in out.error
    assert "the tighter of two page groups: global 16 pages, local 16" in out.error
