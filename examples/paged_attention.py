"""A tiny paged-attention run: three sequences in a shuffled page pool, XLA vs reference.

Run with ``.venv/bin/python examples/paged_attention.py``. Prints the block tables, the per-sequence lengths, and the
largest difference between ``jpaged.paged_attention`` (auto dispatch: "xla" on CPU)
and the plain-jnp f32 reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jpaged
from pallas_kernels.paged_attention import paged_attention_reference, validate_dynamic


def _fmt(x: jax.Array) -> str:
    return " ".join(f"{v:+.4f}" for v in np.asarray(x, np.float32))


def main() -> None:
    rng = np.random.default_rng(0)
    B, N, K, H, C = 3, 8, 2, 64, 16  # sequences, query heads, KV heads, head dim, page size
    lengths_B = np.array([37, 1, 0], np.int32)
    W = 4  # block-table width: up to 64 tokens per sequence
    P = 12  # pool pages

    # Each sequence owns ceil(length / C) pages taken from a shuffled pool; the rest of
    # each table row points at page 0 (never read: the kernels stop at the length).
    perm = rng.permutation(P).astype(np.int32)
    tables_BW = np.zeros((B, W), np.int32)
    cursor = 0
    for b, n in enumerate(lengths_B):
        used = -(-int(n) // C)
        tables_BW[b, :used] = perm[cursor : cursor + used]
        cursor += used

    q_BNH = jnp.asarray(rng.standard_normal((B, N, H)), jnp.bfloat16)
    k_pages_KPCH = jnp.asarray(rng.standard_normal((K, P, C, H)), jnp.bfloat16)
    v_pages_KPCH = jnp.asarray(rng.standard_normal((K, P, C, H)), jnp.bfloat16)
    args = (q_BNH, k_pages_KPCH, v_pages_KPCH, jnp.asarray(tables_BW), jnp.asarray(lengths_B))
    validate_dynamic(*args)

    out = jpaged.paged_attention(*args)
    windowed = jpaged.paged_attention(*args, sliding_window=8, logits_soft_cap=30.0)
    q_f32 = q_BNH.astype(jnp.float32)
    ref = paged_attention_reference(q_f32, *args[1:])
    ref_windowed = paged_attention_reference(
        q_f32, *args[1:], sliding_window=8, logits_soft_cap=30.0
    )

    print(f"jax {jax.__version__} on {jax.default_backend()}; jpaged {jpaged.__version__}")
    print(f"q [B={B}, N={N}, H={H}] bf16, pages [K={K}, P={P}, C={C}, H={H}] bf16")
    print(f"lengths: {lengths_B.tolist()}")
    print(f"block tables:\n{tables_BW}")
    print(f"output[0, 0, :6]:    {_fmt(out[0, 0, :6])}")
    print(f"reference[0, 0, :6]: {_fmt(ref[0, 0, :6])}")
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
    err_w = float(jnp.max(jnp.abs(windowed.astype(jnp.float32) - ref_windowed)))
    print(f"max |paged_attention - reference|: {err:.2e} (bf16 output)")
    print(f"  with sliding_window=8, logits_soft_cap=30: {err_w:.2e}")
    print(f"length-0 sequence output is all zeros: {bool(jnp.all(out[2] == 0))}")


if __name__ == "__main__":
    main()
