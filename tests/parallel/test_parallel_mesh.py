"""Runs the many-device cases in subprocesses, so the rest of the suite keeps one device.

- ``mesh_cases.py`` under ``--xla_force_host_platform_device_count=8`` (tensor parallel 1, 2,
  4, 8 and a 2 x 2 data x model mesh; its slow cases in ``make test-all``);
- ``multihost_worker.py`` as two ``jax.distributed`` processes of 2 CPU devices each (gloo
  collectives): one model split over the 4 devices of both, driven by the leader.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _mesh_cases(marker: str) -> None:
    cmd = [sys.executable, "-m", "pytest", "tests/parallel/mesh_cases.py", "-q", "-x",
           "-p", "no:xdist", "-p", "no:cacheprovider", "-m", marker]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_mesh_cases_on_8_cpu_devices():
    _mesh_cases("not slow")


@pytest.mark.slow
def test_mesh_cases_on_8_cpu_devices_slow():
    _mesh_cases("slow")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_run_one_split_model_in_lockstep(tmp_path):
    port = _free_port()
    outs = [tmp_path / f"process{i}.json" for i in (0, 1)]
    procs = []
    for i in (0, 1):
        cmd = [sys.executable, "tests/parallel/multihost_worker.py", str(i), str(port),
               str(outs[i]), "--swap"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(2), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=900)[0])
        finally:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)
    results = [json.loads(o.read_text()) for o in outs]
    for r in results:
        assert (r["devices"], r["local"]) == (4, 2)
        # Both processes hold the same tokens: transformers' greedy continuation, for three
        # requests only the leader knew, through swap preemption of a 10-page pool.
        assert r["tokens"] == {f"r{i}": r["golden"] for i in range(3)}
        assert r["preemptions_swap"] >= 1
