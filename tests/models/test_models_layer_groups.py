"""Per-layer windows and Gemma 2's switches on random models: the grouped layer scan against
a per-layer loop in NumPy (f64 attention), and the paged forward against the dense one.

A config whose layer windows repeat with period p scans L / p groups of p layers
(``ModelConfig.layer_period``); these tests use periods 1, 2 and 3 and an irregular pattern
(p = L) so that a wrong layer index, a window applied to the wrong layer or a parameter slice
of the wrong group shows up. The Hugging Face goldens (``test_models.py``) check the same
switches against transformers on the tiny Gemma 2 checkpoint.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import assert_close
from flax import nnx

import jpaged
from jpaged import models
from jpaged.models import _llama
from jpaged.models._rope import inverse_frequencies

S = 11  # tokens: longer than every window below
C = 4
GEMMA = dict(
    hidden_act="gelu_pytorch_tanh", attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
    query_pre_attn_scalar=24.0, post_norms=True, norm_unit_offset=True, scale_embeddings=True,
    tie_word_embeddings=True,
)  # fmt: skip
CONFIGS = {
    "mistral_p1": models.tiny(num_layers=3, sliding_window=3),
    "gemma_p2": models.tiny(num_layers=4, sliding_window=3,
                            layer_types=("sliding_attention", "full_attention") * 2, **GEMMA),
    "p3": models.tiny(num_layers=6, sliding_window=5, attn_logit_softcapping=2.0,
                      layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2),
    "irregular": models.tiny(num_layers=3, sliding_window=2, **GEMMA,
                             layer_types=("full_attention", "sliding_attention", "sliding_attention")),
}  # fmt: skip
PERIODS = {"mistral_p1": 1, "gemma_p2": 2, "p3": 3, "irregular": 3}


@functools.cache
def _model(name: str) -> models.LlamaForCausalLM:
    config = CONFIGS[name]
    shapes = models.param_shapes(config)
    rng = np.random.default_rng(7)
    params = {}
    for n, shape in shapes.items():
        if "norm" in n:  # non-trivial norm scales (Gemma's are 1 + weight)
            base = 0.0 if config.norm_unit_offset else 1.0
            params[n] = (base + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        else:
            params[n] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    return models.LlamaForCausalLM(config, params=params)


def _np_rms_norm(c: models.ModelConfig, x, w):
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps)
    return x * (1.0 + w) if c.norm_unit_offset else x * w


def _per_layer_reference(model: models.LlamaForCausalLM, tokens: np.ndarray) -> np.ndarray:
    """Logits [S, V] from a Python loop over the layers (no scan, no grouping), attention in
    NumPy f64 with each layer's window from ``layer_windows``."""
    c = model.config
    arrays = model.layers.arrays()
    inv_freq = inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
    x = np.asarray(model.embed_VD[...])[tokens].astype(np.float64)
    if c.scale_embeddings:
        x = x * np.float32(c.hidden_size**0.5)
    positions = jnp.arange(len(tokens), dtype=jnp.int32)
    G = c.num_heads // c.num_kv_heads
    for i, window in enumerate(c.layer_windows):
        p = {n: a[i] for n, a in arrays.items()}
        xj = jnp.asarray(x, jnp.float32)
        q, k, v = (np.asarray(t, np.float64) for t in _llama.layer_qkv(c, p, xj, positions,
                                                                       inv_freq))  # fmt: skip
        k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # [S, N, H]
        s = np.einsum("qnh,knh->nqk", q, k) * c.sm_scale
        if c.attn_logit_softcapping:
            s = c.attn_logit_softcapping * np.tanh(s / c.attn_logit_softcapping)
        qpos, kpos = np.arange(len(tokens))[:, None], np.arange(len(tokens))[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= qpos - kpos < window
        s = np.where(visible, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("nqk,knh->qnh", w / w.sum(-1, keepdims=True), v)
        x = np.asarray(_llama.layer_out_mlp(c, p, xj, jnp.asarray(o, jnp.float32)), np.float64)
    x = _np_rms_norm(c, x, np.asarray(model.norm_D[...], np.float64))
    head = model.embed_VD[...].T if model.lm_head_DV is None else model.lm_head_DV[...]
    logits = x @ np.asarray(head, np.float64)
    if c.final_logit_softcapping:
        logits = c.final_logit_softcapping * np.tanh(logits / c.final_logit_softcapping)
    return logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grouped_scan_matches_a_per_layer_loop(name):
    model = _model(name)
    assert model.config.layer_period == PERIODS[name]
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, S)
    dense = model.forward_dense(jnp.asarray(tokens[None], jnp.int32))[0]
    # f32 matmuls against an f64 attention over 3-6 layers of width 64.
    assert_close(dense, _per_layer_reference(model, tokens), jnp.float32, scale=20.0)


@functools.partial(jax.jit, static_argnames=("graphdef", "decode"), donate_argnames=("cache",))
def _paged(graphdef, state, tokens_T, positions_T, cache, metadata, decode):
    return nnx.merge(graphdef, state)(tokens_T, positions_T, cache, metadata, decode=decode)


@pytest.mark.parametrize("name", ["gemma_p2", "p3"])
def test_paged_forward_matches_dense_on_a_nan_pool(name):
    """Prefill S - 3 tokens (ragged kernel), then 3 decode steps (decode kernel), on permuted
    pages of a NaN-poisoned pool: each layer's window reaches the kernels."""
    model = _model(name)
    c = model.config
    graphdef, state = nnx.split(model)
    P = 9
    shape = (c.num_layers, c.num_kv_heads, P, C, c.head_dim)
    cache = jpaged.PagedKVCache(k_pages=jnp.full(shape, jnp.nan, jnp.float32),
                                v_pages=jnp.full(shape, jnp.nan, jnp.float32))  # fmt: skip
    table = np.array([[7, 2, 5, 0]], np.int32)
    tokens = np.random.default_rng(2).integers(0, c.vocab_size, S).astype(np.int32)
    slots = (table[0, np.arange(S) // C] * C + np.arange(S) % C).astype(np.int32)

    def metadata(lo, hi):
        return models.AttentionMetadata(
            slot_mapping=slots[lo:hi], block_tables=table,
            kv_lens=np.array([hi], np.int32), cu_q_lens=np.array([0, hi - lo], np.int32),
            num_seqs=np.array(1, np.int32), logits_indices=np.array([hi - lo - 1], np.int32),
        )  # fmt: skip

    got = []
    n = S - 3
    logits, cache = _paged(graphdef, state, tokens[:n], np.arange(n, dtype=np.int32), cache,
                           metadata(0, n), False)  # fmt: skip
    got.append(logits[0])
    for pos in range(n, S):
        logits, cache = _paged(graphdef, state, tokens[pos : pos + 1],
                               np.array([pos], np.int32), cache, metadata(pos, pos + 1), True)  # fmt: skip
        got.append(logits[0])
    dense = model.forward_dense(jnp.asarray(tokens[None]))[0, n - 1 :]
    # f32 both sides; the kernels sum in another order than the dense einsum.
    assert_close(jnp.stack(got), dense, jnp.float32, scale=5.0)
