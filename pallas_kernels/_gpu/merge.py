"""The log-sum-exp merge of split-KV partials, shared by the GPU decode and ragged kernels.

A split that saw keys ``[a, b)`` of a row writes its normalised partial output ``o_s`` and its
base-2 log-sum-exp ``lse_s`` (``-inf`` for a split that saw no key, whose partial is zeros).
The row's output is ``sum_s o_s w_s`` with ``w_s = 2^lse_s / sum_t 2^lse_t``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_splits(o_SRH, lse_SR, dtype) -> jax.Array:
    """Merge partials o [S, R, H] (f32 or a 16-bit float) with their base-2 lse f32[S, R].

    The normalised weights [S, R] come first and the output is one weighted sum over S: three
    XLA kernels at S=32 where the max-sums-divide form took four (3.6 vs 5.1 us on the H200;
    two vs two at S=8 and S=4, 0.3 us cheaper; ``benchmarks/split_merge.py``). A one-kernel
    variadic ``lax.reduce`` was slower (4.9 us at S=32). -inf is clamped to the lowest f32, so
    a row no split saw gets equal weights on zero partials (zeros) with no NaN guard, and a
    real lse, however low, still outweighs an empty split.
    """
    if lse_SR.shape != o_SRH.shape[:-1]:
        raise ValueError(f"lse shape {lse_SR.shape} must be o's {o_SRH.shape} minus its last axis")
    lse_SR = jnp.maximum(lse_SR, -jnp.finfo(jnp.float32).max)
    w_SR = jnp.exp2(lse_SR - jnp.max(lse_SR, axis=0))
    w_SR = w_SR / jnp.sum(w_SR, axis=0)
    return jnp.einsum("sr,srh->rh", w_SR, o_SRH.astype(jnp.float32)).astype(dtype)
