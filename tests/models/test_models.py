"""jpaged's Llama-family models against Hugging Face transformers' goldens.

The checkpoints under ``tests/checkpoints/`` and the goldens under ``tests/goldens/`` come
from ``tools/make_goldens.py`` (transformers, f32, eager attention). Each test loads a
checkpoint with jpaged's loader and checks, in f32:

- the dense forward: prefill logits at every prompt position, and the logits of the 32
  greedy steps (teacher-forced with the golden tokens);
- the paged forward: a NaN-poisoned pool with randomly permuted pages, a ragged batch mixing
  a full prefill, a chunked prefill and short prefills (lengths 1, C - 1, then C, C + 1) and
  a padding sequence, then a mixed decode-and-prefill step, then greedy decode steps with the
  decode kernel (lengths 20..51, crossing page boundaries): per-step logits
  close to the goldens and the 32 greedy tokens identical, with no recompilation across
  decode steps.
"""

from __future__ import annotations

import functools
import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import assert_close
from flax import nnx

import jpaged
from jpaged import models

ROOT = pathlib.Path(__file__).parents[1]
NAMES = ("llama2", "llama3", "mistral", "qwen2")
PAGE_SIZE = 4
T_PAD = 32  # ragged batch bucket
B_PAD = 5  # sequences per batch (the last ones padding)
W = 16  # block-table width: 64 tokens per sequence
# Logits of a 2-layer model reach |5|; the 2e-5 table tolerance is per attention output.
# Two layers of matmuls with D=64..96 in a different summation order than torch's, plus
# RoPE angles at positions up to 50, give up to ~1e-5 absolute differences.
LOGIT_SCALE = 2.0


def _golden(name: str) -> dict:
    return json.loads((ROOT / "goldens" / f"{name}.json").read_text())


@functools.cache
def _model(name: str) -> tuple[nnx.GraphDef, nnx.State, models.ModelConfig]:
    model = models.from_pretrained(ROOT / "checkpoints" / name)
    graphdef, state = nnx.split(model)
    return graphdef, state, model.config


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _dense(graphdef, state, tokens_BS):
    return nnx.merge(graphdef, state).forward_dense(tokens_BS)


def _paged_forward(graphdef, state, tokens_T, positions_T, cache, metadata, decode):
    return nnx.merge(graphdef, state)(tokens_T, positions_T, cache, metadata, decode=decode)


_JIT = dict(static_argnames=("graphdef", "decode"), donate_argnames=("cache",))
_paged = jax.jit(_paged_forward, **_JIT)


@pytest.mark.parametrize("name", NAMES)
def test_dense_forward_matches_transformers(name):
    g = _golden(name)
    graphdef, state, _ = _model(name)
    prompt, greedy = g["prompt_ids"], g["greedy"]["tokens"]
    tokens = jnp.asarray([prompt + greedy[:-1]], jnp.int32)  # teacher-forced greedy run
    logits = np.asarray(_dense(graphdef, state, tokens)[0])
    S = len(prompt)
    assert_close(logits[:S], np.array(g["prefill_logits"]), jnp.float32, scale=LOGIT_SCALE)
    assert_close(
        logits[S - 1 :], np.array(g["greedy"]["step_logits"]), jnp.float32, scale=LOGIT_SCALE
    )
    assert logits[S - 1 :].argmax(-1).tolist() == greedy


class _Seqs:
    """Host bookkeeping for a few sequences on a random page permutation (test-only)."""

    def __init__(self, rng: np.random.Generator, num_pages: int, num_seqs: int):
        perm = rng.permutation(num_pages).astype(np.int32)
        # Each sequence gets W random pages; the rest of the pool stays NaN.
        self.tables = perm[: num_seqs * W].reshape(num_seqs, W)
        self.lens = [0] * num_seqs

    def batch(self, chunks: dict[int, list[int]], *, t_pad: int):
        """Ragged batch: sequence b appends ``chunks[b]`` (sequences not in it are padding)."""
        tokens, positions, slots, cu, kv_lens, last = [], [], [], [0], [], []
        order = sorted(chunks)
        for b in order:
            start = self.lens[b]
            for i, tok in enumerate(chunks[b]):
                pos = start + i
                tokens.append(tok)
                positions.append(pos)
                slots.append(int(self.tables[b, pos // PAGE_SIZE]) * PAGE_SIZE + pos % PAGE_SIZE)
            self.lens[b] = start + len(chunks[b])
            cu.append(len(tokens))
            kv_lens.append(self.lens[b])
            last.append(len(tokens) - 1)
        num_seqs = len(order)
        pad_t = t_pad - len(tokens)
        pad_b = B_PAD - num_seqs
        tables = np.concatenate(
            [self.tables[order], np.zeros((pad_b, W), np.int32)]
        )  # padding rows: page ids never read (kv_len 0)
        md = models.AttentionMetadata(
            slot_mapping=np.array(slots + [-1] * pad_t, np.int32),
            block_tables=tables.astype(np.int32),
            kv_lens=np.array(kv_lens + [0] * pad_b, np.int32),
            cu_q_lens=np.array(cu + [len(tokens)] * pad_b, np.int32),
            num_seqs=np.array(num_seqs, np.int32),
            logits_indices=np.array(last + [0] * pad_b, np.int32),
        )
        return (
            np.array(tokens + [0] * pad_t, np.int32),
            np.array(positions + [0] * pad_t, np.int32),
            md,
        )


def _nan_cache(config: models.ModelConfig, num_pages: int) -> jpaged.PagedKVCache:
    shape = (config.num_layers, config.num_kv_heads, num_pages, PAGE_SIZE, config.head_dim)
    return jpaged.PagedKVCache(
        k_pages=jnp.full(shape, jnp.nan, jnp.float32), v_pages=jnp.full(shape, jnp.nan, jnp.float32)
    )


@pytest.mark.parametrize("name", NAMES)
def test_paged_forward_matches_transformers(name):
    g = _golden(name)
    graphdef, state, config = _model(name)
    prompt = g["prompt_ids"]
    S = len(prompt)
    gold_prefill = np.array(g["prefill_logits"])
    gold_steps = np.array(g["greedy"]["step_logits"])
    gold_tokens = g["greedy"]["tokens"]
    n_steps = len(gold_tokens)
    rng = np.random.default_rng(0)
    num_pages = 4 * W + 5  # 5 pages never assigned: NaN throughout
    seqs = _Seqs(rng, num_pages, num_seqs=4)
    cache = _nan_cache(config, num_pages)

    # Decode steps have one shape: their program traces once (chex counts the traces of
    # this test's own function; the counter restarts per parametrized case).
    chex.clear_trace_counter()

    @functools.partial(jax.jit, **_JIT)
    @chex.assert_max_traces(n=1)
    def decode_once(graphdef, state, tokens_T, positions_T, cache, metadata, decode):
        return _paged_forward(graphdef, state, tokens_T, positions_T, cache, metadata, decode)

    def run(tokens, positions, md, decode, cache):
        step = decode_once if decode else _paged
        logits, cache = step(graphdef, state, tokens, positions, cache, md, decode)
        return np.asarray(logits), cache

    # Step 1 (ragged prefill): seq 0 the whole prompt (19 = 4C + 3), seq 1 a first chunk of
    # 7 tokens (C + 3), seq 2 a single token, seq 3 C - 1 tokens; one padding sequence.
    chunks = {0: prompt, 1: prompt[:7], 2: prompt[:1], 3: prompt[:3]}
    tokens, positions, md = seqs.batch(chunks, t_pad=T_PAD)
    logits, cache = run(tokens, positions, md, False, cache)
    assert_close(logits[:4], gold_prefill[[S - 1, 6, 0, 2]], jnp.float32, scale=LOGIT_SCALE)

    # Step 2 (mixed): seq 0 decodes its first greedy token, seq 1 prefills the rest of the
    # prompt (chunked prefill over 7 cached tokens), seq 2 grows to C + 1 tokens, seq 3 to C.
    out = [int(logits[0].argmax())]
    chunks = {0: out[:1], 1: prompt[7:], 2: prompt[1:5], 3: prompt[3:4]}
    tokens, positions, md = seqs.batch(chunks, t_pad=T_PAD)
    logits, cache = run(tokens, positions, md, False, cache)
    expected = [gold_steps[1], gold_steps[0], gold_prefill[4], gold_prefill[3]]
    assert_close(logits[:4], expected, jnp.float32, scale=LOGIT_SCALE)
    out.append(int(logits[0].argmax()))
    out1 = [int(logits[1].argmax())]

    # Decode steps with the decode kernel (T == B): seq 0 is one token ahead of seq 1;
    # the other rows are padding.
    for step in range(n_steps - 1):
        tokens, positions, md = seqs.batch({0: out[-1:], 1: out1[-1:]}, t_pad=2)
        tokens = np.concatenate([tokens, np.zeros(B_PAD - 2, np.int32)])
        positions = np.concatenate([positions, np.zeros(B_PAD - 2, np.int32)])
        md = models.AttentionMetadata(
            slot_mapping=np.concatenate([md.slot_mapping, np.full(B_PAD - 2, -1, np.int32)]),
            block_tables=md.block_tables,
            kv_lens=md.kv_lens,
            cu_q_lens=np.arange(B_PAD + 1, dtype=np.int32).clip(0, 2),
            num_seqs=md.num_seqs,
            logits_indices=np.arange(B_PAD, dtype=np.int32),
        )
        logits, cache = run(tokens, positions, md, True, cache)
        assert np.all(np.isfinite(logits[:2])), f"step {step}: NaN leaked from the pool"
        if step + 2 < n_steps:
            assert_close(logits[0], gold_steps[step + 2], jnp.float32, scale=LOGIT_SCALE,
                         err_msg=f"seq 0, step {step + 2}")  # fmt: skip
        assert_close(logits[1], gold_steps[step + 1], jnp.float32, scale=LOGIT_SCALE,
                     err_msg=f"seq 1, step {step + 1}")  # fmt: skip
        out.append(int(logits[0].argmax()))
        out1.append(int(logits[1].argmax()))

    assert out[:n_steps] == gold_tokens
    assert out1 == gold_tokens
