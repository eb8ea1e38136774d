"""End to end on a GPU: the Mosaic GPU kernels generate the XLA path's greedy tokens.

CPU CI covers the kernels in their interpreters and the engine on the XLA path; these tests
check that the pieces fit on real hardware, by tokens and not only by ranges: a bf16 Llama whose
attention dispatches to the decode and ragged Mosaic GPU kernels (stacked pool, traced layer
index inside the layer loop) picks the XLA path's greedy token at every step, and ``jpaged.LLM``
generates the same tokens on the kernels as on the XLA path. Each runs on the Mosaic GPU kernels
(auto dispatch on Hopper), on the Pallas-Triton kernels forced (the sm80-sm89 path, run on any
NVIDIA GPU), and with an fp8 cache (per-token scales, the engine's default).

Why not plain equality of free-running generations: the model is random (head dim 64, which
the kernels need; the checkpoints in tests/checkpoints have head dim 16, which they do not
run), and its top-2 logit margin is under 0.012 at about one greedy step in ten, while bf16
kernels and XLA round differently and their logits differ by about 0.01. So

  * the forward test feeds both paths the same tokens (the XLA path's greedy ones) and requires
    the kernels' greedy token to equal XLA's at every step where XLA's top-2 margin exceeds
    twice the largest logit difference between the paths at that step (then no rounding of
    that size can flip the order: the tokens must be equal); at the other steps either token
    is a correct greedy choice;
  * the engine test compares the two engines' free-running tokens exactly up to their first
    difference, which must be such a tie (re-scored at the common prefix), and nothing after
    it (the two continuations have different histories).
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


def _top2_margin(logits_V) -> float:
    top = np.sort(np.asarray(logits_V, np.float64))[-2:]
    return float(top[1] - top[0])


class _Paged:
    """Runs a model's paged forward over a batch of prompts: one ragged prefill, then decode
    steps of one token per sequence, on a randomly permuted table over an all-NaN pool."""

    def __init__(self, config, model, prompts, steps, seed=0, cache_dtype=jnp.bfloat16):
        self.config, self.prompts, self.cache_dtype = config, prompts, cache_dtype
        self.graphdef, self.state = nnx.split(model)
        self.lens = np.array([len(p) for p in prompts], np.int32)
        B = len(prompts)
        W = -(-(int(self.lens.max()) + steps) // C)
        self.P = B * W + 4
        perm = np.random.default_rng(seed).permutation(self.P).astype(np.int32)
        self.table = perm[: B * W].reshape(B, W)

    def _slots(self, b, lo, hi):
        pos = np.arange(lo, hi)
        return (self.table[b, pos // C] * C + pos % C).astype(np.int32)

    def run(self, implementation, steps, feed=None):
        """Logits [steps + 1, B, V] (f32): the prefill's last rows, then one row per decode step.
        The tokens fed at each step are the previous logits' argmax, or ``feed[step]`` [B]."""
        cfg, lens, B = self.config, self.lens, len(self.prompts)
        cache = jpaged.PagedKVCache.create(cfg.num_layers, cfg.num_kv_heads, self.P, C,
                                           cfg.head_dim, dtype=self.cache_dtype)  # fmt: skip
        cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        meta = models.AttentionMetadata(
            slot_mapping=np.concatenate([self._slots(b, 0, n) for b, n in enumerate(lens)]),
            block_tables=self.table, kv_lens=lens, cu_q_lens=cu, num_seqs=np.array(B, np.int32),
            logits_indices=(cu[1:] - 1).astype(np.int32),
        )  # fmt: skip
        tokens = np.concatenate(self.prompts).astype(np.int32)
        positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
        logits, cache = _forward(self.graphdef, self.state, tokens, positions, cache, meta,
                                 False, implementation)  # fmt: skip
        out = [np.asarray(logits, np.float32)]
        kv = lens.copy()
        for step in range(steps):
            nxt = np.argmax(out[-1], -1).astype(np.int32) if feed is None else feed[step]
            meta = models.AttentionMetadata(
                slot_mapping=np.array([self._slots(b, kv[b], kv[b] + 1)[0] for b in range(B)]),
                block_tables=self.table, kv_lens=kv + 1, cu_q_lens=np.arange(B + 1, dtype=np.int32),
                num_seqs=np.array(B, np.int32), logits_indices=np.arange(B, dtype=np.int32),
            )  # fmt: skip
            logits, cache = _forward(self.graphdef, self.state, nxt, kv.copy(), cache, meta, True,
                                     implementation)  # fmt: skip
            out.append(np.asarray(logits, np.float32))
            kv = kv + 1
        return np.stack(out)


# (id, sliding window, the kernels' implementation (None: auto), cache dtype)
_FORWARD_CASES = [
    ("full", None, None, jnp.bfloat16),
    ("window40", 40, None, jnp.bfloat16),
    ("triton", None, "pallas_triton", jnp.bfloat16),
    ("triton-window40", 40, "pallas_triton", jnp.bfloat16),
    ("fp8", None, None, "fp8"),
    ("triton-fp8", None, "pallas_triton", "fp8"),
]


@pytest.mark.parametrize(
    "window,implementation,cache_dtype", [c[1:] for c in _FORWARD_CASES],
    ids=[c[0] for c in _FORWARD_CASES],
)  # fmt: skip
def test_greedy_tokens_match_xla(window, implementation, cache_dtype):
    config, model = _model(sliding_window=window)
    rng = np.random.default_rng(0)
    # Prompt lengths around the page size, and past several 64-token tiles.
    prompts = [rng.integers(0, config.vocab_size, n) for n in (1, C - 1, C + 1, 150, 600)]
    steps = 24
    paged = _Paged(config, model, prompts, steps, cache_dtype=cache_dtype)
    want = paged.run("xla", steps)  # free-running greedy on the XLA path
    xla_tokens = np.argmax(want, -1).astype(np.int32)  # [steps + 1, B]
    got = paged.run(implementation, steps, feed=xla_tokens)  # the kernels, fed the same tokens
    ties = 0
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.all(np.isfinite(g)), f"step {step}: non-finite logits"
        # bf16 K/V and activations: both paths round the same inputs; 2e-2 is the bf16 row
        # of tests/_tolerances.py applied to a relative L2 error.
        assert _rel_err(g, w) < 2e-2, f"step {step}: rel err {_rel_err(g, w):.3g}"
        for b in range(len(prompts)):
            token, want_token = int(np.argmax(g[b])), int(xla_tokens[step, b])
            diff = float(np.max(np.abs(g[b] - w[b])))
            if _top2_margin(w[b]) <= 2 * diff:
                ties += 1  # a near tie: either token is a correct greedy choice
                continue
            assert token == want_token, (
                f"step {step}, sequence {b}: kernels chose {token}, XLA {want_token} with a "
                f"top-2 margin {_top2_margin(w[b]):.3g} > 2 x the logit difference {diff:.3g}"
            )
    # Most steps are decided: a kernel whose logits drift would turn every step into a "tie".
    assert ties <= (steps + 1) * len(prompts) // 4, f"{ties} near ties"


class _Forced(nnx.Module):
    """A model whose attention always takes ``implementation`` (the engine calls it with auto
    dispatch, which picks the Mosaic GPU kernels on a Hopper GPU)."""

    def __init__(self, model, implementation):
        self.model, self.implementation = model, implementation
        self.config = model.config
        self.num_layers, self.num_kv_heads = model.num_layers, model.num_kv_heads
        self.head_dim, self.vocab_size = model.head_dim, model.vocab_size

    def __call__(self, tokens, positions, cache, metadata, *, decode=False):
        return self.model(tokens, positions, cache, metadata, decode=decode,
                          implementation=self.implementation)  # fmt: skip


def _engine(model, cache_dtype=jnp.bfloat16):
    # A 256-token step budget: the 600-token prompt is prefilled in chunks.
    return jpaged.LLM(model, page_size=C, num_pages=256, max_num_seqs=8, max_model_len=1024,
                      max_num_batched_tokens=256, eos_token_id=None, cache_dtype=cache_dtype,
                      debug=True)  # fmt: skip


def _rescore(config, model, prompt, common, implementation, cache_dtype):
    """The XLA path's and the kernels' logits [V] for the token after ``prompt + common``,
    computed as the engines did: by the prefill if ``common`` is empty, else by a decode step
    (the prefill of all but the last common token, then that token through the decode kernel)."""
    *head, last = [*prompt, *common] if common else [*prompt, None]
    paged = _Paged(config, model, [np.asarray(head)], 1, cache_dtype=cache_dtype)
    if last is None:
        return paged.run("xla", 0)[0, 0], paged.run(implementation, 0)[0, 0]
    feed = np.array([[last]], np.int32)
    return paged.run("xla", 1, feed=feed)[1, 0], paged.run(implementation, 1, feed=feed)[1, 0]


@pytest.mark.parametrize(
    "implementation,cache_dtype",
    [(None, jnp.bfloat16), ("pallas_triton", jnp.bfloat16), (None, "fp8")],
    ids=["mosaic", "triton", "fp8"],
)
def test_engine_greedy_tokens_match_xla(implementation, cache_dtype):
    config, model = _model()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 17, 90, 600)]
    greedy = jpaged.SamplingParams(max_tokens=32, temperature=0.0)
    kernels = model if implementation is None else _Forced(model, implementation)
    on_kernels = _engine(kernels, cache_dtype).generate(prompts, greedy, progress=False)
    on_xla = _engine(_Forced(model, "xla"), cache_dtype).generate(prompts, greedy, progress=False)
    compared = 0
    for prompt, k_out, x_out in zip(prompts, on_kernels, on_xla, strict=True):
        got, want = k_out.outputs[0].token_ids, x_out.outputs[0].token_ids
        assert len(got) == len(want) == 32
        same = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want)
        )
        compared += same
        if same < len(want):
            w, g = _rescore(config, model, prompt, want[:same], implementation, cache_dtype)
            # The re-scored logits must agree as in test_greedy_tokens_match_xla (a kernel far
            # off would otherwise excuse any flip as a tie).
            assert _rel_err(g, w) < 2e-2, f"rel err {_rel_err(g, w):.3g} at token {same}"
            gap, diff = abs(w[want[same]] - w[got[same]]), float(np.max(np.abs(g - w)))
            # 4x: the engines' decode steps and this prefill round differently as well.
            assert gap <= 4 * diff, (
                f"prompt of {len(prompt)} tokens, token {same}: kernels {got[same]}, XLA "
                f"{want[same]}, whose XLA logits differ by {gap:.3g} > 4 x {diff:.3g}"
            )
    assert compared >= 32, f"only {compared} of {32 * len(prompts)} tokens compared"


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
