"""Ragged paged attention: the jnp reference against a NumPy f64 dense oracle, and validation.

The case builder and the oracle live in ``tests/_ragged_inputs.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ragged_inputs import dense_ragged_attention, make_ragged_case
from _tolerances import assert_close

from pallas_kernels.ragged_paged_attention import reference, validate


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
