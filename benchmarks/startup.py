"""Engine start-up, cold and warm, then decode bandwidth (MBU) with the compiles counted.

Two processes in a row over one fresh persistent-compilation-cache directory:

- ``cold``: the model (random weights), ``jpaged.LLM(model)`` with its default configuration
  (every option at its default but the cache directory), ``LLM.warmup()``; nothing cached;
- ``warm``: the same again, the cache now filled by the cold process.

Each then serves a few requests of mixed lengths and sampling modes and counts the XLA
compiles that still happen (``compiles_after_warmup``: every program of the process, as
``jax.monitoring`` reports them; the target is zero). The warm process also measures the
engine's decode bandwidth at each ``--mbu`` batch size: B requests of ``--ctx`` prompt tokens
arrive at once, and over the window in which all B decode (from the step after the last one
got its first token, for ``--output-len`` more tokens of that one; no request may end before,
``finished_in_window`` says if one did), MBU = (weight bytes + the mean of the live K/V bytes
at the window's ends) per decode step / step time / the HBM read roofline measured in the same
process (``_timing.read_roofline_tbs``).

    python benchmarks/startup.py --model llama-8b --mbu 64,128,256
    python benchmarks/startup.py --model tiny --mbu 4       # CPU smoke run

Prints each phase and writes JSON (``--out``, default
``benchmarks/results/startup_<model>.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "diagnostics"))


def decode_mbu(llm, B: int, *, ctx: int, output_len: int, roofline_tbs: float,
               weight_bytes: int, kv_bytes_per_token: int, seed: int = 0) -> dict:  # fmt: skip
    """The engine's decode step time and MBU with B sequences decoding (see the module
    docstring); the requests still running at the end are aborted."""
    import numpy as np

    import jpaged

    budget, loop_steps = llm.max_num_batched_tokens, llm.num_decode_steps
    # The prompts are prefilled in `rounds` chunks of `budget` tokens, and the rows already
    # running decode beside them (up to k tokens a round: rows join a running chain), so when
    # the last row starts the first may be k * rounds tokens ahead. max_tokens leaves every
    # row running through the window that follows.
    rounds = math.ceil(B * ctx / budget) + 2
    max_tokens = output_len + loop_steps * (rounds + 1)
    rng = np.random.default_rng(seed + B)
    vocab = llm.model.vocab_size
    params = jpaged.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if ctx + max_tokens > llm.max_model_len or llm.max_num_seqs < B:
        raise ValueError(f"{B=} requests of {ctx=} + {max_tokens=} tokens exceed "
                         f"max_model_len={llm.max_model_len} or max_num_seqs={llm.max_num_seqs}")  # fmt: skip
    ids = [llm.add_request(rng.integers(0, vocab, ctx).tolist(), params) for _ in range(B)]
    mine = set(ids)  # a step also reports requests of an earlier batch (aborted ones)
    started: list[str] = []
    while len(started) < B:
        outs = [o for o in llm.step() if o.request_id in mine]
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]}")
        started += [o.request_id for o in outs
                    if o.outputs[0].token_ids and o.request_id not in started]  # fmt: skip
    last = started[-1]  # every row decodes in each step of the window: count the last one's

    def generated() -> int:
        return len(llm.get_output(last).outputs[0].token_ids)

    before, t0 = llm.stats(), time.perf_counter()
    target = generated() + output_len
    while generated() < target and llm.has_unfinished_requests():
        llm.step()
    wall = time.perf_counter() - t0
    after = llm.stats()
    finished = sum(llm.get_output(rid).finished for rid in ids)
    for rid in ids:
        if not llm.get_output(rid).finished:
            llm.abort(rid)
    d = {k: after[k] - before[k] for k in ("tokens_generated", "device_calls", "steps",
                                           "time_schedule_s", "time_step_s",
                                           "time_device_wait_s")}  # fmt: skip
    steps = d["tokens_generated"] / B
    step_s = wall / steps
    live = (before["live_tokens"] + after["live_tokens"]) / 2  # mean tokens in the cache
    host = d["time_schedule_s"] + d["time_step_s"] - d["time_device_wait_s"]
    # Every counter that moved in the window (single steps, chain starts, preemptions, ...):
    # where the device calls beyond one per loop of k steps came from.
    counters = {k: after[k] - before[k] for k in after
                if isinstance(after[k], int) and not isinstance(after[k], bool)
                and after[k] != before[k]}  # fmt: skip
    return {"batch": B, "ctx": ctx, "decode_steps": steps, "device_calls": d["device_calls"],
            "step_ms": step_s * 1e3, "host_fraction": host / wall,
            "mbu": (weight_bytes + live * kv_bytes_per_token) / step_s / (roofline_tbs * 1e12),
            "finished_in_window": finished, "window_counters": counters}  # fmt: skip


def loop_floor(llm, B: int, *, ctx: int, calls: int = 10, trace: bool = False) -> dict:
    """The engine's own decode loop program (row bucket B, greedy) called back to back on B
    sequences of ``ctx`` tokens, one sync at the end: device time per decode step when the
    host never waits (``floor_ms``); with ``trace``, a ``jax.profiler`` summary of 2 calls
    (kernels per step, the longest kernels: ``diagnostics/decode_step.summarize_trace``)."""
    import jax
    import numpy as np

    from jpaged.engine.batches import LoopBatch, sampling_arrays
    from jpaged.engine.buckets import stop_bucket

    k = llm.num_decode_steps
    Bp = llm.grid.rows(B)  # the loop program's row bucket: padding rows stay inactive
    ids = [f"floor-{b}" for b in range(B)]
    table = np.zeros((Bp, llm.width), np.int32)
    for b, sid in enumerate(ids):
        llm.alloc.allocate(sid, ctx + k)  # every call writes the same k positions
        t = llm.alloc.block_table(sid)
        table[b, : len(t)] = t
    rng = np.random.default_rng(B)
    zeros = np.zeros(Bp, np.int32)
    rows = np.arange(Bp) < B
    batch = LoopBatch(  # host arrays, as the engine's loops take them: no new compile
        tokens=rng.integers(0, llm.model.vocab_size, Bp).astype(np.int32),
        lens=np.where(rows, ctx, 0).astype(np.int32), block_tables=table, active=rows,
        live=rows, max_steps=np.where(rows, k, 0).astype(np.int32), min_steps=zeros,
        stop_ids=np.full((Bp, stop_bucket(0)), -1, np.int32),
        sampling=sampling_arrays(np.zeros((Bp, 5)), Bp),
    )  # fmt: skip

    def call():
        llm.cache, toks, *_ = llm.runner.decode_loop(llm.cache, batch, num_steps=k,
                                                     mode="greedy")  # fmt: skip
        return toks

    jax.block_until_ready(call())
    t0 = time.perf_counter()
    for _ in range(calls):
        toks = call()
    jax.block_until_ready(toks)
    row = {"floor_ms": (time.perf_counter() - t0) / (calls * k) * 1e3}
    if trace:
        from decode_step import summarize_trace

        d = tempfile.mkdtemp()
        with jax.profiler.trace(d):
            jax.block_until_ready([call() for _ in range(2)])
        row["trace"] = summarize_trace(d, 2 * k, top=12)
    for sid in ids:
        llm.alloc.free(sid)
    return row


def serve_mix(llm, seed: int = 0) -> list[list[int]]:
    """A few requests of mixed lengths and sampling modes (greedy, random, top-p, n = 2);
    returns every completion's tokens (seeded: a cold and a warm process give the same)."""
    import numpy as np

    import jpaged

    rng = np.random.default_rng(seed)
    vocab = llm.model.vocab_size
    lengths = [1, 7, 100, 300, 1500][: max(1, min(5, llm.max_model_len // 400 + 2))]
    prompts = [rng.integers(0, vocab, min(n, llm.max_model_len - 40)).tolist() for n in lengths]
    kinds = [dict(temperature=0.0), dict(temperature=1.0, seed=1),
             dict(temperature=0.8, top_p=0.9, seed=2), dict(temperature=1.0, n=2, seed=3)]  # fmt: skip
    params = [jpaged.SamplingParams(max_tokens=24, ignore_eos=True, **kinds[i % len(kinds)])
              for i in range(len(prompts))]  # fmt: skip
    return [c.token_ids for o in llm.generate(prompts, params) for c in o.outputs]


def _child(args) -> None:
    import _timing
    import jax
    import jax.numpy as jnp
    import serving
    from decode_step import _weight_bytes

    import jpaged

    imported = time.time() - args.launched
    compiles = [0]

    def count(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    if args.cache_min_compile_s is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", args.cache_min_compile_s)
    spec = serving.model_spec(args.model)
    t = time.perf_counter()
    model = serving.load_model(spec)
    jax.block_until_ready(jax.tree.leaves(model))
    model_s = time.perf_counter() - t
    t = time.perf_counter()
    steps = {} if args.decode_steps is None else {"num_decode_steps": args.decode_steps}
    llm = jpaged.LLM(model, eos_token_id=[], compilation_cache=args.cache, **steps)
    jax.block_until_ready(llm.cache)
    llm_s = time.perf_counter() - t
    report = llm.warmup(progress=False)
    print(report, flush=True)
    warm_compiles, warm_traces = compiles[0], llm.stats()["recompiles"]
    mix_tokens = serve_mix(llm)
    after = compiles[0] - warm_compiles
    out = {
        "phase": args.phase, "import_s": imported, "model_s": model_s, "llm_s": llm_s,
        "warmup_s": report.total_s, "start_s": llm_s + report.total_s,
        "threads": report.threads, "cache_dir": report.cache_dir,
        "num_programs": report.num_programs, "cache_hits": report.cache_hits,
        "num_loaded": report.num_loaded, "mix_tokens": mix_tokens,
        "page_programs_s": report.page_programs_s,
        "programs": [p.__dict__ for p in report.programs],
        "config": {"max_num_seqs": llm.max_num_seqs, "max_model_len": llm.max_model_len,
                   "max_num_batched_tokens": llm.max_num_batched_tokens,
                   "num_pages": llm.alloc.num_pages, "page_size": llm.page_size,
                   "num_decode_steps": llm.num_decode_steps},
        "compiles_during_warmup": warm_compiles,
    }  # fmt: skip
    if args.mbu:
        roof = (4 << 30) if jax.default_backend() == "gpu" else 1 << 24
        roof_tbs, _ = _timing.read_roofline_tbs(roof)
        cfg = model.config
        kv_tok = (
            2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(spec.dtype).itemsize
        )
        out["roofline_tbs"] = roof_tbs
        out["mbu"] = []
        before = compiles[0]  # the roofline's programs are not the engine's
        for B in (int(b) for b in args.mbu.split(",")):
            row = decode_mbu(llm, B, ctx=args.ctx, output_len=args.output_len,
                             roofline_tbs=roof_tbs, weight_bytes=_weight_bytes(model),
                             kv_bytes_per_token=kv_tok)  # fmt: skip
            row.update(loop_floor(llm, B, ctx=args.ctx, trace=args.trace))
            out["mbu"].append(row)
            print(f"B={B}: decode step {row['step_ms']:.3f} ms (floor {row['floor_ms']:.3f} ms), "
                  f"MBU {row['mbu']:.1%}, host {row['host_fraction']:.1%}; in the window: "
                  f"{row['window_counters']}", flush=True)  # fmt: skip
            if "trace" in row:
                print(json.dumps(row["trace"], indent=1)[:4000], flush=True)
        after += compiles[0] - before
    out["compiles_after_warmup"] = after
    out["recompiles_after_warmup"] = llm.stats()["recompiles"] - warm_traces
    print("RESULT " + json.dumps(out), flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "llama-1b", "llama-8b"))
    ap.add_argument("--mbu", default="", help="batch sizes of the MBU measurement (warm)")
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens of the MBU requests")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--trace", action="store_true", help="a profiler summary per MBU batch")
    ap.add_argument("--cache", default=None,
                    help="cache directory (default: a fresh one, removed at the end)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per phase")
    ap.add_argument("--cache-min-compile-s", type=float, default=None,
                    help="JAX's threshold for caching a program (default JAX's, 1 s)")  # fmt: skip
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--decode-steps", type=int, default=None, help="num_decode_steps (default: jpaged.LLM's)"
    )
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        _child(args)
        return {}
    from _serving_report import environment

    cache = args.cache or tempfile.mkdtemp(prefix="jpaged-startup-")
    doc = {"env": environment(), "model": args.model, "phases": []}
    out = pathlib.Path(args.out) if args.out else RESULTS / f"startup_{args.model}.json"
    for phase in ("cold", "warm"):
        cmd = [sys.executable, __file__, "--model", args.model, "--cache", cache, "--ctx",
               str(args.ctx), "--output-len", str(args.output_len), "--phase", phase,
               "--launched", str(time.time())]  # fmt: skip
        if args.cache_min_compile_s is not None:
            cmd += ["--cache-min-compile-s", str(args.cache_min_compile_s)]
        if args.decode_steps is not None:
            cmd += ["--decode-steps", str(args.decode_steps)]
        if phase == "warm" and args.mbu:
            cmd += ["--mbu", args.mbu] + (["--trace"] if args.trace else [])
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
            text, err = proc.stdout, (proc.stderr[-3000:] if proc.returncode else None)
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = f"timed out after {args.timeout} s"
        print(text, end="", flush=True)
        res = next((json.loads(x[7:]) for x in text.splitlines() if x.startswith("RESULT ")),
                   {"phase": phase})  # fmt: skip
        res["process_s"] = time.perf_counter() - t
        if err:
            res["error"] = err
            print(f"[{phase}] failed: {err}", flush=True)
        else:
            print(f"[{phase}] constructor {res['llm_s']:.1f} s + warm-up {res['warmup_s']:.1f} s"
                  f" = {res['start_s']:.1f} s ({res['num_loaded']} programs loaded compiled, "
                  f"{res['cache_hits']} cache hits; model "
                  f"{res['model_s']:.1f} s; process {res['process_s']:.1f} s); compiles after "
                  f"warm-up: {res['compiles_after_warmup']}", flush=True)  # fmt: skip
        doc["phases"].append(res)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
    mixes = [p["mix_tokens"] for p in doc["phases"] if "mix_tokens" in p]
    if len(mixes) == 2:  # the warm process's programs (loaded) give the cold one's tokens
        doc["warm_tokens_equal_cold"] = mixes[0] == mixes[1]
        print(f"warm tokens equal cold: {doc['warm_tokens_equal_cold']}", flush=True)
        out.write_text(json.dumps(doc, indent=1))
    if not args.cache:  # the fresh directory made here
        shutil.rmtree(cache, ignore_errors=True)
    print(f"wrote {out}")
    return doc


if __name__ == "__main__":
    main()
