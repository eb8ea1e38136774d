"""The "xla" decode-attention implementation vs the f32 reference.

Inputs come from ``_paged_inputs.make_paged_kv``: randomly permuted pools, NaN in
free pages and last-page tails, unused table entries pointing at NaN pages (or out of
range), lengths 0, 1, C-1, C, C+1 and long in every batch. The reference runs in f32
on the same dtype-rounded pages (q passed as f32), so the only difference is the XLA
path's arithmetic.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import make_paged_kv
from _tolerances import assert_close
from hypothesis import given, settings

import jpaged
from pallas_kernels.paged_attention import paged_attention_reference, paged_attention_xla
from pallas_kernels.paged_attention.xla import chunk_schedule

LONG = {1: 37, 8: 8 * 13 + 5, 16: 16 * 9 + 3}


def _lengths(C: int) -> list[int]:
    return [0, 1, C - 1, C, C + 1, LONG[C]]


def _inputs(seed, C, K, G, H, dtype, **kw):
    rng = np.random.default_rng(seed)
    lengths = kw.pop("lengths", None) or _lengths(C)
    kv = make_paged_kv(rng, lengths, num_kv_heads=K, head_dim=H, page_size=C, dtype=dtype, **kw)
    q32 = np.asarray(jnp.asarray(rng.standard_normal((len(lengths), K * G, H)), dtype), np.float32)
    return kv, q32


def _expected(kv, q32, **knobs):
    return paged_attention_reference(
        q32, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, **knobs
    )


# Every (page size, dtype) pair; group size, head dim and chunk size rotate so that each
# value of each meets every page size.
PRODUCT = [
    pytest.param(
        C, dtype, (1, 4, 8)[(i + i // 3) % 3], (64, 128)[i % 2], (1, 3, None)[i // 3],
        id=f"C{C}-{jnp.dtype(dtype).name}-G{(1, 4, 8)[(i + i // 3) % 3]}"
        f"-H{(64, 128)[i % 2]}-ppc{(1, 3, None)[i // 3]}",
    )
    for i, (C, dtype) in enumerate(
        itertools.product((1, 8, 16), (jnp.float32, jnp.bfloat16, jnp.float16))
    )
]  # fmt: skip


@pytest.mark.parametrize("C, dtype, G, H, pages_per_chunk", PRODUCT)
def test_xla_vs_reference(C, dtype, G, H, pages_per_chunk):
    K = 2
    kv, q32 = _inputs([C, G, H], C, K, G, H, dtype)
    q = jnp.asarray(q32, dtype)
    out = jpaged.paged_attention(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths,
        implementation="xla", pages_per_chunk=pages_per_chunk,
    )  # fmt: skip
    assert out.dtype == dtype
    assert_close(out, _expected(kv, q32), dtype)


KNOBS = [
    pytest.param({"logits_soft_cap": 3.0}, 2, id="softcap"),
    pytest.param({"sliding_window": 1}, 2, id="window1"),
    pytest.param({"sliding_window": 9, "sm_scale": 0.05}, 1, id="window-C+1-scale"),
    pytest.param({"sliding_window": 30, "logits_soft_cap": 2.0}, 4, id="window30-softcap"),
    pytest.param({"sliding_window": 500}, 3, id="window-wider-than-context"),
]


@pytest.mark.parametrize("knobs, pages_per_chunk", KNOBS)
def test_xla_knobs_vs_reference(knobs, pages_per_chunk):
    C, K, G, H = 8, 2, 4, 64
    kv, q32 = _inputs(5, C, K, G, H, jnp.float32, out_of_range_tail=True)
    out = jpaged.paged_attention(
        q32, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths,
        implementation="xla", pages_per_chunk=pages_per_chunk, **knobs,
    )  # fmt: skip
    assert_close(out, _expected(kv, q32, **knobs), jnp.float32)


def test_xla_mixed_q_and_page_dtypes():
    # f32 queries over bf16 pages: the XLA path computes in f32.
    kv, q32 = _inputs(9, 8, 2, 4, 64, jnp.bfloat16)
    out = jpaged.paged_attention(
        q32, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, implementation="xla"
    )
    assert out.dtype == jnp.float32
    assert_close(out, _expected(kv, q32), jnp.float32)


def test_xla_all_lengths_zero():
    kv, q32 = _inputs(2, 8, 2, 2, 64, jnp.float32, lengths=[0, 0, 0], width=3)
    out = jpaged.paged_attention(
        q32, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, implementation="xla"
    )
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@jax.jit
def _xla_layer_jit(q, k_pages, v_pages, tables, lengths, layer):
    return jpaged.paged_attention(
        q, k_pages, v_pages, tables, lengths, layer=layer, implementation="xla",
        sliding_window=20, pages_per_chunk=2,
    )  # fmt: skip


def test_xla_five_d_pool_traced_layer_tables_lengths():
    L = 3
    kv, q32 = _inputs(4, 8, 2, 4, 64, jnp.float32, num_layers=L)
    for layer in range(L):
        out = _xla_layer_jit(
            q32, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, jnp.int32(layer)
        )
        expected = _expected(kv, q32, layer=layer, sliding_window=20)
        assert_close(out, expected, jnp.float32, err_msg=f"{layer=}")


def test_chunk_schedule_skips_pages_before_window():
    # C = 8, 2 pages per chunk, W = 200. Length 1000 with window 16: positions 984..999,
    # pages 123 and 124, one chunk (not 63). Length 5: page 0 only.
    _, lo, first, used, num_chunks = chunk_schedule(
        jnp.asarray([1000, 5, 0], jnp.int32),
        page_size=8, width=200, pages_per_chunk=2, sliding_window=16,
    )  # fmt: skip
    np.testing.assert_array_equal(lo, [984, 0, 0])
    np.testing.assert_array_equal(first, [123, 0, 0])
    np.testing.assert_array_equal(used, [125, 1, 0])
    assert int(num_chunks) == 1
    # Without a window the longest sequence sets the trip count: ceil(125 / 2) = 63.
    *_, num_chunks = chunk_schedule(
        jnp.asarray([1000, 5, 0], jnp.int32),
        page_size=8, width=200, pages_per_chunk=2, sliding_window=None,
    )  # fmt: skip
    assert int(num_chunks) == 63


def test_xla_memory_is_one_chunk_not_the_whole_context():
    # B=4, K=2, W=512 pages of C=16, H=64, f32: gathering the whole context would take
    # 4*2*8192*64*4 B = 16 MiB of temporaries. One chunk of 4 pages is 256 KiB per K/V.
    S = jax.ShapeDtypeStruct
    pool = S((2, 64, 16, 64), jnp.float32)
    compiled = (
        jax.jit(lambda q, k, v, t, n: paged_attention_xla(
            q, k, v, t, n, sm_scale=0.125, pages_per_chunk=4))
        .lower(S((4, 8, 64), jnp.float32), pool, pool, S((4, 512), jnp.int32),
               S((4,), jnp.int32))
        .compile()
    )  # fmt: skip
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.fail("memory_analysis() is unavailable on this backend")
    assert stats.temp_size_in_bytes < 2 * 2**20, stats


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_xla_rejects_bad_pages_per_chunk(bad):
    kv, q32 = _inputs(1, 8, 1, 1, 64, jnp.float32, lengths=[3], width=1)
    with pytest.raises(ValueError, match=r"pages_per_chunk=.* must be an int >= 1"):
        paged_attention_xla(
            q32, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths,
            sm_scale=0.1, pages_per_chunk=bad,
        )  # fmt: skip


# Fixed shapes (B=4, W=6, C=4, P=26) so every example reuses one compile per knob setting.
_B, _W, _C = 4, 6, 4


@settings(max_examples=20, deadline=None, database=None)
@given(
    lengths=st.lists(st.integers(0, _W * _C), min_size=_B, max_size=_B),
    seed=st.integers(0, 2**32 - 1),
    pages_per_chunk=st.sampled_from([1, 2, 6]),
    sliding_window=st.sampled_from([None, 3]),
)
def test_xla_random_lengths_property(lengths, seed, pages_per_chunk, sliding_window):
    used = sum(-(-n // _C) for n in lengths)
    kv, q32 = _inputs(
        seed, _C, 2, 2, 64, jnp.float32,
        lengths=lengths, width=_W, extra_pages=_B * _W - used + 2,
    )  # fmt: skip
    assert kv.k_pages.shape[1] == _B * _W + 2
    out = paged_attention_xla(
        q32, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths,
        sm_scale=0.125, sliding_window=sliding_window, pages_per_chunk=pages_per_chunk,
    )  # fmt: skip
    expected = _expected(kv, q32, sm_scale=0.125, sliding_window=sliding_window)
    assert_close(out, expected, jnp.float32, err_msg=f"{lengths=}")
