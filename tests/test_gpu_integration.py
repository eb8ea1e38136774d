"""End to end on a GPU: the model's paged forward through the Mosaic GPU kernels, and jpaged.LLM.

CPU CI covers the kernels in their interpreters and the engine on the XLA path; these tests
check that the pieces fit on real hardware: a bf16 Llama whose attention dispatches to the
decode and ragged Mosaic GPU kernels (stacked pool, traced layer index inside the layer loop)
gives the logits of the XLA path, and the engine generates on it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jpaged
from jpaged import models

pytestmark = pytest.mark.gpu

C = 16


def _model(**overrides):
    config = models.tiny(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=2,
        head_dim=64, num_layers=2, max_position_embeddings=1024, **overrides,
    )  # fmt: skip
    return config, models.LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("graphdef", "decode", "implementation"))
def _forward(graphdef, state, tokens, positions, cache, metadata, decode, implementation):
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, cache, metadata, decode=decode, implementation=implementation)


def _rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_paged_forward_kernels_match_xla(window):
    config, model = _model(sliding_window=window)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    lens = np.array([1, C - 1, C + 1, 150], np.int32)  # prompt lengths
    B, W, P = len(lens), 16, 64
    perm = rng.permutation(P).astype(np.int32)
    table = perm[: B * W].reshape(B, W)
    prompts = [rng.integers(0, config.vocab_size, n).astype(np.int32) for n in lens]

    def slots(b, lo, hi):
        pos = np.arange(lo, hi)
        return (table[b, pos // C] * C + pos % C).astype(np.int32)

    def run(implementation):
        cache = jpaged.PagedKVCache.create(config.num_layers, config.num_kv_heads, P, C,
                                           config.head_dim, dtype=jnp.bfloat16)  # fmt: skip
        cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)
        # Prefill all four prompts in one ragged batch.
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        meta = models.AttentionMetadata(
            slot_mapping=np.concatenate([slots(b, 0, n) for b, n in enumerate(lens)]),
            block_tables=table, kv_lens=lens, cu_q_lens=cu, num_seqs=np.array(B, np.int32),
            logits_indices=(cu[1:] - 1).astype(np.int32),
        )  # fmt: skip
        tokens = np.concatenate(prompts)
        positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
        out = []
        logits, cache = _forward(graphdef, state, tokens, positions, cache, meta, False,
                                 implementation)  # fmt: skip
        out.append(logits)
        # Three decode steps through the decode kernel (one token per sequence).
        kv = lens.copy()
        nxt = rng_tokens = np.asarray(jnp.argmax(logits, -1), np.int32)
        for _ in range(3):
            meta = models.AttentionMetadata(
                slot_mapping=np.array([slots(b, kv[b], kv[b] + 1)[0] for b in range(B)]),
                block_tables=table, kv_lens=kv + 1, cu_q_lens=np.arange(B + 1, dtype=np.int32),
                num_seqs=np.array(B, np.int32), logits_indices=np.arange(B, dtype=np.int32),
            )  # fmt: skip
            logits, cache = _forward(graphdef, state, nxt, kv.copy(), cache, meta, True,
                                     implementation)  # fmt: skip
            out.append(logits)
            kv = kv + 1
            nxt = rng_tokens  # the same tokens for both implementations
        return out

    got, want = run(None), run("xla")
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.all(np.isfinite(np.asarray(g))), f"step {step}: non-finite logits"
        # bf16 K/V and activations: both paths round the same inputs; 2e-2 is the bf16 row
        # of tests/_tolerances.py applied to a relative L2 error.
        assert _rel_err(g, w) < 2e-2, f"step {step}: rel err {_rel_err(g, w):.3g}"


def test_engine_generates_on_the_gpu_kernels():
    config, model = _model()
    llm = jpaged.LLM(model, page_size=C, num_pages=256, max_num_seqs=8, max_model_len=512,
                     eos_token_id=None, debug=True)  # fmt: skip
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 17, 90)]
    outs = llm.generate(prompts, jpaged.SamplingParams(max_tokens=24, temperature=0.0, n=1),
                        progress=False)  # fmt: skip
    beams = llm.beam_search(prompts[:1], jpaged.BeamSearchParams(beam_width=3, max_tokens=8))
    sampled = llm.generate(prompts[1:2], jpaged.SamplingParams(max_tokens=16, n=3, seed=3),
                           progress=False)  # fmt: skip
    for out in outs:
        (c,) = out.outputs
        assert c.finish_reason == "length" and len(c.token_ids) == 24
        assert all(0 <= t < config.vocab_size for t in c.token_ids)
    assert len(beams[0].outputs) == 3
    assert len(sampled[0].outputs) == 3
    stats = llm.stats()
    assert stats["cow_copies"] > 0  # n=3 forked the prompt and copied its partial last page
    # A repeat of a prompt hits the prefix cache and gives the same greedy tokens.
    again = llm.generate(prompts[2:3], jpaged.SamplingParams(max_tokens=24, temperature=0.0),
                         progress=False)  # fmt: skip
    assert again[0].num_cached_tokens >= C
    assert again[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
