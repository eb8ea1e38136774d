"""Serving benchmark by the vLLM paper's method: jpaged vs contiguous-cache baselines.

Requests with ShareGPT-like or Alpaca-like lengths (``_workloads``, or ``--trace`` JSON)
arrive by a Poisson process at each swept request rate; output lengths are enforced (EOS
ignored, greedy tokens). Every system serves the same trace with the same model and the same
KV budget (``--kv-tokens`` token slots): jpaged (`jpaged.LLM`, paged pool of
``kv_tokens / page_size`` pages), static batching, Orca-Max, Orca-Pow2 and Orca-Oracle
(``_baselines``: contiguous caches, one decode step per device call), and ``reserve-max``,
``reserve-pow2``, ``reserve-oracle``: jpaged's own engine (its decode loops, dispatch overlap,
kernels and prefill) admitting by Orca's contiguous reservations (``_engine_systems``), so
jpaged against ``reserve-max`` measures the memory policy alone. No system has host swap
space unless ``--swap-gib`` gives jpaged some. ``--pool paper`` (default) is the paper's
pool-bound regime (``--kv-tokens``); ``--pool realistic`` gives every system the budget of
jpaged.LLM's default memory (at most ``max_num_seqs`` sequences of ``max_len``). Time is
wall-clock in one process. Before its runs, every program a system can meet is compiled
(`precompile_jpaged`, `_baselines.ContiguousLM.precompile`: compiled by a thread pool) and a
short warm-up burst is served; every run records the XLA compiles that still happened inside
it (``compiles``; `backend_compiles`), its model forwards, preemptions (by recompute and by
swap) and swapped bytes, and its MBU (`_serving_report.summarize`).

Metrics per (system, rate): throughput (requests/s, output tokens/s), normalised latency
(mean over requests of end-to-end latency / output length, s/token: the paper's metric),
TTFT and inter-token latency percentiles, KV utilisation over time (live tokens and
allocated slots as fractions of the budget). The sustainable rate of a system is the highest
swept rate whose normalised latency stays under ``--slo`` (default: 5x the lowest normalised
latency measured at the lowest rate) with every request finished, every lower swept rate
passing too.

    python benchmarks/serving.py --quick                      # tiny model, CPU-sized
    python benchmarks/serving.py --model llama-8b --quick     # the H200 run (see BUILD.md)
    python benchmarks/serving.py --model llama-8b --dataset sharegpt --rates 1,2,4,8,16
    python benchmarks/serving.py --plot-from benchmarks/results/serving_llama-8b_sharegpt_h200.json

Prints a table and writes JSON (``--out``, default ``benchmarks/results/``); ``--plot``
also writes PNGs (matplotlib, the ``plot`` extra): normalised latency against rate per
system (`plot_latency_vs_rate`) and KV use over time (`plot_kv_utilisation`); ``--plot-from``
draws them from a saved JSON (e.g. one fetched from a GPU machine without matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _baselines
import _workloads
import jax
import jax.numpy as jnp
from _engine_systems import JpagedSystem, ReservingJpaged, equal_memory_pages
from _serving_report import (
    HEADER,
    _downsample,
    _kept_results,
    _merge,
    _row,
    _sustainable,
    environment,
    serving_plots,
    summarize,
)

from jpaged import models

RESULTS = pathlib.Path(__file__).parent / "results"
_COMPILES = [0]


def _count_compile(event: str, duration_secs: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def backend_compiles() -> int:
    """XLA compiles in this process so far (every program: model steps, cache updates, ...)."""
    return _COMPILES[0]


SYSTEMS = (
    "jpaged",
    "static",
    "orca-max",
    "orca-pow2",
    "orca-oracle",
    "reserve-max",
    "reserve-pow2",
    "reserve-oracle",
)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A benchmark model and the serving sizes that go with it."""

    config: models.ModelConfig
    dtype: object
    max_len: int  # longest request (prompt + output)
    length_scale: dict[str, float]  # per dataset: multiplies its mean lengths
    kv_tokens: int  # default KV budget in token slots
    max_num_seqs: int
    rates: tuple[float, ...]
    quick_rates: tuple[float, ...]
    # --quick on a GPU model: per system, rates around its capacity ("inf" = every request at
    # once: the capacity run) and seconds of arrivals per rate (requests = rate x window).
    quick_system_rates: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    quick_window_s: float | None = None
    quick_capacity_requests: int = 128


_FULL = {"sharegpt": 1.0, "alpaca": 1.0}


def model_spec(name: str) -> ModelSpec:
    """``tiny`` (CPU smoke), ``llama-1b`` and ``llama-8b`` (random bf16 weights)."""
    on_cpu = jax.default_backend() == "cpu"
    if name == "tiny":
        # 8 sequences of max_len fit the pool, as in the paper's regime (below).
        return ModelSpec(models.tiny(), jnp.float32 if on_cpu else jnp.bfloat16, 512,
                         {"sharegpt": 0.25, "alpaca": 1.0}, 8 * 512, 32,
                         (4.0, 16.0, 64.0), (4.0, 64.0))  # fmt: skip
    # The paper's regime: the KV pool, not compute, limits the batch (OPT-13B on an A100-40GB
    # held about 7.5 sequences of 2048 tokens; here 16). 128 running sequences is more than
    # the pool holds at ShareGPT-like lengths, and keeps Orca-Oracle's slot buffer (128 x 2048
    # tokens) within the H200 beside the weights.
    # Quick grids around each system's capacity at ShareGPT-like lengths (8B: from the decode
    # step times, static batching ~3.5 req/s, Orca-Max ~10; jpaged measured 14 req/s before
    # the lookahead fix on 2026-11-29), 10-12 s of arrivals per rate.
    inf = math.inf
    if name == "llama-1b":
        return ModelSpec(models.llama3_2_1b(), jnp.bfloat16, 2048, _FULL, 16 * 2048, 128,
                         (2.0, 4.0, 8.0, 16.0, 32.0), (2.0, 8.0, 24.0),
                         {"static": (2.0, 4.0, 8.0, 12.0, inf),
                          "orca-max": (4.0, 8.0, 16.0, 24.0, 32.0, inf),
                          "orca-pow2": (8.0, 16.0, 32.0, 48.0, 64.0, inf),
                          "orca-oracle": (8.0, 16.0, 32.0, 48.0, 64.0, inf),
                          "reserve-max": (4.0, 8.0, 16.0, 24.0, 32.0, inf),
                          "reserve-pow2": (8.0, 16.0, 32.0, 48.0, 64.0, inf),
                          "reserve-oracle": (8.0, 16.0, 32.0, 48.0, 64.0, inf),
                          "jpaged": (8.0, 16.0, 32.0, 48.0, 64.0, inf)},
                         12.0, 128)  # fmt: skip
    if name == "llama-8b":
        return ModelSpec(models.llama3_8b(), jnp.bfloat16, 2048, _FULL, 16 * 2048, 128,
                         (1.0, 2.0, 4.0, 8.0, 12.0), (1.0, 3.0, 8.0),
                         {"static": (1.0, 2.0, 4.0, inf),
                          "orca-max": (4.0, 8.0, 12.0, 16.0, inf),
                          "orca-pow2": (4.0, 8.0, 16.0, 24.0, inf),
                          "orca-oracle": (8.0, 16.0, 24.0, 32.0, inf),
                          "reserve-max": (4.0, 8.0, 12.0, 16.0, inf),
                          "reserve-pow2": (4.0, 8.0, 16.0, 24.0, inf),
                          "reserve-oracle": (8.0, 16.0, 24.0, 32.0, inf),
                          "jpaged": (4.0, 16.0, 24.0, 32.0, 40.0, inf)},
                         10.0, 128)  # fmt: skip
    raise ValueError(f"model={name!r} must be one of tiny, llama-1b, llama-8b")


def precompile_jpaged(llm, *, threads: int | None = None) -> int:
    """Compiles every step program a `jpaged.LLM` can meet (``LLM.warmup``: its bucket grid,
    compiled by a thread pool); returns how many programs."""
    return llm.warmup(progress=False, threads=threads).num_programs


def make_system(name: str, model, *, budget_tokens: int, spec: ModelSpec, page_size: int,
                max_num_seqs: int, max_num_batched_tokens: int = 2048,
                num_decode_steps: int = 1, chain_decode: bool = True, swap_space: int = 0,
                cache_dtype=None):  # fmt: skip
    """Builds the named system (one of ``SYSTEMS``) over ``model`` with the given budget
    (``swap_space``: host bytes for jpaged's swapped-out pages; the baselines have none;
    ``cache_dtype``: jpaged's quantized pool in the same memory, jpaged systems only;
    ``num_decode_steps``, ``chain_decode``: `jpaged.LLM`'s, jpaged systems only)."""
    if name == "jpaged" or name.startswith("reserve-"):
        system = JpagedSystem(model, budget_tokens=budget_tokens, page_size=page_size,
                              max_len=spec.max_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              num_decode_steps=num_decode_steps, chain_decode=chain_decode,
                              swap_space=swap_space, cache_dtype=cache_dtype)  # fmt: skip
        if name == "jpaged":
            return system
        return ReservingJpaged(system, policy=name.removeprefix("reserve-"),
                               budget_tokens=system.pool_tokens, max_len=spec.max_len)  # fmt: skip
    if cache_dtype is not None:
        raise ValueError(f"system={name!r} has a contiguous cache in the model's dtype only")
    if name == "static":
        return _baselines.StaticBatching(model, budget_tokens=budget_tokens,
                                         max_len=spec.max_len,
                                         max_prefill_tokens=max_num_batched_tokens)  # fmt: skip
    if name.startswith("orca-"):
        return _baselines.Orca(model, policy=name.removeprefix("orca-"),
                               budget_tokens=budget_tokens, max_len=spec.max_len,
                               max_num_seqs=max_num_seqs,
                               max_prefill_tokens=max_num_batched_tokens)  # fmt: skip
    raise ValueError(f"system={name!r} must be one of {SYSTEMS}")


# ---------------------------------------------------------------------------------- harness


def run_trace(
    system,
    trace: list[_workloads.RequestSpec],
    prompts: list[list[int]],
    *,
    progress: bool = True,
    desc: str = "",
    sample_every_s: float = 0.05,
    max_run_s: float = math.inf,
    add_kwargs: dict | None = None,
) -> dict:
    """Serves ``trace`` in real time; returns per-request timings and KV usage samples.

    Requests are handed to the system when the wall clock passes their arrival time; the
    clock of a token is when the step that produced it returned. The run stops when every
    request finished, or after ``max_run_s`` (``saturated`` is then True).

    Returns:
      ``{"requests": [{"arrival_s", "prompt_len", "output_len", "token_times"}],
      "usage": [[t, allocated/pool, live/pool, seqs], ...], "wall_s", "saturated", "steps",
      "compiles", "counts"}``; ``counts``: the system's `RUN_COUNTS` over the run (model
      forwards, preemptions, bytes swapped out).
    """
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    times: list[list[float]] = [[] for _ in trace]
    finished = [False] * len(trace)
    usage: list[list[float]] = []
    compiles0, steps, counts0 = backend_compiles(), 0, system.counts()
    bar = _workloads.tqdm(
        total=len(trace), desc=desc, unit="req", disable=not progress, leave=False
    )
    nxt, last_sample, saturated = 0, -math.inf, False
    start = time.perf_counter()
    while True:
        now = time.perf_counter() - start
        while nxt < len(order) and trace[order[nxt]].arrival_s <= now:
            i = order[nxt]
            system.add(i, prompts[i], trace[i].output_len, **(add_kwargs or {}))
            nxt += 1
        if not system.has_work():
            if nxt == len(order):
                break
            time.sleep(max(0.0, trace[order[nxt]].arrival_s - now))
            continue
        events = system.step()
        steps += 1
        t = time.perf_counter() - start
        for rid, ntok, done in events:
            times[rid].extend([t] * (ntok - len(times[rid])))
            if done and not finished[rid]:
                finished[rid] = True
                bar.update(1)
        if t - last_sample >= sample_every_s:
            u = system.kv_usage()
            usage.append([t, u.allocated_slots / u.pool_slots, u.live_tokens / u.pool_slots,
                          u.num_seqs])  # fmt: skip
            last_sample = t
        if t > max_run_s:
            saturated = True
            break
    bar.close()
    wall = time.perf_counter() - start
    reqs = [
        {"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len,
         "token_times": times[i], "finished": finished[i]}
        for i, r in enumerate(trace)
    ]  # fmt: skip
    return {
        "requests": reqs,
        "usage": usage,
        "wall_s": wall,
        "saturated": saturated or not all(finished),
        "steps": steps,
        "compiles": backend_compiles() - compiles0,
        "counts": {k: v - counts0[k] for k, v in system.counts().items()},
    }


def _warm_up(system, trace, prompts) -> None:
    """Compiles what a run will need: the trace's prompts as one burst, then one at a time
    (and, for a baseline, every prefill and decode shape first).

    Output lengths are capped (compiled shapes depend on prompt lengths and batch sizes).
    """
    lm = getattr(system, "lm", None)
    if lm is not None:  # a baseline: compile every shape it can meet
        lm.precompile(system.max_prefill_tokens)
    else:
        precompile_jpaged(system.llm)
    short = [dataclasses.replace(r, output_len=min(r.output_len, 32), arrival_s=0.0)
             for r in trace]  # fmt: skip
    run_trace(system, short, prompts, progress=False)
    for i, r in enumerate(short):
        one = [dataclasses.replace(r, output_len=min(r.output_len, 8))]
        run_trace(system, one, [prompts[i]], progress=False)


def requests_for_rate(rate: float, num: int, window_s: float | None) -> int:
    """How many requests of the trace a run at ``rate`` serves.

    Without a window every run serves ``num``. With one, a finite rate serves ``rate x
    window_s`` requests (at least 8), so every run has about the same span of arrivals and
    a rate beyond a system's capacity builds a queue that grows for the whole window (a fixed
    count would make the overload shorter the higher the rate); ``inf`` (all at once: the
    capacity run) serves ``num``.

    >>> requests_for_rate(4.0, 100, None), requests_for_rate(4.0, 100, 12.0)
    (100, 48)
    >>> requests_for_rate(math.inf, 256, 12.0)
    256
    """
    if window_s is None or math.isinf(rate):
        return num
    return max(8, math.ceil(rate * window_s))


def sweep(model, spec: ModelSpec, trace, prompts, *, systems, rates, budget_tokens: int,
          page_size: int, max_num_seqs: int, max_num_batched_tokens: int = 2048,
          num_decode_steps: int = 1, chain_decode: bool = True, seed: int = 0,
          max_run_s: float = math.inf,
          warmup: int = 16, progress: bool = True, on_result=None,
          window_s: float | None = None, capacity_requests: int | None = None,
          swap_space: int = 0, bandwidth: dict | None = None, cache_dtype=None) -> dict:  # fmt: skip
    """Every system at every rate (same lengths, fresh Poisson arrivals per rate).

    ``rates``: one tuple for every system, or ``{system: tuple}``. ``window_s``: see
    `requests_for_rate` (the runs take the first requests of ``trace``, which must be long
    enough); ``capacity_requests``: requests of the ``inf`` run (default: all of ``trace``).

    ``bandwidth``: `serving_bandwidth`'s constants, for each point's MBU.

    Returns ``{system: [point, ...]}`` where a point is `summarize`'s dict plus ``rate`` and
    the KV usage series ``usage`` ([t, allocated, live fractions, seqs], downsampled).
    """
    per_system = rates if isinstance(rates, dict) else {name: rates for name in systems}
    results: dict[str, list[dict]] = {}
    outer = _workloads.tqdm(
        total=sum(len(per_system[n]) for n in systems), desc="sweep", unit="run",
        disable=not progress,
    )  # fmt: skip

    def build(name):
        # A fresh system per run (no state carried over); the jitted programs are module-level,
        # so a rebuilt system reuses what the warm-up compiled.
        return make_system(name, model, budget_tokens=budget_tokens, spec=spec,
                           page_size=page_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens,
                           num_decode_steps=num_decode_steps, chain_decode=chain_decode,
                           swap_space=swap_space, cache_dtype=cache_dtype)  # fmt: skip

    for name in systems:
        if warmup:
            _warm_up(build(name), trace[:warmup], prompts[:warmup])
        results[name] = []
        for rate in per_system[name]:
            system = build(name)
            num = capacity_requests if math.isinf(rate) and capacity_requests else len(trace)
            n = min(len(trace), requests_for_rate(rate, num, window_s))
            timed = _workloads.with_arrivals(trace[:n], rate, seed=seed + 1)
            run = run_trace(system, timed, prompts[:n], progress=progress, max_run_s=max_run_s,
                            desc=f"{name} @ {rate:g} req/s")  # fmt: skip
            lm = getattr(system, "lm", None)
            attention = "paged (jpaged dispatch)" if lm is None else lm.attention
            del system, lm
            point = {"rate": rate, **summarize(run, bandwidth), "attention": attention,
                     "usage": _downsample(run["usage"])}  # fmt: skip
            results[name].append(point)
            outer.update(1)
            outer.write(_row(name, point))
            if on_result is not None:
                on_result(results)
    outer.close()
    return results


def serving_bandwidth(model, pool_slots: int, cache_dtype=None) -> dict:
    """What a run's MBU needs (`_serving_report.summarize`): the bytes a forward reads of the
    weights and per live token of K/V (of ``cache_dtype``'s pool, scales included, if given),
    the KV budget in slots, and the HBM read roofline measured now
    (``_timing.read_roofline_tbs``; 4 GiB on a GPU, 16 MiB elsewhere)."""
    import _timing
    from diagnostics.decode_step import _weight_bytes

    cfg = model.config
    itemsize = jnp.dtype(model.embed_VD[...].dtype).itemsize
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    if cache_dtype is not None:  # codes of one byte and an f32 scale per token and KV head
        kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    roof, _ = _timing.read_roofline_tbs((4 << 30) if jax.default_backend() == "gpu" else 1 << 24)
    return {"weight_bytes": _weight_bytes(model), "pool_slots": pool_slots, "roofline_tbs": roof,
            "kv_bytes_per_token": kv_bytes}  # fmt: skip


def realistic_kv_tokens(model, spec: ModelSpec, max_num_seqs: int) -> int:
    """The KV budget of ``jpaged.LLM``'s default memory (60% of the device memory left with
    the model loaded), at most ``max_num_seqs`` sequences of ``max_len``: the engine's own
    regime, beside the paper's pool-bound one."""
    from jpaged.engine.model_setup import default_kv_bytes

    cfg = model.config
    itemsize = jnp.dtype(model.embed_VD[...].dtype).itemsize
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    return min(default_kv_bytes() // per_token, max_num_seqs * spec.max_len)


def load_model(spec: ModelSpec, seed: int = 0):
    return models.init_random(spec.config, seed=seed, dtype=spec.dtype)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "llama-1b", "llama-8b"))
    ap.add_argument("--dataset", default="sharegpt", choices=sorted(_workloads.DISTRIBUTIONS))
    ap.add_argument("--trace", help="JSON trace (overrides --dataset/--num-requests)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--rates", help="comma-separated request rates (req/s); 'inf' allowed")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV budget in token slots")
    ap.add_argument("--pool", default="paper", choices=("paper", "realistic"),
                    help="paper: the model's pool-bound budget (--kv-tokens); realistic: "
                    "jpaged.LLM's default memory, at most max-num-seqs x max-len tokens")  # fmt: skip
    ap.add_argument("--swap-gib", type=float, default=0.0,
                    help="host swap space of jpaged (GiB; the baselines have none)")  # fmt: skip
    ap.add_argument("--cache-dtype", default="bf16", choices=("bf16", "fp8", "int8"),
                    help="jpaged's KV cache: fp8 / int8 pools hold more tokens in the bytes of "
                    "the bf16 budget (jpaged systems only)")  # fmt: skip
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=None, help="longest request (tokens)")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=1, help="jpaged num_decode_steps")
    ap.add_argument(
        "--chain-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="jpaged chain_decode (--no-chain-decode: one synchronous step a call)",
    )
    ap.add_argument("--slo", type=float, default=None, help="normalised latency bound (s/tok)")
    ap.add_argument(
        "--max-run-s",
        type=float,
        default=None,
        help="cap per run, then 'saturated' (default 600 s, --quick 90 s)",
    )
    ap.add_argument("--warmup", type=int, default=16, help="requests of the warm-up burst")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="few requests and rates")
    ap.add_argument(
        "--window",
        type=float,
        default=None,
        help="seconds of arrivals per finite rate (requests = rate x window; --quick on a GPU "
        "model: its spec's, 10 s for llama-8b)",
    )
    ap.add_argument("--plot", action="store_true", help="write PNGs (needs matplotlib)")
    ap.add_argument("--plot-from", metavar="JSON", help="only write the PNGs of a saved run")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/serving_*.json)")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the results already in --out (same settings) for other systems or rates",
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.plot_from:
        doc = json.loads(pathlib.Path(args.plot_from).read_text())
        for path in serving_plots(doc, pathlib.Path(args.plot_from).with_suffix("")):
            print(f"wrote {path}")
        return doc

    spec = model_spec(args.model)
    if args.max_len:
        spec = dataclasses.replace(spec, max_len=args.max_len)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"--systems: {s!r} must be one of {SYSTEMS}")
    rates = spec.rates if args.rates is None else tuple(float(r) for r in args.rates.split(","))
    window, capacity = args.window, None
    if args.quick and args.rates is None:
        rates = spec.quick_rates
        if spec.quick_system_rates:  # per-system grids (the same trace for every system)
            rates = {n: spec.quick_system_rates.get(n, spec.quick_rates) for n in SYSTEMS}
            window = spec.quick_window_s if window is None else window
            capacity = spec.quick_capacity_requests
    num = args.num_requests or capacity or (24 if args.quick else 200)
    if window is not None:  # enough requests for the longest window (every system's grid)
        grid = rates.values() if isinstance(rates, dict) else [rates]
        finite = [r for g in grid for r in g if math.isfinite(r)]
        num = max([num] + [requests_for_rate(r, num, window) for r in finite])
    if args.trace:
        trace = _workloads.read_trace(args.trace)
    else:
        trace = _workloads.make_trace(args.dataset, num, seed=args.seed, max_len=spec.max_len,
                                      scale=spec.length_scale[args.dataset])  # fmt: skip
    if isinstance(rates, dict):
        rates = {n: rates[n] for n in systems}
    max_num_seqs = args.max_num_seqs or spec.max_num_seqs
    max_run_s = args.max_run_s or (90.0 if args.quick else 600.0)
    model = load_model(spec, args.seed)
    if args.pool == "realistic":
        kv_tokens = realistic_kv_tokens(model, spec, max_num_seqs)
    else:
        kv_tokens = args.kv_tokens or spec.kv_tokens
    kv_tokens -= kv_tokens % args.page_size
    swap_space = int(args.swap_gib * (1 << 30))
    cache_dtype = None if args.cache_dtype == "bf16" else args.cache_dtype
    if cache_dtype is not None and any(s != "jpaged" and not s.startswith("reserve-")
                                       for s in systems):  # fmt: skip
        raise ValueError(f"--cache-dtype {cache_dtype}: --systems must be jpaged or reserve-*")
    pool_slots = kv_tokens
    if cache_dtype is not None:
        pool_slots = equal_memory_pages(model, kv_tokens, args.page_size, cache_dtype)
        pool_slots *= args.page_size
    bandwidth = serving_bandwidth(model, pool_slots, cache_dtype)
    prompts = _workloads.prompt_tokens(trace, spec.config.vocab_size, seed=args.seed)
    tag = f"{args.model}_{args.dataset if not args.trace else 'trace'}"
    tag += "_realistic" if args.pool == "realistic" else ""
    tag += f"_{cache_dtype}" if cache_dtype else ""
    out = pathlib.Path(args.out) if args.out else RESULTS / f"serving_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "env": environment(),
        "model": args.model,
        "workload": {"dataset": None if args.trace else args.dataset, "trace": args.trace,
                     **_workloads.summary(trace)},
        "kv_budget_tokens": kv_tokens,
        "cache_dtype": args.cache_dtype,
        "pool_slots": pool_slots,
        "pool": args.pool,
        "swap_space": swap_space,
        "bandwidth": bandwidth,
        "page_size": args.page_size,
        "max_len": spec.max_len,
        "max_num_seqs": max_num_seqs,
        "jpaged_decode": {"num_decode_steps": args.decode_steps,
                          "chain_decode": args.chain_decode},
        "window_s": window,
        "capacity_requests": capacity,
        "rates": sorted({r for g in rates.values() for r in g}) if isinstance(rates, dict)
        else list(rates),
    }  # fmt: skip

    kept = _kept_results(out, doc) if args.merge else {}

    def save(results):
        doc["results"] = _merge(kept, results)
        doc["rates"] = sorted({p["rate"] for pts in doc["results"].values() for p in pts})
        doc["summary"] = _sustainable(doc["results"], args.slo)
        out.write_text(json.dumps(doc, indent=1, default=float))

    print(f"{doc['env']['device']} jax {jax.__version__}: {args.model}, {len(trace)} requests,"
          f" KV budget {kv_tokens} tokens, page {args.page_size}")  # fmt: skip
    print(HEADER)
    results = sweep(model, spec, trace, prompts, systems=systems, rates=rates,
                    budget_tokens=kv_tokens, page_size=args.page_size,
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    num_decode_steps=args.decode_steps, chain_decode=args.chain_decode,
                    seed=args.seed,
                    max_run_s=max_run_s, warmup=args.warmup,
                    progress=not args.no_progress, on_result=save, window_s=window,
                    capacity_requests=capacity, swap_space=swap_space,
                    bandwidth=bandwidth, cache_dtype=cache_dtype)  # fmt: skip
    save(results)
    for name, points in kept.items():
        for p in points:
            if name not in results or p["rate"] not in {q["rate"] for q in results[name]}:
                print(_row(name, p) + "  (from --out)")
    print(json.dumps(doc["summary"], indent=1))
    print(f"wrote {out}")
    if args.plot:
        for path in serving_plots(doc, out.with_suffix("")):
            print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
