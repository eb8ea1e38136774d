"""Ragged attention test inputs: the case builder (``make_ragged_case``) and a NumPy f64 dense
oracle (``dense_ragged_attention``), shared by the reference, XLA, GPU and TPU kernel tests and
by ``_attention_checks``."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from _paged_inputs import make_paged_kv


@dataclasses.dataclass(frozen=True)
class RaggedCase:
    """Arguments of one ragged call plus what the oracle needs.

    Attributes:
      args: (q[T,N,H], k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs).
      k_dense: f32[B, S, K, H] (or [L, ...]) the values the pages hold.
      v_dense: like ``k_dense``.
      q_lens: the live sequences' query lengths.
    """

    args: tuple
    k_dense: np.ndarray
    v_dense: np.ndarray
    q_lens: tuple[int, ...]


def make_ragged_case(
    rng,
    kv_lens,
    q_lens,
    *,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    page_size=8,
    dtype=jnp.float32,
    extra_rows=3,
    extra_seqs=1,
    width=None,
    num_layers=None,
) -> RaggedCase:
    """Builds a ragged batch over a permuted, NaN-poisoned paged pool.

    ``extra_rows`` padding rows of q (NaN-free random garbage) follow the live rows;
    ``extra_seqs`` dead sequences (garbage kv_lens, cu_q_lens repeating the end) follow the
    live ones, so ``num_seqs < B``.
    """
    kv_lens = list(kv_lens)
    q_lens = list(q_lens)
    assert len(kv_lens) == len(q_lens) and all(q <= k for q, k in zip(q_lens, kv_lens, strict=True))
    ns = len(kv_lens)
    dead_lens = [int(x) for x in rng.integers(0, 5, size=extra_seqs)]
    kv = make_paged_kv(
        rng,
        kv_lens + dead_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        width=width,
        num_layers=num_layers,
    )
    lens = kv.lengths.copy()
    lens[ns:] = rng.integers(0, 1000, size=extra_seqs)  # garbage past num_seqs
    T = sum(q_lens) + extra_rows
    q = rng.standard_normal((T, num_q_heads, head_dim)).astype(np.float32)
    q = np.asarray(q, jnp.dtype(dtype))
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(extra_seqs, sum(q_lens))])
    args = (
        q,
        kv.k_pages,
        kv.v_pages,
        kv.block_tables,
        lens.astype(np.int32),
        cu.astype(np.int32),
        np.asarray(ns, np.int32),
    )
    return RaggedCase(args=args, k_dense=kv.k_dense, v_dense=kv.v_dense, q_lens=tuple(q_lens))


def dense_ragged_attention(
    case: RaggedCase,
    *,
    sm_scale=None,
    causal=True,
    logits_soft_cap=None,
    sliding_window=None,
    layer=None,
) -> np.ndarray:
    """The f64 NumPy oracle on the dense K/V: [T, N, H], zeros on padding rows."""
    q, *_, kv_lens, cu, ns = case.args
    q = np.asarray(q, np.float32).astype(np.float64)
    k = case.k_dense if layer is None else case.k_dense[layer]
    v = case.v_dense if layer is None else case.v_dense[layer]
    T, N, H = q.shape
    G = N // k.shape[2]
    scale = 1.0 / math.sqrt(H) if sm_scale is None else sm_scale
    out = np.zeros((T, N, H))
    for b in range(int(ns)):
        n, ql, start = int(kv_lens[b]), int(cu[b + 1] - cu[b]), int(cu[b])
        if ql == 0:
            continue
        pos = n - ql + np.arange(ql)[:, None]  # [ql, 1]
        j = np.arange(n)[None, :]
        vis = np.ones((ql, n), bool)
        if causal:
            vis &= j <= pos
        if sliding_window is not None:
            vis &= pos - j < sliding_window
        for h in range(N):
            s = q[start : start + ql, h] @ k[b, :n, h // G].astype(np.float64).T * scale
            if logits_soft_cap is not None:
                s = logits_soft_cap * np.tanh(s / logits_soft_cap)
            s = np.where(vis, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
            den = p.sum(axis=1, keepdims=True)
            o = p @ v[b, :n, h // G].astype(np.float64)
            out[start : start + ql, h] = np.where(den > 0, o / np.maximum(den, 1e-300), 0.0)
    return out


def sds_case(T, B, W, *, N=32, K=8, H=128, C=16):
    """Shapes of a ragged call (``jax.ShapeDtypeStruct``): T query tokens of B sequences, W
    table columns each, bf16 pages (B * W of them), in ``ragged_paged_attention``'s order."""
    sds = jax.ShapeDtypeStruct
    pool = sds((K, B * W, C, H), jnp.bfloat16)
    return (
        sds((T, N, H), jnp.bfloat16), pool, pool, sds((B, W), jnp.int32), sds((B,), jnp.int32),
        sds((B + 1,), jnp.int32), sds((), jnp.int32),
    )  # fmt: skip
