"""Ragged paged attention: the jnp reference against a NumPy f64 dense oracle, and validation.

Also holds the shared case builder (``make_ragged_case``) and the oracle
(``dense_ragged_attention``) that the XLA and GPU tests import.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import make_paged_kv
from _tolerances import assert_close

from pallas_kernels.ragged_paged_attention import reference, validate


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
    q = np.asarray(jnp.asarray(q, dtype))
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
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
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


@functools.partial(
    jax.jit, static_argnames=("causal", "logits_soft_cap", "sliding_window", "sm_scale")
)
def _ref(*args, layer=None, **kw):
    return reference.ragged_paged_attention_reference(*args, layer=layer, **kw)


# Lengths cover 0, 1, C-1, C, C+1 and long (C = 8), with query lengths from decode (1) to full.
MIXED_KV = (0, 1, 7, 8, 9, 37)
MIXED_Q = (0, 1, 3, 8, 1, 20)


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"causal": False},
        {"sliding_window": 5},
        {"logits_soft_cap": 2.0, "sm_scale": 0.7},
        {"sliding_window": 1},
    ],
)
def test_reference_matches_dense_oracle(opts):
    rng = np.random.default_rng(1)
    case = make_ragged_case(rng, MIXED_KV, MIXED_Q)
    out = _ref(*case.args, **opts)
    assert_close(out, dense_ragged_attention(case, **opts), jnp.float32, err_msg=str(opts))


@pytest.mark.parametrize(("num_q_heads", "page_size"), [(2, 1), (8, 8), (16, 16)])
def test_reference_gqa_and_page_sizes(num_q_heads, page_size):
    rng = np.random.default_rng(2)
    C = page_size
    kv_lens = (1, C - 1 if C > 1 else 2, C, C + 1, 3 * C + 2)
    q_lens = (1, 1, C, 2, 2 * C)
    case = make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=num_q_heads, num_kv_heads=2, page_size=C
    )
    assert_close(_ref(*case.args), dense_ragged_attention(case), jnp.float32)


def test_reference_stacked_layers_traced_layer():
    rng = np.random.default_rng(3)
    case = make_ragged_case(rng, (5, 12), (5, 2), num_layers=3)
    out = _ref(*case.args, layer=jnp.int32(2))
    assert_close(out, dense_ragged_attention(case, layer=2), jnp.float32)


def test_reference_hand_worked():
    # One sequence, 2 keys with equal scores: the second row sees both -> mean of the values.
    q = np.zeros((2, 1, 2), np.float32)
    k = np.zeros((1, 1, 2, 2), np.float32)
    v = np.array([[[[1.0, 2.0], [3.0, 6.0]]]], np.float32)
    out = reference.ragged_paged_attention_reference(
        q, k, v, np.array([[0]], np.int32), np.array([2], np.int32),
        np.array([0, 2], np.int32), np.array(1, np.int32),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(out)[:, 0], [[1.0, 2.0], [2.0, 4.0]], rtol=1e-6)


def test_reference_padding_rows_zero_and_finite():
    rng = np.random.default_rng(4)
    case = make_ragged_case(rng, (9, 4), (3, 4), extra_rows=5, extra_seqs=2)
    out = np.asarray(_ref(*case.args))
    assert np.all(np.isfinite(out))
    assert np.all(out[7:] == 0.0)
    assert np.any(out[:7] != 0.0)


# ---- validation ---------------------------------------------------------------------------


def _valid_args():
    rng = np.random.default_rng(5)
    return list(make_ragged_case(rng, (9, 4), (3, 4), extra_rows=2, extra_seqs=1).args)


@pytest.mark.parametrize(
    ("index", "value", "match"),
    [
        (5, np.array([0, 3, 2, 7], np.int32), "non-decreasing"),
        (5, np.array([0, 3, 7, 7], np.int32) + 5, r"cu_q_lens\[0\] must be 0"),
        (5, np.array([0, 3, 12, 12], np.int32), r"cu_q_lens\[num_seqs=2\]=12 must be <= T=9"),
        (4, np.array([9, 2, 0], np.int32), "query length of sequence 1"),
        (4, np.array([9, 10_000, 0], np.int32), r"kv_lens\[1\]=10000 must be in \[0, W\*C"),
        (6, np.array(4, np.int32), r"num_seqs=4 must be in \[0, B=3\]"),
    ],
)
def test_validate_dynamic_rejects_bad_values(index, value, match):
    args = _valid_args()
    validate.validate_dynamic(*args)  # the unmodified case is valid
    args[index] = value
    with pytest.raises(ValueError, match=match):
        validate.validate_dynamic(*args)


def test_validate_dynamic_rejects_page_out_of_range():
    args = _valid_args()
    tables = args[3].copy()
    tables[0, 1] = args[1].shape[1] + 4
    args[3] = tables
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\]=\d+ must be a page id"):
        validate.validate_dynamic(*args)


def test_validate_static_reports_all_errors_at_once():
    q, k, v, bt, lens, cu, ns = _valid_args()
    with pytest.raises(ValueError) as err:
        validate.validate_static(
            q[:, :3], k, v.astype(np.float16), bt.astype(np.int64), lens, cu[:-1], ns,
            sliding_window=0, logits_soft_cap=-1.0,
        )  # fmt: skip
    msg = str(err.value)
    for expected in (
        "N=3 must be divisible by num_kv_heads K=2",
        "v_pages.dtype must equal",
        "block_tables.dtype must be int32",
        "cu_q_lens.shape must be (B + 1,)=(4,)",
        "sliding_window=0 must be None or an int >= 1",
        "logits_soft_cap=-1.0 must be None or a positive float",
    ):
        assert expected in msg, (expected, msg)


def test_validate_static_layer_rules():
    q, k, v, bt, lens, cu, ns = _valid_args()
    with pytest.raises(ValueError, match="layer must be None for a 4-D pool"):
        validate.validate_static(q, k, v, bt, lens, cu, ns, layer=0)
    k5, v5 = k[None], v[None]
    with pytest.raises(ValueError, match="layer is required for a 5-D pool"):
        validate.validate_static(q, k5, v5, bt, lens, cu, ns)
    with pytest.raises(ValueError, match=r"layer=1 must be in \[0, L=1\)"):
        validate.validate_static(q, k5, v5, bt, lens, cu, ns, layer=1)
    validate.validate_static(q, k5, v5, bt, lens, cu, ns, layer=np.int32(0))
