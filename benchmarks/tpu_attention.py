"""Decode and prefill attention on a TPU: the Mosaic TPU kernels beside the XLA path.

On a TPU VM (from the repository root)::

    python benchmarks/tpu_attention.py                 # decode sweep + prefill rows, JSON to benchmarks/results/
    python benchmarks/tpu_attention.py --quick

Decode reports effective bandwidth (live K/V bytes / time) and its share of the HBM read roofline
measured in the same process (``jnp.sum`` over 1 GiB); prefill reports TFLOP/s (causal count).
Inputs are random (never zeros) with randomly permuted page tables. Timing: ``--calls``
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


def decode_row(rng, impl, *, B, ctx, N, K, H, C, dtype, interpret, calls, rounds):
    lengths = rng.integers(max(1, ctx // 2), ctx * 3 // 2 + 1, B).astype(np.int32)
    k, v, table = _pool(rng, lengths, K, C, H, dtype)
    q = jnp.asarray(rng.standard_normal((B, N, H), np.float32), dtype)
    fn = jax.jit(
        lambda q, k, v, t, n: jpaged.paged_attention(
            q, k, v, t, n, implementation=impl, interpret=interpret or None
        )
    )
    us = wall_us(fn, q, k, v, table, jnp.asarray(lengths), calls=calls, rounds=rounds)
    live = int(lengths.sum()) * K * H * jnp.dtype(dtype).itemsize * 2
    return {"us": us, "tbs": live / (us * 1e-6) / 1e12}


def prefill_row(rng, impl, *, B, T, N, K, H, C, dtype, interpret, calls, rounds):
    lengths = np.full(B, T, np.int32)
    k, v, table = _pool(rng, lengths, K, C, H, dtype)
    q = jnp.asarray(rng.standard_normal((B * T, N, H), np.float32), dtype)
    cu = jnp.asarray(np.arange(B + 1, dtype=np.int32) * T)
    fn = jax.jit(
        lambda q, k, v, t, n, cu, s: jpaged.ragged_paged_attention(
            q, k, v, t, n, cu, s, implementation=impl, interpret=interpret or None
        )
    )
    args = (q, k, v, table, jnp.asarray(lengths), cu, jnp.asarray(B, jnp.int32))
    us = wall_us(fn, *args, calls=calls, rounds=rounds)
    flops = 4 * B * N * H * T * T / 2
    return {"us": us, "tflops": flops / (us * 1e-6) / 1e12}


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
    for case in decode:
        row = {"kind": "decode", **case}
        for impl in ("pallas_tpu", "xla"):
            r = decode_row(rng, impl, **case, dtype=dtype, interpret=interpret and impl != "xla",
                           calls=calls, rounds=rounds)  # fmt: skip
            row[impl] = r
        rows.append(row)
        print(f"decode {case}: pallas_tpu {row['pallas_tpu']['tbs']:.2f} TB/s "
              f"({row['pallas_tpu']['tbs'] / roofline:.0%} of roofline), xla {row['xla']['tbs']:.2f} TB/s")  # fmt: skip
    for case in prefill:
        row = {"kind": "prefill", **case}
        for impl in ("pallas_tpu", "xla"):
            row[impl] = prefill_row(rng, impl, **case, dtype=dtype,
                                    interpret=interpret and impl != "xla", calls=calls,
                                    rounds=rounds)  # fmt: skip
        rows.append(row)
        print(f"prefill {case}: pallas_tpu {row['pallas_tpu']['tflops']:.1f} TFLOP/s, "
              f"xla {row['xla']['tflops']:.1f} TFLOP/s")  # fmt: skip
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
