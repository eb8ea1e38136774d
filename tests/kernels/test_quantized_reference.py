"""Quantized pages (fp8 / int8 with f32 scales, ``pallas_kernels/_quant.py``) in the references,
the XLA paths and the public ops' validation: every dtype and granularity against the f64 oracle
on the dequantized values, permuted tables, poisoned free pages and tails, lengths 0, 1, C-1,
C, C+1 and 150, a 5-D pool, a hand-worked case, and the errors of bad scales."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantized_cases import (
    DTYPES,
    GRANULARITIES,
    assert_matches,
    decode_case,
    decode_oracle,
    ragged_case,
    ragged_oracle,
)
from jax.experimental import checkify

import jpaged
from pallas_kernels import _quant
from pallas_kernels.paged_attention.reference import paged_attention_reference
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

C = 16
LENGTHS = [0, 1, C - 1, C, C + 1, 150]
PRODUCT = [(d, g) for d in DTYPES for g in GRANULARITIES]
# ``make test`` runs each granularity once per op and implementation, the dtypes rotating so
# that the four (implementation, op) pairs together run every (dtype, granularity) pair;
# ``make test-all`` runs the whole product for each (``tests/conftest.py``).
_CI = {
    (test, impl): {(DTYPES[(i + shift) % len(DTYPES)], g) for i, g in enumerate(GRANULARITIES)}
    for shift, (test, impl) in enumerate(
        (t, impl) for t in ("decode", "ragged") for impl in ("reference", "xla")
    )
}
SLOW_CASES = {
    f"test_{test}_matches_oracle[{impl}-{d}-{g}]"
    for (test, impl), ci in _CI.items()
    for d, g in PRODUCT
    if (d, g) not in ci
}


@pytest.mark.parametrize("dtype,granularity", PRODUCT)
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_decode_matches_oracle(impl, dtype, granularity):
    rng = np.random.default_rng(len(dtype) * 7 + len(granularity))
    q, kv = decode_case(
        rng, LENGTHS, C=C, dtype=dtype, granularity=granularity, q_dtype=jnp.float32
    )
    args = (q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
    scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
    if impl == "reference":
        out = paged_attention_reference(*args, **scales)
    else:
        out = jpaged.paged_attention(*args, **scales, implementation="xla")
    assert_matches(out, decode_oracle(q, kv), f"{impl} {dtype} {granularity}")
    assert np.all(np.asarray(out)[np.asarray(LENGTHS) == 0] == 0.0)


@pytest.mark.parametrize("dtype,granularity", PRODUCT)
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_ragged_matches_oracle(impl, dtype, granularity):
    rng = np.random.default_rng(len(dtype) * 11 + len(granularity))
    case, ks, vs = ragged_case(
        rng, [C - 1, 1, C + 1, 150, C], [3, 1, C + 1, 40, 0], C=C, dtype=dtype,
        granularity=granularity, q_dtype=jnp.float32,
    )  # fmt: skip
    scales = dict(k_scale=ks, v_scale=vs)
    if impl == "reference":
        out = ragged_paged_attention_reference(*case.args, **scales)
    else:
        out = jpaged.ragged_paged_attention(*case.args, **scales, implementation="xla")
    assert_matches(out, ragged_oracle(case), f"{impl} {dtype} {granularity}")


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_layered_pool_and_mixed_granularities(granularity):
    # A 5-D pool: the scales carry L (or 1 per tensor); a traced layer picks the row. Value
    # scales per token beside key scales of each granularity.
    rng = np.random.default_rng(3)
    q, kv = decode_case(
        rng, LENGTHS, C=C, dtype="float8_e4m3fn", granularity=granularity,
        v_granularity="token", num_layers=3, q_dtype=jnp.float32,
    )  # fmt: skip
    f = jax.jit(lambda layer: jpaged.paged_attention(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, layer=layer,
        k_scale=kv.k_scale, v_scale=kv.v_scale, implementation="xla",
    ))  # fmt: skip
    for layer in (0, 2):
        assert_matches(f(jnp.int32(layer)), decode_oracle(q, kv, layer=layer), f"{layer=}")


def test_hand_worked_case():
    # One sequence of 3 keys in one page of int8, per-token scales: keys k_j = s_j * q_j.
    k = np.zeros((1, 1, 4, 2), np.int8)
    k[0, 0, :3] = [[10, 0], [0, 20], [5, 5]]
    k_scale = np.array([[[0.1, 0.05, 0.2, np.nan]]], np.float32)  # row 3: past the end
    v = np.zeros((1, 1, 4, 2), np.int8)
    v[0, 0, :3] = [[1, 2], [3, 4], [5, 6]]
    v_scale = np.array([[[1.0]]], np.float32)  # per head
    q = np.array([[[1.0, 0.0]]], np.float32)
    out = paged_attention_reference(
        q, k, v, np.array([[0]], np.int32), np.array([3], np.int32), sm_scale=1.0,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    s = np.array([1.0, 0.0, 1.0])  # k rows dequantized: (1, 0), (0, 1), (1, 1)
    p = np.exp(s) / np.exp(s).sum()
    np.testing.assert_allclose(
        np.asarray(out)[0, 0], p @ np.array([[1, 2], [3, 4], [5, 6]]), rtol=1e-6
    )


def test_granularity_of_shapes():
    pool = (2, 5, 16, 64)
    assert _quant.granularity((), pool) == "tensor"
    assert _quant.granularity((1, 1, 1), pool) == "tensor"
    assert _quant.granularity((2, 1, 1), pool) == "head"
    assert _quant.granularity((2, 5, 1), pool) == "page"
    assert _quant.granularity((2, 5, 16), pool) == "token"
    assert _quant.granularity((1, 5, 1), pool) is None
    assert _quant.granularity((2, 5, 16, 1), pool) is None
    layered = (3, 2, 5, 16, 64)
    assert _quant.granularity((3, 2, 5, 1), layered) == "page"
    assert _quant.granularity((1, 2, 1, 1), layered) == "head"
    assert _quant.granularity((2, 2, 1, 1), layered) is None


def _call(op, q, pages, **kw):
    B = q.shape[0]
    tables, lengths = np.zeros((B, 2), np.int32), np.ones(B, np.int32)
    if op == "decode":
        return jpaged.paged_attention(q, pages, pages, tables, lengths, **kw)
    cu = np.arange(B + 1, dtype=np.int32)
    return jpaged.ragged_paged_attention(
        q, pages, pages, tables, lengths, cu, np.asarray(B, np.int32), **kw
    )


@pytest.mark.parametrize("op", ["decode", "ragged"])
@pytest.mark.parametrize(
    "pages_dtype,kw,match",
    [
        ("int8", {}, r"k_scale is missing: k_pages.dtype=int8 is quantized"),
        ("float8_e4m3fn", {"k_scale": np.ones((), np.float32)}, r"v_scale is missing"),
        ("bfloat16", {"k_scale": np.ones((), np.float32), "v_scale": np.ones((), np.float32)},
         r"k_scale is given but k_pages.dtype=bfloat16 is not quantized"),
        ("int8", {"k_scale": np.ones((2, 3, 1), np.float32), "v_scale": np.ones((), np.float32)},
         r"k_scale.shape=\(2, 3, 1\) must be \(\) or one of \[1, 1, 1\], \[2, 1, 1\], "
         r"\[2, 4, 1\], \[2, 4, 8\]"),
        ("float8_e5m2", {"k_scale": np.ones((), np.float32), "v_scale": np.ones((), jnp.bfloat16)},
         r"v_scale.dtype=bfloat16 must be float32"),
        ("int16", {}, r"floating dtype or int8"),
    ],
    ids=["missing", "one-missing", "not-quantized", "bad-shape", "bad-dtype", "int16"],
)  # fmt: skip
def test_bad_scales_raise(op, pages_dtype, kw, match):
    q = np.zeros((2, 4, 16), np.float32)
    pages = np.zeros((2, 4, 8, 16), pages_dtype)
    with pytest.raises(ValueError, match=match):
        _call(op, q, pages, **kw)


def test_implementation_reasons_accept_scales():
    # Every implementation's UNSUPPORTED_REASONS takes the scales; the TPU kernel wants pages of
    # a multiple of 32 tokens in 8 bits, the GPU kernel a GPU.
    from pallas_kernels.paged_attention import dispatch

    q = jax.ShapeDtypeStruct((2, 4, 64), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((2, 6, 16, 64), jnp.int8)
    args = (q, pages, pages, jax.ShapeDtypeStruct((2, 3), jnp.int32),
            jax.ShapeDtypeStruct((2,), jnp.int32))  # fmt: skip
    scales = dict(k_scale=jnp.ones((2, 6, 16)), v_scale=jnp.ones(()))
    assert dispatch.UNSUPPORTED_REASONS["xla"](*args, **scales) is None
    assert "multiple of 32" in dispatch.UNSUPPORTED_REASONS["pallas_tpu"](*args, **scales)
    if jax.default_backend() != "gpu":
        assert "compute capability" in dispatch.UNSUPPORTED_REASONS["pallas_gpu"](*args, **scales)


def test_quant_doctests():
    import doctest

    result = doctest.testmod(_quant)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_triton"])
def test_invalid_metadata_with_quantized_pages(impl):
    # Quantized calls go through the same value checks and sanitizing as the others: eagerly a
    # used page id out of range raises naming it; unchecked, that sequence gives zeros and the
    # others their attention; under jit, check=True raises through checkify.
    rng = np.random.default_rng(9)
    q, kv = decode_case(rng, [C + 1, 40, 5], C=C, dtype="int8", granularity="token")
    tables = kv.block_tables.copy()
    bad_id = kv.k_pages.shape[1] + 7
    tables[1, 0] = bad_id
    scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
    if impl == "reference":
        run = functools.partial(paged_attention_reference, **scales)
    else:
        kw = dict(interpret=True) if impl == "pallas_triton" else {}
        run = functools.partial(jpaged.paged_attention, implementation=impl, **scales, **kw)
        with pytest.raises(ValueError, match=rf"block_tables\[1, 0\] = {bad_id}"):
            run(q, kv.k_pages, kv.v_pages, tables, kv.lengths)
        run = functools.partial(run, check=False)
    out = np.asarray(jnp.asarray(run(q, kv.k_pages, kv.v_pages, tables, kv.lengths)), np.float64)
    ref = decode_oracle(q, kv)
    assert np.all(out[1] == 0.0)
    assert_matches(out[[0, 2]], ref[[0, 2]], impl)
    if impl == "xla":
        f = jax.jit(lambda t, n: jpaged.paged_attention(
            q, kv.k_pages, kv.v_pages, t, n, check=True, implementation="xla", **scales
        ))  # fmt: skip
        err, _ = checkify.checkify(f)(kv.block_tables, kv.lengths)
        err.throw()  # valid: nothing raised
        err, _ = checkify.checkify(f)(tables, kv.lengths)
        with pytest.raises(checkify.JaxRuntimeError, match=rf"block_tables\[1, 0\]={bad_id}"):
            err.throw()


def test_invalid_ragged_metadata_with_quantized_pages():
    # A malformed cu_q_lens: eagerly an error naming it; unchecked every row is zeros.
    rng = np.random.default_rng(10)
    case, ks, vs = ragged_case(rng, [C + 1, 40], [3, 40], C=C, dtype="float8_e5m2")
    q, kp, vp, tables, lens, cu, ns = case.args
    bad_cu = cu.copy()
    bad_cu[1], bad_cu[2] = 5, 3
    scales = dict(k_scale=ks, v_scale=vs, implementation="xla")
    with pytest.raises(ValueError, match=r"cu_q_lens\[1\]=5 > cu_q_lens\[2\]=3"):
        jpaged.ragged_paged_attention(q, kp, vp, tables, lens, bad_cu, ns, **scales)
    out = jpaged.ragged_paged_attention(q, kp, vp, tables, lens, bad_cu, ns, check=False, **scales)
    assert np.all(np.asarray(out, np.float32) == 0.0)
