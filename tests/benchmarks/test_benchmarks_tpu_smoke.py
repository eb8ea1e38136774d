"""`benchmarks/tpu_attention.py --smoke` end to end (the kernels in the TPU interpreter): the
Pallas kernels' outputs match the XLA path's on the benchmark's own inputs, and the JSON holds
the rows it printed with figures consistent with their times. Nothing here is a timing."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax.numpy as jnp
import pytest
from _tolerances import tol

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "tpu_attention", ROOT / "benchmarks/tpu_attention.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_tpu_benchmark_smoke_matches_xla_and_writes_what_it_prints(tmp_path, capsys):
    out = tmp_path / "tpu.json"
    result = _bench().main(["--smoke", "--out", str(out)])
    printed = [line for line in capsys.readouterr().out.splitlines() if "max |pallas" in line]
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert [row["kind"] for row in saved["rows"]] == ["decode", "prefill"]
    assert [line.split()[0] for line in printed] == ["decode", "prefill"]
    assert saved["env"]["smoke"] is True
    t = tol(jnp.bfloat16)
    for row, line in zip(saved["rows"], printed, strict=True):
        # Outputs are convex combinations of N(0, 1) values (|o| < 5); a wrong page, mask or
        # scale moves them by O(0.1-1), two correct bf16 implementations by about 1e-2.
        assert row["max_abs_diff_vs_xla"] <= t["atol"] + 5 * t["rtol"], row
        assert f"{row['max_abs_diff_vs_xla']:.2e}" in line
        per_us, unit = (row["live_bytes"], "tbs") if row["kind"] == "decode" else (
            row["flops"], "tflops")  # fmt: skip
        for impl in ("pallas_tpu", "xla"):
            entry = row[impl]
            assert entry[unit] == pytest.approx(per_us / (entry["us"] * 1e-6) / 1e12)
    decode, prefill = saved["rows"]
    assert decode["live_bytes"] >= 2 * (40 // 2) * 2 * 128 * 2 * 2  # B=2, >= ctx/2 each, K, H
    assert prefill["flops"] == 4 * 1 * 4 * 128 * 32 * 32 / 2  # B=1, N=4, H=128, T=32
