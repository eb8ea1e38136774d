"""Your own Flax NNX model, served by ``jpaged.LLM``.

``TinyGPT`` below is a GPT-2-style model (LayerNorm, learned positions, GELU MLP, one shared
KV head) written the way a user would: a dense causal forward over one sequence. The block
marked "the adaptation" is everything it takes to serve it on the paged KV cache, following
``jpaged.models.PagedModel``:

1. expose ``num_layers``, ``num_kv_heads``, ``head_dim``, ``vocab_size``;
2. ``__call__(tokens_T, positions_T, cache, metadata, *, decode=False)`` returns
   ``(logits for metadata.logits_indices, cache)``;
3. each attention layer calls ``jpaged.models.paged_attention_layer(q, k, v, cache, layer,
   metadata)``: it writes k, v into the cache slots and attends over the pages.

``main`` serves the adapted model with ``jpaged.LLM(model).generate(...)`` and checks its
greedy tokens against the model's own dense greedy decode; ``by_hand`` runs one prefill and
one decode step on a pool you manage yourself, with ``jpaged.models.batch_metadata``.

Run: .venv/bin/python examples/custom_model.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jpaged
from jpaged.models import batch_metadata, paged_attention_layer


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
    """A user's model: ``dense(tokens_S) -> logits [S, V]``, plain causal attention."""

    def __init__(self, vocab=128, dim=32, num_layers=2, num_heads=4, max_len=64, *, rngs):
        self.vocab_size, self.num_layers = vocab, num_layers
        self.tok = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(max_len, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, num_heads, 8, rngs=rngs) for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(dim, rngs=rngs)

    def dense(self, tokens_S):
        S = tokens_S.shape[0]
        x = self.tok(tokens_S) + self.pos(jnp.arange(S))
        mask = jnp.tril(jnp.ones((S, S), bool))
        for block in self.blocks:
            q, k, v = block.qkv(x)
            s = jnp.einsum("snh,tkh->nst", q, k) / jnp.sqrt(8.0)
            p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
            x = block.finish(x, jnp.einsum("nst,tkh->snh", p, v))
        return self.tok.attend(self.ln_f(x))


# ---- the adaptation: TinyGPT on the paged KV cache (jpaged.models.PagedModel) ----
class PagedTinyGPT(TinyGPT):
    num_kv_heads, head_dim = 1, 8

    def __call__(self, tokens_T, positions_T, cache, metadata, *, decode=False):
        x = self.tok(tokens_T) + self.pos(positions_T)
        for layer, block in enumerate(self.blocks):  # or a lax.scan over stacked layers
            q, k, v = block.qkv(x)
            o, cache = paged_attention_layer(q, k, v, cache, layer, metadata, decode=decode)
            x = block.finish(x, o)
        return self.tok.attend(self.ln_f(x[metadata.logits_indices])), cache


# ---- end of the adaptation ----


def dense_greedy(model: TinyGPT, prompt: list[int], max_tokens: int, S: int = 64) -> list[int]:
    """The model's own greedy decode: one dense forward per token over the sequence padded
    to S tokens (causal, so the padding after it changes nothing; one compiled shape)."""
    forward = nnx.jit(TinyGPT.dense)
    tokens = list(prompt)
    for _ in range(max_tokens):
        logits = forward(model, jnp.array(tokens + [0] * (S - len(tokens)), jnp.int32))
        tokens.append(int(logits[len(tokens) - 1].argmax()))
    return tokens[len(prompt) :]


def main(seed: int = 0, max_tokens: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """Serves the adapted model; returns (engine's greedy tokens, dense greedy tokens)."""
    rng = np.random.default_rng(seed)
    model = PagedTinyGPT(rngs=nnx.Rngs(seed))
    llm = jpaged.LLM(model, page_size=4, num_pages=64, max_num_seqs=4, max_model_len=64)
    prompts = [rng.integers(0, 128, n).tolist() for n in (9, 3, 4, 1)]
    greedy = jpaged.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    paged = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, greedy)]
    return paged, [dense_greedy(model, p, max_tokens) for p in prompts]


def by_hand(seed: int = 0) -> float:
    """Prefill two prompts into shuffled pages, then one decode step, on a pool you manage
    (no engine); returns the largest |paged - dense| logit difference."""
    rng = np.random.default_rng(seed)
    model = PagedTinyGPT(rngs=nnx.Rngs(seed))
    C, W, P = 4, 4, 16  # page size, pages per sequence, pool pages
    cache = jpaged.PagedKVCache.create(model.num_layers, 1, P, C, 8, dtype=jnp.float32)
    tables = rng.permutation(P)[: 2 * W].reshape(2, W)  # any pages will do
    seqs = [rng.integers(0, 128, 9).tolist(), rng.integers(0, 128, 3).tolist()]
    step = nnx.jit(PagedTinyGPT.__call__, static_argnames="decode")
    pos, meta = batch_metadata(tables, [0, 0], [9, 3], C, num_tokens=16)
    tokens = np.array(seqs[0] + seqs[1] + [0] * 4, np.int32)
    first, cache = step(model, tokens, pos, cache, meta)
    nxt = [int(row.argmax()) for row in first]
    pos, meta = batch_metadata(tables, [9, 3], [1, 1], C)  # one new token each: decode
    second, cache = step(model, np.array(nxt, np.int32), pos, cache, meta, decode=True)
    worst = 0.0
    for b, s in enumerate(seqs):
        dense = nnx.jit(TinyGPT.dense)(model, jnp.array([*s, nxt[b]], jnp.int32))
        worst = max(worst, float(jnp.abs(first[b] - dense[-2]).max()))
        worst = max(worst, float(jnp.abs(second[b] - dense[-1]).max()))
    return worst


if __name__ == "__main__":
    paged, dense = main()
    for p, d in zip(paged, dense, strict=True):
        print(f"engine {p}\ndense  {d}  {'equal' if p == d else 'DIFFERENT'}")
    print(f"by hand: max |paged - dense| logit difference {by_hand():.2e}")
