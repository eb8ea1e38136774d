"""Smoke tests of the benchmark suite: serving and memory (tiny model, a handful of requests)
and prefill attention (the XLA path, one small row), on CPU.

They check that the harness runs end to end and that what it measures is consistent: the
contiguous baselines generate exactly jpaged's greedy tokens (same model, same math), every
request gets its enforced output length, jpaged's KV waste stays under a page plus one decode
loop's reservation per sequence while the contiguous caches waste more, sharing and prefix
caching save pages, every derived figure (throughput, normalised latency, sustainable rate,
ratios, TFLOP/s) equals what the raw columns give, and the JSON holds the rows printed. Nothing
here times anything. One shape configuration (``serving.model_spec("tiny")``, page 16) is
used throughout, so the jitted programs compile once for the file.
"""

import dataclasses
import functools
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
import _serving_report
import _workloads
import memory
import serving

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
C = 16
SPEC = serving.model_spec("tiny")
KV = 16 * 64  # 2 sequences of max_len for static / Orca-Max: the pool is the bottleneck
MAX_LEN = 64
SPEC = serving.ModelSpec(
    SPEC.config, SPEC.dtype, MAX_LEN, SPEC.length_scale, KV, 8, (50.0,), (50.0,)
)


@functools.cache
def _model():
    return serving.load_model(SPEC)


def _trace(lengths, rate=math.inf, seed=0):
    trace = [_workloads.RequestSpec(p, o) for p, o in lengths]
    return _workloads.with_arrivals(trace, rate, seed=seed)


# Prompt lengths 1, C-1, C, C+1 and long; outputs cross page boundaries.
LENGTHS = [(1, 9), (C - 1, 3), (C, 17), (C + 1, 1), (40, 20)]


def _system(name, **kw):
    return serving.make_system(name, _model(), budget_tokens=KV, spec=SPEC, page_size=C,
                               max_num_seqs=8, **kw)  # fmt: skip


# ------------------------------------------------------------------------------ workloads


def test_workloads_are_seeded_and_match_their_documented_means():
    a = _workloads.sample_lengths("sharegpt", 20000, seed=1, max_len=1 << 30)
    assert a == _workloads.sample_lengths("sharegpt", 20000, seed=1, max_len=1 << 30)
    for name in ("sharegpt", "alpaca"):
        pairs = _workloads.sample_lengths(name, 20000, seed=2, max_len=1 << 30)
        d = _workloads.DISTRIBUTIONS[name]
        pm, om = np.mean([x for x, _ in pairs]), np.mean([y for _, y in pairs])
        assert abs(pm / d.prompt_mean - 1) < 0.06 and abs(om / d.output_mean - 1) < 0.06, name
    clipped = _workloads.sample_lengths("sharegpt", 500, seed=3, max_len=256)
    assert all(p >= 1 and o >= 1 and p + o <= 256 for p, o in clipped)
    gaps = np.diff(_workloads.poisson_arrivals(20000, 4.0, seed=0))
    assert abs(gaps.mean() * 4.0 - 1) < 0.05 and (gaps >= 0).all()
    assert not _workloads.poisson_arrivals(5, math.inf).any()


def test_trace_json_roundtrip_and_bad_input(tmp_path):
    trace = _workloads.make_trace("alpaca", 7, rate=3.0, seed=5)
    path = tmp_path / "t.json"
    _workloads.write_trace(path, trace, {"note": "x"})
    assert _workloads.read_trace(path) == trace
    path.write_text(json.dumps([{"prompt_len": 3}]))
    with pytest.raises(ValueError, match="output_len"):
        _workloads.read_trace(path)
    with pytest.raises(ValueError, match="name="):
        _workloads.sample_lengths("nope", 3)
    with pytest.raises(ValueError, match="rate="):
        _workloads.poisson_arrivals(3, 0.0)
    with pytest.raises(ValueError, match="policy="):
        _baselines.Orca(_model(), policy="pow3", budget_tokens=KV, max_len=MAX_LEN)


# ------------------------------------------------------------------------------ baselines


@functools.cache
def _jpaged_greedy():
    system = _system("jpaged")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, p).tolist() for p, _ in LENGTHS]
    run = serving.run_trace(system, _trace(LENGTHS), prompts, progress=False)
    assert not run["saturated"]
    return prompts, {i: out[0] for i, out in system.outputs.items()}


@pytest.mark.parametrize("name", ["static", "orca-max", "orca-pow2", "orca-oracle"])
def test_baselines_generate_jpaged_greedy_tokens_within_budget(name):
    prompts, want = _jpaged_greedy()
    system = _system(name)
    for i, (p, (_, o)) in enumerate(zip(prompts, LENGTHS, strict=True)):
        system.add(i, p, o)
    while system.has_work():
        system.step()
        u = system.kv_usage()
        assert u.live_tokens <= u.allocated_slots <= u.pool_slots == KV
    assert system.outputs == want
    assert [len(system.outputs[i]) for i in range(len(LENGTHS))] == [o for _, o in LENGTHS]


def test_baseline_precompile_covers_every_shape_a_run_meets():
    prompts, want = _jpaged_greedy()
    system = _system("orca-oracle", max_num_batched_tokens=64)
    assert system.lm.precompile(64) > 0
    before = serving.backend_compiles()
    for i, (p, (_, o)) in enumerate(zip(prompts, LENGTHS, strict=True)):
        system.add(i, p, o)
    while system.has_work():
        system.step()
    assert serving.backend_compiles() == before
    assert system.outputs == want


def test_jpaged_precompile_covers_every_shape_a_run_meets():
    # 5 shapes (decode, 3 loop sampling modes, the 32-token ragged step), the join of rows
    # into a running chain (one row bucket: no grow) and the page program of copy-on-write
    # at one page-count bucket (no swap space: no swap programs); prompts run chunked.
    system = _system("jpaged", max_num_batched_tokens=32)
    assert serving.precompile_jpaged(system.llm) == 7
    before = serving.backend_compiles()
    rng = np.random.default_rng(4)
    lengths = [(int(p), int(o)) for p, o in zip(rng.integers(1, 60, 12), rng.integers(1, 30, 12),
                                                strict=True)]  # fmt: skip
    # A burst (prefill-heavy steps) and a slow trickle (chains of decode loops, the next loop
    # dispatched from the previous one's carry): neither compiles anything.
    for rate in (300.0, 20.0):
        trace = _trace(lengths, rate=rate, seed=5)
        run = serving.run_trace(system, trace, _workloads.prompt_tokens(trace, 256),
                                progress=False)  # fmt: skip
        assert not run["saturated"] and run["compiles"] == 0
    assert serving.backend_compiles() == before
    assert system.llm.stats()["loop_decode_steps"] > 0


# ------------------------------------------------------------------------------ harness


def test_serving_harness_end_to_end_gives_sane_metrics():
    rng = np.random.default_rng(1)
    lengths = [(int(p), int(o)) for p, o in zip(rng.integers(1, 40, 6), rng.integers(1, 20, 6),
                                                strict=True)]  # fmt: skip
    trace = _trace(lengths, rate=200.0, seed=3)
    prompts = _workloads.prompt_tokens(trace, 256, seed=0)
    points = []
    for name in ("jpaged", "orca-max"):
        run = serving.run_trace(_system(name), trace, prompts, progress=False,
                                sample_every_s=0.0)  # fmt: skip
        for r, spec in zip(run["requests"], trace, strict=True):
            assert r["finished"] and len(r["token_times"]) == spec.output_len
            assert r["token_times"][0] >= r["arrival_s"]
            assert r["token_times"] == sorted(r["token_times"])
        u = np.asarray(run["usage"])
        assert ((u[:, 2] >= 0) & (u[:, 2] <= u[:, 1]) & (u[:, 1] <= 1)).all()
        if name == "jpaged":  # paged: the last page's tail + the slots reserved for one loop
            assert ((u[:, 1] - u[:, 2]) * KV <= u[:, 3] * (C - 1 + 8) + 1e-9).all()
        s = _serving_report.summarize(run)
        assert s["num_finished"] == 6 and not s["saturated"]
        assert s["throughput_tok_s"] == pytest.approx(sum(o for _, o in lengths) / s["duration_s"])
        assert s["throughput_req_s"] == pytest.approx(6 / s["duration_s"])
        assert s["duration_s"] == max(r["token_times"][-1] for r in run["requests"])
        ttft = [r["token_times"][0] - r["arrival_s"] for r in run["requests"]]
        for q in (50, 99):
            assert s["ttft_s"][f"p{q}"] == pytest.approx(float(np.percentile(ttft, q)))
        assert min(ttft) >= 0
        norm = [(r["token_times"][-1] - r["arrival_s"]) / r["output_len"] for r in run["requests"]]
        assert s["normalized_latency_s"] == pytest.approx(sum(norm) / len(norm))
        assert s["kv_waste_mean"] == pytest.approx(s["kv_allocated_mean"] - s["kv_live_mean"])
        points.append({"rate": 200.0, **s})
    assert _serving_report.sustainable_rate(points, slo=math.inf) == 200.0
    assert _serving_report.sustainable_rate([{**points[0], "saturated": True}], slo=math.inf) == 0.0
    slo = points[0]["normalized_latency_s"]  # the bound sits exactly on jpaged's latency
    assert _serving_report.sustainable_rate(points[:1], slo=slo) == 200.0
    assert _serving_report.sustainable_rate(points[:1], slo=slo * (1 - 1e-9)) == 0.0


def test_serving_main_writes_json_and_merges(tmp_path):
    out = tmp_path / "s.json"
    common = ["--rates", "100", "--num-requests", "3", "--warmup", "0", "--no-progress",
              "--out", str(out), "--kv-tokens", str(KV), "--max-len", str(MAX_LEN),
              "--max-num-seqs", "8"]  # fmt: skip
    serving.main(["--systems", "jpaged", *common])
    serving.main(["--systems", "static", "--merge", *common])
    doc = serving.main(["--systems", "static", "--merge", *common[2:], "--rates", "inf"])
    saved = json.loads(out.read_text())
    assert saved["env"]["jax"] and saved["kv_budget_tokens"] == KV
    assert saved["rates"] == [100.0, math.inf]
    assert [p["rate"] for p in saved["results"]["static"]] == [100.0, math.inf]
    assert [p["rate"] for p in saved["results"]["jpaged"]] == [100.0]
    for points in saved["results"].values():
        for p in points:
            assert p["num_finished"] == 3
            assert p["throughput_req_s"] == pytest.approx(3 / p["duration_s"])
    summary = doc["summary"]
    assert summary == saved["summary"]
    assert summary["sustainable_rate"].keys() == {"jpaged", "static"}
    lowest = min(pts[0]["normalized_latency_s"] for pts in saved["results"].values())
    assert summary["slo_s_per_token"] == pytest.approx(5 * lowest)
    for name, pts in saved["results"].items():
        ok = [p["rate"] for p in pts if math.isfinite(p["rate"]) and not p["saturated"]
              and p["normalized_latency_s"] <= summary["slo_s_per_token"]]  # fmt: skip
        assert summary["sustainable_rate"][name] == max(ok, default=0.0)
    rates = summary["sustainable_rate"]
    want = rates["jpaged"] / rates["static"] if rates["static"] else None
    assert summary["jpaged_over_static"] == (pytest.approx(want) if want is not None else None)
    with pytest.raises(ValueError, match="other settings"):
        serving.main(["--systems", "static", "--merge", *common, "--page-size", "8"])


def test_serving_windowed_sweep_and_capacity(tmp_path, monkeypatch):
    # --quick on a GPU model: per-system grids, rate x window requests per finite rate, an
    # inf (capacity) run of its own size; the same trace for every system, so runs merge.
    spec = dataclasses.replace(SPEC, quick_system_rates={"jpaged": (100.0, math.inf),
                                                         "static": (400.0,)},
                               quick_window_s=0.1, quick_capacity_requests=5)  # fmt: skip
    monkeypatch.setattr(serving, "model_spec", lambda name: spec)
    out = tmp_path / "w.json"
    common = ["--quick", "--warmup", "0", "--no-progress", "--out", str(out), "--merge"]
    serving.main(["--systems", "jpaged", *common])
    doc = serving.main(["--systems", "static", *common])
    assert doc["workload"]["num_requests"] == 40  # 400 req/s x 0.1 s: the longest window
    (fin, cap), (static,) = doc["results"]["jpaged"], doc["results"]["static"]
    assert (fin["rate"], fin["num_requests"]) == (100.0, 10)
    assert (cap["rate"], cap["num_requests"]) == (math.inf, 5)
    assert static["num_requests"] == 40
    assert all(p["num_finished"] == p["num_requests"] for p in (fin, cap, static))
    summary = doc["summary"]
    ok = fin["normalized_latency_s"] <= summary["slo_s_per_token"] and not fin["saturated"]
    assert summary["sustainable_rate"]["jpaged"] == (100.0 if ok else 0.0)  # never inf
    assert summary["slo_s_per_token"] == pytest.approx(
        5 * min(fin["normalized_latency_s"], static["normalized_latency_s"])
    )
    assert summary["capacity"]["jpaged"]["tok_s"] == cap["throughput_tok_s"]
    assert "capacity_jpaged_over_static" not in summary  # static has no inf run


def test_doctests():
    import doctest

    for mod in (_workloads, _baselines, serving, memory):
        failed, _ = doctest.testmod(mod)
        assert failed == 0, mod.__name__


# ------------------------------------------------------------------------------ memory


def test_waste_jpaged_bounded_per_sequence_contiguous_more():
    rng = np.random.default_rng(2)
    trace = _trace([(int(p), int(o)) for p, o in zip(rng.integers(1, 30, 8),
                                                     rng.integers(5, 30, 8), strict=True)])  # fmt: skip
    prompts = _workloads.prompt_tokens(trace, 256, seed=1)
    w = memory.measure_waste(_model(), SPEC, trace, prompts, systems=("jpaged", "orca-max"),
                             budget_tokens=KV, page_size=C, max_num_seqs=8,
                             progress=False)  # fmt: skip
    assert w["jpaged"]["all_finished"] and w["orca-max"]["all_finished"]
    # The last page's tail + the slots reserved for an in-flight 8-step decode loop.
    assert w["jpaged"]["waste_slots_per_seq_max"] <= C - 1 + 8
    assert w["orca-max"]["waste_mean"] > 2 * w["jpaged"]["waste_mean"]
    assert w["orca-max"]["live_of_allocated_mean"] < w["jpaged"]["live_of_allocated_mean"]


@pytest.mark.parametrize("kind", ["n", "beam"])
def test_sharing_saves_pages(kind):
    trace = _trace([(2 * C + 3, 12), (C + 5, 20)])
    prompts = _workloads.prompt_tokens(trace, 256, seed=2)
    r = memory.measure_sharing(_model(), SPEC, trace, prompts, kind=kind, width=4,
                               budget_tokens=KV, page_size=C, max_num_seqs=8,
                               progress=False)  # fmt: skip
    assert r["pages_used_step_sum"] < r["pages_unshared_step_sum"]
    assert r["savings"] == pytest.approx(
        1 - r["pages_used_step_sum"] / r["pages_unshared_step_sum"]
    )
    assert r["page_map"]["shared_pages"] >= 2  # both prompts' full pages are shared


def test_prefix_caching_skips_the_shared_prompt():
    trace = _trace([(3, 4), (5, 2), (1, 3), (C + 1, 2)])
    prompts = _workloads.prompt_tokens(trace, 256, seed=3)
    p = memory.measure_prefix(_model(), SPEC, trace, prompts, prefix_len=2 * C,
                              budget_tokens=KV, page_size=C, max_num_seqs=8,
                              progress=False)  # fmt: skip
    assert p["on"]["shared_prefix_hit_fraction"] == 1.0
    assert p["off"]["shared_prefix_hit_fraction"] == 0.0
    assert p["off"]["prefill_tokens_computed"] == p["off"]["prompt_tokens"]
    assert p["on"]["prefill_tokens_computed"] == p["on"]["prompt_tokens"] - 3 * 2 * C
    assert p["prefill_saved_fraction"] > 0.5
    assert p["on"]["compiles"] == p["off"]["compiles"] == 0  # the warm-up compiled every shape


def test_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    point = {"rate": 1.0, "normalized_latency_s": 0.01, "saturated": False,
             "usage": [[0.0, 0.5, 0.4, 2], [0.1, 0.6, 0.55, 3]]}  # fmt: skip
    doc = {"model": "tiny", "env": {}, "workload": {"dataset": "alpaca"},
           "results": {"jpaged": [point, {**point, "rate": 2.0, "saturated": True}]},
           "summary": {"slo_s_per_token": 0.05},
           "sharing": [{"kind": "beam", "width": 2, "page_map": {
               "num_pages": 10, "owners": {"0": [0, 1], "3": [1]}}},
               {"kind": "n", "width": 4, "page_map": {"num_pages": 10, "owners": {}}}]}  # fmt: skip
    paths = _serving_report.serving_plots(doc, tmp_path / "s") + memory.memory_plots(
        doc, tmp_path / "m"
    )
    assert [p.name for p in paths] == ["s_latency.png", "s_kv.png", "m_pages_beam2.png"]
    (tmp_path / "memory.json").write_text(json.dumps({"sharing": doc["sharing"]}))
    memory.main(["--plot-from", str(tmp_path / "memory.json")])
    (tmp_path / "serving.json").write_text(json.dumps(doc))
    serving.main(["--plot-from", str(tmp_path / "serving.json")])
    paths += [tmp_path / "memory_pages_beam2.png", tmp_path / "serving_latency.png",
              tmp_path / "serving_kv.png"]  # fmt: skip
    for path in paths:
        assert path.read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------ prefill


def test_prefill_benchmark_writes_the_rows_it_prints(tmp_path):
    # The XLA path at one small length: the row's TFLOP/s, printed and saved, is the causal
    # FLOP count over the saved wall time.
    import subprocess

    out = tmp_path / "prefill.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "benchmarks/prefill_attention.py", "--impl", "xla", "--lengths", "64",
         "--batch-tokens", "128", "--skip-cudnn", "--skip-decode", "--skip-jax-fa3",
         "--calls", "1", "--rounds", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["impl"] == "xla" and doc["meta"]["jax"]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("prefill")]
    assert len(printed) == len(doc["rows"]) == 1
    (row,) = doc["rows"]
    shape = doc["meta"]["shape"]
    B, T = row["B"], row["T"]
    assert (B, T) == (2, 64)
    assert row["flops"] == 4 * B * shape["N"] * shape["H"] * T * T / 2
    entry = row["jpaged"]
    assert f"{entry['wall_us']:9.1f} us" in printed[0]
    tflops = row["flops"] / (entry["wall_us"] * 1e-6) / 1e12
    assert f"{tflops:6.1f} TF/s" in printed[0]
