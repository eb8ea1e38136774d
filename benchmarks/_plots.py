"""PNG plots of the serving and memory benchmarks' JSON (matplotlib: the ``plot`` extra).

- `latency_vs_rate`: normalised latency (s/token) against request rate, one line per system
  (the vLLM paper's Fig. 12 layout); runs that did not finish every request are hollow.
- `kv_utilisation`: live tokens and allocated slots as fractions of the KV budget over time,
  one panel per system, at one request rate.
- `page_map`: the pool as a grid of pages, coloured by the request that holds each page,
  shared pages (more than one holder) outlined in black, pages held by none left white.
- `timeline`: inside one decode kernel (``profile_decode_timeline.py`` JSON): each CTA as a
  line from its start to its end, one row per SM slot, and the running CTAs over time
  against the resident slots.

Every function takes the benchmark's JSON document (or a part of it) and a path, and
returns the path written. From the command line, the PNGs of saved JSON files (e.g. fetched
from a GPU machine without matplotlib) are written next to them:

    python benchmarks/_plots.py benchmarks/results/serving_llama-8b_sharegpt.json \
        benchmarks/results/memory_llama-8b.json
"""

from __future__ import annotations

import math
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def _title(doc: dict, what: str) -> str:
    env = doc.get("env", {})
    return f"{what}\n{doc.get('model')} on {env.get('device')}, jax {env.get('jax')}, {env.get('date')}"


def latency_vs_rate(doc: dict, path: str | pathlib.Path) -> pathlib.Path:
    """Normalised latency against request rate per system (``serving.py`` JSON)."""
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
    ax.set_title(_title(doc, f"{doc['workload'].get('dataset') or 'trace'}"), fontsize=9)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def kv_utilisation(doc: dict, path: str | pathlib.Path, rate_index: int = -1) -> pathlib.Path:
    """KV live/allocated fractions over time per system at the ``rate_index``-th rate."""
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
    fig.suptitle(_title(doc, f"KV budget use at {rate:g} req/s"), fontsize=9)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def page_map(snapshot: dict, path: str | pathlib.Path, title: str = "") -> pathlib.Path:
    """The pool's pages coloured by holding request, shared ones outlined.

    Args:
      snapshot: ``{"num_pages": P, "owners": {page: [request index per holder]}}``.
    """
    P = int(snapshot["num_pages"])
    owners = {int(k): v for k, v in snapshot["owners"].items()}
    cols = math.ceil(math.sqrt(P * 2))
    rows = math.ceil(P / cols)
    grid = np.full((rows, cols), np.nan)
    for page, holders in owners.items():
        grid[page // cols, page % cols] = holders[0]
    fig, ax = plt.subplots(figsize=(min(12, 0.12 * cols + 2), min(8, 0.12 * rows + 1.5)))
    ax.imshow(grid, cmap="tab20", interpolation="nearest", vmin=0, vmax=19)
    for page, holders in owners.items():
        if len(holders) > 1:
            r, c = divmod(page, cols)
            ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, lw=1.2, ec="k"))
    shared = sum(1 for h in owners.values() if len(h) > 1)
    ax.set_title(f"{title}\n{len(owners)} of {P} pages held, {shared} shared (outlined)",
                 fontsize=9)  # fmt: skip
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def serving_plots(doc: dict, stem: str | pathlib.Path) -> list[pathlib.Path]:
    """Both serving plots next to ``stem`` (``<stem>_latency.png``, ``<stem>_kv.png``)."""
    stem = str(stem)
    return [latency_vs_rate(doc, stem + "_latency.png"), kv_utilisation(doc, stem + "_kv.png")]


def memory_plots(doc: dict, stem: str | pathlib.Path) -> list[pathlib.Path]:
    """A page map per sharing run that found shared pages (``<stem>_pages_<kind><w>.png``)."""
    paths = []
    for r in doc.get("sharing", []):
        snap = r.get("page_map", {})
        if snap.get("owners"):
            what = "beam width" if r["kind"] == "beam" else "parallel sampling n"
            paths.append(page_map(snap, f"{stem}_pages_{r['kind']}{r['width']}.png",
                                  _title(doc, f"{what} = {r['width']}")))  # fmt: skip
    return paths


def timeline(doc: dict, path: str | pathlib.Path) -> pathlib.Path:
    """CTAs per SM slot over time (upper panel) and running CTAs (lower) of one profiled
    decode kernel (``profile_decode_timeline.py``), with the HBM roofline's time marked."""
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


def main(paths: list[str]) -> list[pathlib.Path]:
    """Writes the plots of each ``serving.py`` / ``memory.py`` / ``profile_decode_timeline.py``
    JSON file next to it."""
    import json

    written = []
    for path in map(pathlib.Path, paths):
        doc = json.loads(path.read_text())
        stem = path.with_suffix("")
        if "ctas" in doc:
            written.append(timeline(doc, stem.with_suffix(".png")))
            continue
        written += serving_plots(doc, stem) if "results" in doc else memory_plots(doc, stem)
    for w in written:
        print(f"wrote {w}")
    return written


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
