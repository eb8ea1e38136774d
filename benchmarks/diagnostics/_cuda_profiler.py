"""The CUDA profiler range the Nsight Compute scripts open around their measured calls
(``ncu --profile-from-start off`` profiles only inside it)."""

from __future__ import annotations

import ctypes


def profiler(start: bool) -> None:
    """``cuProfilerStart()`` (``start``) or ``cuProfilerStop()``; raises on a CUDA error."""
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = cuda.cuProfilerStart() if start else cuda.cuProfilerStop()
    if rc != 0:
        raise RuntimeError(f"cuProfiler{'Start' if start else 'Stop'} returned {rc}")
