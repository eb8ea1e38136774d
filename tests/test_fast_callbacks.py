"""``_fast_callbacks``: the interpreters' callback operands, put on the CPU device faster, are
the arrays ``jax.device_put`` gives, and interpreted kernels give the original's outputs."""

from __future__ import annotations

import _fast_callbacks
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _ragged_inputs import make_ragged_case
from jax._src import api, callback
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention import kernel_gpu
from pallas_kernels.ragged_paged_attention import kernel_tpu

pytestmark = pytest.mark.skipif(
    callback.io_callback_impl is not _fast_callbacks.fast_io_callback_impl,
    reason="_fast_callbacks is for jax 0.11.2 (not installed with this jax)",
)


def _aligned(n: int, dtype) -> np.ndarray:
    """n elements of ``dtype`` starting on a 64-byte boundary (the CPU client may alias)."""
    itemsize = np.dtype(dtype).itemsize
    buf = np.zeros(n * itemsize + 128, np.uint8)
    start = -buf.ctypes.data % 64
    return buf[start : start + n * itemsize].view(dtype)


def _operands() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = [np.asarray(True), np.asarray(-7, np.int32), np.asarray(3, np.uint32)]
    for dtype in (np.int8, np.uint8, np.int16, np.int32, np.uint32, np.float16, np.float32,
                  ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.bool_):  # fmt: skip
        out.append(rng.standard_normal((3, 5)).astype(dtype))
        aligned = _aligned(64 * 8, dtype).reshape(64, 8)
        aligned[...] = rng.standard_normal((64, 8)).astype(dtype)
        out.append(aligned)
    out.append(np.zeros((0, 4), np.float32))
    assert all(type(x) is np.ndarray for x in out)  # each takes the fast transfer
    return out


def _same(a: jax.Array, b: jax.Array) -> None:
    assert type(a) is type(b) and a.aval == b.aval and a.weak_type == b.weak_type
    assert a.sharding == b.sharding and a.committed == b.committed
    x, y = np.asarray(a), np.asarray(b)
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def test_operands_are_the_arrays_device_put_gives(monkeypatch):
    cpu = jax.local_devices(backend="cpu")[0]
    operands = _operands()
    monkeypatch.setattr(api, "device_put", None)  # the fast transfer only
    fast = _fast_callbacks.put_on_cpu(tuple(operands), cpu)
    monkeypatch.undo()
    slow = jax.device_put(tuple(operands), cpu)
    assert len(fast) == len(slow) == len(operands)
    for a, b in zip(fast, slow, strict=True):
        _same(a, b)
    # Each aliases its host buffer exactly when device_put's does: write every operand, then
    # compare again.
    for x in operands:
        if x.size:
            x.reshape(-1)[0] = x.reshape(-1)[-1] if x.size > 1 else np.zeros((), x.dtype)
    for a, b in zip(fast, slow, strict=True):
        _same(a, b)
    # Anything else (a JAX array, a 64-bit operand JAX canonicalizes) goes through device_put.
    mixed = (np.ones(3, np.float32), jnp.ones(2), np.arange(4, dtype=np.int64))
    for a, b in zip(_fast_callbacks.put_on_cpu(mixed, cpu), jax.device_put(mixed, cpu),
                    strict=True):  # fmt: skip
        _same(a, b)


def _decode_gpu(capfd):
    rng = np.random.default_rng(3)
    K, G, H, C, P = 2, 2, 64, 16, 12
    q = jnp.asarray(rng.standard_normal((3, K * G, H)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((K, P, C, H)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((K, P, C, H)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(P)[:9].reshape(3, 3), jnp.int32)
    lengths = jnp.asarray([0, 17, 40], jnp.int32)
    out = kernel_gpu.paged_attention_pallas_gpu(
        q, k, v, tables, lengths, sm_scale=0.125, num_splits=2, block_kv=64,
        interpret=plgpu.InterpretGPUParams(detect_races=True),
    )  # fmt: skip
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return np.asarray(out, np.float32), gpu_callbacks.get_races().races_found


def _ragged_tpu(capfd):
    case = make_ragged_case(np.random.default_rng(4), (1, 9, 20), (1, 4, 9), head_dim=64)
    out = kernel_tpu.ragged_paged_attention_pallas_tpu(
        *case.args, sm_scale=0.125, interpret=pltpu.InterpretParams(detect_races=True),
        block_q=4, pages_per_compute_block=2,
    )  # fmt: skip
    out = np.asarray(out, np.float32)
    return out, "RACE DETECTED" in capfd.readouterr().out


@pytest.mark.parametrize("run", [_decode_gpu, _ragged_tpu], ids=["decode-gpu", "ragged-tpu"])
def test_interpreted_kernels_give_the_originals_outputs(run, monkeypatch, capfd):
    calls = []

    def counted(args, cpu_device):
        calls.append(len(args))
        return put_on_cpu(args, cpu_device)

    put_on_cpu = _fast_callbacks.put_on_cpu
    monkeypatch.setattr(_fast_callbacks, "put_on_cpu", counted)
    fast, fast_races = run(capfd)
    assert len(calls) > 100  # the interpreter's callbacks took the fast transfer
    monkeypatch.setattr(callback, "io_callback_impl", _fast_callbacks.original_io_callback_impl())
    fast_calls = len(calls)
    slow, slow_races = run(capfd)
    assert len(calls) == fast_calls  # the original's own transfer, this time
    assert fast.tobytes() == slow.tobytes() and not fast_races and not slow_races
