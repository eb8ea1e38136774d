"""Smoke tests of ``benchmarks/diagnostics/`` and of the suite's shared timing helpers and
decode-table plumbing, on CPU: tiny shapes, one variant each, in their own processes as on the
GPU. They check that the scripts run end to end, that what they write holds the rows they
print, and that every derived figure (MBU, TB/s, per-call times) is the quotient its docs give;
nothing here is a timing."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "diagnostics"))


def _run(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_decode_step_floor_engine_and_trace(tmp_path):
    out = tmp_path / "ds.json"
    stdout = _run(["benchmarks/diagnostics/decode_step.py", "--model", "tiny", "--batch", "8", "--ctx", "40",
                   "--k", "4", "--calls", "2", "--output-len", "6", "--variants", "default",
                   "--engine", "--trace", "--out", str(out)], tmp_path)  # fmt: skip
    (variant,) = json.loads(out.read_text())["variants"]
    assert "error" not in variant, variant.get("error")
    (row,) = variant["rows"]
    assert row["batch"] == 8
    # MBU = (weights + live K/V bytes) per step / step time / roofline, as the docstring says
    import serving

    cfg = serving.model_spec("tiny").config
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # f32
    roof = variant["roofline_tbs"] * 1e12
    live = 8 * (40 + (4 + 1) / 2)  # B x (ctx + the mean of the k=4 steps' new tokens)
    step_s = row["floor_step_ms"] / 1e3
    assert row["floor_mbu"] == pytest.approx(
        (variant["weight_bytes"] + live * kv_per_token) / step_s / roof
    )
    e = row["engine"]
    live = 8 * (40 + 1 + e["decode_steps"] / 2)  # the engine's window starts after prefill
    assert e["mbu"] == pytest.approx(
        (variant["weight_bytes"] + live * kv_per_token) / e["step_s"] / roof
    )
    assert "trace" in row  # CPU traces have no GPU stream: the summary says so
    assert f"[default] B=8: floor {row['floor_step_ms']:.3f} ms/step" in stdout
    summary = _run(["tools/summarize_decode_step.py", str(out)], tmp_path)
    assert summary.startswith("default B=8 floor")


def _fake_wall_us(calls_seen, us):
    """A stand-in for ``_timing.wall_us`` that records its calls and reports ``us``."""

    def wall_us(fn, *args, calls, rounds, warmup=2):
        calls_seen.append((fn(*args), calls, rounds))
        return us

    return wall_us


def test_loop_timing_chains_every_call(monkeypatch):
    import _timing
    import jax.numpy as jnp

    f = lambda x, y: (x + y).reshape(-1)  # noqa: E731  (reshaped back to x's shape)
    x, y = jnp.zeros((2, 3), jnp.float32), jnp.ones((2, 3), jnp.float32)
    out = _timing.chained(f, 7)(x, y)
    assert out.shape == (2, 3) and bool(jnp.all(out == 7.0))
    # loop_us times ONE call of the 4-call chain per round and divides by 4
    seen = []
    monkeypatch.setattr(_timing, "wall_us", _fake_wall_us(seen, 100.0))
    assert _timing.loop_us(f, x, y, iterations=4, rounds=2) == 25.0
    ((chained_out, calls, rounds),) = seen
    assert bool(jnp.all(chained_out == 4.0)) and (calls, rounds) == (1, 2)


def test_rooflines_are_bytes_over_time(monkeypatch):
    import _timing

    seen = []
    monkeypatch.setattr(_timing, "wall_us", _fake_wall_us(seen, 10.0))
    monkeypatch.setattr(_timing, "cupti_us", lambda fn, *a: 8.0)
    wall_tbs, cupti_tbs = _timing.read_roofline_tbs(1 << 20)
    assert (wall_tbs, cupti_tbs) == pytest.approx(
        ((1 << 20) / 10e-6 / 1e12, (1 << 20) / 8e-6 / 1e12)
    )
    monkeypatch.setattr(_timing, "cupti_us", lambda fn, *a: None)
    assert math.isnan(_timing.read_roofline_tbs(1 << 20)[1])  # no CUPTI, no kernel figure
    # the loop roofline: 3 chained reductions in one call, 30 us, so 10 us a read
    monkeypatch.setattr(_timing, "wall_us", _fake_wall_us(seen, 30.0))
    assert _timing.read_roofline_loop_tbs(1 << 20, iterations=3, rounds=2) == pytest.approx(
        (1 << 20) / 10e-6 / 1e12
    )
    total = seen[-1][0]  # each reduction reads x once: 3 sums of the same data
    assert float(total) == pytest.approx(3 * float(seen[0][0]), rel=1e-2)


def test_launch_gap_analysis(capsys):
    import profile_launch_gaps as plg

    # Two groups 50 ms apart; in the first, gaps of 1 and 3 us and two overlapping ops.
    ms = 1_000_000
    ops = [(0, 10_000, "k_a"), (11_000, 5_000, "k_b"), (12_000, 1_000, "k_side"),
           (19_000, 1_000, "MemcpyHtoD"), (50 * ms, 2_000, "k_c"), (50 * ms + 2_500, 2_000, "k_d")]  # fmt: skip
    host = [(5_000, 6_000, 1_000, "launch"), (8_000, 10_000, 2_000, "launch")]
    plg.analyze([(s, s + d, d, n) for s, d, n in ops], ["b2b", "chained"], host)
    out = capsys.readouterr().out
    assert "2 groups of GPU activity (6 ops)" in out
    assert "b2b: 4 ops (1 copies), busy 16.0 us, span 20.0 us, idle 4.0 us" in out
    assert "chained: 2 ops (0 copies), busy 4.0 us, span 4.5 us, idle 0.5 us" in out
    assert "host       3.0 us in    2 x launch" in out


def test_launch_gap_trace_parsing(tmp_path):
    import glob

    import jax
    import jax.numpy as jnp
    import profile_launch_gaps as plg

    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        f(x).block_until_ready()
    (path,) = glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)
    gpu, host = plg.gpu_events(path)
    assert host and all(e[1] - e[0] == e[2] >= 0 for e in host)
    assert bool(gpu) == (jax.default_backend() == "gpu")  # GPU ops only where there is one


def test_decode_attention_case_and_variant_parsing():
    import decode_attention

    assert decode_attention.parse_case("256,1024,8") == decode_attention.Case(256, 1024, 8)
    assert decode_attention.parse_case("8,512,4,64,256").H == 256
    assert decode_attention._parse_kwargs("num_stages=2,order_method=rank,swap_ab=False") == {
        "num_stages": 2, "order_method": "rank", "swap_ab": False}  # fmt: skip
    assert decode_attention._parse_kwargs("num_splits=none,fixed_max=TRUE") == {
        "num_splits": None, "fixed_max": True}  # fmt: skip
    import pytest

    with pytest.raises(SystemExit, match="B,ctx,K"):
        decode_attention.parse_case("256,x")
    with pytest.raises(SystemExit, match="name=value"):
        decode_attention._parse_kwargs("num_stages")


def test_decode_attention_only_rows_keep_the_whole_tables_draws():
    """``--only`` (``table_inputs``) gives a row the lengths, tables and data it has in a run of
    the whole table, in any order of rows; an index past the table is an error naming it."""
    import decode_attention as da
    import numpy as np
    import pytest

    cases = [da.Case(2, 64, 2), da.Case(3, 128, 1, C=8), da.Case(1, 32, 2, H=64), da.Case(4, 48, 1)]
    whole = {i: inp for i, _, inp in da.table_inputs(cases, width_multiple=4)}
    for order in ([2], [3, 1], [1, 3, 0, 2], [2, 2]):
        got = list(da.table_inputs(cases, order, width_multiple=4))
        assert [i for i, _, _ in got] == order
        for i, case, inp in got:
            assert case == cases[i]
            np.testing.assert_array_equal(inp.lengths_np, whole[i].lengths_np)
            np.testing.assert_array_equal(inp.block_tables, whole[i].block_tables)
            np.testing.assert_array_equal(inp.q, whole[i].q)
            np.testing.assert_array_equal(inp.k_pages, whole[i].k_pages)
    # rows differ from one another (the draws are not all the same)
    assert not np.array_equal(whole[0].lengths_np, whole[3].lengths_np[:2])
    # another seed, other draws; sequential pages keep each sequence's pages consecutive
    other = next(da.table_inputs(cases, [0], seed=1, width_multiple=4))[2]
    assert not np.array_equal(other.q, whole[0].q)
    seq = next(da.table_inputs(cases, [1], sequential=True))[2]
    n = -(-int(seq.lengths_np[0]) // 8)
    np.testing.assert_array_equal(seq.block_tables[0, :n], np.arange(n))
    with pytest.raises(SystemExit, match="row index 4 is out of range: the table has 4 rows"):
        list(da.table_inputs(cases, [4]))


def test_decode_timeline_reading_and_plot(tmp_path):
    # The profiler trace of a decode kernel (Mosaic GPU, GPU only) as the timeline script reads
    # it: 2 SMs x 2 slots, 8 CTAs of 4 regions; at 1.5 GHz each CTA ends as the next on its
    # slot starts, so the lowest consistent clock is 1.5 GHz and two CTAs run at any time.
    import profile_decode_timeline as tl

    events = []
    for cta in range(8):
        sm, wave = cta % 2, cta // 4
        start = 1000.0 + wave * 60.0  # us (globaltimer ns / 1e3)
        offset = 0.0  # cycles / 1e3 past the start: 90 in all, 60 us at 1.5 GHz
        for name, cycles in (("order", 3.0), ("prologue", 6.0), ("loop", 78.0), ("store", 3.0)):
            for ph, off in (("B", offset), ("E", offset + cycles)):
                events.append({"name": name, "ph": ph, "ts": start + off, "pid": sm + 1,
                               "tid": cta + 1})  # fmt: skip
            offset += cycles
    ctas = tl.ctas_from_trace(events)
    assert len(ctas) == 8 and {c["sm"] for c in ctas} == {0, 1}
    assert tl._fit_ghz(ctas) == 1.5
    s = tl.summarize(ctas, 1.5)
    assert abs(s["span_us"] - 120.0) < 1e-6 and s["tail_us"] == 60.0
    assert s["first_wave_ctas"] == 4 and abs(s["loop_median_us"] - 52.0) < 1e-6
    assert abs(s["mean_running"] - 4.0) < 1e-6 and len(s["drain_last_40us"]) == 16
    doc = {"label": "synthetic", "device": "cpu", "jax": "x", "roofline_us": 100.0,
           "ctas": [{k: c[k] for k in ("sm", "t_start", "t_end", "loop_us", "order_us",
                                        "prologue_us")} for c in ctas]}  # fmt: skip
    assert tl.timeline(doc, tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_decode_timeline_one_wave_and_no_order_region():
    # One wave (every CTA starts at once): the occupancy condition says nothing, so the clock
    # is the one that ends the last CTA at the kernel's CUPTI time. A trace without the order
    # region (the order off) reads the same; starts across a globaltimer wrap are unwrapped.
    import profile_decode_timeline as tl

    wrap = 2.0**32 / 1e3
    events = []
    for cta, cycles in enumerate((100.0, 150.0, 200.0)):
        start = wrap - 0.5 if cta == 0 else 0.2  # CTA 0 started just before the wrap
        for name, b, e in (
            ("prologue", 0.0, 2.0),
            ("loop", 2.0, cycles - 1),
            ("store", cycles - 1, cycles),
        ):
            events.append(
                {"name": name, "ph": "B", "ts": start + b, "pid": cta + 1, "tid": cta + 1}
            )
            events.append(
                {"name": name, "ph": "E", "ts": start + e, "pid": cta + 1, "tid": cta + 1}
            )
    ctas = tl.ctas_from_trace(events)
    assert max(c["start"] for c in ctas) - min(c["start"] for c in ctas) < 1.0  # unwrapped
    assert tl._fit_ghz(ctas, kernel_us=100.0) == 2.0  # 200 cycles / 1e3 over 100 us
    assert tl._fit_ghz(ctas) == 1.75
    s = tl.summarize(ctas, 2.0)
    assert "order_median_us" not in s and s["first_wave_ctas"] == 3


def test_decode_attention_measure_flags_bad_outputs(capsys):
    # Every timed output is checked: non-finite values are counted and a warning printed (the
    # reference is the untimed XLA call when --skip-xla drops its timing).
    import types

    import decode_attention
    import jax
    import jax.numpy as jnp
    import numpy as np

    ns = types.SimpleNamespace(calls=2, rounds=1, loop=False)
    res: dict = {}
    f = jax.jit(lambda x: x / x)
    x = jnp.array([1.0, 0.0, 2.0], jnp.float32)
    decode_attention._measure("bad", lambda: (f, (x,)), 12, ns, res, ref=np.ones(3))
    assert res["bad"]["nonfinite"] == 1
    assert "WARNING bad: 1 non-finite" in capsys.readouterr().out
    decode_attention._measure("good", lambda: (f, (x + 1.0,)), 12, ns, res, ref=np.ones(3))
    assert res["good"]["nonfinite"] == 0 and res["good"]["max_abs_err_vs_xla"] == 0.0


def test_stream_bound_kernel_reads_each_ctas_share(tmp_path):
    # The same-size streaming kernel in the interpreter: 7 tiles over 3 CTAs (3, 2, 2), each
    # CTA's output the first rows of the last tile its slot 0 held; and it lowers for CUDA.
    assert "interpreter check passed" in _run(
        ["benchmarks/diagnostics/stream_bound.py", "--interpret"], tmp_path
    )
    import jax
    import jax.numpy as jnp
    import numpy as np
    from stream_bound import decode_units, stream_kernel

    x = jax.ShapeDtypeStruct((4096, 128), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((264,), jnp.int32)
    text = stream_kernel(264, 128, 3).trace(x, idx, idx).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in text.as_text().lower()
    # The decode kernel's units in its dispatch order: 32 x 2k-token sequences at 8 KV heads
    # are split in two and ordered longest first; every tile of K and V is read once.
    rng = np.random.default_rng(0)
    lengths = rng.integers(1024, 3073, size=32)
    units = decode_units(lengths, K=8, W=192, C=16, H=128)
    assert len(units) == 32 * 2 * 8 and units.sum() == 8 * lengths.sum()
    assert np.all(np.diff(units[::16]) <= 0)  # longest first (a sequence's first split)
    assert np.all(units[::16] % 64 == 0)  # a first split ends on a tile boundary
    # 128 sequences at 4 KV heads and head dim 64: unsplit, longest first
    units = decode_units(lengths.repeat(4), K=4, W=192, C=16, H=64)
    assert len(units) == 128 * 4 and units.sum() == 4 * 4 * lengths.sum()
    assert np.all(np.diff(-(-units // 128)) <= 0)  # longest first by 128-token tiles


def test_dispatch_cost_runs_its_cases_and_checks_its_kernel(tmp_path):
    # On CPU: the host and wall figures of the no-op and of the Mosaic GPU copy kernel in the
    # interpreter (one process per XLA setting; the GPU cases are reported as skipped); the
    # copy kernel sums its inputs and lowers for CUDA with one TMA descriptor an input.
    out = tmp_path / "dc.json"
    stdout = _run(["benchmarks/diagnostics/dispatch_cost.py", "--cases", "noop,mgpu_copy2,ours",
                   "--interpret", "--flags", "default", "--calls", "3", "--rounds", "1",
                   "--out", str(out)], tmp_path)  # fmt: skip
    assert "noop" in stdout and "needs a GPU" in stdout
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]["default"]}
    # the host's enqueue time is part of the wall time of the same calls
    assert rows["noop"]["wall_us"] >= rows["noop"]["host_us"]
    for name in ("noop", "mgpu_copy2"):  # the table printed is the JSON's rows
        r = rows[name]
        assert f"{name:<16} {r['host_us']:>8.1f} {r['wall_us']:>8.1f}" in stdout
    assert rows["ours"] == {"case": "ours", "skipped": "needs a GPU"}
    import jax
    import jax.numpy as jnp
    import numpy as np
    from dispatch_cost import mgpu_copy, mgpu_descriptors

    from pallas_kernels.paged_attention import kernel_gpu

    xs = [jax.random.normal(jax.random.key(i), (64, 128), jnp.bfloat16) for i in range(3)]
    got = jax.jit(mgpu_copy(3, interpret=True))(*xs)
    want = sum(x.astype(jnp.float32) for x in xs).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), 0.02)
    # The per-input and per-descriptor cases: 3 inputs of which one is loaded (x_0); one
    # input loaded 3 times with 8, 16 and 24 rows (3 * its first 8 rows).
    got = jax.jit(mgpu_copy(3, interpret=True, loads=1))(*xs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(xs[0]))
    got = jax.jit(mgpu_descriptors(3, interpret=True))(xs[0])
    want = 3 * xs[0][:8].astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), 0.02, 0.05)
    spec = [jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)] * 3
    for f, args, descriptors in [
        (mgpu_copy(3), spec, 3),
        (mgpu_copy(3, loads=1), spec, 1),
        (mgpu_descriptors(3), spec[:1], 3),
    ]:
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text().lower()
        if kernel_gpu.swap_ab_lowers():  # tools/lowered_ir.py reads jax 0.11.2's modules
            sys.path.insert(0, os.path.join(ROOT, "tools"))
            import lowered_ir

            [kernel] = lowered_ir._kernel_texts(lowered)[1]
            assert kernel.count("callee = @mosaic_gpu_init_tma_desc") == descriptors


def test_decode_profile_splits_host_and_device_time():
    import decode_step
    import serving

    spec = serving.model_spec("tiny")
    C = 16
    p = decode_step.profile_decode(serving.load_model(spec), batch_sizes=[4], prompt_len=C + 1,
                                   output_len=12, page_size=C, num_decode_steps=4,
                                   roofline_bytes=1 << 20, progress=False)  # fmt: skip
    (row,) = p["rows"]
    # One prefill step starts all 4; each may make 12 + 3 tokens (3: the prefill stagger
    # bound); the first came from the prefill, the window ends when they all finish together.
    assert row["decode_steps"] == 14
    assert 1 <= row["device_calls"] <= 14 and row["engine_steps"] >= 1
    assert row["host_s"] <= row["wall_s"]
    assert row["host_fraction"] == pytest.approx(row["host_s"] / row["wall_s"])
    assert row["step_s"] == pytest.approx(row["wall_s"] / row["decode_steps"])
    live = 4 * (C + 1 + 1 + row["decode_steps"] / 2)  # mean tokens in the cache
    assert row["mbu"] == pytest.approx(
        (p["weight_bytes"] + live * p["kv_bytes_per_token"]) / row["step_s"]
        / (p["roofline_tbs"] * 1e12))  # fmt: skip
    assert row["compiles"] == 0
    cfg = spec.config  # untied: the embedding table is not read by a decode step
    assert p["weight_bytes"] == 4 * sum(
        math.prod(s) for n, s in serving.models.param_shapes(cfg).items() if n != "embed_VD"
    )


def test_tensor_parallel_runs_tp1_on_one_device(tmp_path):
    out = tmp_path / "tp.json"
    stdout = _run(["benchmarks/diagnostics/tensor_parallel.py", "--model", "tiny", "--tp", "1,2",
                   "--batch", "8", "--ctx", "40", "--k", "4", "--calls", "2", "--out", str(out)],
                  tmp_path)  # fmt: skip
    res = json.loads(out.read_text())
    assert res["devices"] == 1 and res["skipped_tp"] == [2]
    (row,) = res["rows"]
    assert (row["tp"], row["batch"], row["collective_ms"]) == (1, 8, 0.0)
    # MBU = the bytes one device reads per step / step time / roofline, as the docstring says
    live = 8 * (40 + (4 + 1) / 2)
    assert (
        row["device_bytes_per_step"]
        == row["device_weight_bytes"] + live * (row["device_kv_bytes_per_token"])
    )
    step_s = row["step_ms"] / 1e3
    assert row["mbu"] == pytest.approx(row["device_bytes_per_step"] / step_s / (
        res["roofline_tbs"] * 1e12))  # fmt: skip
    assert "TP=1 B=   8:" in stdout


@pytest.mark.slow
def test_tensor_parallel_on_two_devices_checks_tokens(tmp_path, monkeypatch):
    out = tmp_path / "tp.json"
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    monkeypatch.setenv("XLA_FLAGS", flags)
    _run(["benchmarks/diagnostics/tensor_parallel.py", "--model", "tiny", "--tp", "1,2",
          "--batch", "8", "--ctx", "40", "--k", "4", "--calls", "2", "--check",
          "--out", str(out)], tmp_path)  # fmt: skip
    res = json.loads(out.read_text())
    assert [(r["tp"], r["batch"]) for r in res["rows"]] == [(1, 8), (2, 8)]
    assert res["rows"][1]["collective_ms"] > 0 and res["rows"][1]["speedup_vs_tp1"] > 0
    # Greedy tokens at TP=2 equal TP=1's, f32 and bf16, demo model and test checkpoints.
    assert {(c["model"], c["dtype"], c["same_tokens_as_tp1"]) for c in res["check"]} == {
        (m, d, 1.0) for m in ("demo", "llama2", "llama3", "mistral", "qwen2")
        for d in ("float32", "bfloat16")
    }  # fmt: skip
