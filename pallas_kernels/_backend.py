"""Backend facts used by dispatch: which platform runs, which GPU generation."""

from __future__ import annotations

import functools

import jax


def default_platform() -> str:
    """Returns "cpu", "gpu" or "tpu" for the default backend."""
    return jax.default_backend()


@functools.cache
def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first GPU, or None without one."""
    if default_platform() != "gpu":
        return None
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if cc is None:
        return None
    major, minor = (int(x) for x in str(cc).split(".")[:2])
    return major, minor


@functools.cache
def gpu_num_sms(default: int = 132) -> int:
    """Streaming multiprocessors of the first GPU (``default``, an H100/H200's 132, without
    one: cross-lowering on a CPU host sizes persistent grids for the H200)."""
    if default_platform() != "gpu":
        return default
    return int(getattr(jax.devices()[0], "core_count", None) or default)


def has_mosaic_gpu() -> bool:
    """True on NVIDIA GPUs that Mosaic GPU targets (Hopper sm90 and newer)."""
    cc = gpu_compute_capability()
    return cc is not None and cc >= (9, 0)
