"""``benchmarks/startup.py`` end to end on CPU (tiny model): a cold process fills the
persistent compilation cache, a warm one loads every step program from it, neither compiles
anything after warm-up, and the MBU row's figures follow from its raw columns. Slow (two
processes compile the default configuration's programs): ``make test-all`` runs it."""

import json
import os
import sys

import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
)

import startup


@pytest.mark.slow
def test_cold_then_warm_start_and_mbu(tmp_path):
    out = tmp_path / "s.json"
    doc = startup.main(["--model", "tiny", "--mbu", "4", "--ctx", "64", "--output-len", "16",
                        "--cache", str(tmp_path / "cache"), "--cache-min-compile-s", "0",
                        "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    cold, warm = doc["phases"]
    for phase in (cold, warm):
        assert "error" not in phase, phase.get("error")
        assert phase["compiles_after_warmup"] == phase["recompiles_after_warmup"] == 0
        assert phase["start_s"] == pytest.approx(phase["llm_s"] + phase["warmup_s"])
        assert phase["config"]["max_num_seqs"] == 256  # jpaged.LLM's defaults
    steps = len(cold["programs"])
    assert cold["cache_hits"] == 0 and warm["cache_hits"] == steps
    assert [p["name"] for p in warm["programs"]] == [p["name"] for p in cold["programs"]]
    assert doc["warm_tokens_equal_cold"]  # the loaded programs give the compiled ones' tokens
    (row,) = warm["mbu"]
    assert row["batch"] == 4 and row["decode_steps"] >= 16 and row["floor_ms"] > 0
    assert 0 < row["host_fraction"] < 1 and row["mbu"] > 0
    counters = row["window_counters"]  # what moved while the B rows decoded
    assert counters["device_calls"] == row["device_calls"]
    assert counters["tokens_generated"] == pytest.approx(row["decode_steps"] * 4)
