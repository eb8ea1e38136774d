"""Fixtures shared by the engine tests."""

import jax
import pytest


@pytest.fixture
def backend_compiles():
    """XLA compiles of this process while the test runs (``jax.monitoring``): every placement
    of a program's inputs compiles anew, which the trace count (``recompiles``) does not see."""
    count = [0]

    def listen(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield lambda: count[0]
    jax.monitoring.unregister_event_duration_listener(listen)
