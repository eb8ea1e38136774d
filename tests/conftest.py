"""Test configuration shared by the whole suite.

Strict dtype promotion everywhere (no silent f32 upcasts); warnings are errors
(pyproject.toml). Tests marked ``gpu``/``tpu`` are skipped unless that backend
is present.
"""

import os

# The engine's persistent compilation cache stays off here (it would write into the home
# directory); tests/engine/test_warmup.py turns it on in temporary directories.
os.environ.setdefault("JPAGED_COMPILATION_CACHE", "off")
# Nor JAX's own persistent cache from the environment (the Makefile sets one for the demo):
# the suite checks what the engine compiles, caches and reports, from a known start.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
os.environ.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)

import gc

import _fast_callbacks
import _fast_lowering
import jax
import pytest

from jpaged.engine import runner

jax.config.update("jax_numpy_dtype_promotion", "strict")
# Cross-lowering for CUDA spends half its time naming layout-inference variables: an
# output-identical shortcut (tests/_fast_lowering.py; checked in tests/test_lowered_ir.py).
_fast_lowering.install()
# The Pallas interpreters' callbacks take their operands faster, the same arrays
# (tests/_fast_callbacks.py; checked in tests/test_fast_callbacks.py).
_fast_callbacks.install()


_MAX_MAPPINGS = 30_000  # clear well below Linux's default vm.max_map_count (65530)


def _num_mappings() -> int:
    """Memory mappings of this process (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after a test module once the process holds many.

    On CPU each XLA executable maps its JIT code into the process (several memory mappings
    each). A worker that compiled a few thousand programs reached Linux's default limit of
    65530 mappings per process (``vm.max_map_count``), and the next compile segfaulted.
    Programs a later module needs again are recompiled.
    """
    yield
    if _num_mappings() > _MAX_MAPPINGS:
        jax.clear_caches()
        runner.clear_installed()  # the engine's installed executables (warm-up's)
        gc.collect()


def _backend() -> str:
    return jax.default_backend()


def _check_slow_cases(config, items):
    """Every id in a module's SLOW_CASES names one of its tests: a stale id (a test renamed or
    a case's id changed) would silently put a slow case back into ``make test``. Checked only
    when whole files or directories were collected (a node id given on the command line
    collects only part of a module)."""
    if any("::" in str(arg) for arg in config.args):
        return
    names: dict = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "SLOW_CASES"):
            names.setdefault(module, set()).add(item.name)
    stale = {
        module.__name__: sorted(set(module.SLOW_CASES) - found) for module, found in names.items()
    }
    stale = {name: ids for name, ids in stale.items() if ids}
    if stale:
        raise pytest.UsageError(f"SLOW_CASES ids that match no test (rename them): {stale}")


# Modules that run first, in this order: those whose cases start subprocesses or take the
# longest each. `pytest -n 2` hands tests out in collection order, so the long ones start
# early and the two workers end on short tests, together.
_RUN_FIRST = (
    "tests/parallel/test_parallel_mesh.py",  # 8-device and 2-process subprocesses
    "tests/engine/",  # one worker's (_ONE_WORKER)
    "tests/engine/test_executable_store.py",  # fresh processes
    "tests/examples/",  # the training script, the notebook's kernel
    "tests/test_examples.py",  # the examples, each a process
    "tests/kernels/paged_attention/test_paged_attention_gpu_interpret.py",  # up to 20 s a case
    "tests/test_lowered_ir.py",
    "tests/kernels/paged_attention/test_paged_attention_gpu_lowering.py",
)


# The engine tests run on one worker, together: their engines share a few shape
# configurations, whose step programs that worker then compiles once instead of both workers
# each compiling them (the executable store's cases run in fresh processes: not grouped).
_ONE_WORKER = "tests/engine/"
_OWN_PROCESSES = ("tests/engine/test_executable_store.py",)


def _grouped(path: str) -> bool:
    return path.startswith(_ONE_WORKER) and not path.startswith(_OWN_PROCESSES)


def _run_order(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    if _grouped(path):
        return _RUN_FIRST.index(_ONE_WORKER)
    for rank, first in enumerate(_RUN_FIRST):
        if path.startswith(first) and first != _ONE_WORKER:
            return rank
    return len(_RUN_FIRST)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's `--dist load` (the default of `-n`), but with the engine tests as one unit of
    work (`_ONE_WORKER`): every other test is a unit of its own, handed out in collection
    order to whichever worker is about to run out."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _ONE_WORKER if _grouped(nodeid.split("::", 1)[0]) else nodeid

    return _Scheduling(config, log)


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: every collected test is seen
def pytest_collection_modifyitems(config, items):
    _check_slow_cases(config, items)
    items.sort(key=_run_order)  # stable: each module keeps its order
    backend = _backend()
    skip_gpu = pytest.mark.skip(reason="needs a GPU backend (run with `pytest -m gpu` on a GPU)")
    skip_tpu = pytest.mark.skip(reason="needs a TPU backend (run with `pytest -m tpu` on a TPU)")
    for item in items:
        # A module's SLOW_CASES (test ids) are slow: left out of `make test`, run by test-all.
        if item.name in getattr(item.module, "SLOW_CASES", ()):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and backend != "gpu":
            item.add_marker(skip_gpu)
        if "tpu" in item.keywords and backend != "tpu":
            item.add_marker(skip_tpu)
