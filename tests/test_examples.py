"""The examples run end to end (``make demo`` runs ``examples/generate.py``)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("examples/generate.py", ["== greedy", "== beam search", "prefix_hit_rate", "cow_copies"]),
        ("examples/paged_attention.py", ["block tables:", "output is all zeros: True"]),
    ],
)
def test_example_runs(script, expected):
    proc = subprocess.run(
        [sys.executable, str(ROOT / script)], cwd=ROOT, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stdout, f"{text!r} missing from the output of {script}"
