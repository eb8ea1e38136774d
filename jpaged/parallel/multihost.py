"""Several hosts: one engine, run in lockstep by every process of a ``jax.distributed`` job.

Under ``jax.distributed.initialize()`` (one process per host) every process builds the same
``jpaged.LLM`` over the global mesh and makes the same calls in the same order: the host
side (scheduler, allocator, sampling seeds) is deterministic, so every process plans the
same steps and launches the same programs, each on its own devices. One process, the leader
(process 0), takes the requests; `broadcast_from_leader` hands each step's new requests to
the others before the step (BUILD.md, "Several devices and several hosts", has the loop).
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["broadcast_from_leader", "is_leader"]


def is_leader() -> bool:
    """True on process 0 (the one that takes requests), and in a one-process job."""
    return jax.process_index() == 0


def broadcast_from_leader(obj: Any) -> Any:
    """The leader's ``obj`` on every process (the others pass anything, e.g. None).

    The object travels pickled, as bytes padded to a power of two (>= 256), so a few
    broadcast programs serve every size. Every process must call it at the same point.
    In a one-process job it returns ``obj``.
    """
    if jax.process_count() == 1:
        return obj
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if is_leader() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(payload.size)))
    padded = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)
    padded[: payload.size] = payload
    data = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return pickle.loads(data[:size].tobytes())
