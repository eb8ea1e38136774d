"""Where the time between kernels goes: decode calls dispatched back to back vs chained in one
jitted program, for Nsight Systems.

``wall_us`` (back-to-back dispatches) and ``loop_us`` (one program of chained calls) exceed the
kernels' CUPTI sum by 5-20 us a call on the H200; this shows the GPU timeline of both:

    nsys profile --capture-range=cudaProfilerApi --trace=cuda -o gaps \\
        python benchmarks/profile_launch_gaps.py --only 0 2
    nsys stats --report cuda_gpu_trace --format csv --output gaps gaps.nsys-rep
    python benchmarks/profile_launch_gaps.py --analyze gaps_cuda_gpu_trace.csv

(``tools/gpu_kernels.sh gaps OUT`` does all three.) Per case (``decode_attention.QUICK``
indices) and implementation (jpaged's kernel, cuDNN non-paged), it runs ``--calls`` calls
back to back and then one program of ``--calls`` chained calls, with a 50 ms sleep between
groups so the analysis can split the trace. ``--analyze`` prints, per group: kernels, kernel
time, span, the idle time between kernels (median and total) and the kernels that follow the
longest gaps.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_GROUP_GAP_NS = 20_000_000  # groups are 50 ms apart; kernels within one much closer


def _profiler(start: bool) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = cuda.cuProfilerStart() if start else cuda.cuProfilerStop()
    if rc != 0:
        raise RuntimeError(f"cuProfiler{'Start' if start else 'Stop'} returned {rc}")


def run(ns) -> None:
    import _timing
    import decode_attention as da
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    groups = []
    for i in ns.only:
        case = da.QUICK[i]
        inp = da.make_inputs(case, rng, width_multiple=64)
        impls = [("pallas_gpu", *da._ours(inp, case))]
        if not ns.skip_cudnn:
            kd, vd = da._dense_kv(inp, case)
            impls.append(("cudnn", *da._cudnn(inp, case, kd, vd)))
        for name, f, args in impls:
            chain = _timing.chained(f, ns.calls)
            groups.append((f"{case.label} {name} back-to-back", f, args, ns.calls))
            groups.append((f"{case.label} {name} chained", chain, args, 1))
    for _, f, args, _ in groups:  # compile and warm up outside the profiled range
        for _ in range(2):
            jax.block_until_ready(f(*args))
    _profiler(True)
    for k, (label, f, args, reps) in enumerate(groups):
        print(f"group {k}: {label}", flush=True)
        out = None
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        time.sleep(0.05)
    _profiler(False)


def analyze(path: str, labels: list[str]) -> None:
    with open(path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("Name") and r.get("Duration (ns)")]
    kernels = []
    for r in rows:
        if "memcpy" in r["Name"].lower() or "memset" in r["Name"].lower():
            kind = "copy"
        else:
            kind = "kernel"
        start, dur = int(r["Start (ns)"]), int(r["Duration (ns)"])
        kernels.append((start, start + dur, dur, kind, r["Name"]))
    kernels.sort()
    groups, cur = [], []
    for k in kernels:
        if cur and k[0] - cur[-1][1] > _GROUP_GAP_NS:
            groups.append(cur)
            cur = []
        cur.append(k)
    if cur:
        groups.append(cur)
    print(f"{len(groups)} groups of GPU activity ({len(kernels)} kernels and copies)")
    for g, ks in enumerate(groups):
        label = labels[g] if g < len(labels) else f"group {g}"
        gaps = [(b[0] - a[1], b[4]) for a, b in itertools.pairwise(ks)]
        busy = sum(k[2] for k in ks)
        span = ks[-1][1] - ks[0][0]
        copies = sum(1 for k in ks if k[3] == "copy")
        med = statistics.median(gap for gap, _ in gaps) / 1e3 if gaps else 0.0
        print(
            f"{label}: {len(ks)} ops ({copies} copies), busy {busy / 1e3:.1f} us, span "
            f"{span / 1e3:.1f} us, idle {(span - busy) / 1e3:.1f} us, median gap {med:.2f} us"
        )
        for gap, name in sorted(gaps, reverse=True)[:3]:
            print(f"    gap {gap / 1e3:7.2f} us before {name[:90]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", type=int, nargs="+", default=[0, 2], help="QUICK case indices")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--skip-cudnn", action="store_true")
    p.add_argument("--analyze", metavar="CSV", help="nsys cuda_gpu_trace CSV to summarise")
    p.add_argument("--labels", metavar="LOG", help="this script's own output (group labels)")
    ns = p.parse_args(argv)
    if ns.analyze:
        labels = []
        if ns.labels:
            with open(ns.labels) as fh:
                labels = [ln.split(": ", 1)[1].strip() for ln in fh if ln.startswith("group ")]
        analyze(ns.analyze, labels)
    else:
        run(ns)


if __name__ == "__main__":
    main()
