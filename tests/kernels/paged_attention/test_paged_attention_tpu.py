"""The Mosaic TPU decode kernel: in the strict TPU interpreter on CPU, compiled on a TPU.

Inputs follow the suite's rules (``_paged_inputs``): randomly permuted page pools, free pages
and last-page tails NaN, unused table entries pointing at NaN pages (or out of range), lengths
0, 1, C-1, C, C+1 and longer. The interpreter runs with ``pltpu.InterpretParams()`` in its
default DMA mode (a DMA takes effect only when awaited, scratch starts as NaN), so a missing
wait, a read of an un-fetched page or of uninitialised scratch reaches the output as NaN, and
an out-of-range page id raises. Grids stay at most 32 steps (B * K).
"""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import make_paged_kv
from _tolerances import assert_close
from jax.experimental.pallas import tpu as pltpu

import jpaged
from pallas_kernels.paged_attention import kernel_tpu, tuning_tpu
from pallas_kernels.paged_attention.reference import paged_attention_reference


def _lengths(C: int) -> list[int]:
    return [0, 1, C - 1, C, C + 1, 3 * C + 2]


def _case(seed, *, C, K, G, H, dtype, lengths=None, num_layers=None, **kw):
    rng = np.random.default_rng(seed)
    lengths = _lengths(C) if lengths is None else lengths
    kv = make_paged_kv(
        rng, lengths, num_kv_heads=K, head_dim=H, page_size=C, dtype=dtype,
        num_layers=num_layers, **kw,
    )  # fmt: skip
    q = jnp.asarray(rng.standard_normal((len(lengths), K * G, H)), dtype)
    return q, kv


def _check(q, kv, dtype, *, interpret, layer=None, scale=1.0, **kw):
    args = (q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
    if isinstance(interpret, pltpu.InterpretParams):  # the public API takes only a bool
        sm_scale = kw.pop("sm_scale", None) or 1.0 / np.sqrt(q.shape[-1])
        out = kernel_tpu.paged_attention_pallas_tpu(
            *args, sm_scale=sm_scale, layer=layer, interpret=interpret, **kw
        )
        kw["sm_scale"] = sm_scale
    else:
        out = jpaged.paged_attention(
            *args, layer=layer, implementation="pallas_tpu", interpret=interpret, **kw
        )
    for knob in ("pages_per_compute_block", "seqs_per_program"):
        kw.pop(knob, None)
    ref = paged_attention_reference(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, layer=layer, **kw
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, dtype, scale=scale)
    n0 = np.asarray(kv.lengths) == 0
    assert np.all(np.asarray(out, np.float32)[n0] == 0.0), "length-0 rows must be zeros"


# (C, K, G, H, dtype, pages_per_compute_block, seqs_per_program): page sizes, GQA ratios, head
# dims, dtypes and block sizes (1 page, several pages, a block wider than some sequences; one
# sequence per program, several, and a count that does not divide B = 6).
SHAPES = [
    (8, 2, 1, 64, jnp.float32, 1, 2),
    (8, 2, 4, 128, jnp.float32, 2, 1),
    (16, 1, 8, 64, jnp.float32, 3, 6),
    (16, 2, 2, 128, jnp.bfloat16, 2, 4),
    (16, 2, 1, 64, jnp.bfloat16, 4, 3),
    (4, 2, 3, 64, jnp.float32, 2, 2),  # interpreter only: C=4 is below the f32 sublane tile
]


# Left out of ``make test`` (``make test-all`` runs it): a bf16 shape of G=1 (G=1:
# [8-2-1-64-float32-1-2]; bf16: [16-2-2-128-bfloat16-2-4]; a compute block wider than some
# sequences: [16-1-8-64-float32-3-6]).
_SLOW_SHAPE = (16, 2, 1, 64, jnp.bfloat16, 4, 3)


@pytest.mark.parametrize(
    "C,K,G,H,dtype,ppcb,bb",
    [pytest.param(*s, marks=pytest.mark.slow) if s == _SLOW_SHAPE else s for s in SHAPES],
)
def test_matches_reference(C, K, G, H, dtype, ppcb, bb):
    q, kv = _case(C * 100 + G, C=C, K=K, G=G, H=H, dtype=dtype)
    _check(q, kv, dtype, interpret=True, pages_per_compute_block=ppcb, seqs_per_program=bb)


# Windows 5, 9 and 40 are left out of ``make test`` (``make test-all`` runs them): CI keeps a
# window of one key and of exactly a page here, windows of 10, 12 and 20 keys crossing pages
# in test_pages_before_the_window_are_never_fetched, test_no_races_two_cores_random_order and
# test_bf16_window_cap_head_dim_256; a window past every sequence reads what no window reads.
@pytest.mark.parametrize(
    "window", [1, pytest.param(5, marks=pytest.mark.slow), 8,
               pytest.param(9, marks=pytest.mark.slow), pytest.param(40, marks=pytest.mark.slow)],
)  # fmt: skip
def test_sliding_window(window):
    # Windows smaller than a page, crossing a page boundary, equal to a page, past it, and
    # longer than every sequence.
    q, kv = _case(window, C=8, K=1, G=2, H=64, dtype=jnp.float32)
    _check(q, kv, jnp.float32, interpret=True, sliding_window=window, pages_per_compute_block=2)


# The cap at the default scale is left out of ``make test`` (the cap stays in CI:
# [30.0-0.37], test_bf16_window_cap_head_dim_256).
@pytest.mark.parametrize(
    "cap,sm_scale", [pytest.param(2.0, None, marks=pytest.mark.slow), (30.0, 0.37)]
)
def test_soft_cap_and_scale(cap, sm_scale):
    q, kv = _case(7, C=8, K=2, G=2, H=64, dtype=jnp.float32)
    q = q * 4  # large logits, so the cap matters
    _check(
        q, kv, jnp.float32, interpret=True, logits_soft_cap=cap, sm_scale=sm_scale,
        pages_per_compute_block=2,
    )  # fmt: skip


def test_bf16_window_cap_head_dim_256():
    q, kv = _case(11, C=16, K=1, G=4, H=256, dtype=jnp.bfloat16, lengths=[17, 0, 40])
    _check(
        q, kv, jnp.bfloat16, interpret=True, sliding_window=20, logits_soft_cap=5.0,
        pages_per_compute_block=2,
    )  # fmt: skip


def test_f32_queries_on_bf16_pages():
    q, kv = _case(12, C=16, K=2, G=2, H=64, dtype=jnp.bfloat16, lengths=[5, 16, 0, 33])
    _check(q.astype(jnp.float32), kv, jnp.bfloat16, interpret=True, pages_per_compute_block=2)


def test_layered_pool_with_traced_layer():
    q, kv = _case(3, C=8, K=2, G=2, H=64, dtype=jnp.float32, num_layers=3)

    @jax.jit
    def run(q, k, v, t, lens, layer):
        return kernel_tpu.paged_attention_pallas_tpu(
            q, k, v, t, lens, sm_scale=0.125, layer=layer, interpret=True,
            pages_per_compute_block=2,
        )  # fmt: skip

    for layer in (2, 0):
        out = run(q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, jnp.int32(layer))
        ref = paged_attention_reference(
            q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=0.125, layer=layer
        )
        assert_close(out, ref, jnp.float32, err_msg=f"{layer=}")
    # The static-int layer through the public API takes the same kernel.
    _check(q, kv, jnp.float32, interpret=True, layer=1, pages_per_compute_block=2)


def test_out_of_range_unused_entries_are_never_read():
    # Unused table entries hold ids >= P or negative; the interpreter raises on any
    # out-of-bounds DMA, so passing means they were never fetched.
    q, kv = _case(5, C=8, K=2, G=2, H=64, dtype=jnp.float32, out_of_range_tail=True)
    _check(q, kv, jnp.float32, interpret=True, pages_per_compute_block=2)


def test_pages_before_the_window_are_never_fetched():
    # Table entries of pages wholly before each sequence's window hold out-of-range ids: the
    # interpreter raises on an out-of-bounds DMA, so passing means they were skipped.
    C, window = 8, 10
    q, kv = _case(6, C=8, K=2, G=2, H=64, dtype=jnp.float32, lengths=[40, 9, 0, 17, 33])
    P = kv.k_pages.shape[-3]
    tables = kv.block_tables.copy()
    for b, n in enumerate(kv.lengths):
        tables[b, : max(0, int(n) - window) // C] = P + 5
    out = kernel_tpu.paged_attention_pallas_tpu(
        q, kv.k_pages, kv.v_pages, tables, kv.lengths, sm_scale=0.125,
        sliding_window=window, interpret=True, pages_per_compute_block=2,
    )  # fmt: skip
    ref = paged_attention_reference(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=0.125,
        sliding_window=window,
    )  # fmt: skip
    assert_close(out, ref, jnp.float32)


def _record_core(cores: set[int]):
    """A ``grid_point_recorder`` that collects the simulated cores that ran grid points."""

    def record(token, grid_point, core):
        del grid_point
        cores.add(int(core))
        return token

    return record


def test_no_races_two_cores_random_order(capfd):
    # Two simulated TensorCores, parallel grid points visited in random order, and the
    # race detector on: the grid must be safe to split across cores (megacore).
    q, kv = _case(9, C=8, K=2, G=2, H=64, dtype=jnp.float32, lengths=[9, 0, 30, 17])
    cores = set()
    params = pltpu.InterpretParams(
        detect_races=True, num_cores_or_threads=2, random_seed=3,
        grid_point_recorder=_record_core(cores),
    )  # fmt: skip
    _check(
        q, kv, jnp.float32, interpret=params, sliding_window=12, pages_per_compute_block=2,
        seqs_per_program=2,
    )  # fmt: skip
    assert "RACE DETECTED" not in capfd.readouterr().out
    assert cores == {0, 1}, "both simulated TensorCores must have run grid points"


def test_new_lengths_compile_nothing():
    q, kv = _case(13, C=8, K=2, G=1, H=64, dtype=jnp.float32, lengths=[3, 12])
    args = (q, kv.k_pages, kv.v_pages, kv.block_tables)
    kw = dict(sm_scale=0.125, interpret=True, pages_per_compute_block=2)
    kernel_tpu.paged_attention_pallas_tpu(*args, jnp.asarray(kv.lengths), **kw).block_until_ready()
    before = kernel_tpu._paged_attention_tpu._cache_size()
    kernel_tpu.paged_attention_pallas_tpu(*args, jnp.asarray([8, 1], jnp.int32), **kw)
    assert kernel_tpu._paged_attention_tpu._cache_size() == before


def test_batch_larger_than_smem_runs_in_chunks(monkeypatch):
    # Pretend SMEM holds only two rows of the block table: 6 sequences run as 3 calls.
    q, kv = _case(17, C=8, K=1, G=2, H=64, dtype=jnp.float32, lengths=[0, 9, 1, 16, 7, 20])
    W = kv.block_tables.shape[1]
    monkeypatch.setattr(tuning_tpu, "max_scalar_prefetch_entries", lambda gen=None: 2 * W + 7)
    _check(q, kv, jnp.float32, interpret=True, pages_per_compute_block=2)


def test_bad_block_size_raises():
    q, kv = _case(1, C=8, K=1, G=1, H=64, dtype=jnp.float32, lengths=[3])
    for knob in ("pages_per_compute_block", "seqs_per_program"):
        with pytest.raises(ValueError, match=knob):
            kernel_tpu.paged_attention_pallas_tpu(
                q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=1.0,
                interpret=True, **{knob: 0},
            )  # fmt: skip


@pytest.mark.parametrize(
    "dtype,C,H,match",
    [
        (jnp.float16, 16, 128, "float32 or bfloat16"),
        (jnp.float32, 8, 96, "multiple of 64"),
        (jnp.float32, 4, 128, "multiple of 8"),
        (jnp.bfloat16, 8, 128, "multiple of 16"),
    ],
)
def test_unsupported_reason(dtype, C, H, match):
    q = jax.ShapeDtypeStruct((2, 4, H), dtype)
    kv = jax.ShapeDtypeStruct((2, 5, C, H), dtype)
    t = jax.ShapeDtypeStruct((2, 3), jnp.int32)
    n = jax.ShapeDtypeStruct((2,), jnp.int32)
    reason = kernel_tpu.unsupported_reason(q, kv, kv, t, n, sm_scale=1.0)
    assert reason is not None and match in reason


def test_supported_shapes_have_no_reason():
    for dtype, C in ((jnp.float32, 8), (jnp.bfloat16, 16)):
        for H in (64, 128, 256):
            q = jax.ShapeDtypeStruct((2, 4, H), dtype)
            kv = jax.ShapeDtypeStruct((3, 2, 5, C, H), dtype)
            t = jax.ShapeDtypeStruct((2, 3), jnp.int32)
            n = jax.ShapeDtypeStruct((2,), jnp.int32)
            assert kernel_tpu.unsupported_reason(q, kv, kv, t, n, sm_scale=1.0, layer=0) is None


@pytest.mark.parametrize(
    "dtype,C,K,G,H,window,cap",
    [
        (jnp.float32, 8, 2, 1, 64, None, None),
        (jnp.bfloat16, 16, 2, 4, 128, 100, None),
        (jnp.bfloat16, 32, 1, 8, 256, None, 30.0),
    ],
)
def test_lowers_for_tpu(dtype, C, K, G, H, window, cap):
    # Cross-lowers the compiled kernel to a Mosaic TPU custom call on the CPU: catches ops
    # and shapes the Mosaic lowering rejects, without a TPU.
    B, P, W, L = 4, 64, 16, 2
    q = jax.ShapeDtypeStruct((B, K * G, H), dtype)
    kv = jax.ShapeDtypeStruct((L, K, P, C, H), dtype)
    t = jax.ShapeDtypeStruct((B, W), jnp.int32)
    n = jax.ShapeDtypeStruct((B,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)

    def f(q, k, v, t, n, layer):
        return kernel_tpu.paged_attention_pallas_tpu(
            q, k, v, t, n, sm_scale=0.1, logits_soft_cap=cap, sliding_window=window,
            layer=layer, pages_per_compute_block=4,
        )  # fmt: skip

    text = jax.jit(f).trace(q, kv, kv, t, n, layer).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def test_auto_dispatch_picks_tpu_kernel_on_a_tpu_backend(monkeypatch):
    from jpaged import _attention
    from pallas_kernels import _backend
    from pallas_kernels.paged_attention import dispatch

    monkeypatch.setattr(_backend, "default_platform", lambda: "tpu")
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    kw = dict(sm_scale=0.1, logits_soft_cap=None, sliding_window=None, layer=None)
    for H, expected in ((128, "pallas_tpu"), (96, "xla")):  # H = 96 is not supported
        args = (S((2, 4, H), jnp.bfloat16), S((2, 9, 16, H), jnp.bfloat16))
        args = (*args, args[1], S((2, 3), i32), S((2,), i32))
        assert _attention._resolve("paged_attention", dispatch, None, None, args, kw) == expected


def test_tuning_heuristic():
    for gen in (*tuning_tpu.GENERATIONS.values(), tuning_tpu.DEFAULT, tuning_tpu.INTERPRET):
        for C, H, itemsize, W in ((16, 128, 2, 64), (8, 64, 4, 3), (256, 256, 4, 512)):
            n = tuning_tpu.decode_block_sizes(
                page_size=C, head_dim=H, itemsize=itemsize, width=W, gen=gen
            )["pages_per_compute_block"]
            assert 1 <= n <= W
            # The double buffer of K and V fits a quarter of the VMEM budget (or is 1 page).
            assert n == 1 or 4 * n * C * max(H, 128) * itemsize <= gen.vmem_bytes // 4
    for gen in (tuning_tpu.GENERATIONS["v5e"], tuning_tpu.INTERPRET):
        for B, K in ((1, 1), (3, 1), (64, 8), (7, 2)):
            bb = tuning_tpu.seqs_per_program(batch=B, num_kv_heads=K, gen=gen)
            assert 1 <= bb <= B
            assert bb == 1 or -(-B // bb) * K >= 4  # enough programs for two TensorCores
    assert tuning_tpu._generation_from_kind("TPU v5 lite").name == "v5e"
    assert tuning_tpu._generation_from_kind("TPU v6 lite").name == "v6e"
    assert tuning_tpu._generation_from_kind("TPU v5p").name == "v5p"
    assert tuning_tpu._generation_from_kind("TPU7x").name == "v7x"
    assert tuning_tpu._generation_from_kind("TPU v4").name == "v4"
    assert tuning_tpu._generation_from_kind("something new").name == "default"


def test_doctests():
    result = doctest.testmod(kernel_tpu, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.tpu
class TestCompiledOnTpu:
    """The same cases compiled by Mosaic TPU (run with ``pytest -m tpu`` on a TPU)."""

    @pytest.mark.parametrize("C,K,G,H,dtype,ppcb,bb", [s for s in SHAPES if s[0] >= 8])
    def test_matches_reference(self, C, K, G, H, dtype, ppcb, bb):
        q, kv = _case(C * 100 + G, C=C, K=K, G=G, H=H, dtype=dtype)
        _check(q, kv, dtype, interpret=False, pages_per_compute_block=ppcb, seqs_per_program=bb)

    @pytest.mark.parametrize("window", [1, 5, 8, 9, 40])
    def test_sliding_window(self, window):
        q, kv = _case(window, C=8, K=2, G=2, H=64, dtype=jnp.float32)
        _check(q, kv, jnp.float32, interpret=False, sliding_window=window)

    def test_cap_layer_bf16_long(self):
        q, kv = _case(
            21, C=16, K=2, G=4, H=128, dtype=jnp.bfloat16, num_layers=2,
            lengths=[0, 1, 15, 16, 17, 1000, 4099],
        )  # fmt: skip
        _check(q, kv, jnp.bfloat16, interpret=False, layer=1, logits_soft_cap=20.0)

    def test_auto_dispatch_picks_tpu_kernel(self):
        q, kv = _case(2, C=16, K=2, G=2, H=128, dtype=jnp.bfloat16)
        args = (q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
        auto = jpaged.paged_attention(*args)
        explicit = jpaged.paged_attention(*args, implementation="pallas_tpu")
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(explicit))
