"""Shared timing helpers for the benchmarks (GPU first; they also run, slowly, on CPU).

- ``wall_us``: many back-to-back calls, one sync, median over rounds (what a serving loop sees,
  launch gaps and epilogue kernels included).
- ``loop_us``: chained calls in one jitted program (unrolled), one dispatch per round. Per-call
  host dispatch is gone, but NOT a device-only time: each program's own overhead (launch,
  XLA command-buffer set-up, the final sync) is spread over its calls, and on the H200 it
  exceeded ``wall_us`` in 6 of 9 quick rows. For comparisons within one
  implementation; the device timeline is ``diagnostics/profile_launch_gaps.py``.
- ``cupti_us``: kernel-only device time through ``jax.experimental.mosaic.gpu.profiler``
  (CUPTI), median over iterations; None where CUPTI is unavailable.
- ``read_roofline_tbs``: HBM read bandwidth of a large reduction measured in the same process,
  the ceiling every memory-bound figure is compared with.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _block(x):
    return jax.block_until_ready(x)


def wall_us(fn: Callable, *args, calls: int = 50, rounds: int = 5, warmup: int = 2) -> float:
    """Median over ``rounds`` of (time for ``calls`` back-to-back calls, one sync) / calls, in us.

    ``fn`` should be jitted; its first call (compile) is excluded by the warm-up.
    """
    for _ in range(warmup):
        _block(fn(*args))
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        _block(out)
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_call)


def chained(fn: Callable, iterations: int) -> Callable:
    """One jitted program of ``iterations`` calls of ``fn`` in a row (unrolled), each call's
    output (reshaped and cast to the first argument's shape and dtype) the next call's first
    argument, so no call can be hoisted or skipped and the data are never constant.

    Unrolled, not a ``fori_loop``, so no loop trip adds its own cost (on the H200, JAX 0.11.2,
    a ``fori_loop`` trip measured 10-22 us over the kernels' CUPTI time); the program's fixed
    overhead remains (``loop_us``).
    Values computed from the other arguments alone (the decode kernel's longest-first order
    from ``lengths``) are computed once for all calls, as XLA does for the layers of a step.
    """

    def run(x, *rest):
        for _ in range(iterations):
            x = fn(x, *rest).reshape(x.shape).astype(x.dtype)
        return x

    return jax.jit(run)


def loop_us(fn: Callable, *args, iterations: int = 50, rounds: int = 5) -> float:
    """Per-call time in us of ``chained(fn, iterations)``, median over ``rounds`` (one dispatch
    and one sync per round); includes the program's fixed overhead / ``iterations``."""
    return wall_us(chained(fn, iterations), *args, calls=1, rounds=rounds, warmup=1) / iterations


def cupti_us(fn: Callable, *args, iterations: int = 20) -> float | None:
    """Median kernel-only time in us over ``iterations`` (sum of the kernels of one call).

    Returns None where CUPTI cannot run (no GPU, or another CUPTI subscriber is attached).
    """
    if jax.default_backend() != "gpu":
        return None
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, times_ms = profiler.measure(fn, iterations=iterations)(*args)
    except Exception as e:  # CUPTI unavailable: report, do not fail the benchmark
        print(f"cupti unavailable: {type(e).__name__}: {e}")
        return None
    if times_ms is None:
        return None
    if not isinstance(times_ms, list):
        times_ms = [times_ms]
    return statistics.median(times_ms) * 1e3


def cupti_kernels_us(fn: Callable, *args) -> list[tuple[str, float]] | None:
    """Each kernel of one call with its CUPTI time in us (name, us), launch order; None where
    CUPTI cannot run. Shows what the XLA ops around a Pallas kernel cost."""
    if jax.default_backend() != "gpu":
        return None
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, timings = profiler.measure(fn, aggregate=False)(*args)
    except Exception as e:
        print(f"cupti unavailable: {type(e).__name__}: {e}")
        return None
    return [(str(name), float(ms) * 1e3) for name, ms in (timings or [])]


def kernel_costs(fn: Callable, *args) -> dict:
    """``wall_us`` of back-to-back calls, each kernel of one call (``kernels_us``, CUPTI) and
    their sum (``cupti_us``; None without CUPTI): what a small XLA epilogue or prologue costs."""
    kernels = cupti_kernels_us(fn, *args)
    return {
        "wall_us": wall_us(fn, *args),
        "kernels_us": kernels,
        "cupti_us": sum(us for _, us in kernels) if kernels else None,
    }


def write_rows(path: str | None, rows: list) -> None:
    """Writes ``{"device", "jax", "rows"}`` JSON to ``path`` (nothing when None)."""
    if path:
        with open(path, "w") as fh:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, fh)


def read_roofline_tbs(num_bytes: int = 4 << 30, dtype=jnp.bfloat16) -> tuple[float, float]:
    """HBM read bandwidth of ``jnp.sum`` over ``num_bytes`` of random data.

    Returns:
      (TB/s from wall-clock, TB/s from CUPTI or NaN).
    """
    n = num_bytes // jnp.dtype(dtype).itemsize
    x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), dtype)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    wall = wall_us(f, x, calls=20, rounds=5)
    kern = cupti_us(f, x)
    del x
    wall_tbs = num_bytes / (wall * 1e-6) / 1e12
    return wall_tbs, (num_bytes / (kern * 1e-6) / 1e12 if kern else float("nan"))


def read_roofline_loop_tbs(
    num_bytes: int = 4 << 30, dtype=jnp.bfloat16, iterations: int = 10, rounds: int = 5
) -> float:
    """HBM read bandwidth of ``iterations`` chained ``jnp.sum`` reductions in one jitted program
    (unrolled, as ``chained``; the roofline for ``loop_us`` figures). Each reduction reads
    ``x * (1 + 0 * acc)``: the running sum makes every read depend on the last (nothing is
    hoisted or merged) and the scale fuses into the reduction, so each byte is read once."""
    n = num_bytes // jnp.dtype(dtype).itemsize
    x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), dtype)

    def run(a):
        acc = jnp.float32(0.0)
        for _ in range(iterations):
            acc = acc + jnp.sum(a * (1.0 + 0.0 * acc).astype(dtype), dtype=jnp.float32)
        return acc

    f = jax.jit(run)
    us = wall_us(f, x, calls=1, rounds=rounds, warmup=1) / iterations
    del x
    return num_bytes / (us * 1e-6) / 1e12
