"""Log-sum-exp merge of split-KV partials as ONE XLA reduction (shared by the GPU kernels).

A split that saw keys ``[a, b)`` of a row writes its normalised partial output ``o_s`` and its
base-2 log-sum-exp ``lse_s``; the row's output is ``sum_s o_s 2^(lse_s - LSE)`` with
``LSE = log2 sum_s 2^lse_s``. That is a fold with an associative combiner on ``(lse, o)``
pairs:

    (a, o_a) + (b, o_b) = (m + log2(1 + e), (o_big + e o_small) / (1 + e)),
    m = max(a, b), e = 2^(min(a, b) - m) in [0, 1]

so ``lax.reduce`` over the split axis, with the lse broadcast over the head dim inside it,
compiles to one reduction kernel on the GPU. The previous form (normalised weights, then a
weighted sum) was three kernels and two launch gaps: at B=1 they were 4 us of a 51 us call
(H200, seventh session). ``benchmarks/split_merge.py`` times the forms side by side.

An empty split's lse is ``-inf`` (its partial is zeros); it is clamped to the lowest finite
f32 first, so two empty splits combine without ``inf - inf`` (equal weights on zero partials:
zeros), and any real lse outweighs an empty split entirely (``e`` underflows to 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_LOWEST = float(jnp.finfo(jnp.float32).min)


def _combine(x, y):
    (la, oa), (lb, ob) = x, y
    a_big = la >= lb
    m = jnp.maximum(la, lb)
    e = jnp.exp2(jnp.minimum(la, lb) - m)  # the smaller weight relative to the larger, <= 1
    big = jnp.where(a_big, oa, ob)
    small = jnp.where(a_big, ob, oa)
    return m + jnp.log2(1.0 + e), (big + e * small) / (1.0 + e)


def merge_lse_partials(o_S, lse_S, dtype) -> jax.Array:
    """Merge partials ``o_S`` ``[S, ..., H]`` (any float dtype) with base-2 log-sum-exps
    ``lse_S`` ``[S, ...]`` (f32, ``-inf`` for an empty split) over the leading split axis.

    Returns ``[..., H]`` in ``dtype``. A row that no split saw (all ``-inf``) gives zeros,
    provided its partials are zeros, as the kernels write them.
    """
    if lse_S.shape != o_S.shape[:-1]:
        raise ValueError(
            f"lse shape {lse_S.shape} must be o's shape {o_S.shape} minus its last axis"
        )
    lse = jnp.maximum(lse_S.astype(jnp.float32), _LOWEST)
    lse = jnp.broadcast_to(lse[..., None], o_S.shape)
    init = (jnp.float32(_LOWEST), jnp.float32(0.0))
    _, out = lax.reduce((lse, o_S.astype(jnp.float32)), init, _combine, (0,))
    return out.astype(dtype)
