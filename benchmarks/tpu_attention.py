"""Decode and prefill attention on a TPU: the Mosaic TPU kernels beside the XLA path.

On a TPU VM (from the repository root)::

    python benchmarks/tpu_attention.py                 # decode sweep + prefill rows, JSON to benchmarks/results/
    python benchmarks/tpu_attention.py --quick

Decode reports effective bandwidth (live K/V bytes / time) and its share of the HBM read roofline
measured in the same process (``jnp.sum`` over 1 GiB); prefill reports TFLOP/s (causal count).
Inputs are random (never zeros) with randomly permuted page tables; both implementations run on
the same inputs, and each row records the Pallas output's largest difference from XLA's. Timing: ``--calls``
back-to-back calls, one sync, median of ``--rounds`` (``benchmarks/_timing.wall_us``).

``--smoke`` runs two tiny cases with the kernels in the TPU interpreter, on any machine (CI runs it
so this script cannot rot); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _timing import read_roofline_tbs, wall_us

import jpaged

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
IMPLS = ("pallas_tpu", "xla")


def _pool(rng, lengths, K, C, H, dtype):
    """A random pool [K, P, C, H] holding ``lengths`` in randomly permuted pages."""
    pages = [-(-int(n) // C) for n in lengths]
    W = max(max(pages), 1)
    P = sum(pages) + 1
    perm = rng.permutation(P).astype(np.int32)
    table = np.zeros((len(lengths), W), np.int32)
    cur = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[cur : cur + n]
        cur += n
    k = jnp.asarray(rng.standard_normal((K, P, C, H), np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((K, P, C, H), np.float32), dtype)
    return k, v, jnp.asarray(table)


def decode_inputs(rng, *, B, ctx, N, K, H, C, dtype):
    """One decode batch: lengths uniform in [ctx/2, 3 ctx/2], q [B, N, H], a random pool.

    Returns the call's arguments (q, k, v, table, lengths) and the live K/V bytes.
    """
    lengths = rng.integers(max(1, ctx // 2), ctx * 3 // 2 + 1, B).astype(np.int32)
    k, v, table = _pool(rng, lengths, K, C, H, dtype)
    q = jnp.asarray(rng.standard_normal((B, N, H), np.float32), dtype)
    live = int(lengths.sum()) * K * H * jnp.dtype(dtype).itemsize * 2
    return (q, k, v, table, jnp.asarray(lengths)), live


def prefill_inputs(rng, *, B, T, N, K, H, C, dtype):
    """B causal prompts of T tokens: q [B*T, N, H] over a random pool, with the causal FLOPs.

    Returns the call's arguments (q, k, v, table, lengths, cu_q_lens, num_seqs) and
    ``4 * B * N * H * T^2 / 2``.
    """
    lengths = np.full(B, T, np.int32)
    k, v, table = _pool(rng, lengths, K, C, H, dtype)
    q = jnp.asarray(rng.standard_normal((B * T, N, H), np.float32), dtype)
    cu = jnp.asarray(np.arange(B + 1, dtype=np.int32) * T)
    args = (q, k, v, table, jnp.asarray(lengths), cu, jnp.asarray(B, jnp.int32))
    return args, 4 * B * N * H * T * T / 2


def measure(op, args, impls, *, interpret, calls, rounds) -> tuple[dict, dict]:
    """Times ``op`` (``jpaged.paged_attention`` or ``ragged_paged_attention``) per
    implementation on the same ``args``; returns ``{impl: us}`` and ``{impl: output}``."""
    times, outputs = {}, {}
    for impl in impls:
        fn = jax.jit(
            lambda *a, impl=impl: op(
                *a, implementation=impl, interpret=(interpret and impl != "xla") or None
            )
        )
        outputs[impl] = np.asarray(fn(*args), np.float32)
        times[impl] = wall_us(fn, *args, calls=calls, rounds=rounds)
    return times, outputs


def _row(kind, case, times, outputs, *, per_us, unit) -> dict:
    """A table row: per implementation its time and ``per_us / us`` in ``unit`` (TB/s of live
    bytes or TFLOP/s), and the Pallas output's largest difference from the XLA path's."""
    row = {"kind": kind, **case}
    for impl, us in times.items():
        row[impl] = {"us": us, unit: per_us / (us * 1e-6) / 1e12}
    row["max_abs_diff_vs_xla"] = float(np.max(np.abs(outputs["pallas_tpu"] - outputs["xla"])))
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny cases in the TPU interpreter")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16
    if args.smoke:
        interpret, calls, rounds = True, 1, 1
        decode = [dict(B=2, ctx=40, N=4, K=2, H=128, C=16)]
        prefill = [dict(B=1, T=32, N=4, K=2, H=128, C=16)]
        roofline = float("nan")
    else:
        if jax.default_backend() != "tpu":
            ap.error("needs a TPU backend (use --smoke for an interpreter run on any machine)")
        interpret, calls, rounds = False, args.calls, args.rounds
        decode = [
            dict(B=B, ctx=ctx, N=32, K=8, H=128, C=C)
            for B, ctx in ((8, 32768), (32, 2048), (128, 2048), (256, 1024))
            for C in ((16,) if args.quick else (16, 64))
        ]
        prefill = [dict(B=max(1, 16384 // T), T=T, N=32, K=8, H=128, C=64) for T in (1024, 4096)]
        roofline = read_roofline_tbs(1 << 30)[0]
    rows = []
    timing = dict(interpret=interpret, calls=calls, rounds=rounds)
    for case in decode:
        call_args, live = decode_inputs(rng, **case, dtype=dtype)
        times, outs = measure(jpaged.paged_attention, call_args, IMPLS, **timing)
        row = _row("decode", case, times, outs, per_us=live, unit="tbs")
        row["live_bytes"] = live
        rows.append(row)
        print(f"decode {case}: pallas_tpu {row['pallas_tpu']['tbs']:.2f} TB/s "
              f"({row['pallas_tpu']['tbs'] / roofline:.0%} of roofline), xla {row['xla']['tbs']:.2f} TB/s, "
              f"max |pallas - xla| {row['max_abs_diff_vs_xla']:.2e}")  # fmt: skip
    for case in prefill:
        call_args, flops = prefill_inputs(rng, **case, dtype=dtype)
        times, outs = measure(jpaged.ragged_paged_attention, call_args, IMPLS, **timing)
        row = _row("prefill", case, times, outs, per_us=flops, unit="tflops")
        row["flops"] = flops
        rows.append(row)
        print(f"prefill {case}: pallas_tpu {row['pallas_tpu']['tflops']:.1f} TFLOP/s, "
              f"xla {row['xla']['tflops']:.1f} TFLOP/s, "
              f"max |pallas - xla| {row['max_abs_diff_vs_xla']:.2e}")  # fmt: skip
    result = {
        "env": {
            "device": str(jax.devices()[0].device_kind),
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "smoke": args.smoke,
        },
        "roofline_tbs": roofline,
        "rows": rows,
    }
    out = args.out or (None if args.smoke else RESULTS / "tpu_attention.json")
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
