"""Random paged K/V inputs shared by every attention test (reference, XLA, kernels).

Everything is built with NumPy (fast, no compiles) and follows the suite's rules:
fresh random data, a randomly permuted page pool, free pages and the unused
tail of each sequence's last page filled with NaN, unused block-table entries
pointing at NaN pages. A kernel that reads anything it should not turns the
output into NaN.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """A random paged K/V pool with its dense equivalent.

    Attributes:
      k_pages: [K, P, C, H] (or [L, K, P, C, H] when ``num_layers`` was given).
      v_pages: like ``k_pages``.
      block_tables: i32[B, W].
      lengths: i32[B].
      k_dense: f32[B, S, K, H] (per layer: [L, B, S, K, H]), the same values the pages hold,
        zero past each length; S = W * C.
      v_dense: like ``k_dense``.
    """

    k_pages: np.ndarray
    v_pages: np.ndarray
    block_tables: np.ndarray
    lengths: np.ndarray
    k_dense: np.ndarray
    v_dense: np.ndarray


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """Rounds f32 values to ``dtype`` and back, so references see what kernels see (in NumPy:
    ``jnp.asarray(x, dtype)`` rounds there too, and a JAX ``astype`` compiles a program for
    every shape)."""
    return np.asarray(x, jnp.dtype(dtype)).astype(np.float32)


def make_paged_kv(
    rng: np.random.Generator,
    lengths,
    *,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=jnp.float32,
    width: int | None = None,
    extra_pages: int = 3,
    num_layers: int | None = None,
    poison: float = np.nan,
    out_of_range_tail: bool = False,
) -> PagedKV:
    """Builds a random paged pool holding sequences of the given ``lengths``.

    Args:
      rng: NumPy generator.
      lengths: the B sequence lengths (0 allowed).
      num_kv_heads, head_dim, page_size: K, H, C.
      dtype: storage dtype of the pages (values are rounded to it).
      width: W, the block-table width; default ceil(max(lengths) / C) (at least 1).
      extra_pages: free pages added to the pool (poisoned).
      num_layers: if given, pages are [L, K, P, C, H].
      poison: value written to free pages and last-page tails.
      out_of_range_tail: if True, unused table entries hold random ids that are
        out of range (>= P or negative) instead of ids of poisoned pages.
    """
    lengths = np.asarray(lengths, np.int32)
    C, K, H = page_size, num_kv_heads, head_dim
    pages_needed = [-(-int(n) // C) for n in lengths]
    W = width if width is not None else max(1, max(pages_needed, default=1))
    assert all(p <= W for p in pages_needed), (pages_needed, W)
    used = sum(pages_needed)
    P = used + max(extra_pages, 1)
    perm = rng.permutation(P).astype(np.int32)
    free_pages = perm[used:]
    L = 1 if num_layers is None else num_layers
    S = W * C
    B = len(lengths)

    k_pages = np.full((L, K, P, C, H), poison, np.float32)
    v_pages = np.full((L, K, P, C, H), poison, np.float32)
    k_dense = np.zeros((L, B, S, K, H), np.float32)
    v_dense = np.zeros((L, B, S, K, H), np.float32)
    tables = np.empty((B, W), np.int32)
    cursor = 0
    for b, n in enumerate(lengths):
        n = int(n)
        npg = pages_needed[b]
        pages = perm[cursor : cursor + npg]
        cursor += npg
        if out_of_range_tail:
            tail = rng.integers(P, 2 * P + 7, size=W - npg).astype(np.int32)
            tail[::2] = -1 - tail[::2]
        else:
            tail = rng.choice(free_pages, size=W - npg).astype(np.int32)
        tables[b] = np.concatenate([pages, tail])
        kv = _round(rng.standard_normal((2, L, n, K, H)).astype(np.float32), dtype)
        k_dense[:, b, :n] = kv[0]
        v_dense[:, b, :n] = kv[1]
        for i, page in enumerate(pages):
            lo, hi = i * C, min(n, (i + 1) * C)
            # [L, t, K, H] -> [L, K, t, H]
            k_pages[:, :, page, : hi - lo] = kv[0][:, lo:hi].transpose(0, 2, 1, 3)
            v_pages[:, :, page, : hi - lo] = kv[1][:, lo:hi].transpose(0, 2, 1, 3)
    if num_layers is None:
        k_pages, v_pages, k_dense, v_dense = k_pages[0], v_pages[0], k_dense[0], v_dense[0]
    return PagedKV(
        k_pages=np.asarray(k_pages, jnp.dtype(dtype)),
        v_pages=np.asarray(v_pages, jnp.dtype(dtype)),
        block_tables=tables,
        lengths=lengths,
        k_dense=k_dense,
        v_dense=v_dense,
    )


def dense_attention(q, k, v, lengths, *, sm_scale=None, logits_soft_cap=None, sliding_window=None):
    """Non-paged decode attention in f64 NumPy: q[B,N,H], k/v[B,S,K,H] -> [B,N,H].

    The query of sequence b sits at position lengths[b] - 1 and sees keys at
    positions j < lengths[b] with (lengths[b] - 1) - j < sliding_window.
    Length-0 sequences give zeros.
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    B, N, H = q.shape
    K = k.shape[2]
    G = N // K
    scale = 1.0 / np.sqrt(H) if sm_scale is None else sm_scale
    out = np.zeros((B, N, H))
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        pos = np.arange(n)
        visible = np.ones(n, bool)
        if sliding_window is not None:
            visible = (n - 1 - pos) < sliding_window
        for h in range(N):
            s = (k[b, :n, h // G] @ q[b, h]) * scale
            if logits_soft_cap is not None:
                s = logits_soft_cap * np.tanh(s / logits_soft_cap)
            s = np.where(visible, s, -np.inf)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[b, h] = p @ v[b, :n, h // G]
    return out
