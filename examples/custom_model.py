"""Your own Flax NNX model on jpaged's paged KV cache.

A GPT-2-style model (LayerNorm, learned positions, GELU MLP, multi-query attention), written
the way a user would, runs on the paged cache by following ``jpaged.models.PagedModel``:

1. expose ``num_layers``, ``num_kv_heads``, ``head_dim``, ``vocab_size``;
2. take ``(tokens_T, positions_T, cache, metadata, *, decode=False)`` and return
   ``(logits for metadata.logits_indices, cache)``;
3. in each attention layer, call ``jpaged.models.paged_attention_layer(q, k, v, cache, layer,
   metadata)``: it writes k, v into the cache slots and attends over the pages.

The script prefills two prompts into randomly chosen pages, decodes a few greedy tokens, and
checks every logit against the model's own dense (no-cache) forward.

Run: .venv/bin/python examples/custom_model.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jpaged
from jpaged.models import AttentionMetadata, paged_attention_layer


class Block(nnx.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, *, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.q = nnx.Linear(dim, num_heads * head_dim, rngs=rngs)
        self.kv = nnx.Linear(dim, 2 * head_dim, rngs=rngs)  # one shared KV head (MQA)
        self.o = nnx.Linear(num_heads * head_dim, dim, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def qkv(self, x):
        """x: [..., D] -> q [..., N, H], k [..., 1, H], v [..., 1, H]."""
        h = self.ln1(x)
        q = self.q(h).reshape(*x.shape[:-1], self.num_heads, self.head_dim)
        k, v = jnp.split(self.kv(h).reshape(*x.shape[:-1], 2, 1, self.head_dim), 2, axis=-3)
        return q, k[..., 0, :, :], v[..., 0, :, :]

    def finish(self, x, o):
        x = x + self.o(o.reshape(*o.shape[:-2], -1))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class TinyGPT(nnx.Module):
    """A user's model. Only ``__call__`` knows about the paged cache."""

    def __init__(self, vocab=128, dim=32, num_layers=2, num_heads=4, max_len=64, *, rngs):
        self.vocab_size, self.num_layers, self.num_kv_heads, self.head_dim = vocab, num_layers, 1, 8
        self.tok = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(max_len, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, num_heads, 8, rngs=rngs) for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, tokens_T, positions_T, cache, metadata: AttentionMetadata, *, decode=False):
        x = self.tok(tokens_T) + self.pos(positions_T)
        for layer, block in enumerate(self.blocks):  # 2 layers: a Python loop is fine
            q, k, v = block.qkv(x)
            o, cache = paged_attention_layer(q, k, v, cache, layer, metadata, decode=decode)
            x = block.finish(x, o)
        return self.tok.attend(self.ln_f(x[metadata.logits_indices])), cache

    def dense(self, tokens_S):
        """The reference: plain causal attention over one sequence."""
        S = tokens_S.shape[0]
        x = self.tok(tokens_S) + self.pos(jnp.arange(S))
        mask = jnp.tril(jnp.ones((S, S), bool))
        for block in self.blocks:
            q, k, v = block.qkv(x)
            s = jnp.einsum("snh,tkh->nst", q, k) / jnp.sqrt(8.0)
            p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
            x = block.finish(x, jnp.einsum("nst,tkh->snh", p, v))
        return self.tok.attend(self.ln_f(x))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _step(graphdef, state, tokens, positions, cache, metadata):
    """One jitted step; the cache is donated, so the pool is updated in place."""
    return nnx.merge(graphdef, state)(tokens, positions, cache, metadata)


def main(seed: int = 0, new_tokens: int = 6) -> float:
    """Runs the demo; returns the largest |paged - dense| logit difference."""
    rng = np.random.default_rng(seed)
    model = TinyGPT(rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    C, W, P = 4, 8, 24  # page size, pages per sequence, pool pages
    cache = jpaged.PagedKVCache.create(model.num_layers, model.num_kv_heads, P, C, model.head_dim,
                                       dtype=jnp.float32)  # fmt: skip
    tables = rng.permutation(P)[: 2 * W].reshape(2, W).astype(np.int32)  # any pages will do
    seqs = [rng.integers(0, 128, 9).tolist(), rng.integers(0, 128, 3).tolist()]
    new = [list(s) for s in seqs]  # tokens not yet in the cache
    paged = [[], []]  # logits of each sequence's last token, step by step
    for _ in range(new_tokens):
        lens = [len(s) for s in seqs]
        tokens = [t for n in new for t in n]
        positions = [
            p for s, n in zip(seqs, new, strict=True) for p in range(len(s) - len(n), len(s))
        ]
        slots = [int(tables[b, p // C]) * C + p % C
                 for b, (s, n) in enumerate(zip(seqs, new, strict=True))
                 for p in range(len(s) - len(n), len(s))]  # fmt: skip
        cu = np.cumsum([0] + [len(n) for n in new]).astype(np.int32)
        T = 16  # one padded shape for every step: one compile
        metadata = AttentionMetadata(
            slot_mapping=np.array(slots + [-1] * (T - len(slots)), np.int32),
            block_tables=tables,
            kv_lens=np.array(lens, np.int32),
            cu_q_lens=cu,
            num_seqs=np.array(2, np.int32),
            logits_indices=cu[1:] - 1,
        )
        pad = [0] * (T - len(tokens))
        logits, cache = _step(graphdef, state, np.array(tokens + pad, np.int32),
                              np.array(positions + pad, np.int32), cache, metadata)  # fmt: skip
        logits = np.asarray(logits)
        for b in range(2):
            paged[b].append(logits[b])
        new = [[int(logits[b].argmax())] for b in range(2)]
        for s, n in zip(seqs, new, strict=True):
            s.extend(n)
    worst = 0.0
    for b, s in enumerate(seqs):  # the reference: one dense forward over the whole sequence
        dense = np.asarray(nnx.jit(TinyGPT.dense)(model, jnp.array(s, jnp.int32)))
        rows = dense[len(s) - new_tokens - 1 : len(s) - 1]
        worst = max(worst, float(np.abs(np.stack(paged[b]) - rows).max()))
    return worst


if __name__ == "__main__":
    diff = main()
    print(f"max |paged - dense| logit difference over all steps: {diff:.2e}")
