"""Where the time between kernels goes: decode calls dispatched back to back vs chained in one
jitted program, from a JAX profiler trace (CUPTI; the H200 image has no Nsight Systems).

``wall_us`` (back-to-back dispatches) and ``loop_us`` (one program of chained calls) exceed the
kernels' CUPTI sum by 5-20 us a call on the H200; this shows the GPU timeline of both:

    python benchmarks/diagnostics/profile_launch_gaps.py --only 0 2 --out OUT

Per case (``decode_attention.QUICK`` indices) and implementation (jpaged's kernel, cuDNN
non-paged), it runs ``--calls`` calls back to back and then one program of ``--calls``
chained calls under ``jax.profiler.trace``, 50 ms apart. It prints, per group: GPU ops, busy
time, span, the idle time between ops (median and total), the ops that follow the longest
gaps, and the host events that took the most time in that window.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_GROUP_GAP_NS = 20_000_000  # groups are 50 ms apart; kernels within one much closer


def run(ns) -> None:
    import _timing
    import decode_attention as da
    import jax

    groups = []
    for _, case, inp in da.table_inputs(da.QUICK, ns.only, width_multiple=64):
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
    trace_dir = os.path.join(ns.out, "launch_gaps_trace")
    with jax.profiler.trace(trace_dir):
        for k, (label, f, args, reps) in enumerate(groups):
            print(f"group {k}: {label}", flush=True)
            out = None
            for _ in range(reps):
                out = f(*args)
            jax.block_until_ready(out)
            time.sleep(0.05)
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    gpu, host = gpu_events(max(paths, key=os.path.getmtime))
    analyze(gpu, [g[0] for g in groups], host)


def gpu_events(xspace_path: str):
    """(GPU ops, host events) of a profiler trace: (start_ns, end_ns, duration_ns, name)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xspace_path)
    gpu, host = [], []
    for plane in data.planes:
        dest = gpu if plane.name.startswith("/device:GPU") else host
        if dest is host and not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                start, dur = int(ev.start_ns), int(ev.duration_ns)
                dest.append((start, start + dur, dur, ev.name))
    return sorted(gpu), sorted(host)


def analyze(ops, labels: list[str], host=()) -> None:
    """Prints the per-group summary of GPU ``ops`` (groups are 50 ms apart)."""
    ops = sorted(ops)
    groups, cur = [], []
    for k in ops:
        if cur and k[0] - max(c[1] for c in cur) > _GROUP_GAP_NS:
            groups.append(cur)
            cur = []
        cur.append(k)
    if cur:
        groups.append(cur)
    print(f"{len(groups)} groups of GPU activity ({len(ops)} ops)")
    if labels and len(groups) != len(labels):
        print(f"WARNING: {len(labels)} labels for {len(groups)} groups: labels may be shifted")
    for g, ks in enumerate(groups):
        label = labels[g] if g < len(labels) else f"group {g}"
        # Ops on several streams may overlap: idle is the span not covered by any op.
        covered, end = 0, ks[0][0]
        for s0, e0, _, _ in ks:
            covered += max(0, e0 - max(s0, end))
            end = max(end, e0)
        span = end - ks[0][0]
        copies = sum(1 for k in ks if "memcpy" in k[3].lower() or "memset" in k[3].lower())
        gaps = [(b[0] - a[1], b[3]) for a, b in itertools.pairwise(ks)]
        med = statistics.median(gap for gap, _ in gaps) / 1e3 if gaps else 0.0
        print(
            f"{label}: {len(ks)} ops ({copies} copies), busy {covered / 1e3:.1f} us, span "
            f"{span / 1e3:.1f} us, idle {(span - covered) / 1e3:.1f} us, median gap {med:.2f} us"
        )
        for gap, name in sorted(gaps, reverse=True)[:3]:
            print(f"    gap {gap / 1e3:7.2f} us before {name[:90]}")
        window = [h for h in host if h[0] >= ks[0][0] - 2_000_000 and h[1] <= end]
        totals: dict[str, list[int]] = {}
        for h in window:
            totals.setdefault(h[3], []).append(h[2])
        for name, durs in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:6]:
            print(f"    host {sum(durs) / 1e3:9.1f} us in {len(durs):4d} x {name[:80]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", type=int, nargs="+", default=[0, 2], help="QUICK case indices")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--skip-cudnn", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"), help="trace directory parent")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
