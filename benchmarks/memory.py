"""KV memory benchmark (vLLM paper, Fig. 2 and section 6.3): waste, sharing, prefix caching.

Three measurements, each on a real run of the systems (``serving.py``'s harness, same model
and KV budget), with the allocator's or the baseline's accounting read after every step:

- ``waste``: every system serves the trace with all requests arriving at once (the pool is
  under pressure). Waste = (allocated slots - live tokens) / pool slots, averaged over steps;
  also the worst step's waste per running sequence (paged: the last page's unused tail plus
  the slots reserved ahead for an in-flight multi-step decode loop, < C + k).
- ``sharing``: jpaged with parallel sampling ``n`` in {2, 4, 6} and beam search of width
  {2, 4, 6} on Alpaca-like requests. Savings = 1 - sum over steps of pages used / sum over
  steps of pages without sharing (each sequence's own block-table length), the paper's
  "blocks saved by sharing / blocks without sharing". The step with the most shared pages is
  kept as a page map (``--plot``; ``--plot-from JSON`` draws those of a saved run).
- ``prefix``: a shared system prompt (``--prefix-len`` tokens) before each request's own
  prompt. The first request runs alone, then the rest arrive together; with and without
  prefix caching: prefill tokens computed, fraction of the shared prompt served from the
  cache, pages used (mean and peak) and TTFT.

    python benchmarks/memory.py --quick                   # tiny model, CPU-sized
    python benchmarks/memory.py --model llama-8b --quick  # the H200 run (see BUILD.md)

Prints tables and writes JSON (``--out``, default ``benchmarks/results/memory_<model>.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _serving_report
import _workloads
import serving

RESULTS = pathlib.Path(__file__).parent / "results"


def measure_waste(model, spec, trace, prompts, *, systems, budget_tokens, page_size,
                  max_num_seqs, progress=True) -> dict:  # fmt: skip
    """KV waste of each system over a burst of ``trace`` (see the module docstring)."""
    burst = _workloads.with_arrivals(trace, math.inf)
    out = {}
    for name in systems:
        system = serving.make_system(name, model, budget_tokens=budget_tokens, spec=spec,
                                     page_size=page_size, max_num_seqs=max_num_seqs)  # fmt: skip
        run = serving.run_trace(system, burst, prompts, progress=progress,
                                desc=f"waste {name}", sample_every_s=0.0)  # fmt: skip
        del system
        u = np.asarray(run["usage"]).reshape(-1, 4)
        busy = u[u[:, 3] > 0]
        waste = busy[:, 1] - busy[:, 2]
        per_seq_slots = waste * budget_tokens / busy[:, 3]
        out[name] = {
            "steps": len(u),
            "allocated_mean": float(busy[:, 1].mean()),
            "live_mean": float(busy[:, 2].mean()),
            "waste_mean": float(waste.mean()),
            "waste_max": float(waste.max()),
            "waste_slots_per_seq_max": float(per_seq_slots.max()),
            "live_of_allocated_mean": float((busy[:, 2] / busy[:, 1]).mean()),
            "all_finished": not run["saturated"],
        }
    return out


def _page_owners(llm) -> tuple[list[int], dict[int, list[int]]]:
    """(pages without sharing per live sequence, request index per used page)."""
    per_seq, owners = [], {}
    for r, req in enumerate(llm.scheduler.running):
        for seq in req.live_seqs():
            if seq.seq_id not in llm.alloc:
                continue
            table = llm.alloc.block_table(seq.seq_id)
            per_seq.append(len(table))
            for page in table:
                owners.setdefault(page, []).append(r)
    return per_seq, owners


def measure_sharing(model, spec, trace, prompts, *, kind: str, width: int, budget_tokens,
                    page_size, max_num_seqs, progress=True) -> dict:  # fmt: skip
    """Pages saved by sharing for parallel sampling (``kind="n"``) or beam search ("beam")."""
    # One synchronous step per call (no decode chains), so averaging over steps averages
    # over time.
    system = serving.JpagedSystem(model, budget_tokens=budget_tokens, page_size=page_size,
                                  max_len=spec.max_len, max_num_seqs=max_num_seqs,
                                  chain_decode=False)  # fmt: skip
    llm = system.llm
    for i, r in enumerate(trace):
        if kind == "beam":
            system.add(i, prompts[i], r.output_len, beam_width=width)
        else:
            system.add(i, prompts[i], r.output_len, n=width)
    used = unshared = 0
    best = {"shared_pages": -1}
    bar = _workloads.tqdm(total=len(trace), desc=f"sharing {kind}={width}",
                          disable=not progress, leave=False)  # fmt: skip
    while system.has_work():
        done = sum(1 for _, _, f in system.step() if f)
        bar.update(done)
        per_seq, owners = _page_owners(llm)
        used += len(owners)
        unshared += sum(per_seq)
        shared = sum(1 for v in owners.values() if len(v) > 1)
        if shared > best["shared_pages"]:
            best = {"shared_pages": shared, "owners": {int(p): v for p, v in owners.items()},
                    "num_pages": llm.alloc.num_pages}  # fmt: skip
    bar.close()
    llm.alloc.check_invariants()
    return {
        "kind": kind,
        "width": width,
        "pages_used_step_sum": used,
        "pages_unshared_step_sum": unshared,
        "savings": 1.0 - used / unshared if unshared else 0.0,
        "page_map": best,
    }


def measure_prefix(model, spec, trace, prompts, *, prefix_len: int, budget_tokens, page_size,
                   max_num_seqs, seed=0, progress=True) -> dict:  # fmt: skip
    """Prefix caching of a shared ``prefix_len``-token system prompt, on and off."""
    rng = np.random.default_rng(seed + 7)
    V = spec.config.vocab_size
    system_prompt = rng.integers(0, V, prefix_len).tolist()
    full = [system_prompt + p for p in prompts]
    reqs = [_workloads.RequestSpec(len(p), r.output_len) for p, r in zip(full, trace,
                                                                         strict=True)]  # fmt: skip
    # Warm-up prompts: the same lengths and sharing, other tokens (compiles, cache stays cold).
    other_prefix = rng.integers(0, V, prefix_len).tolist()
    other = [other_prefix + rng.integers(0, V, len(p)).tolist() for p in prompts]
    out = {}
    for caching in (False, True):

        def build(caching=caching):
            return serving.JpagedSystem(model, budget_tokens=budget_tokens, page_size=page_size,
                                        max_len=spec.max_len, max_num_seqs=max_num_seqs,
                                        enable_prefix_caching=caching)  # fmt: skip

        for system, prompts_ in ((build(), other), (build(), full)):
            first = serving.run_trace(system, reqs[:1], prompts_[:1], progress=False)
            rest = serving.run_trace(system, reqs[1:], prompts_[1:], progress=progress,
                                     desc=f"prefix caching={caching}",
                                     sample_every_s=0.0)  # fmt: skip
        s = system.llm.stats()
        cached = [system.num_cached_tokens[i] for i in range(len(reqs) - 1)]  # requests 1..
        u = np.asarray(rest["usage"]).reshape(-1, 4)
        summ = _serving_report.summarize(rest)
        prompt_tokens = sum(r.prompt_len for r in reqs[1:])
        out["on" if caching else "off"] = {
            "prefill_tokens_computed": prompt_tokens - sum(cached),
            "prompt_tokens": prompt_tokens,
            "shared_prefix_hit_fraction": float(
                np.mean([min(c, prefix_len) / prefix_len for c in cached])
            ),
            "pages_used_mean": float(u[:, 1].mean() * s["pages_total"]),
            "pages_used_peak": float(u[:, 1].max() * s["pages_total"]),
            "ttft_s": summ["ttft_s"],
            "compiles": summ["compiles"],  # during the measured run (0 after the warm-up)
            "first_request_ttft_s": _serving_report.summarize(first)["ttft_s"]["mean"],
            "prefix_hit_tokens_total": s["prefix_hit_tokens"],
        }
        del system
    off, on = out["off"], out["on"]
    out["prefill_saved_fraction"] = 1 - on["prefill_tokens_computed"] / max(
        off["prefill_tokens_computed"], 1
    )
    out["pages_saved_fraction_mean"] = 1 - on["pages_used_mean"] / max(off["pages_used_mean"], 1)
    out["prefix_len"] = prefix_len
    return out


def plot_page_map(snapshot: dict, path: str | pathlib.Path, title: str = "") -> pathlib.Path:
    """The pool as a grid of pages coloured by the request holding each, shared pages (more
    than one holder) outlined, pages held by none left white.

    Args:
      snapshot: ``{"num_pages": P, "owners": {page: [request index per holder]}}``.
    """
    plt = _serving_report._pyplot()
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


def memory_plots(doc: dict, stem: str | pathlib.Path) -> list[pathlib.Path]:
    """A page map per sharing run that found shared pages (``<stem>_pages_<kind><w>.png``)."""
    paths = []
    for r in doc.get("sharing", []):
        snap = r.get("page_map", {})
        if snap.get("owners"):
            what = "beam width" if r["kind"] == "beam" else "parallel sampling n"
            paths.append(plot_page_map(snap, f"{stem}_pages_{r['kind']}{r['width']}.png",
                                       _serving_report.plot_title(doc, f"{what} = {r['width']}")))  # fmt: skip
    return paths


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "llama-1b", "llama-8b"))
    ap.add_argument("--parts", default="waste,sharing,prefix")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV budget in token slots")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--widths", default="2,4,6", help="n and beam widths")
    ap.add_argument("--prefix-len", type=int, default=None, help="shared prompt tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plot", action="store_true", help="write PNGs (needs matplotlib)")
    ap.add_argument("--plot-from", metavar="JSON", help="only write the page maps of a saved run")
    ap.add_argument("--out")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.plot_from:
        doc = json.loads(pathlib.Path(args.plot_from).read_text())
        for path in memory_plots(doc, pathlib.Path(args.plot_from).with_suffix("")):
            print(f"wrote {path}")
        return doc

    spec = serving.model_spec(args.model)
    num = args.num_requests or (12 if args.quick else 100)
    C = args.page_size
    kv = (args.kv_tokens or spec.kv_tokens) // C * C
    prog = not args.no_progress
    model = serving.load_model(spec, args.seed)
    V = spec.config.vocab_size
    common = dict(budget_tokens=kv, page_size=C, max_num_seqs=spec.max_num_seqs, progress=prog)
    out = pathlib.Path(args.out) if args.out else RESULTS / f"memory_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"env": _serving_report.environment(), "model": args.model, "kv_budget_tokens": kv,
           "page_size": C}  # fmt: skip

    def save():
        out.write_text(json.dumps(doc, indent=1, default=float))

    parts = args.parts.split(",")
    if "waste" in parts:
        trace = _workloads.make_trace("sharegpt", num, seed=args.seed, max_len=spec.max_len,
                                      scale=spec.length_scale["sharegpt"])  # fmt: skip
        prompts = _workloads.prompt_tokens(trace, V, seed=args.seed)
        doc["waste"] = measure_waste(model, spec, trace, prompts, systems=serving.SYSTEMS,
                                     **common)  # fmt: skip
        doc["waste_workload"] = _workloads.summary(trace)
        print(f"\nKV waste, sharegpt-like burst of {num} requests, pool {kv} tokens, page {C}")
        print(f"{'system':<12} {'allocated':>9} {'live':>7} {'waste':>7} {'waste max':>9} "
              f"{'max waste/seq':>13}")  # fmt: skip
        for name, w in doc["waste"].items():
            print(f"{name:<12} {w['allocated_mean']:>9.1%} {w['live_mean']:>7.1%} "
                  f"{w['waste_mean']:>7.1%} {w['waste_max']:>9.1%} "
                  f"{w['waste_slots_per_seq_max']:>10.1f} sl")  # fmt: skip
        save()
    if "sharing" in parts:
        trace = _workloads.make_trace("alpaca", num, seed=args.seed, max_len=spec.max_len,
                                      scale=spec.length_scale["alpaca"])  # fmt: skip
        prompts = _workloads.prompt_tokens(trace, V, seed=args.seed)
        doc["sharing"] = []
        doc["sharing_workload"] = _workloads.summary(trace)
        print(f"\nSharing savings, alpaca-like, {num} requests")
        for kind in ("n", "beam"):
            for w in (int(x) for x in args.widths.split(",")):
                r = measure_sharing(model, spec, trace, prompts, kind=kind, width=w, **common)
                doc["sharing"].append(r)
                print(f"{kind:>5}={w}: {r['savings']:.1%} of pages saved")
                save()
    if "prefix" in parts:
        prefix_len = args.prefix_len or (128 if args.model == "tiny" else 1024)
        trace = _workloads.make_trace("alpaca", num, seed=args.seed,
                                      max_len=spec.max_len - prefix_len,
                                      scale=spec.length_scale["alpaca"])  # fmt: skip
        prompts = _workloads.prompt_tokens(trace, V, seed=args.seed)
        doc["prefix"] = p = measure_prefix(model, spec, trace, prompts, prefix_len=prefix_len,
                                           seed=args.seed, **common)  # fmt: skip
        print(f"\nPrefix caching, shared {prefix_len}-token prompt, {num} requests")
        for k in ("off", "on"):
            q = p[k]
            print(f"caching {k:>3}: prefill computed {q['prefill_tokens_computed']}/"
                  f"{q['prompt_tokens']}, shared prompt hit {q['shared_prefix_hit_fraction']:.1%}"
                  f", pages mean {q['pages_used_mean']:.0f} peak {q['pages_used_peak']:.0f}, "
                  f"TTFT mean {q['ttft_s']['mean'] * 1e3:.1f} ms")  # fmt: skip
        print(
            f"prefill saved {p['prefill_saved_fraction']:.1%}, "
            f"pages saved (mean) {p['pages_saved_fraction_mean']:.1%}"
        )
        save()
    save()
    print(f"wrote {out}")
    if args.plot:
        for path in memory_plots(doc, out.with_suffix("")):
            print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
