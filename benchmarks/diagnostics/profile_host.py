"""Host time of ``jpaged.LLM``'s decode steps on a small random model (CPU is fine).

For each batch size B: B requests (``--prompt-len`` prompt tokens, ``--output-len`` outputs,
``ignore_eos``, greedy) arrive at once; after prefill (every request has a token) the decode
phase is timed twice over (the first run compiles). Prints, per decode step, the engine's
own counters (``time_schedule_s``, ``time_step_s`` minus ``time_device_wait_s``; of that the
``time_dispatch_s`` the calls starting device work took) and the
wall time of ``LLM.step`` (which also builds the ``RequestOutput``s), then a cProfile of the
measured decode phase (top functions by own time) with ``--cprofile``.

    .venv/bin/python benchmarks/diagnostics/profile_host.py --batch 64,128 --cprofile
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

import jpaged
from jpaged import models


def run(B: int, *, prompt_len: int, output_len: int, page_size: int, k: int, prof) -> dict:
    cfg = models.tiny(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                      head_dim=32, max_position_embeddings=prompt_len + output_len + 8)  # fmt: skip
    model = models.init_random(cfg, seed=0, dtype=np.float32)
    rng = np.random.default_rng(B)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(B)]
    pages = B * (-(-(prompt_len + output_len) // page_size) + 2)
    res = None
    for rep in range(2):  # the first pass compiles
        llm = jpaged.LLM(model, page_size=page_size, num_pages=pages, max_num_seqs=B,
                         max_model_len=prompt_len + output_len + 1, num_decode_steps=k,
                         max_num_batched_tokens=min(2048, B * prompt_len),
                         enable_prefix_caching=False, eos_token_id=[])  # fmt: skip
        sp = jpaged.SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        for p in prompts:
            llm.add_request(p, sp)
        started: set[str] = set()
        while len(started) < B:
            started |= {o.request_id for o in llm.step() if o.outputs[0].token_ids}
        before, t0 = llm.stats(), time.perf_counter()
        if rep == 1 and prof is not None:
            prof.enable()
        steps = 0
        while llm.has_unfinished_requests():
            llm.step()
            steps += 1
        if rep == 1 and prof is not None:
            prof.disable()
        wall = time.perf_counter() - t0
        after = llm.stats()
        d = {k_: after[k_] - before[k_] for k_ in before if isinstance(before[k_], int | float)}
        n = d["tokens_generated"] / B  # decode steps
        host = d["time_schedule_s"] + d["time_step_s"] - d["time_device_wait_s"]
        res = {
            "batch": B, "decode_steps": n, "engine_steps": steps,
            "device_calls": d["device_calls"], "wall_ms_per_decode_step": wall / n * 1e3,
            "host_ms_per_decode_step": host / n * 1e3,
            "schedule_ms": d["time_schedule_s"] / n * 1e3,
            "step_minus_wait_ms": (d["time_step_s"] - d["time_device_wait_s"]) / n * 1e3,
            "device_wait_ms": d["time_device_wait_s"] / n * 1e3,
            "dispatch_ms": d.get("time_dispatch_s", float("nan")) / n * 1e3,
            "outside_counters_ms": (wall - d["time_schedule_s"] - d["time_step_s"]) / n * 1e3,
            "compiles": d["recompiles"],
        }  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="64,128")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    for B in (int(b) for b in args.batch.split(",")):
        prof = cProfile.Profile() if args.cprofile else None
        r = run(B, prompt_len=args.prompt_len, output_len=args.output_len,
                page_size=args.page_size, k=args.decode_steps, prof=prof)  # fmt: skip
        print(
            f"B={B:>4}: {r['decode_steps']:.0f} decode steps, {r['engine_steps']} engine steps, "
            f"{r['device_calls']} device calls; per decode step: wall "
            f"{r['wall_ms_per_decode_step']:.3f} ms, host (counters) "
            f"{r['host_ms_per_decode_step']:.3f} ms = schedule {r['schedule_ms']:.3f} + step "
            f"{r['step_minus_wait_ms']:.3f} (of which dispatch {r['dispatch_ms']:.3f}); device wait {r['device_wait_ms']:.3f} ms; outside "
            f"the counters (RequestOutput) {r['outside_counters_ms']:.3f} ms; "
            f"compiles {r['compiles']}"
        )
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
