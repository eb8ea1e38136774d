"""Lowering a Pallas-Triton kernel for CUDA on a CPU host, as for a chosen GPU: the lowering
reads the compute capability of the abstract device in the current abstract mesh (Pallas ->
Triton IR for that GPU); XLA compiles the IR only for a real device, so this checks Pallas's
lowering and the kernel's API use, not the Triton compiler's code generation."""

from __future__ import annotations

import warnings

import jax
from jax._src.mesh import AbstractDevice, AbstractMesh


def lower_for_device(device_kind: str, f, args) -> str:
    """The text of ``jax.jit(f)`` lowered for CUDA with ``args`` (ShapeDtypeStructs) as if on
    ``device_kind`` (e.g. "NVIDIA A100", "NVIDIA L4", "Tesla T4")."""
    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), abstract_device=device)
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
