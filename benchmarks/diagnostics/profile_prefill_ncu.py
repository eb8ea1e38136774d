"""Runs the ragged (prefill) kernel once per tuning inside a CUDA profiler range, for Nsight
Compute.

Compilation and warm-up happen before ``cuProfilerStart``; run under
``ncu --profile-from-start off`` so only the measured calls are profiled:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        -o prefill python benchmarks/diagnostics/profile_prefill_ncu.py --length 4096 \\
        --variants "persistent=false,block_kv=128" "persistent=true,block_kv=128,num_stages=2"

One batch of ``32k / T`` causal prompts of ``T`` tokens (``prefill_attention.py``'s shapes:
N=32 / K=8, H=128, bf16, C=16, permuted pages). Each call also runs the small XLA ops of the
schedule; the report's Mosaic GPU kernels are the ``ragged_paged_mgpu_*`` entries, one per
tuning in the printed launch order. Each output's max abs difference from the first
tuning's is printed (a tuning that computes garbage is noticed). ``--with-fa3`` adds JAX's
dense FA3 example kernel on the same data (``prefill_attention.py``'s anchor, f16 inputs).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import prefill_attention as pa
from _cuda_profiler import profiler


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=4096, help="T, tokens a prompt")
    p.add_argument("--batch-tokens", type=int, default=32768, help="B = batch_tokens // T")
    p.add_argument("--variants", nargs="+", default=["persistent=false", "persistent=true"],
                   help='tunings, e.g. "persistent=true,block_kv=128,num_stages=2"')  # fmt: skip
    p.add_argument("--with-fa3", action="store_true",
                   help="also JAX's dense FA3 example kernel on the same data (f16)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)

    T = ns.length
    B = max(1, ns.batch_tokens // T)
    inp = pa._paged(np.random.default_rng(ns.seed), [T] * B, [T] * B)
    runs = [(spec, pa._ragged_fn("pallas_gpu", pa._parse_variant(spec))) for spec in ns.variants]
    if ns.with_fa3:  # the anchor of prefill_attention.py, same tuning and inputs
        from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3

        cfg = fa3.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        q4, kd, vd = pa._dense_from_paged(inp, B, T)
        dense = tuple(x.astype(jnp.float16) for x in (q4 / math.sqrt(pa.H), kd, vd))
        fa3_fn = jax.jit(lambda q, k, v: fa3.attention(q, k, v, cfg))
        runs.append(("jax_fa3_example", lambda *_: fa3_fn(*dense)))
    first = None
    for spec, fn in runs:  # compile and warm up outside the profiled range
        for _ in range(3):
            out = jax.block_until_ready(fn(*inp))
        out = np.asarray(out, np.float32).reshape(B * T, pa.N, pa.H)
        if first is None:
            first = out
        else:
            print(f"{spec}: max abs diff vs {ns.variants[0]} {np.max(np.abs(out - first)):.2e}")
    profiler(True)
    for k, (spec, fn) in enumerate(runs):
        print(f"launch group {k}: T={T} B={B} {spec}", flush=True)
        jax.block_until_ready(fn(*inp))
    profiler(False)


if __name__ == "__main__":
    main()
