"""Ragged paged attention, "xla" implementation, against the f32 reference."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ragged_inputs import dense_ragged_attention, make_ragged_case
from _tolerances import assert_close

import jpaged
from pallas_kernels.ragged_paged_attention import reference, xla

_STATIC = ("sm_scale", "causal", "logits_soft_cap", "sliding_window")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _ref(*args, layer=None, sm_scale=None, **kw):
    return reference.ragged_paged_attention_reference(*args, layer=layer, sm_scale=sm_scale, **kw)


def _xla(*args, sm_scale=None, **kw):
    H = args[0].shape[-1]
    scale = 1.0 / np.sqrt(H) if sm_scale is None else sm_scale
    return xla.ragged_paged_attention_xla(*args, sm_scale=float(scale), **kw)


def _check(case, dtype=jnp.float32, **opts):
    out = _xla(*case.args, **opts)
    assert out.dtype == case.args[0].dtype
    assert_close(out, _ref(*case.args, **opts), dtype, err_msg=str(opts))
    return np.asarray(out)


def test_decode_only():
    rng = np.random.default_rng(10)
    kv_lens = (1, 7, 8, 9, 30, 64)
    _check(make_ragged_case(rng, kv_lens, (1,) * 6))


def test_prefill_only():
    rng = np.random.default_rng(11)
    case = make_ragged_case(rng, (1, 9, 40), (1, 9, 40), extra_seqs=0)
    out = _check(case)
    assert_close(out, dense_ragged_attention(case), jnp.float32)


def test_mixed_decode_and_long_prefill():
    rng = np.random.default_rng(12)
    kv_lens = (5, 17, 1, 100, 33, 8)
    q_lens = (1, 1, 1, 100, 1, 4)
    case = make_ragged_case(rng, kv_lens, q_lens, num_q_heads=8, num_kv_heads=2)
    out = _check(case)
    # also against the f64 oracle, and with explicit small tiles/chunks (several loop trips)
    assert_close(out, dense_ragged_attention(case), jnp.float32)
    out2 = _xla(*case.args, block_q=4, pages_per_chunk=1)
    assert_close(out2, out, jnp.float32)


@pytest.mark.parametrize(
    "opts",
    [{"causal": False}, {"sliding_window": 6}, {"logits_soft_cap": 3.0, "sm_scale": 0.9}],
)
def test_options(opts):
    rng = np.random.default_rng(13)
    case = make_ragged_case(rng, (0, 1, 7, 8, 9, 45), (0, 1, 3, 8, 1, 20))
    _check(case, **opts)
    # many chunks, so the window's chunk skipping and the online softmax both run
    out = _xla(*case.args, block_q=2, pages_per_chunk=1, **opts)
    assert_close(out, dense_ragged_attention(case, **opts), jnp.float32, err_msg=str(opts))


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "page_size"), [(2, 2, 1), (8, 2, 8), (16, 2, 16)]
)
def test_gqa_and_page_sizes(num_q_heads, num_kv_heads, page_size):
    rng = np.random.default_rng(14)
    C = page_size
    kv_lens = (1, max(C - 1, 2), C, C + 1, 4 * C + 3)
    q_lens = (1, 2, C, 1, 3 * C)
    case = make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, page_size=C
    )
    _check(case)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dtypes(dtype):
    rng = np.random.default_rng(15)
    case = make_ragged_case(rng, (3, 20, 9), (1, 20, 2), dtype=dtype)
    _check(case, dtype)


def test_chunked_prefill_equals_one_prefill():
    """A prompt prefilled in 3 chunks (each attending to the cached ones) equals one prefill."""
    rng = np.random.default_rng(16)
    n = 37
    case = make_ragged_case(rng, (n,), (n,), extra_rows=0, extra_seqs=0)
    q, kp, vp, bt, _, _, _ = case.args
    full = np.asarray(_xla(*case.args))
    pieces = []
    T_chunk = 13  # every chunk call has the same static shapes: one compile serves all three
    for lo, hi in ((0, 12), (12, 25), (25, 37)):
        q_chunk = np.zeros((T_chunk, *q.shape[1:]), q.dtype)
        q_chunk[: hi - lo] = q[lo:hi]
        part = _xla(
            q_chunk, kp, vp, bt, np.array([hi], np.int32),
            np.array([0, hi - lo], np.int32), np.array(1, np.int32),
        )  # fmt: skip
        pieces.append(np.asarray(part)[: hi - lo])
    np.testing.assert_allclose(np.concatenate(pieces), full, atol=2e-6, rtol=2e-6)


def test_padding_rows_are_zero_not_nan():
    rng = np.random.default_rng(17)
    case = make_ragged_case(rng, (9, 4), (3, 4), extra_rows=6, extra_seqs=3)
    q = case.args[0].copy()
    q[7:] = np.nan  # padding rows of q may hold anything
    out = np.asarray(_xla(q, *case.args[1:]))
    assert np.all(out[7:] == 0.0)
    assert np.all(np.isfinite(out))
    # num_seqs = 0: everything is padding
    args0 = (q, *case.args[1:6], np.array(0, np.int32))
    assert np.all(np.asarray(_xla(*args0)) == 0.0)


def test_stacked_pool_with_traced_layer():
    rng = np.random.default_rng(18)
    case = make_ragged_case(rng, (5, 30), (5, 2), num_layers=3)
    f = jax.jit(lambda lyr, *a: _xla(*a, layer=lyr))
    for layer in (0, 2):
        out = f(jnp.int32(layer), *case.args)
        assert_close(out, dense_ragged_attention(case, layer=layer), jnp.float32)


def test_out_of_range_block_table_tails_are_never_read():
    rng = np.random.default_rng(19)
    case = make_ragged_case(rng, (3, 17), (2, 17), extra_seqs=0, width=6)
    q, kp, vp, bt, lens, cu, ns = case.args
    bt = bt.copy()
    bt[0, 1:] = [-7, 10_000, -1, 99, 2**30]  # seq 0 uses 1 page of 6
    out = _xla(q, kp, vp, bt, lens, cu, ns)
    assert_close(out, dense_ragged_attention(case), jnp.float32)


def test_second_call_compiles_nothing():
    rng = np.random.default_rng(20)
    case_a = make_ragged_case(rng, (9, 4, 20), (3, 4, 1), extra_rows=4, extra_seqs=1)
    q, kp, vp, bt, _, _, _ = case_a.args
    # Same pool and static shapes (T=12, B=4); different lengths, rows and live sequences.
    args_b = (
        rng.standard_normal(q.shape).astype(np.float32), kp, vp, bt,
        np.array([9, 2, 0, 77], np.int32), np.array([0, 6, 8, 8, 8], np.int32),
        np.array(2, np.int32),
    )  # fmt: skip
    case_b = dataclasses.replace(case_a, args=args_b, q_lens=(6, 2))
    _xla(*case_a.args).block_until_ready()
    compiles = []
    listener = lambda event, *_, **__: compiles.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = _xla(*case_b.args)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not [e for e in compiles if "compile" in e], compiles
    assert_close(out, dense_ragged_attention(case_b), jnp.float32)


def test_public_entry_point_dispatches_to_xla():
    rng = np.random.default_rng(21)
    case = make_ragged_case(rng, (9, 4), (3, 4))
    out = jpaged.ragged_paged_attention(*case.args, implementation="xla")
    assert_close(out, dense_ragged_attention(case), jnp.float32)
    if jax.default_backend() == "cpu":
        auto = jpaged.ragged_paged_attention(*case.args)
        assert_close(auto, out, jnp.float32)
