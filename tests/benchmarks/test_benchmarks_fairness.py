"""The serving comparison's fairness rules, on CPU (tiny model, a handful of requests):

- ``reserve-*`` systems: jpaged's own engine admitting by Orca's contiguous reservations
  (the same decode loops, dispatch and kernels as jpaged; the memory policy alone differs);
- every run records model forwards, preemptions and swapped bytes, and its MBU;
- the sustainable rate needs every lower swept rate to pass;
- the realistic pool: jpaged.LLM's default memory, at most max_num_seqs x max_len.

Nothing here times anything; derived figures are checked against the raw columns.
"""

import doctest
import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
)

import _baselines
import _engine_systems
import _serving_report
import _workloads
import serving
from test_benchmarks_smoke import KV, MAX_LEN, SPEC, _model, _system, _trace

LENGTHS = [(5, 30), (20, 9), (33, 25), (1, 40), (12, 17), (40, 20), (8, 33), (17, 16)]


def _run(system, lengths=LENGTHS, rate=math.inf, seed=0):
    trace = _trace(lengths, rate=rate, seed=seed)
    prompts = _workloads.prompt_tokens(trace, 256, seed=seed)
    return serving.run_trace(system, trace, prompts, progress=False, sample_every_s=0.0)


@pytest.mark.parametrize("policy", ["max", "oracle"])
def test_reserving_jpaged_admits_by_reservation_and_keeps_jpaged_tokens(policy):
    budget = 2 * MAX_LEN  # Orca-Max: two requests at a time, in an engine pool of KV slots
    system = _engine_systems.ReservingJpaged(_system("jpaged"), policy=policy,
                                             budget_tokens=budget, max_len=MAX_LEN)  # fmt: skip
    held = []
    step = system.step

    def checked_step():
        out = step()
        assert system.reserved == sum(system.held.values()) <= budget
        held.append(len(system.held))
        return out

    system.step = checked_step
    run = _run(system)
    assert all(r["finished"] for r in run["requests"])
    if policy == "max":
        assert max(held) == 2
    else:  # prompt + output each: more fit, never beyond the budget
        need = sorted(p + o for p, o in LENGTHS)
        assert max(held) <= max(k for k in range(len(need) + 1) if sum(need[:k]) <= budget)
        assert max(held) > 2
    u = np.asarray(run["usage"])
    assert (u[:, 1] <= 1).all()  # allocated = reserved, a fraction of the reservation budget
    assert (u[:, 2] <= u[:, 1] + 1e-9).all()
    jpaged = _system("jpaged")
    _run(jpaged)
    assert system.outputs == jpaged.outputs  # the same engine, greedy: the same tokens
    assert system.name == f"reserve-{policy}" and system.counts()["forwards"] > 0


def test_reservation_rules():
    assert _baselines.reservation("max", 10, 5, 64) == 64
    assert _baselines.reservation("pow2", 10, 5, 64) == 18
    assert _baselines.reservation("pow2", 60, 5, 64) == 64  # capped at max_len
    assert _baselines.reservation("oracle", 10, 5, 64) == 15
    inner = _system("jpaged")
    with pytest.raises(ValueError, match="policy='min' must be one of"):
        _engine_systems.ReservingJpaged(inner, policy="min", budget_tokens=KV, max_len=MAX_LEN)
    with pytest.raises(ValueError, match="budget_tokens=10 must hold one sequence"):
        _engine_systems.ReservingJpaged(inner, policy="max", budget_tokens=10, max_len=MAX_LEN)
    with pytest.raises(ValueError, match="1 \\+ 70 > 64"):
        _system("reserve-max").add(0, [1], 70)


def test_runs_record_forwards_preemptions_and_mbu():
    bandwidth = {"weight_bytes": 1000, "kv_bytes_per_token": 10, "pool_slots": KV,
                 "roofline_tbs": 1e-9}  # fmt: skip
    for name in ("jpaged", "orca-max"):
        system = _system(name)
        before = system.llm.stats() if name == "jpaged" else None
        run = _run(system)
        counts = run["counts"]
        assert set(counts) == set(_engine_systems.RUN_COUNTS)
        if name == "jpaged":
            after = system.llm.stats()
            steps = ("single_steps", "steps_beside_chain", "chains_from_steps", "loop_decode_steps")
            assert counts["forwards"] == sum(after[k] - before[k] for k in steps)
            # Prefills ran outside single steps too (beside a chain, or starting one).
            assert after["steps_beside_chain"] + after["chains_from_steps"] > 0
            assert after["loop_decode_steps"] > 0
        else:
            assert counts["forwards"] == system.lm.forwards >= run["steps"]
            assert counts["preemptions_recompute"] == counts["preemptions_swap"] == 0
        s = _serving_report.summarize(run, bandwidth)
        live = np.asarray(run["usage"])[:, 2].mean() * KV
        want = counts["forwards"] * (1000 + live * 10) / s["duration_s"] / 1e3
        assert s["mbu"] == pytest.approx(want) and s["forwards"] == counts["forwards"]
        assert _serving_report.summarize(run)["mbu"] is None
        assert "preempt" in _serving_report.HEADER and _serving_report._row(name, {
            "rate": 1.0, **s})  # fmt: skip


def test_a_starved_pool_records_jpaged_preemptions():
    system = serving.make_system("jpaged", _model(), budget_tokens=96, spec=SPEC, page_size=16,
                                 max_num_seqs=8)  # fmt: skip
    run = _run(system, lengths=[(20, 30), (20, 30), (20, 30)])
    stats = system.llm.stats()
    assert run["counts"]["preemptions_recompute"] == stats["preemptions_recompute"] > 0
    assert run["counts"]["preemptions_swap"] == 0  # no host swap space: the baselines have none
    assert system.llm.kv.alloc.num_host_pages == 0


def test_sustainable_rate_needs_every_lower_rate_to_pass():
    def pt(rate, lat, saturated=False):
        return {"rate": rate, "normalized_latency_s": lat, "saturated": saturated}

    # The lower rates fail, a higher one passes: not sustainable at any rate.
    pts = [pt(1.0, 2.0), pt(2.0, 1.5), pt(4.0, 0.5), pt(math.inf, 0.1)]
    assert _serving_report.sustainable_rate(pts, slo=1.0) == 0.0
    pts = [pt(4.0, 0.5), pt(1.0, 0.2), pt(2.0, 0.3), pt(8.0, 0.9, saturated=True), pt(16, 0.1)]
    assert _serving_report.sustainable_rate(pts, slo=1.0) == 4.0  # unsorted input
    assert _serving_report.sustainable_rate([], slo=1.0) == 0.0
    failed, _ = doctest.testmod(_serving_report)
    assert failed == 0


def test_realistic_pool_and_main_with_reserving_systems(tmp_path):
    model = _model()
    per_token = 2 * model.config.num_layers * model.config.num_kv_heads * model.config.head_dim * 4
    from jpaged.engine.model_setup import default_kv_bytes

    assert serving.realistic_kv_tokens(model, SPEC, 8) == min(default_kv_bytes() // per_token,
                                                              8 * MAX_LEN)  # fmt: skip
    out = tmp_path / "r.json"
    doc = serving.main(["--systems", "jpaged,reserve-max", "--rates", "100,inf", "--pool",
                        "realistic", "--num-requests", "4", "--warmup", "0", "--no-progress",
                        "--max-len", str(MAX_LEN), "--max-num-seqs", "8", "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["pool"] == "realistic" and saved["swap_space"] == 0
    assert saved["kv_budget_tokens"] == 8 * MAX_LEN
    assert saved["bandwidth"]["pool_slots"] == 8 * MAX_LEN
    for name in ("jpaged", "reserve-max"):
        for p in saved["results"][name]:
            assert p["num_finished"] == 4 and p["mbu"] > 0 and p["forwards"] > 0
            assert p["compiles"] == 0 or p["rate"] == 100.0  # the first run compiles
    summary = doc["summary"]
    assert summary["capacity_jpaged_over_reserve-max"] == pytest.approx(
        summary["capacity"]["jpaged"]["tok_s"] / summary["capacity"]["reserve-max"]["tok_s"]
    )
    low = summary["ttft_at_lowest_rate"]["jpaged"]
    assert low["rate"] == 100.0 and low["p50_s"] == saved["results"]["jpaged"][0]["ttft_s"]["p50"]


# Slow (``make test-all``): the engine's fp8 / int8 pools hold 7,943 pages in bf16's 4,096
# pages of bytes in CI (tests/engine/test_engine_quantized.py); this runs serving.py on both.
@pytest.mark.slow
def test_quantized_pool_holds_more_tokens_in_the_same_memory(tmp_path):
    # --cache-dtype fp8: jpaged's pool in the bytes of the bf16 budget (codes of one byte and
    # an f32 scale per token and KV head), the reservations of reserve-* over that pool, and
    # the MBU's K/V bytes per token of that pool; the contiguous baselines refuse it.
    model = _model()
    cfg = model.config
    itemsize = np.dtype(model.embed_VD[...].dtype).itemsize
    pages = _engine_systems.equal_memory_pages(model, KV, 16, "fp8")
    want = KV * cfg.head_dim * itemsize // ((cfg.head_dim + 4) * 16)
    assert pages == want and pages * 16 > KV
    system = _system("jpaged", cache_dtype="fp8")
    assert system.pool_tokens == pages * 16
    assert system.llm.cache.k_pages.dtype.name == "float8_e4m3fn"
    reserving = _system("reserve-max", cache_dtype="fp8")
    assert reserving.budget_tokens == pages * 16
    run = _run(system)
    assert [len(r["token_times"]) for r in run["requests"]] == [n for _, n in LENGTHS]
    with pytest.raises(ValueError, match="contiguous cache in the model's dtype only"):
        _system("orca-max", cache_dtype="fp8")
    out = tmp_path / "s.json"
    args = ["--rates", "100", "--num-requests", "3", "--warmup", "0", "--no-progress",
            "--kv-tokens", str(KV), "--max-len", str(MAX_LEN), "--max-num-seqs", "8",
            "--cache-dtype", "fp8", "--out", str(out)]  # fmt: skip
    doc = serving.main(["--systems", "jpaged", *args])
    assert doc["cache_dtype"] == "fp8" and doc["pool_slots"] == pages * 16
    assert doc["bandwidth"]["kv_bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * (
        cfg.head_dim + 4
    )
    with pytest.raises(ValueError, match="--systems must be jpaged or reserve"):
        serving.main(["--systems", "jpaged,static", *args])
