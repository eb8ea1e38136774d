"""`benchmarks/tpu_attention.py --smoke` runs end to end (kernels in the TPU interpreter)."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).parent.parent


def test_tpu_benchmark_smoke_runs_both_implementations():
    spec = importlib.util.spec_from_file_location(
        "tpu_attention", ROOT / "benchmarks/tpu_attention.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--smoke"])
    kinds = [row["kind"] for row in result["rows"]]
    assert kinds == ["decode", "prefill"]
    for row in result["rows"]:
        for impl in ("pallas_tpu", "xla"):
            assert row[impl]["us"] > 0
    assert result["env"]["smoke"] is True
