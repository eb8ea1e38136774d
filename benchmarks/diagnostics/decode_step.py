"""Where a decode step's time goes: jpaged's decode loop on device, per XLA configuration.

For each variant (XLA flags or compiler options, attention implementation), in its own process
(XLA flags are read once per process), and each batch size B (every sequence ``--ctx`` tokens
in the cache, greedy, ``--k`` steps per loop call):

- ``floor``: back-to-back calls of the engine's jitted decode loop (``Runner.decode_loop``)
  on a fixed batch, one sync at the end: device time per decode step when the host never
  waits, plus how long each call took to return (``dispatch``; a call that returns only after
  the device caught up means the host launches the work itself, kernel by kernel);
- ``engine``: `profile_decode` (the engine end to end: scheduling, chained loops; its host
  time from the engine's own counters);
- ``--trace``: a ``jax.profiler`` trace of a few floor calls, summarised (kernels per step,
  device busy time per step, the longest kernels by total time).

MBU = (weight bytes + live K/V bytes) per step / step time / HBM read roofline (same process).

    python benchmarks/diagnostics/decode_step.py --model llama-8b --batch 64,256 --variants default,none --engine

Variants (``VARIANTS``): ``default`` is jpaged's own configuration (``GPU_COMPILER_OPTIONS``),
``none`` XLA's defaults; the others are the configurations compared on the H200 on
2026-11-29 (``BENCHMARKS.md``, "Serving").
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent.parent  # benchmarks/
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

_GRAPH_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
_GRAPH_FLAGS = f"--xla_gpu_enable_command_buffer={_GRAPH_TYPES} --xla_gpu_graph_min_graph_size=1"
# name -> (extra XLA_FLAGS, LLM compiler_options, attention implementation, layer unroll)
VARIANTS: dict[str, tuple[str, dict | None, str | None] | tuple] = {
    "unroll": ("", {}, None, True),  # the layer scan fully unrolled (static weight slices)
    "scan": ("", {}, None, 1),  # the layer scan rolled
    "scan-cublas": (
        "--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false",
        {},
        None,
        1,
    ),
    "dsfusion": ("--xla_gpu_enable_dynamic_slice_fusion=true", {}, None),
    "dsfusion-cublas": (
        "--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false",
        {},
        None,
    ),
    "none": ("", {}, None),  # XLA's defaults
    "nographs": ("--xla_gpu_enable_command_buffer=", {}, None),
    "graphs": (_GRAPH_FLAGS, {}, None),
    "graphs-opts": (
        "",
        {"xla_gpu_enable_command_buffer": _GRAPH_TYPES, "xla_gpu_graph_min_graph_size": 1},
        None,
    ),
    "default": ("", None, None),  # jpaged's default_compiler_options()
    "cublas": ("", {"xla_gpu_enable_triton_gemm": False}, None),
    "graphs-xla-attn": (_GRAPH_FLAGS, {}, "xla"),
}


def summarize_trace(path: str, steps: int, top: int = 15) -> dict:
    """Device kernels of a ``jax.profiler`` trace: count, busy time per step, top kernels."""
    from jax._src.lib import _profile_data

    files = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {"error": "no xplane.pb written"}
    prof = _profile_data.ProfileData.from_file(files[0])
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    sample: dict[str, str] = {}  # one event's stats per kernel name (sizes of copies)
    spans = []
    busy = 0
    for plane in prof.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            intervals = []
            for ev in line.events:
                totals[ev.name] += ev.duration_ns
                counts[ev.name] += 1
                if ev.name not in sample:
                    sample[ev.name] = str(list(ev.stats))[:300]
                intervals.append((ev.start_ns, ev.end_ns))
            if not intervals:
                continue
            intervals.sort()
            spans += [intervals[0][0], intervals[-1][1]]
            end = -1
            for s, e in intervals:  # union of the line's busy time
                s = max(s, end)
                if e > s:
                    busy += e - s
                end = max(end, e)
    if not spans:
        lines = [(pl.name, [ln.name for ln in pl.lines]) for pl in prof.planes]
        return {"error": "no GPU stream events in the trace", "lines": lines[:8]}
    span = max(spans) - min(spans)
    return {
        "kernels_per_step": sum(counts.values()) / steps,
        "busy_ms_per_step": busy / steps / 1e6,
        "span_ms_per_step": span / steps / 1e6,
        "top": [
            {
                "name": n[:120],
                "ms_per_step": t / steps / 1e6,
                "calls_per_step": counts[n] / steps,
                "stats": sample.get(n, ""),
            }
            for n, t in totals.most_common(top)
        ],
    }


def _weight_bytes(model) -> int:
    """Parameter bytes a decode step reads (the embedding table only when tied)."""
    import jax.numpy as jnp

    from jpaged import models

    cfg = model.config
    itemsize = jnp.dtype(model.embed_VD[...].dtype).itemsize
    total = 0
    for name, shape in models.param_shapes(cfg).items():
        if name == "embed_VD" and not cfg.tie_word_embeddings:
            continue  # a gather of B rows
        total += math.prod(shape) * itemsize
    return total


def profile_decode(model, *, batch_sizes, prompt_len: int, output_len: int, page_size: int,
                   num_decode_steps: int = 8, roofline_bytes: int = 4 << 30,
                   progress: bool = True, engine_kw: dict | None = None,
                   roofline_tbs: float | None = None) -> dict:  # fmt: skip
    """Host scheduling time and memory-bandwidth utilisation of jpaged's decode, per batch size.

    For each B: B requests of ``prompt_len`` prompt tokens and ``output_len`` outputs arrive
    at once, twice (the first pass compiles; ``compiles`` counts those in the second's decode
    phase); the decode phase runs from the step after which every request has its first
    token until the first request finishes (every request decodes in every step of it). From the engine's own counters
    (``LLM.stats()``: ``time_schedule_s``, ``time_step_s``, ``time_device_wait_s``), host
    time = scheduling + step time - time spent waiting for the device. Step time = phase wall
    time / decode steps; MBU = (weight bytes + mean live K/V bytes) per decode step / step
    time, over the HBM read roofline measured in the same process (``_timing``).
    ``engine_kw`` goes to ``jpaged.LLM`` (e.g. ``compiler_options``); ``roofline_tbs``, when
    given, is used instead of measuring it again.
    """
    import _timing
    import _workloads
    import jax.numpy as jnp
    import numpy as np
    from serving import JpagedSystem, backend_compiles

    if roofline_tbs is None:
        roofline_tbs, _ = _timing.read_roofline_tbs(roofline_bytes)
    roof_tbs = roofline_tbs
    cfg = model.config
    itemsize = jnp.dtype(model.embed_VD[...].dtype).itemsize
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    weights = _weight_bytes(model)
    keys = ("time_schedule_s", "time_step_s", "time_device_wait_s", "tokens_generated",
            "steps", "device_calls")  # fmt: skip
    rows = []
    for B in _workloads.tqdm(batch_sizes, desc="decode profile", disable=not progress):
        budget = min(2048, B * prompt_len)
        # Requests start decoding as their prefill ends (chunked, `budget` tokens per step):
        # at most `stagger` steps apart. Each may generate output_len + stagger tokens, so
        # every one still runs for output_len steps after the last one started: the
        # measured window, which ends when the first request finishes.
        stagger = math.ceil(B * prompt_len / budget) + 2
        need = B * (math.ceil((prompt_len + output_len + stagger) / page_size) + 2) * page_size
        rng = np.random.default_rng(B)
        prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(B)]
        for _ in range(2):  # the first pass compiles what the second one measures
            system = JpagedSystem(model, budget_tokens=need, page_size=page_size,
                                  max_len=prompt_len + output_len + stagger + 1, max_num_seqs=B,
                                  num_decode_steps=num_decode_steps,
                                  max_num_batched_tokens=budget, **(engine_kw or {}))  # fmt: skip
            llm = system.llm
            for i, p in enumerate(prompts):
                system.add(i, p, output_len + stagger)
            started: set[int] = set()
            while len(started) < B:  # prefill (chunked) until every request has a token
                started |= {rid for rid, n, _ in system.step() if n >= 1}
            compiles, before, t0 = backend_compiles(), llm.stats(), time.perf_counter()
            done = False
            while not done and system.has_work():  # every request decoding
                done = any(fin for _, _, fin in system.step())
            wall = time.perf_counter() - t0
            after = llm.stats()
            compiles = backend_compiles() - compiles
            d = {k: after[k] - before[k] for k in keys}
            del system, llm
        steps = d["tokens_generated"] / B  # decode steps (every sequence decodes each step)
        host = d["time_schedule_s"] + d["time_step_s"] - d["time_device_wait_s"]
        live = B * (prompt_len + 1 + steps / 2)  # mean tokens in the cache over the phase
        step_s = wall / steps
        row = {
            "batch": B, "decode_steps": steps, "engine_steps": d["steps"],
            "device_calls": d["device_calls"], "wall_s": wall, "host_s": host,
            "device_wait_s": d["time_device_wait_s"], "host_fraction": host / wall,
            "step_s": step_s, "mbu": (weights + live * kv_per_token) / step_s / (roof_tbs * 1e12),
            "compiles": compiles,
        }  # fmt: skip
        rows.append(row)
        print(f"B={B:>4}: decode step {step_s * 1e3:7.3f} ms, host {host / steps * 1e3:7.3f} ms "
              f"per decode step ({row['host_fraction']:.1%} of the wall time; "
              f"{steps / max(d['device_calls'], 1):.1f} steps per device call), "
              f"MBU {row['mbu']:.1%}")  # fmt: skip
    return {"roofline_tbs": roof_tbs, "weight_bytes": weights,
            "kv_bytes_per_token": kv_per_token, "prompt_len": prompt_len,
            "output_len": output_len, "num_decode_steps": num_decode_steps,
            "rows": rows}  # fmt: skip


def _child(args) -> None:
    import _timing
    import jax
    import jax.numpy as jnp
    import numpy as np
    import serving

    import jpaged
    from jpaged.engine.batches import LoopBatch, SamplingArrays

    _, options, attention, *unroll = VARIANTS[args.variant]
    if unroll:
        from jpaged.models import _llama

        _llama.LAYER_SCAN_UNROLL = unroll[0]
    if attention is not None:  # every model layer's attention through this implementation
        from jpaged.models import _llama

        _llama.paged_attention_layer = functools.partial(
            _llama.paged_attention_layer, implementation=attention
        )
    spec = serving.model_spec(args.model)
    model = serving.load_model(spec)
    roof_bytes = (4 << 30) if jax.default_backend() == "gpu" else 1 << 24  # CPU: a smoke run
    roof_tbs, _ = _timing.read_roofline_tbs(roof_bytes)
    cfg = model.config
    itemsize = jnp.dtype(spec.dtype).itemsize
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    weights = _weight_bytes(model)
    k, ctx, C = args.k, args.ctx, 16
    out = {"variant": args.variant, "roofline_tbs": roof_tbs, "weight_bytes": weights,
           "compiler_options": options, "attention": attention, "rows": []}  # fmt: skip
    for B in [int(b) for b in args.batch.split(",")]:
        pages = B * (math.ceil((ctx + k) / C) + 1) + 8
        llm = jpaged.LLM(model, page_size=C, num_pages=pages, max_num_seqs=B,
                         max_model_len=min(ctx + 512, cfg.max_position_embeddings),
                         num_decode_steps=k, eos_token_id=[],
                         enable_prefix_caching=False, compiler_options=options)  # fmt: skip
        rng = np.random.default_rng(B)
        table = np.zeros((B, llm.width), np.int32)
        for b in range(B):
            llm.alloc.allocate(b, ctx + k)
            t = llm.alloc.block_table(b)
            table[b, : len(t)] = t
        i32 = functools.partial(np.zeros, dtype=np.int32)
        samp = SamplingArrays(temperature=np.zeros(B, np.float32), top_k=i32(B),
                              top_p=np.ones(B, np.float32), seed=i32(B), position=i32(B))  # fmt: skip
        batch = jax.device_put(LoopBatch(
            tokens=rng.integers(0, cfg.vocab_size, B).astype(np.int32),
            lens=np.full(B, ctx, np.int32), block_tables=table, active=np.ones(B, bool),
            live=np.ones(B, bool),
            max_steps=np.full(B, k, np.int32), min_steps=i32(B),
            stop_ids=np.full((B, 4), -1, np.int32), sampling=samp,
        ))  # fmt: skip

        def call(llm=llm, batch=batch):
            llm.cache, toks, *_ = llm.runner.decode_loop(
                llm.cache, batch, num_steps=k, mode="greedy"
            )
            return toks

        t0 = time.perf_counter()
        jax.block_until_ready(call())
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(call())
        calls, dispatch = args.calls, []
        t0 = time.perf_counter()
        for _ in range(calls):
            t = time.perf_counter()
            toks = call()
            dispatch.append(time.perf_counter() - t)
        jax.block_until_ready(toks)
        wall = time.perf_counter() - t0
        step_s = wall / (calls * k)
        live = B * (ctx + (k + 1) / 2)
        row = {"batch": B, "ctx": ctx, "k": k, "compile_s": compile_s,
               "floor_step_ms": step_s * 1e3,
               "dispatch_ms_per_call": float(np.median(dispatch)) * 1e3,
               "floor_mbu": (weights + live * kv_per_token) / step_s / (roof_tbs * 1e12)}  # fmt: skip
        if args.engine:
            prof = profile_decode(model, batch_sizes=[B], prompt_len=ctx,
                                          output_len=args.output_len, page_size=C,
                                          num_decode_steps=k, progress=False,
                                          roofline_tbs=roof_tbs,
                                          engine_kw={"compiler_options": options})  # fmt: skip
            e = prof["rows"][0]
            row["engine"] = {key: e[key] for key in ("step_s", "mbu", "host_fraction", "host_s",
                                                      "decode_steps", "device_calls")}  # fmt: skip
        if args.trace:  # last: CUPTI (the roofline's) fails after a trace
            d = tempfile.mkdtemp()
            with jax.profiler.trace(d):
                for _ in range(3):
                    toks = call()
                jax.block_until_ready(toks)
            row["trace"] = summarize_trace(d, 3 * k)
        del llm, call
        out["rows"].append(row)
        print("ROW " + json.dumps(row), flush=True)
        print(f"[{args.variant}] B={B}: floor {row['floor_step_ms']:.3f} ms/step "
              f"(MBU {row['floor_mbu']:.1%}), dispatch {row['dispatch_ms_per_call']:.3f} ms/call"
              + (f", engine {row['engine']['step_s'] * 1e3:.3f} ms/step" if args.engine else ""),
              flush=True)  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-1b", choices=("tiny", "llama-1b", "llama-8b"))
    ap.add_argument("--batch", default="64,128")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--output-len", type=int, default=64, help="engine phase output tokens")
    ap.add_argument("--variants", default="default,none")
    ap.add_argument("--engine", action="store_true", help="also profile the engine end to end")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per variant")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant
    args = ap.parse_args(argv)
    if args.variant:
        _child(args)
        return {}
    results = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "variants": []}  # fmt: skip
    out = pathlib.Path(args.out) if args.out else RESULTS / f"decode_step_{args.model}.json"
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: {name!r} is not one of {sorted(VARIANTS)}")
        env = dict(os.environ)
        flags = VARIANTS[name][0]
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
               "--variant", name]  # fmt: skip
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)  # fmt: skip
            text = proc.stdout
            err = proc.stderr[-3000:] if proc.returncode else None
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = f"timed out after {args.timeout} s"
        print(text, end="", flush=True)
        res = next((json.loads(x[7:]) for x in text.splitlines() if x.startswith("RESULT ")),
                   None)  # fmt: skip
        if res is None:  # failed or timed out: keep the rows it finished
            rows = [json.loads(x[4:]) for x in text.splitlines() if x.startswith("ROW ")]
            res = {"variant": name, "rows": rows}
        if err:
            res["error"] = err
            print(f"[{name}] failed: {err}", flush=True)
        results["variants"].append(res)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
