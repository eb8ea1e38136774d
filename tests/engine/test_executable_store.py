"""The executable store: compiled step programs that a later process's warm-up loads without
tracing or lowering them. Each case runs engines in fresh processes (store_process.py), as
a user's restarts do."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_engine import dense_greedy

from jpaged.engine import executable_store

STEP_PROGRAMS = ["decode B=6", "loop B=6 greedy", "loop B=6 random", "loop B=6 truncate",
                 "ragged T=32 B=6"]  # fmt: skip
# A case ``make test`` leaves out and ``make test-all`` runs (``tests/conftest.py``), two fresh
# processes: torn entries (a stored program that fails is removed and compiled in CI:
# test_a_loaded_program_that_fails_its_first_run_is_removed_and_compiled).
SLOW_CASES = {
    "test_an_unreadable_entry_is_removed_and_compiled",
    # Two data-parallel replicas, each storing and loading its own 2-device programs (CI: a
    # fresh process loads every step program, test_a_fresh_process_loads_every_step_program_
    # without_tracing; what decides a program is in its key, test_anything_that_decides_the_
    # program_is_in_the_key; the replicas' routing, tests/parallel/mesh_cases.py)
    "test_data_parallel_replicas_each_load_their_own_programs",
}


def _process(directory, mode: str = "run", env: dict | None = None) -> tuple[dict, str]:
    """A fresh process's JSON line and its stderr."""
    done = subprocess.run(
        [sys.executable, "tests/engine/store_process.py", str(directory), mode],
        env={**os.environ, "PYTHONPATH": os.getcwd(), executable_store.CPU_ENV_VAR: "1",
             **(env or {})}, capture_output=True, text=True,
        timeout=300, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _store_files(directory) -> list[str]:
    path = os.path.join(directory, executable_store.SUBDIR)
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A cache directory a cold process filled, and that process's results."""
    directory = tmp_path_factory.mktemp("stored")
    cold, _ = _process(directory)
    return directory, cold


def _copy(stored, tmp_path):
    shutil.copytree(stored[0], tmp_path / "c")
    return tmp_path / "c"


def test_a_fresh_process_loads_every_step_program_without_tracing(stored, tmp_path):
    directory, cold = stored
    assert cold["loaded"] == 0 and cold["traces"] >= len(STEP_PROGRAMS)
    assert len(_store_files(directory)) == len(STEP_PROGRAMS)
    prompts = [[int(t) for t in p] for p in _prompts()]
    assert cold["tokens"] == [dense_greedy(p, 7) for p in prompts]
    warm, _ = _process(_copy(stored, tmp_path))
    assert warm["loaded"] == len(STEP_PROGRAMS) and warm["programs"] == STEP_PROGRAMS
    assert warm["traces"] <= 1  # the join program (a few scatters) goes through jax.jit
    assert "5 loaded compiled" in warm["summary"]
    # Decode loops, ragged and decode steps ran loaded: the same tokens, nothing traced.
    assert warm["tokens"] == cold["tokens"] and warm["recompiles_after_warmup"] == 0
    # An engine rebuilt over the same model runs the loaded programs too (never traced here).
    for out in (cold, warm):
        assert out["rebuilt_tokens"] == cold["tokens"] and out["rebuilt_traces"] == 0
        assert out["rebuilt_highest_traces"] >= 2  # the step and the loop, for this precision


def test_anything_that_decides_the_program_is_in_the_key(stored, tmp_path):
    # Another jpaged source, another JAX flag, other compiler options: nothing loads (of the
    # decode and ragged steps, which load without them).
    out, _ = _process(_copy(stored, tmp_path), "keys")
    assert out["loaded"] == len(STEP_PROGRAMS)
    assert out["edited_source"] == out["other_jax_flag"] == out["other_options"] == 0
    assert out["steps_again"] == 2 and out["again"] == len(STEP_PROGRAMS)


def test_an_unreadable_entry_is_removed_and_compiled(stored, tmp_path):
    directory = _copy(stored, tmp_path)
    store = directory / executable_store.SUBDIR
    names = _store_files(directory)
    (store / names[0]).write_bytes(b"torn write")
    (store / names[1]).write_bytes((store / names[1]).read_bytes()[:1000])
    out, err = _process(directory)
    assert out["loaded"] == len(STEP_PROGRAMS) - 2
    assert err.count("removing stored compiled program") == 2
    assert out["tokens"] == stored[1]["tokens"]
    # A CPU process that loaded programs stores none (module docstring): the two are gone.
    assert _store_files(directory) == names[2:]
    for name in os.listdir(directory):  # JAX's entries gone too: a clean process stores all
        if name.endswith("-cache"):
            os.remove(directory / name)
    shutil.rmtree(store)
    out, _ = _process(directory)
    assert out["loaded"] == 0 and _store_files(directory) == names


def test_a_loaded_program_that_fails_its_first_run_is_removed_and_compiled(stored, tmp_path):
    directory = _copy(stored, tmp_path)
    out, err = _process(directory, "badrun")
    assert out["loaded"] == len(STEP_PROGRAMS) - 1 and "loop B=6 greedy" not in out["programs"]
    assert "its first run failed: RuntimeError: INTERNAL: injected" in err
    assert out["tokens"] == stored[1]["tokens"] and out["recompiles_after_warmup"] == 0
    assert len(_store_files(directory)) == len(STEP_PROGRAMS) - 1


def test_data_parallel_replicas_each_load_their_own_programs(tmp_path):
    # A 2 x 2 ("data", "model") mesh of CPU devices: each replica stores its programs for its
    # own 2-device mesh, and the next process's replicas load them onto the same devices.
    env = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " "
                        "--xla_force_host_platform_device_count=4"}  # fmt: skip
    cold, _ = _process(tmp_path, "mesh", env)
    warm, _ = _process(tmp_path, "mesh", env)
    assert cold["loaded"] == 0 and len(_store_files(tmp_path)) == 2 * len(STEP_PROGRAMS)
    assert warm["loaded"] == 2 * len(STEP_PROGRAMS) and warm["traces"] <= 2
    assert warm["tokens"] == cold["tokens"] and warm["recompiles_after_warmup"] == 0


def test_no_store_without_a_local_cache_directory(tmp_path, monkeypatch):
    import jax

    devices = jax.devices()[:1]
    monkeypatch.setenv(executable_store.CPU_ENV_VAR, "1")
    assert executable_store.ExecutableStore.in_cache_dir(None, devices) is None
    assert executable_store.ExecutableStore.in_cache_dir("gs://bucket/jax", devices) is None
    store = executable_store.ExecutableStore.in_cache_dir(str(tmp_path), devices)
    assert store.directory == tmp_path / executable_store.SUBDIR
    monkeypatch.delenv(executable_store.CPU_ENV_VAR)  # off on the CPU by default
    assert executable_store.ExecutableStore.in_cache_dir(str(tmp_path), devices) is None


def test_a_loaded_programs_donated_output_traces_like_any_array(tmp_path, monkeypatch):
    """JAX's AutoLayout marker loads as JAX's own instance (the store's module docstring): on
    JAX 0.12 a scan over a loaded program's output from a donated input failed to trace."""
    import pickle

    import jax
    import jax.numpy as jnp
    from jax._src import layout

    monkeypatch.setattr(executable_store, "_LOADED_IN_PROCESS", [False])
    monkeypatch.setattr(executable_store, "process_cache_hits", lambda: 0)
    store = executable_store.ExecutableStore(tmp_path, jax.devices()[:1])
    double = jax.jit(lambda x, y: (x * 2, y + 1), donate_argnums=0)
    y = jnp.ones(3)
    assert store.save("k", double.lower(jnp.ones((2, 3, 4)), y).compile(), from_jax_cache=False)
    loaded = store.load("k", jax.tree.structure(((jnp.ones((2, 3, 4)), y), {})))
    assert loaded is not None
    out, _ = loaded(jnp.ones((2, 3, 4)), y)
    twice = jax.jit(lambda a: jax.lax.scan(lambda c, _: (c * 2, None), a, None, length=2)[0])
    assert (twice(out) == 8).all()
    assert pickle.loads(pickle.dumps(layout.AutoLayout)) is layout.AutoLayout


def test_a_failed_write_is_logged_and_warmup_goes_on(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv(executable_store.CPU_ENV_VAR, "1")
    import jax
    import jax.numpy as jnp

    (tmp_path / executable_store.SUBDIR).write_text("a file where the store's directory goes")
    store = executable_store.ExecutableStore.in_cache_dir(str(tmp_path), jax.devices()[:1])
    compiled = jax.jit(lambda x: x + 1).trace(jnp.zeros(3)).lower().compile()
    # The suite's process may have loaded programs (then a CPU store writes nothing at all).
    monkeypatch.setattr(executable_store, "_LOADED_IN_PROCESS", [False])
    monkeypatch.setattr(executable_store, "process_cache_hits", lambda: 0)
    with caplog.at_level("WARNING", logger="jpaged.engine.executable_store"):
        assert not store.save(store.key("x"), compiled, from_jax_cache=False)
    assert "cannot store a compiled program" in caplog.text
    assert os.listdir(tmp_path) == [executable_store.SUBDIR]  # no temporary file left


def _prompts():
    from _engine_helpers import random_prompts

    return random_prompts(41, (5, 13, 1, 22))


@pytest.mark.gpu
def test_a_fresh_gpu_process_loads_what_another_stored(tmp_path):
    # On a GPU the store is on by default (no environment variable): the second process
    # loads every step program and gives the first one's tokens.
    env = {executable_store.CPU_ENV_VAR: "0"}
    cold, _ = _process(tmp_path, env=env)
    warm, _ = _process(tmp_path, env=env)
    assert cold["loaded"] == 0 and len(_store_files(tmp_path)) == len(STEP_PROGRAMS)
    assert warm["loaded"] == len(STEP_PROGRAMS) and warm["traces"] <= 1
    assert warm["tokens"] == cold["tokens"] and warm["recompiles_after_warmup"] == 0
    assert warm["rebuilt_tokens"] == cold["tokens"] and warm["rebuilt_traces"] == 0
