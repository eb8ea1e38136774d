"""Runs each decode implementation once inside a CUDA profiler range, for Nsight Compute.

Compilation, autotuning and warm-up happen before ``cuProfilerStart``; run under
``ncu --profile-from-start off`` so only the measured kernels are profiled:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        -o decode python benchmarks/diagnostics/profile_decode_ncu.py --only 6 --variants block_kv=128

Per case (``decode_attention.QUICK`` indices): the HBM roofline reduction once, jpaged's
kernel with its defaults, each ``--variants`` set, and cuDNN non-paged on the same lengths.
It prints the launch order (case, implementation), which is the order of the kernels in the
report, and each output's max abs difference from the default kernel's (so a variant that
computes garbage is noticed).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import decode_attention as da
from _cuda_profiler import profiler


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", type=int, nargs="+", default=[6], help="QUICK case indices")
    p.add_argument("--variants", nargs="*", default=[], help='e.g. "block_kv=128"')
    p.add_argument("--skip-cudnn", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)

    x = jax.random.normal(jax.random.key(0), (1 << 19, 4096), jnp.bfloat16)  # 4 GiB
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    runs = [("roofline jnp.sum 4 GiB", total, (x,))]
    for _, case, inp in da.table_inputs(da.QUICK, ns.only, ns.seed, width_multiple=64):
        live = da.live_bytes(case, inp.lengths_np)
        print(f"{case.label}: live K/V {live / 1e9:.3f} GB (compare ncu's dram__bytes_read)")
        runs.append((f"{case.label} pallas_gpu", *da._ours(inp, case)))
        for spec in ns.variants:
            kw = da._parse_kwargs(spec)
            runs.append((f"{case.label} pallas_gpu_{spec}", *da._ours(inp, case, **kw)))
        if not ns.skip_cudnn:
            kd, vd = da._dense_kv(inp, case)
            runs.append((f"{case.label} cudnn", *da._cudnn(inp, case, kd, vd)))

    ref = {}
    for name, f, args in runs:  # compile, autotune, warm up: outside the profiled range
        for _ in range(3):
            out = jax.block_until_ready(f(*args))
        case = name.rsplit(" ", 1)[0]
        if name.endswith(" pallas_gpu"):
            ref[case] = np.asarray(out.astype(jnp.float32))
        elif case in ref:
            err = float(np.max(np.abs(np.asarray(out.astype(jnp.float32)) - ref[case])))
            print(f"{name}: max abs diff vs the default kernel {err:.2e}")
    profiler(True)
    for k, (name, f, args) in enumerate(runs):
        print(f"launch group {k}: {name}", flush=True)
        jax.block_until_ready(f(*args))
    profiler(False)


if __name__ == "__main__":
    main()
