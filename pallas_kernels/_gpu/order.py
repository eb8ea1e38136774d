"""Longest-first orders as packed int32 sort keys, shared by the GPU decode and ragged kernels.

A key is ``(top - work) << bits | index``: one single-operand ``lax.sort`` of the keys orders
the indices by decreasing ``work`` (ties in index order), and ``key & (2**bits - 1)`` is the
index. On the H200 (ncu, jax 0.11.2) ``jnp.argsort(-work)`` at 256 entries was a negate and a
two-operand sort, 7.3 us; the one-operand sort of packed keys 2.5-4.7 us.
"""

from __future__ import annotations

import jax
from jax import lax


def pack(work, index, bits: int, top: int):
    """The sort key of ``index`` (< 2**bits) with ``work`` in [0, top] (clipped by the caller):
    ``(top - work) << bits | index``; below 2**31 when ``top < 2**(31 - bits)``. Works on arrays
    and on in-kernel values alike."""
    return ((top - work) << bits) | index


def sort_keys(keys) -> jax.Array:
    """The keys in increasing order: the indices by decreasing work (one single-operand sort)."""
    return lax.sort(keys)


def index_of(key, bits: int):
    """The index a packed key holds (its low ``bits`` bits)."""
    return key & ((1 << bits) - 1)
