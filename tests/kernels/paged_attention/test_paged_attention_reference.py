"""The decode-attention reference: hand-worked tiny cases, then vs dense attention.

Hand-worked cases use one query head, sm_scale = 1 unless said, and keys chosen as
logarithms so the softmax weights are small fractions worked out in the comments.
Pages are laid out out of order and everything the reference must not read is NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import dense_attention, make_paged_kv
from _tolerances import assert_close

from pallas_kernels.paged_attention import paged_attention_reference

NAN = np.nan
LN2, LN3, LN5 = math.log(2.0), math.log(3.0), math.log(5.0)


def _pages(tokens, table, num_pages, page_size):
    """Builds [K=1, P, C, H=1] pages holding ``tokens`` (one value per token) along ``table``.

    Every slot not holding a token is NaN.
    """
    pages = np.full((1, num_pages, page_size, 1), NAN, np.float32)
    for t, value in enumerate(tokens):
        pages[0, table[t // page_size], t % page_size, 0] = value
    return jnp.asarray(pages)


# One sequence of 3 tokens, page size 2, pool of 3 pages: tokens 0-1 live in page 2,
# token 2 in slot 0 of page 0; slot 1 of page 0 (the last page's tail) and page 1 (free,
# and the table's unused last entry) are NaN.
TABLE = [2, 0, 1]
K3 = _pages([0.0, LN2, LN5], TABLE, 3, 2)  # q = 1, sm_scale = 1: logits [0, ln 2, ln 5]
V3 = _pages([8.0, 16.0, 0.0], TABLE, 3, 2)
Q1 = jnp.ones((1, 1, 1), jnp.float32)
TABLES = jnp.asarray([TABLE], jnp.int32)


def _ref(length, **kw):
    out = paged_attention_reference(
        Q1, K3, V3, TABLES, jnp.asarray([length], jnp.int32), sm_scale=1.0, **kw
    )
    return float(out[0, 0, 0])


def test_hand_three_tokens():
    # exp(logits) = [1, 2, 5], weights [1/8, 2/8, 5/8]; out = 8/8 + 32/8 + 0 = 5.
    assert _ref(3) == pytest.approx(5.0, rel=1e-6)


def test_hand_two_tokens_ignores_rest_of_pool():
    # Length 2: only page 2 is read. Weights [1/3, 2/3]; out = 8/3 + 32/3 = 40/3.
    assert _ref(2) == pytest.approx(40.0 / 3.0, rel=1e-6)


def test_hand_one_token_returns_its_value():
    # A single key gets weight 1: out = v[0] = 8, exactly.
    assert _ref(1) == 8.0


def test_hand_length_zero_gives_zero():
    # No visible key: zeros, not NaN (the table entries all point at NaN slots or unused).
    assert _ref(0) == 0.0


def test_hand_sliding_window():
    # Window 2 at length 3 sees tokens 1 and 2: exp = [2, 5], out = (2*16 + 5*0) / 7 = 32/7.
    assert _ref(3, sliding_window=2) == pytest.approx(32.0 / 7.0, rel=1e-6)
    # Window 1 sees only the query's own token 2: out = v[2] = 0.
    assert _ref(3, sliding_window=1) == 0.0
    # A window wider than the sequence changes nothing.
    assert _ref(3, sliding_window=10) == pytest.approx(5.0, rel=1e-6)


def test_hand_soft_cap():
    # cap = 2; keys [0, 2 atanh(ln 3 / 2)] give capped logits 2 tanh(k / 2) = [0, ln 3],
    # weights [1/4, 3/4]; values [4, 8]: out = 1 + 6 = 7.
    k = _pages([0.0, 2.0 * math.atanh(LN3 / 2.0)], [1], 2, 2)
    v = _pages([4.0, 8.0], [1], 2, 2)
    out = paged_attention_reference(
        Q1, k, v, jnp.asarray([[1]], jnp.int32), jnp.asarray([2], jnp.int32),
        sm_scale=1.0, logits_soft_cap=2.0,
    )  # fmt: skip
    assert float(out[0, 0, 0]) == pytest.approx(7.0, rel=1e-6)


def test_hand_default_sm_scale_and_gqa():
    # N = 4 query heads, K = 2 KV heads, H = 2, default sm_scale = 1/sqrt(2).
    # KV head 0: keys [[0, 0], [1, 0]], values [[4, 0], [0, 8]].
    # KV head 1: keys [[1, 0], [0, 0]], values [[0, 4], [4, 0]].
    # Every query is q = [sqrt(2) ln 3, 0], so q.k / sqrt(2) = ln 3 * k[0].
    # Heads 0, 1 (KV head 0): logits [0, ln 3] -> weights [1/4, 3/4] -> out [1, 6].
    # Heads 2, 3 (KV head 1): logits [ln 3, 0] -> weights [3/4, 1/4] -> out [1, 3].
    # (Reading KV head n % K instead of n // G would swap heads 1 and 2.)
    k = np.full((2, 3, 2, 2), NAN, np.float32)
    v = np.full((2, 3, 2, 2), NAN, np.float32)
    k[0, 1] = [[0, 0], [1, 0]]
    v[0, 1] = [[4, 0], [0, 8]]
    k[1, 1] = [[1, 0], [0, 0]]
    v[1, 1] = [[0, 4], [4, 0]]
    q = jnp.full((1, 4, 2), 0.0, jnp.float32).at[:, :, 0].set(math.sqrt(2.0) * LN3)
    out = paged_attention_reference(
        q, jnp.asarray(k), jnp.asarray(v), jnp.asarray([[1, 0]], jnp.int32),
        jnp.asarray([2], jnp.int32),
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(out[0]), [[1, 6], [1, 6], [1, 3], [1, 3]], rtol=1e-6, atol=1e-6
    )


def test_hand_batch_mixes_zero_length():
    # Two sequences share the pool; the second has length 0 and returns zeros.
    out = paged_attention_reference(
        jnp.ones((2, 1, 1), jnp.float32), K3, V3,
        jnp.asarray([TABLE, [1, 1, 1]], jnp.int32), jnp.asarray([3, 0], jnp.int32),
        sm_scale=1.0,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(out[:, 0, 0]), [5.0, 0.0], rtol=1e-6)


def test_returns_q_dtype():
    out = paged_attention_reference(
        Q1.astype(jnp.bfloat16), K3, V3, TABLES, jnp.asarray([3], jnp.int32), sm_scale=1.0
    )
    assert out.dtype == jnp.bfloat16
    assert float(out[0, 0, 0]) == 5.0


# --- random inputs vs dense (non-paged) attention --------------------------------------

# (page_size C, KV heads K, group G, head dim H, long length, knobs)
DENSE_CASES = [
    pytest.param(4, 2, 1, 16, 45, {}, id="C4-G1"),
    pytest.param(8, 2, 4, 32, 150, {"logits_soft_cap": 5.0}, id="C8-G4-softcap"),
    pytest.param(16, 1, 8, 64, 200, {"sliding_window": 7, "sm_scale": 0.3}, id="C16-G8-window"),
    pytest.param(8, 2, 4, 32, 150, {"sliding_window": 9}, id="C8-G4-window-C+1"),
    pytest.param(1, 4, 1, 16, 40, {"sliding_window": 40, "logits_soft_cap": 1.5}, id="C1-all"),
]


@pytest.mark.parametrize("out_of_range_tail", [False, True], ids=["nan-tail", "oob-tail"])
@pytest.mark.parametrize("C, K, G, H, long, knobs", DENSE_CASES)
def test_vs_dense(C, K, G, H, long, knobs, out_of_range_tail):
    rng = np.random.default_rng([C, K, G, H, long, out_of_range_tail])
    lengths = [0, 1, max(C - 1, 0), C, C + 1, long]
    kv = make_paged_kv(
        rng, lengths, num_kv_heads=K, head_dim=H, page_size=C,
        width=-(-long // C) + 2, out_of_range_tail=out_of_range_tail,
    )  # fmt: skip
    q = rng.standard_normal((len(lengths), K * G, H)).astype(np.float32)
    out = paged_attention_reference(q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, **knobs)
    expected = dense_attention(q, kv.k_dense, kv.v_dense, kv.lengths, **knobs)
    assert_close(out, expected, jnp.float32)


def test_vs_dense_inf_poison():
    # Inf (not only NaN) in free pages and last-page tails must not reach the output.
    rng = np.random.default_rng(7)
    kv = make_paged_kv(rng, [3, 9, 0, 17], num_kv_heads=2, head_dim=16, page_size=4, poison=np.inf)
    q = rng.standard_normal((4, 4, 16)).astype(np.float32)
    out = paged_attention_reference(q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
    assert_close(out, dense_attention(q, kv.k_dense, kv.v_dense, kv.lengths), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_vs_dense_low_precision_pages(dtype):
    # Pages in bf16/f16; the dense oracle sees the same rounded values, math is f32.
    rng = np.random.default_rng(11)
    kv = make_paged_kv(rng, [5, 0, 33], num_kv_heads=2, head_dim=32, page_size=8, dtype=dtype)
    q = jnp.asarray(rng.standard_normal((3, 8, 32)), dtype)
    out = paged_attention_reference(q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
    assert out.dtype == dtype
    expected = dense_attention(np.asarray(q, np.float32), kv.k_dense, kv.v_dense, kv.lengths)
    assert_close(out, expected, dtype)


@jax.jit
def _reference_layer_jit(q, k_pages, v_pages, tables, lengths, layer):
    return paged_attention_reference(q, k_pages, v_pages, tables, lengths, layer=layer)


def test_five_d_pool_with_layer():
    rng = np.random.default_rng(3)
    L = 3
    kv = make_paged_kv(rng, [1, 8, 9, 30], num_kv_heads=2, head_dim=16, page_size=8, num_layers=L)
    q = rng.standard_normal((4, 4, 16)).astype(np.float32)
    for layer in range(L):
        expected = dense_attention(q, kv.k_dense[layer], kv.v_dense[layer], kv.lengths)
        eager = paged_attention_reference(
            q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, layer=layer
        )
        assert_close(eager, expected, jnp.float32, err_msg=f"{layer=}")
        traced = _reference_layer_jit(
            q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, jnp.int32(layer)
        )
        assert_close(traced, expected, jnp.float32, err_msg=f"traced {layer=}")
