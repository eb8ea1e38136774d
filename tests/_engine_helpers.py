"""Engine fixtures shared by the engine tests (``tests/engine/test_engine*.py``).

Engines share one shape configuration (page size 8, 8 sequences, 64 tokens, 32-token step
budget, ``debug=True``: allocator invariants checked after every step) so the jitted step
programs compile once per worker.

``SWAP_SPACE`` (8 MiB of host slots for swapped pages) holds at least twice the pool of every
test checkpoint's engine here: the default 1 GiB gives these tiny checkpoints 262144 host
slots (a million for mistral's 4-token pages), and ``debug=True``'s invariant check walks
every slot after every step (most of an engine test's time at that size).
"""

import functools

import jax.numpy as jnp
import numpy as np

import jpaged

CKPT = "tests/checkpoints/llama2"
C = 8
SWAP_SPACE = 8 << 20
ENGINE = dict(
    page_size=C, num_pages=64, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32,
    debug=True, swap_space=SWAP_SPACE,
)  # fmt: skip
# The engine's decode paths, by name: synchronous single steps, and chains of k-step loops.
DECODE_PATHS = {
    "single-steps": dict(chain_decode=False),
    "chains-k1": dict(num_decode_steps=1),
    "chains-k4": dict(num_decode_steps=4),
}


def assert_took_path(stats: dict, path: str) -> None:
    """Decode loops ran (``stats``: ``LLM.stats()``) exactly when ``path`` chains them."""
    assert (stats["loop_decode_steps"] > 0) == DECODE_PATHS[path].get("chain_decode", True)


@functools.cache
def model():
    """The tiny llama2 test checkpoint, loaded once."""
    return jpaged.models.from_pretrained(CKPT)


def make_llm(**kw):
    """An engine whose whole pool starts as NaN: reading any slot not written first (a stale
    page, a page past a sequence's length, the tail of its last page) poisons the logits."""
    llm = jpaged.LLM(model(), **{**ENGINE, **kw})
    nan = jnp.full_like(llm.cache.k_pages, jnp.nan)
    llm.cache = jpaged.PagedKVCache(k_pages=nan, v_pages=jnp.full_like(nan, jnp.nan))
    return llm


def random_prompts(seed, lengths):
    """Prompts of the given lengths, token ids in [3, 300)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=n).tolist() for n in lengths]
