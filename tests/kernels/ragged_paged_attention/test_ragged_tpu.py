"""The Mosaic TPU ragged kernel: in the strict TPU interpreter on CPU, compiled on a TPU.

Cases come from ``make_ragged_case`` (permuted NaN-poisoned pools, padding rows, dead
sequences with garbage ``kv_lens`` past ``num_seqs``) and are checked against the f32 jnp
reference. The interpreter runs with ``pltpu.InterpretParams()`` (DMAs take effect when
awaited, scratch starts as NaN, out-of-range DMAs raise). Grids stay at most 32 steps.
"""

from __future__ import annotations

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ragged_inputs import dense_ragged_attention, make_ragged_case
from _tolerances import assert_close
from jax.experimental.pallas import tpu as pltpu

import jpaged
from pallas_kernels.paged_attention.tuning_tpu import GENERATIONS
from pallas_kernels.ragged_paged_attention import kernel_tpu, reference, tuning_tpu

_STATIC = ("sm_scale", "causal", "logits_soft_cap", "sliding_window")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _ref(*args, layer=None, sm_scale=None, **kw):
    return reference.ragged_paged_attention_reference(*args, layer=layer, sm_scale=sm_scale, **kw)


def _check(case, dtype=jnp.float32, *, interpret=True, layer=None, **opts):
    if isinstance(interpret, pltpu.InterpretParams):  # the public API takes only a bool
        sm_scale = opts.pop("sm_scale", None) or 1.0 / np.sqrt(case.args[0].shape[-1])
        out = kernel_tpu.ragged_paged_attention_pallas_tpu(
            *case.args, sm_scale=sm_scale, layer=layer, interpret=interpret, **opts
        )
        opts["sm_scale"] = sm_scale
    else:
        out = jpaged.ragged_paged_attention(
            *case.args, layer=layer, implementation="pallas_tpu", interpret=interpret, **opts
        )
    for knob in ("block_q", "pages_per_compute_block", "tiles_per_program"):
        opts.pop(knob, None)
    q, cu, ns = case.args[0], case.args[5], int(case.args[6])
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, _ref(*case.args, layer=layer, **opts), dtype, err_msg=str(opts))
    pad = np.asarray(out, np.float32)[int(cu[ns]) :]
    assert np.all(pad == 0.0), "padding rows must be zeros"
    return np.asarray(out, np.float32)


# Lengths 0, 1, C-1, C, C+1 and longer, decode rows and multi-page prefills in one batch.
KV_LENS = (0, 1, 7, 8, 9, 29)
Q_LENS = (0, 1, 3, 8, 1, 12)


def test_decode_only():
    rng = np.random.default_rng(20)
    case = make_ragged_case(rng, (1, 7, 8, 9, 30), (1,) * 5, head_dim=64)
    _check(case, block_q=1, pages_per_compute_block=2)


@pytest.mark.parametrize("block_q,ppcb,tb", [(8, 3, 1), (3, 1, 3), (5, 2, 16)])
def test_mixed_batch(block_q, ppcb, tb):
    rng = np.random.default_rng(21 + block_q)
    case = make_ragged_case(rng, KV_LENS, Q_LENS, head_dim=64)
    out = _check(case, block_q=block_q, pages_per_compute_block=ppcb, tiles_per_program=tb)
    assert_close(out, dense_ragged_attention(case), jnp.float32)


# Two cases left out of ``make test`` (``make test-all`` runs them): non-causal without a
# window (non-causal: opts3, with a window of 5) and a window of 6 (windows: opts1's one key,
# opts3, test_shapes_and_dtypes' C+3, test_pages_outside_every_rows_window_are_never_fetched).
@pytest.mark.parametrize(
    "opts",
    [
        pytest.param({"causal": False}, marks=pytest.mark.slow),
        {"sliding_window": 1},
        pytest.param({"sliding_window": 6}, marks=pytest.mark.slow),
        {"sliding_window": 5, "causal": False},
        {"logits_soft_cap": 3.0, "sm_scale": 0.9},
    ],
)
def test_options(opts):
    rng = np.random.default_rng(22)
    case = make_ragged_case(rng, KV_LENS, Q_LENS, head_dim=64)
    out = _check(case, block_q=4, pages_per_compute_block=2, **opts)
    kw = {k: v for k, v in opts.items() if k != "sm_scale"}
    scale = opts.get("sm_scale")
    assert_close(out, dense_ragged_attention(case, sm_scale=scale, **kw), jnp.float32)


@pytest.mark.parametrize(
    "C,K,G,H,dtype",
    [(16, 1, 4, 128, jnp.bfloat16), (16, 2, 1, 64, jnp.bfloat16), (4, 1, 3, 64, jnp.float32)],
)
def test_shapes_and_dtypes(C, K, G, H, dtype):
    rng = np.random.default_rng(C + G)
    kv_lens = (C - 1, 0, 2 * C + 1, C)
    q_lens = (2, 0, C + 1, 1)
    case = make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=K * G, num_kv_heads=K, head_dim=H, page_size=C,
        dtype=dtype,
    )  # fmt: skip
    _check(case, dtype, sliding_window=C + 3, pages_per_compute_block=2)


def test_pages_outside_every_rows_window_are_never_fetched():
    # Entries of pages before the window of a sequence's first query row hold out-of-range
    # ids; an out-of-bounds DMA raises in the interpreter, so passing means they were skipped.
    rng = np.random.default_rng(29)
    C, window = 8, 6
    case = make_ragged_case(rng, (40, 9, 30), (3, 9, 1), head_dim=64)
    q, k, v, tables, kv_lens, cu, ns = case.args
    P = k.shape[-3]
    poisoned = tables.copy()
    for b in range(int(ns)):
        pos0 = int(kv_lens[b]) - int(cu[b + 1] - cu[b])
        poisoned[b, : max(0, pos0 - window + 1) // C] = P + 5
    out = kernel_tpu.ragged_paged_attention_pallas_tpu(
        q, k, v, poisoned, kv_lens, cu, ns, sm_scale=0.125, sliding_window=window,
        interpret=True, block_q=2, pages_per_compute_block=1,
    )  # fmt: skip
    ref = _ref(*case.args, sm_scale=0.125, sliding_window=window)
    assert_close(out, ref, jnp.float32)


def test_layered_pool_with_traced_layer():
    rng = np.random.default_rng(23)
    case = make_ragged_case(rng, (9, 20), (4, 6), head_dim=64, num_layers=3, extra_seqs=0)

    @jax.jit
    def run(*args):
        return kernel_tpu.ragged_paged_attention_pallas_tpu(
            *args[:7], sm_scale=0.125, layer=args[7], interpret=True, block_q=4,
            pages_per_compute_block=2,
        )  # fmt: skip

    for layer in (2, 0):
        out = run(*case.args, jnp.int32(layer))
        ref = _ref(*case.args, layer=layer, sm_scale=0.125)
        assert_close(out, ref, jnp.float32, err_msg=f"{layer=}")


def _record_core(cores: set[int]):
    """A ``grid_point_recorder`` that collects the simulated cores that ran grid points."""

    def record(token, grid_point, core):
        del grid_point
        cores.add(int(core))
        return token

    return record


def test_no_races_two_cores_random_order(capfd):
    rng = np.random.default_rng(24)
    case = make_ragged_case(rng, (9, 0, 20), (9, 0, 5), head_dim=64)
    cores = set()
    params = pltpu.InterpretParams(
        detect_races=True, num_cores_or_threads=2, random_seed=5,
        grid_point_recorder=_record_core(cores),
    )  # fmt: skip
    _check(
        case, interpret=params, block_q=4, pages_per_compute_block=2, tiles_per_program=2,
        sliding_window=7,
    )  # fmt: skip
    assert "RACE DETECTED" not in capfd.readouterr().out
    assert cores == {0, 1}, "both simulated TensorCores must have run grid points"


def test_num_seqs_zero_gives_zeros():
    rng = np.random.default_rng(25)
    case = make_ragged_case(rng, (5, 9), (2, 3), head_dim=64)
    args = (*case.args[:6], np.asarray([0], np.int32))
    out = kernel_tpu.ragged_paged_attention_pallas_tpu(
        *args, sm_scale=0.125, interpret=True, block_q=4, pages_per_compute_block=2
    )
    assert np.all(np.asarray(out) == 0.0)


def test_bad_block_size_raises():
    rng = np.random.default_rng(26)
    case = make_ragged_case(rng, (5,), (2,), head_dim=64)
    for knob in ("block_q", "pages_per_compute_block", "tiles_per_program"):
        with pytest.raises(ValueError, match=knob):
            kernel_tpu.ragged_paged_attention_pallas_tpu(
                *case.args, sm_scale=1.0, interpret=True, **{knob: 0}
            )


@pytest.mark.parametrize(
    "dtype,C,H,match",
    [
        (jnp.float16, 16, 128, "float32 or bfloat16"),
        (jnp.float32, 8, 80, "multiple of 64"),
        (jnp.bfloat16, 8, 128, "multiple of 16"),
        (jnp.bfloat16, 16, 128, "exceed SMEM"),
    ],
)
def test_unsupported_reason(dtype, C, H, match):
    S = jax.ShapeDtypeStruct
    B, W = (2, 3) if match != "exceed SMEM" else (512, 1024)
    q, kv = S((10, 4, H), dtype), S((2, 5, C, H), dtype)
    i32 = jnp.int32
    reason = kernel_tpu.unsupported_reason(
        q, kv, kv, S((B, W), i32), S((B,), i32), S((B + 1,), i32), S((), i32), sm_scale=1.0
    )
    assert reason is not None and match in reason
    if match == "exceed SMEM":  # the same call with a small table is supported
        small = (S((2, 3), i32), S((2,), i32), S((3,), i32), S((), i32))
        assert kernel_tpu.unsupported_reason(q, kv, kv, *small, sm_scale=1.0) is None


@pytest.mark.parametrize(
    "dtype,C,G,H,causal,window",
    [(jnp.float32, 8, 2, 64, True, None), (jnp.bfloat16, 16, 4, 128, False, 50)],
)
def test_lowers_for_tpu(dtype, C, G, H, causal, window):
    # Cross-lowers to a Mosaic TPU custom call on the CPU (no TPU needed).
    S = jax.ShapeDtypeStruct
    T, B, K, P, W, L = 64, 4, 2, 40, 8, 2
    i32 = jnp.int32
    shapes = (
        S((T, K * G, H), dtype), S((L, K, P, C, H), dtype), S((L, K, P, C, H), dtype),
        S((B, W), i32), S((B,), i32), S((B + 1,), i32), S((), i32), S((), i32),
    )  # fmt: skip

    def f(*a):
        return kernel_tpu.ragged_paged_attention_pallas_tpu(
            *a[:7], sm_scale=0.1, causal=causal, sliding_window=window, layer=a[7],
            logits_soft_cap=5.0, block_q=16, pages_per_compute_block=4,
        )  # fmt: skip

    text = jax.jit(f).trace(*shapes).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def test_auto_dispatch_picks_tpu_kernel_on_a_tpu_backend(monkeypatch):
    from jpaged import _attention
    from pallas_kernels import _backend
    from pallas_kernels.ragged_paged_attention import dispatch

    monkeypatch.setattr(_backend, "default_platform", lambda: "tpu")
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    kw = dict(sm_scale=0.1, causal=True, logits_soft_cap=None, sliding_window=None, layer=None)
    for H, expected in ((128, "pallas_tpu"), (96, "xla")):  # H = 96 is not supported
        kv = S((2, 9, 16, H), jnp.bfloat16)
        args = (S((10, 4, H), jnp.bfloat16), kv, kv, S((2, 3), i32), S((2,), i32))
        args = (*args, S((3,), i32), S((), i32))
        assert (
            _attention._resolve("ragged_paged_attention", dispatch, None, None, args, kw)
            == expected
        )


def test_tuning_heuristic():
    for gen in (*GENERATIONS.values(), tuning_tpu.INTERPRET):
        for G, T in ((1, 1), (4, 1000), (8, 5), (3, 64)):
            knobs = tuning_tpu.ragged_block_sizes(
                page_size=16, head_dim=128, itemsize=2, width=32, group=G, num_tokens=T, gen=gen
            )
            assert 1 <= knobs["block_q"] <= min(T, 32)
            assert knobs["tiles_per_program"] >= 1
            assert 1 <= knobs["pages_per_compute_block"] <= 32
    assert tuning_tpu.ragged_block_sizes(
        page_size=8, head_dim=64, itemsize=4, width=4, group=2, num_tokens=100,
        gen=tuning_tpu.INTERPRET,
    )["block_q"] == 4  # fmt: skip


def test_doctests():
    result = doctest.testmod(kernel_tpu, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.tpu
class TestCompiledOnTpu:
    """The same cases compiled by Mosaic TPU (run with ``pytest -m tpu`` on a TPU)."""

    @pytest.mark.parametrize("block_q,ppcb,tb", [(8, 3, 1), (3, 1, 3), (None, None, None)])
    def test_mixed_batch(self, block_q, ppcb, tb):
        rng = np.random.default_rng(21)
        case = make_ragged_case(rng, KV_LENS, Q_LENS, head_dim=128)
        _check(
            case, interpret=False, block_q=block_q, pages_per_compute_block=ppcb,
            tiles_per_program=tb,
        )  # fmt: skip

    @pytest.mark.parametrize(
        "opts", [{"causal": False}, {"sliding_window": 6}, {"logits_soft_cap": 3.0}]
    )
    def test_options(self, opts):
        rng = np.random.default_rng(22)
        case = make_ragged_case(rng, KV_LENS, Q_LENS, head_dim=128)
        _check(case, interpret=False, **opts)

    def test_bf16_long_prefill_layer(self):
        rng = np.random.default_rng(27)
        case = make_ragged_case(
            rng, (1000, 1, 333, 17), (700, 1, 33, 17), num_q_heads=8, num_kv_heads=2,
            head_dim=128, page_size=16, dtype=jnp.bfloat16, num_layers=2,
        )  # fmt: skip
        _check(case, jnp.bfloat16, interpret=False, layer=1, sliding_window=256)

    def test_auto_dispatch_picks_tpu_kernel(self):
        rng = np.random.default_rng(28)
        case = make_ragged_case(rng, KV_LENS, Q_LENS, head_dim=128, page_size=16)
        auto = jpaged.ragged_paged_attention(*case.args)
        explicit = jpaged.ragged_paged_attention(*case.args, implementation="pallas_tpu")
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(explicit))
