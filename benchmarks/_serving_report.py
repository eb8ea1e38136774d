"""The serving benchmark's report: per-run summaries, the sustainable rate, the printed table,
result-file merging and plots (matplotlib, the ``plot`` extra). ``serving.py`` runs the systems;
this module only reads what the runs recorded."""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import sys

import jax
import numpy as np


def _pct(x, q) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def summarize(run: dict, bandwidth: dict | None = None) -> dict:
    """The paper's metrics from a `run_trace` result (times in seconds), the run's counts
    (model forwards, preemptions by recompute and swap, bytes swapped out) and, given
    ``bandwidth`` (``serving.serving_bandwidth``), its MBU: the bytes the forwards had to read
    (each forward the weights and the live K/V, at the run's mean live tokens) per second of
    the run, over the HBM read roofline."""
    done = [r for r in run["requests"] if r["finished"]]
    end = max((r["token_times"][-1] for r in done), default=run["wall_s"])
    ttft = [r["token_times"][0] - r["arrival_s"] for r in done]
    norm = [(r["token_times"][-1] - r["arrival_s"]) / r["output_len"] for r in done]
    itl = np.concatenate([np.diff(r["token_times"]) for r in done] or [np.zeros(0)])
    out_tokens = sum(r["output_len"] for r in done)
    u = np.asarray(run["usage"]).reshape(-1, 4)
    return {
        "num_finished": len(done),
        "num_requests": len(run["requests"]),
        "saturated": run["saturated"],
        "duration_s": end,
        "throughput_req_s": len(done) / end if end > 0 else float("nan"),
        "throughput_tok_s": out_tokens / end if end > 0 else float("nan"),
        "normalized_latency_s": float(np.mean(norm)) if norm else float("nan"),
        "ttft_s": {"mean": float(np.mean(ttft)) if ttft else float("nan"),
                   **{f"p{q}": _pct(ttft, q) for q in (50, 90, 99)}},
        "itl_s": {"mean": float(itl.mean()) if itl.size else float("nan"),
                  **{f"p{q}": _pct(itl, q) for q in (50, 90, 99)}},
        "kv_allocated_mean": float(u[:, 1].mean()) if len(u) else 0.0,
        "kv_live_mean": float(u[:, 2].mean()) if len(u) else 0.0,
        "kv_waste_mean": float((u[:, 1] - u[:, 2]).mean()) if len(u) else 0.0,
        "steps": run["steps"],
        "compiles": run["compiles"],
        **run.get("counts", {}),
        "mbu": _mbu(run.get("counts", {}).get("forwards"), u, end, bandwidth),
    }  # fmt: skip


def _mbu(forwards, usage, seconds: float, bandwidth: dict | None) -> float | None:
    if forwards is None or bandwidth is None or not seconds > 0:
        return None
    live = float(usage[:, 2].mean()) * bandwidth["pool_slots"] if len(usage) else 0.0
    read = forwards * (bandwidth["weight_bytes"] + live * bandwidth["kv_bytes_per_token"])
    return read / seconds / (bandwidth["roofline_tbs"] * 1e12)


def passes(p: dict, slo: float) -> bool:
    """Every request finished and normalised latency <= ``slo``."""
    return not p["saturated"] and p["normalized_latency_s"] <= slo


def sustainable_rate(points: list[dict], slo: float) -> float:
    """Highest swept finite rate that passes (`passes`) with every lower swept rate passing
    too (0 when the lowest fails; an ``inf`` run measures capacity, not a rate a system
    sustains).

    >>> pts = [{"rate": r, "saturated": False, "normalized_latency_s": x}
    ...        for r, x in ((1, 0.9), (2, 0.5), (4, 0.1))]
    >>> sustainable_rate(pts, 1.0), sustainable_rate(pts, 0.6)
    (4, 0.0)
    """
    best = 0.0
    for p in sorted((p for p in points if math.isfinite(p["rate"])), key=lambda p: p["rate"]):
        if not passes(p, slo):
            break
        best = p["rate"]
    return best


def _downsample(series: list, n: int = 400) -> list:
    if len(series) <= n:
        return series
    idx = np.linspace(0, len(series) - 1, n).astype(int)
    return [series[i] for i in idx]


HEADER = (f"{'system':<14} {'rate':>6} {'done':>9} {'req/s':>7} {'tok/s':>8} {'norm lat':>9} "
          f"{'ttft p50':>9} {'itl p50':>8} {'itl p99':>8} {'kv live':>7} {'kv waste':>8} "
          f"{'comp':>4} {'preempt':>7} {'mbu':>6}")  # fmt: skip


def _row(name: str, p: dict) -> str:
    preempt = p.get("preemptions_recompute", 0) + p.get("preemptions_swap", 0)
    mbu = f"{p['mbu']:>6.1%}" if p.get("mbu") is not None else f"{'-':>6}"
    return (
        f"{name:<14} {p['rate']:>6g} {p['num_finished']:>4}/{p['num_requests']:<4} "
        f"{p['throughput_req_s']:>7.2f} {p['throughput_tok_s']:>8.1f} "
        f"{p['normalized_latency_s'] * 1e3:>7.2f}ms {p['ttft_s']['p50'] * 1e3:>7.1f}ms "
        f"{p['itl_s']['p50'] * 1e3:>6.2f}ms {p['itl_s']['p99'] * 1e3:>6.2f}ms "
        f"{p['kv_live_mean']:>7.1%} {p['kv_waste_mean']:>8.1%} {p['compiles']:>4} "
        f"{preempt:>7} {mbu}"
    )


def _pyplot():
    """matplotlib's pyplot on the file-only backend (the ``plot`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_title(doc: dict, what: str) -> str:
    """A plot's title: ``what``, then the model, device, JAX version and date of ``doc``."""
    env = doc.get("env", {})
    return f"{what}\n{doc.get('model')} on {env.get('device')}, jax {env.get('jax')}, {env.get('date')}"


def plot_latency_vs_rate(doc: dict, path: str | pathlib.Path) -> pathlib.Path:
    """Normalised latency against request rate, one line per system (the vLLM paper's Fig. 12
    layout); runs that did not finish every request are hollow."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in doc["results"].items():
        rates = [p["rate"] for p in points]
        lat = [p["normalized_latency_s"] for p in points]
        (line,) = ax.plot(rates, lat, marker="o", label=name)
        bad = [(r, y) for r, y, p in zip(rates, lat, points, strict=True) if p["saturated"]]
        if bad:
            ax.scatter(*zip(*bad, strict=True), s=80, facecolors="white",
                       edgecolors=line.get_color(), zorder=3)  # fmt: skip
    slo = doc.get("summary", {}).get("slo_s_per_token")
    if slo and math.isfinite(slo):
        ax.axhline(slo, color="grey", ls="--", lw=1, label="SLO")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalised latency (s/token)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(plot_title(doc, f"{doc['workload'].get('dataset') or 'trace'}"), fontsize=9)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_kv_utilisation(doc: dict, path: str | pathlib.Path, rate_index: int = -1) -> pathlib.Path:
    """Live tokens and allocated slots as fractions of the KV budget over time, one panel per
    system, at the ``rate_index``-th rate."""
    plt = _pyplot()
    names = list(doc["results"])
    fig, axes = plt.subplots(len(names), 1, figsize=(6, 1.6 * len(names) + 0.6), sharex=True,
                             squeeze=False)  # fmt: skip
    rate = None
    for ax, name in zip(axes[:, 0], names, strict=True):
        point = doc["results"][name][rate_index]
        rate = point["rate"]
        u = np.asarray(point["usage"], dtype=float).reshape(-1, 4)
        if len(u):
            ax.fill_between(u[:, 0], u[:, 1], step="post", alpha=0.35, label="allocated")
            ax.plot(u[:, 0], u[:, 2], drawstyle="steps-post", lw=1, label="live tokens")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(name, fontsize=8)
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle(plot_title(doc, f"KV budget use at {rate:g} req/s"), fontsize=9)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def serving_plots(doc: dict, stem: str | pathlib.Path) -> list[pathlib.Path]:
    """Both serving plots next to ``stem`` (``<stem>_latency.png``, ``<stem>_kv.png``)."""
    stem = str(stem)
    return [plot_latency_vs_rate(doc, stem + "_latency.png"),
            plot_kv_utilisation(doc, stem + "_kv.png")]  # fmt: skip


def _kept_results(out: pathlib.Path, doc: dict) -> dict:
    """The results in an earlier ``out`` measured with the same settings (``--merge``).

    Raises:
      ValueError: ``out`` was measured with another model, workload, budget or sizes.
    """
    if not out.exists():
        return {}
    old = json.loads(out.read_text())
    keys = (
        "model",
        "workload",
        "kv_budget_tokens",
        "page_size",
        "max_len",
        "max_num_seqs",
        "jpaged_decode",
        "window_s",
        "capacity_requests",
        "pool",
        "swap_space",
    )
    diff = [k for k in keys if old.get(k) != doc[k]]
    if diff:
        raise ValueError(f"--merge: {out} was measured with other settings ({diff}); "
                         "pass another --out")  # fmt: skip
    return old.get("results", {})


def _merge(old: dict, new: dict) -> dict:
    """Per system, the new points plus the old points at rates not measured again."""
    merged = {}
    for name in {**old, **new}:
        fresh = {p["rate"] for p in new.get(name, [])}
        pts = [p for p in old.get(name, []) if p["rate"] not in fresh] + new.get(name, [])
        merged[name] = sorted(pts, key=lambda p: p["rate"])
    return merged


def _sustainable(results: dict, slo: float | None) -> dict:
    """Sustainable rate per system (finite rates) and, where an ``inf`` run exists, capacity:
    its throughput with every request queued at once (requests/s and output tokens/s)."""
    lowest = [pts[0]["normalized_latency_s"] for pts in results.values() if pts]
    lowest = [x for x in lowest if np.isfinite(x)]
    if slo is None:
        slo = 5 * min(lowest) if lowest else float("nan")
    rates = {name: sustainable_rate(pts, slo) for name, pts in results.items()}
    base = rates.get("jpaged", 0.0)
    ratios = {f"jpaged_over_{n}": (base / r if r else None) for n, r in rates.items()
              if n != "jpaged"}  # fmt: skip
    out = {"slo_s_per_token": slo, "sustainable_rate": rates, **ratios}
    # Latency at low load: TTFT p50 / p99 at each system's lowest finite rate.
    low = {name: min((p for p in pts if math.isfinite(p["rate"])), key=lambda p: p["rate"])
           for name, pts in results.items() if any(math.isfinite(p["rate"]) for p in pts)}  # fmt: skip
    out["ttft_at_lowest_rate"] = {name: {"rate": p["rate"], "p50_s": p["ttft_s"]["p50"],
                                         "p99_s": p["ttft_s"]["p99"]}
                                  for name, p in low.items()}  # fmt: skip
    capacity = {name: {"req_s": p["throughput_req_s"], "tok_s": p["throughput_tok_s"]}
                for name, pts in results.items() for p in pts if math.isinf(p["rate"])}  # fmt: skip
    if capacity:
        out["capacity"] = capacity
        if "jpaged" in capacity:
            top = capacity["jpaged"]["tok_s"]
            out.update({f"capacity_jpaged_over_{n}": top / c["tok_s"]
                        for n, c in capacity.items() if n != "jpaged" and c["tok_s"]})  # fmt: skip
    return out


def environment() -> dict:
    """Device, JAX version, date: recorded beside every figure."""
    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
