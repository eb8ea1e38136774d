"""Meshes for the engine: the ``"model"`` axis splits a model (tensor parallel), the ``"data"``
axis holds independent replicas (data parallel).

``jpaged.LLM(..., tensor_parallel_size=n)`` builds a mesh of the first n devices along
``"model"``; ``jpaged.LLM(..., mesh=mesh)`` takes a user's mesh whose axes are ``"model"``
and/or ``"data"``. The engine runs every program with the axes in ``Auto`` mode (XLA's
sharding propagation between the explicit ``shard_map`` of the model).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jpaged.parallel.layout import MODEL_AXIS

__all__ = ["AXES", "DATA_AXIS", "MODEL_AXIS", "engine_mesh", "make_mesh", "replica_meshes"]

DATA_AXIS = "data"
AXES = (DATA_AXIS, MODEL_AXIS)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, *, devices=None) -> Mesh:
    """A ``("data", "model")`` mesh of ``data_parallel_size * tensor_parallel_size`` devices.

    Devices are taken in ``jax.devices()`` order (process by process), so a model axis no
    longer than one host's devices stays inside a host (NVLink, one ICI slice host).

    Raises:
      ValueError: a size is not a positive int, or there are not enough devices.
    """
    for name, n in (("tensor_parallel_size", tensor_parallel_size),
                    ("data_parallel_size", data_parallel_size)):  # fmt: skip
        if not isinstance(n, int | np.integer) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}={n!r} must be an int >= 1")
    devices = list(jax.devices() if devices is None else devices)
    need = int(tensor_parallel_size) * int(data_parallel_size)
    if need > len(devices):
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size="
            f"{tensor_parallel_size} needs {need} devices; there are {len(devices)}"
        )
    grid = np.array(devices[:need], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def _check(mesh: Mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    unknown = [a for a in mesh.axis_names if a not in AXES]
    if unknown:
        raise ValueError(
            f"mesh axes {unknown} are not engine axes: name them {AXES} "
            f'("data": independent replicas, "model": tensor parallel)'
        )


def engine_mesh(tensor_parallel_size: int = 1, mesh: Mesh | None = None) -> Mesh | None:
    """The engine's ``("data", "model")`` mesh (``Auto`` axes), or None for one device.

    Raises:
      ValueError: a mesh with other axes, or a ``tensor_parallel_size`` other than 1 that
        differs from the mesh's ``"model"`` axis.
    """
    if mesh is None:
        return None if tensor_parallel_size == 1 else make_mesh(tensor_parallel_size)
    _check(mesh)
    shape = dict(mesh.shape)
    model, data = shape.get(MODEL_AXIS, 1), shape.get(DATA_AXIS, 1)
    if tensor_parallel_size not in (1, model):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must be 1 or the mesh's "
            f"{MODEL_AXIS!r} axis size {model} when a mesh is given"
        )
    if data > 1 and jax.process_count() > 1:
        raise ValueError(
            f"a {DATA_AXIS!r} axis of {data} under jax.distributed is not supported: every "
            "process runs every engine in lockstep; run one engine per host instead, or put "
            f"all devices on {MODEL_AXIS!r}"
        )
    devices = mesh.devices
    order = [mesh.axis_names.index(a) for a in AXES if a in mesh.axis_names]
    grid = np.transpose(devices, order).reshape(data, model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``("model",)`` mesh per index of the ``"data"`` axis of an engine mesh."""
    return [
        Mesh(row, (MODEL_AXIS,), axis_types=(AxisType.Auto,))
        for row in np.asarray(mesh.devices).reshape(mesh.shape[DATA_AXIS], -1)
    ]
