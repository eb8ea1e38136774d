"""Inside one decode kernel: each CTA's SM, start, and the time of its regions, from the Mosaic
GPU on-device profiler (the kernel's ``profile_dir``), so the ramp at the start, the tail at
the end and the gaps between CTAs on an SM can be read off.

    python benchmarks/diagnostics/profile_decode_timeline.py --cases 128,2048,8 64,2048,32 --out OUT

Per case (``"B,ctx,K[,C[,H]]"`` as ``decode_attention.py --cases``) and tuning (``--variants``)
it runs the kernel once with profiling, reads the trace, and reports:

- the kernel's span (first CTA start to last CTA end) against its CUPTI time with profiling on
  and off (the profiler's own cost) and the HBM read roofline's time for the live bytes;
- the ramp: when the first-wave CTAs entered their loop (median and last);
- the tail: from the last CTA start to the end, and how many CTAs were running over time
  (deciles of the span);
- per-CTA medians of the regions (order, prologue, loop, store);
- how the running CTAs drain in the last 40 us (every 2.5 us).

A CTA's start is the SM's globaltimer (ns); region times are SM clock cycles. They are
converted at the lowest clock (to 0.01 GHz) at which no SM ever runs more CTAs than it started
at once (``_fit_ghz``): at a lower one a CTA would still run when the slot's next CTA
started (with one wave, at the clock that makes the span the kernel's CUPTI time). On the H200
that was 1.74-1.77 GHz in every case, under the 1.98 GHz boost: the SMs run slower under this
HBM-bound load; at that clock the profiled span matched the kernel's CUPTI time within 3 us.
Per-CTA rows go to ``OUT/decode_timeline_<case>.json``; `timeline` draws them
(``--plot-from OUT/decode_timeline_*.json``, matplotlib).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

REGIONS = ("order", "prologue", "loop", "store")


def ctas_from_trace(events: list[dict]) -> list[dict]:
    """Per CTA (one warpgroup a CTA): sm, start (trace us: globaltimer ns / 1e3) and each
    region's begin and end offsets in cycles / 1e3 (the trace's unit past the start).

    The start is the low 32 bits of ``%globaltimer``, which wrap every 4.29 s: starts more
    than 2**31 ns below the latest are moved up by 2**32 ns (a kernel that straddled a wrap)."""
    by_tid: dict[int, list[dict]] = {}
    for e in events:
        if e.get("ph") in ("B", "E"):
            by_tid.setdefault(e["tid"], []).append(e)
    ctas = []
    for tid, evs in sorted(by_tid.items()):
        start = evs[0]["ts"]  # the first event: the profiler's start, offset 0
        row = {"tid": tid, "sm": evs[0]["pid"] - 1, "start": start}
        for e in evs:
            key = f"{e['name']}_{'b' if e['ph'] == 'B' else 'e'}"
            row[key] = e["ts"] - start
        row["end_k"] = max(e["ts"] for e in evs) - start  # cycles / 1e3
        ctas.append(row)
    if ctas:
        wrap, half = 2.0**32 / 1e3, 2.0**31 / 1e3
        latest = max(c["start"] for c in ctas)
        for c in ctas:
            if latest - c["start"] > half:
                c["start"] += wrap
    return ctas


def summarize(ctas: list[dict], ghz: float) -> dict:
    """Ramp, tail, occupancy over time and per-CTA region medians (us) at ``ghz``."""
    t0 = min(c["start"] for c in ctas)
    for c in ctas:
        c["t_start"] = c["start"] - t0
        c["t_end"] = c["t_start"] + c["end_k"] / ghz
        for r in REGIONS:
            if f"{r}_b" in c and f"{r}_e" in c:
                c[f"{r}_us"] = (c[f"{r}_e"] - c[f"{r}_b"]) / ghz
        if "loop_b" in c:
            c["t_loop"] = c["t_start"] + c["loop_b"] / ghz
    span = max(c["t_end"] for c in ctas)
    last_start = max(c["t_start"] for c in ctas)
    first = sorted(c["t_start"] for c in ctas)
    wave = [c for c in ctas if c["t_start"] <= first[0] + 1.0]  # launched at the start
    out = {
        "ctas": len(ctas),
        "sms": len({c["sm"] for c in ctas}),
        "span_us": span,
        "first_wave_ctas": len(wave),
        "first_wave_loop_us": {
            "median": statistics.median(c.get("t_loop", 0.0) for c in wave),
            "max": max(c.get("t_loop", 0.0) for c in wave),
        },
        "last_start_us": last_start,
        "tail_us": span - last_start,
    }
    for r in REGIONS:
        vals = [c[f"{r}_us"] for c in ctas if f"{r}_us" in c]
        if vals:
            out[f"{r}_median_us"] = statistics.median(vals)
    # Running CTAs at each tenth of the span, and the mean over the span.
    deciles = [span * k / 10 for k in range(10)] + [span * 0.99]
    out["running_at_deciles"] = [sum(c["t_start"] <= t < c["t_end"] for c in ctas) for t in deciles]
    busy = sum(c["t_end"] - c["t_start"] for c in ctas)
    out["mean_running"] = busy / span
    # The drain: running CTAs every 2.5 us over the last 40 us.
    out["drain_last_40us"] = [
        sum(c["t_start"] <= t < c["t_end"] for c in ctas)
        for t in [span - 40 + 2.5 * k for k in range(16)]
    ]
    return out


def run(ns) -> None:
    import _timing
    import decode_attention as da
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    roof_wall, roof_cupti = _timing.read_roofline_tbs()
    print(f"roofline {roof_wall:.2f} TB/s wall, {roof_cupti:.2f} TB/s cupti", flush=True)
    docs = []
    for spec in ns.cases:
        case = da.parse_case(spec)
        inp = da.make_inputs(case, rng, width_multiple=64)
        nbytes = da.live_bytes(case, inp.lengths_np)
        for variant in ns.variants:
            kw = da._parse_kwargs(variant) if variant else {}
            f0, args = da._ours(inp, case, **kw)
            plain = _timing.cupti_us(f0, *args)
            trace_dir = tempfile.mkdtemp(prefix="decode_timeline_")
            f, args = da._ours(inp, case, profile_dir=trace_dir, **kw)
            profiled = _timing.cupti_us(f, *args)  # also compiles and writes traces
            for path in glob.glob(os.path.join(trace_dir, "*.json")):
                os.remove(path)
            jax.block_until_ready(f(*args))
            jax.effects_barrier()
            paths = sorted(glob.glob(os.path.join(trace_dir, "*.json")))
            if not paths:
                raise SystemExit(f"no trace in {trace_dir}")
            with open(paths[-1]) as fh:
                trace = json.load(fh)
            events = trace["traceEvents"] if isinstance(trace, dict) else trace
            ctas = ctas_from_trace(events)
            if not ctas:
                raise SystemExit(
                    f"{spec} {variant}: no profiler regions in the trace (this "
                    "variant records none)"
                )
            # The longest kernel of the call (the attention kernel), to compare the span with.
            kernels = _timing.cupti_kernels_us(f, *args) or []
            kernel_us = max((us for _, us in kernels), default=profiled)
            ghz = ns.ghz or _fit_ghz(ctas, kernel_us)
            summary = summarize(ctas, ghz)
            label = f"{case.label} {variant or 'default'}"
            doc = {
                "label": label,
                "case": spec,
                "variant": variant,
                "device": str(jax.devices()[0]),
                "jax": jax.__version__,
                "live_bytes": nbytes,
                "roofline_us": nbytes / (roof_cupti * 1e6),
                "cupti_us": plain,
                "cupti_profiled_us": profiled,
                "kernel_profiled_us": kernel_us,
                "clock_ghz": ghz,
                "summary": summary,
                "ctas": [
                    {k: c[k] for k in ("sm", "t_start", "t_end", *[f"{r}_us" for r in REGIONS])
                     if k in c}
                    for c in ctas
                ],
            }  # fmt: skip
            docs.append(doc)
            s = summary
            print(
                f"-- {label}: {s['ctas']} CTAs on {s['sms']} SMs, clock {ghz:.3f} GHz\n"
                f"   CUPTI {_us(plain)} us (profiled {_us(profiled)}; kernel {_us(kernel_us)}), "
                f"roofline {doc['roofline_us']:.1f} us, span {s['span_us']:.1f}\n"
                f"   first wave {s['first_wave_ctas']} CTAs in their loop at "
                f"{s['first_wave_loop_us']['median']:.2f} us (median), "
                f"{s['first_wave_loop_us']['max']:.2f} (last)\n"
                f"   last start {s['last_start_us']:.1f} us, tail {s['tail_us']:.1f} us; "
                f"running at each tenth {s['running_at_deciles']}, mean {s['mean_running']:.0f}\n"
                f"   medians: "
                + ", ".join(f"{r} {s[f'{r}_median_us']:.2f}" for r in REGIONS if f"{r}_median_us" in s)
                + f" us\n   drain (last 40 us, every 2.5): {s['drain_last_40us']}",
                flush=True,
            )  # fmt: skip
            if ns.out:
                name = spec.replace(",", "_") + (f"_{variant}" if variant else "")
                name = name.replace("=", "-").replace(",", "_")  # letters, digits, . _ - only
                path = os.path.join(ns.out, f"decode_timeline_{name}.json")
                with open(path, "w") as fh:
                    json.dump(doc, fh)


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _fit_ghz(ctas: list[dict], kernel_us: float | None = None) -> float:
    """The lowest SM clock (GHz, 0.01 steps from 1.2 to 2.0) at which no SM runs more CTAs at
    any CTA's start than it started in the kernel's first microsecond (its resident slots).
    With one wave (no CTA starts later) that says nothing: then the clock at which the last
    CTA ends ``kernel_us`` after the first start (1.75 GHz without it)."""
    t0 = min(c["start"] for c in ctas)
    if all(c["start"] - t0 < 1.0 for c in ctas):
        if not kernel_us:
            return 1.75
        return round(max(c["end_k"] for c in ctas) / kernel_us, 3)
    per_sm: dict[int, list[tuple[float, float]]] = {}
    for c in ctas:
        per_sm.setdefault(c["sm"], []).append((c["start"] - t0, c["end_k"]))
    slots = max(sum(s < 1.0 for s, _ in v) for v in per_sm.values())
    for step in range(120, 201):
        ghz = step / 100
        if all(
            sum(s <= t + 0.3 < s + k / ghz for s, k in v) <= slots
            for v in per_sm.values()
            for t, _ in v
        ):
            return ghz
    return 2.0


def timeline(doc: dict, path: str | pathlib.Path) -> pathlib.Path:
    """CTAs per SM slot over time (upper panel) and running CTAs (lower) of one profiled
    decode kernel (the JSON ``run`` writes), with the HBM roofline's time marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ctas = sorted(doc["ctas"], key=lambda c: (c["sm"], c["t_start"]))
    # Slots: each CTA takes the lowest slot of its SM that is free at its start.
    rows, free_at = [], {}
    for c in ctas:
        slots = free_at.setdefault(c["sm"], [])
        slot = next((i for i, t in enumerate(slots) if t <= c["t_start"] + 0.3), len(slots))
        if slot == len(slots):
            slots.append(0.0)
        slots[slot] = c["t_end"]
        rows.append((c["sm"], slot, c))
    per_sm = max(len(v) for v in free_at.values())
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    colors = plt.cm.tab10.colors
    for sm, slot, c in rows:
        y = sm * per_sm + slot
        start = c["t_start"]
        lead = c.get("order_us", 0.0) + c.get("prologue_us", 0.0)
        top.plot([start, start + lead], [y, y], color="0.6", lw=0.6)
        top.plot([start + lead, c["t_end"]], [y, y], color=colors[slot % 10], lw=0.6)
    top.set_ylabel(f"SM x slot ({per_sm} a SM)")
    span = max(c["t_end"] for c in ctas)
    ts = np.linspace(0.0, span, 600)
    running = [sum(c["t_start"] <= t < c["t_end"] for c in ctas) for t in ts]
    bottom.plot(ts, running, color="k", lw=1)
    bottom.axhline(per_sm * len(free_at), color="0.5", ls=":", lw=1)
    for ax in (top, bottom):
        ax.axvline(doc["roofline_us"], color="r", ls="--", lw=1)
    bottom.set_ylabel("running CTAs")
    bottom.set_xlabel("us since the first CTA started (red: live bytes at the HBM roofline)")
    top.set_title(
        f"{doc['label']}: {len(ctas)} CTAs, span {span:.0f} us, roofline {doc['roofline_us']:.0f}"
        f" us\n{doc['device']}, jax {doc['jax']} (grey: order + prologue)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return pathlib.Path(path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["128,2048,8"])
    p.add_argument("--variants", nargs="*", default=[""], help='"" is the default tuning')
    p.add_argument("--ghz", type=float, default=None, help="SM clock (default: fitted)")
    p.add_argument("--out", default=None)
    p.add_argument("--plot-from", nargs="+", metavar="JSON", help="only draw saved timelines")
    ns = p.parse_args(argv)
    if ns.plot_from:
        for path in map(pathlib.Path, ns.plot_from):
            print(f"wrote {timeline(json.loads(path.read_text()), path.with_suffix('.png'))}")
        return
    run(ns)


if __name__ == "__main__":
    main()
