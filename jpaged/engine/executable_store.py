"""Compiled step programs kept on disk and loaded without tracing or lowering them.

JAX's persistent compilation cache (`compile_cache`) skips XLA's compile, but it finds an
entry by the lowered program, so a hit still traces and lowers it: for a Llama-3-8B step
program 1-2.5 s of single-threaded Python, most of it the attention kernel's lowering. The
store keeps each warm-up program's executable (``jax.experimental.serialize_executable``)
under a key made of everything that decides the program, computed without tracing it:

- the store's format; the versions of JAX, jaxlib, its plugins, flax and jpaged; a hash of
  every source file of ``jpaged`` and ``pallas_kernels`` (an edited checkout is a new key);
- the backend: platform, platform version, the kinds and ids of the program's devices, the
  process count; JAX's flags (all but the cache's and logging's) and ``XLA_FLAGS``-style
  environment variables;
- the program (`program_key`): its name and static arguments, the model's graphdef (which
  holds its config), and the tree structure, shapes, dtypes and shardings of the state, the
  pool and the batch; the compiler options.

What the key cannot see is code patched at run time into jpaged or JAX; a store directory
is as trusted as the compiled code in it (loading one runs it). It lives inside the
persistent cache's directory, so ``compilation_cache=None`` turns both off. A corrupt or
unloadable entry is removed and the program compiles as without a store.

On the CPU an executable is written only by a process that has loaded none (from the store
or JAX's cache): XLA's CPU backend links a new program against functions that a loaded one
brought into the process, so its serialized copy lacks them and fails when run elsewhere
("Function ... not found"). A CPU process that loaded programs compiles the missing ones
without storing them; the next clean process stores them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import pickle
from collections.abc import Sequence
from typing import Any

import jax

from jpaged.engine.compile_cache import process_cache_hits

__all__ = ["ExecutableStore", "program_key"]

_LOG = logging.getLogger(__name__)
FORMAT = "jpaged-executable-store-1"
SUBDIR = "jpaged-executables"
# JAX flags that change where compiles are cached or what is logged, never a program.
_IGNORED_FLAGS = ("jax_compilation_cache", "jax_persistent_cache", "jax_enable_compilation_cache",
                  "jax_log", "jax_debug_log_modules", "jax_explain_cache_misses",
                  "jax_raise_persistent_cache_errors")  # fmt: skip
_ENV_PREFIXES = ("XLA_", "LIBTPU_", "TPU_", "NVIDIA_TF32", "MOSAIC_", "JAX_")
_ENV_IGNORED = ("JAX_COMPILATION_CACHE_DIR", "JAX_PLATFORMS")
_LOADED_IN_PROCESS = [False]  # any executable loaded from a store in this process


@functools.cache
def _packages_fingerprint() -> str:
    """sha256 over the versions of JAX and its neighbours and every file of ``jpaged`` and
    ``pallas_kernels`` (path and bytes), once per process."""
    h = hashlib.sha256(FORMAT.encode())
    for dist in sorted(d.metadata["Name"] or "" for d in importlib.metadata.distributions()):
        if dist.lower().startswith(("jax", "flax", "jpaged", "triton")):
            h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
    kernels = importlib.util.find_spec("pallas_kernels")
    roots = [pathlib.Path(__file__).parents[1]]  # jpaged
    roots += [pathlib.Path(kernels.origin).parent] if kernels and kernels.origin else []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _environment_fingerprint(devices: Sequence[jax.Device]) -> str:
    """The backend, JAX's flags and the compiler's environment variables."""
    d0 = devices[0]
    flags = sorted((k, repr(v)) for k, v in jax.config.values.items()
                   if not k.startswith(_IGNORED_FLAGS))  # fmt: skip
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(_ENV_PREFIXES) and k not in _ENV_IGNORED)  # fmt: skip
    parts = (d0.platform, getattr(d0.client, "platform_version", ""), jax.process_count(),
             [(d.id, d.device_kind) for d in devices], flags, env)  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def describe_tree(tree: Any) -> str:
    """The tree structure and each leaf's shape, dtype and sharding (a key part).

    >>> import numpy as np
    >>> describe_tree({"a": np.zeros((2, 3), np.int32)})
    "PyTreeDef({'a': *}) [((2, 3), 'int32', None)]"
    """
    leaves, treedef = jax.tree.flatten(tree)
    return f"{treedef} " + repr([(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))
                                 for x in leaves])  # fmt: skip


def program_key(*parts: Any) -> str:
    """The store key of one program: sha256 of ``parts`` (its name, static arguments,
    described inputs, ...), this jpaged and JAX, and the default backend's environment.

    >>> len(program_key("decode", 8))
    64
    """
    h = hashlib.sha256(_packages_fingerprint().encode())
    h.update(repr(parts).encode())
    return h.hexdigest()


class ExecutableStore:
    """Serialized executables in one directory, one file per program key.

    Args:
      directory: where the files live (made when the first is written).
      devices: the devices the programs run on, in the order their executables were
        compiled for (the model's device; a tensor-parallel mesh's devices, flat).
    """

    def __init__(self, directory: str | os.PathLike, devices: Sequence[jax.Device]):
        self.directory = pathlib.Path(directory)
        self.devices = tuple(devices)
        self._environment = _environment_fingerprint(self.devices)

    @classmethod
    def in_cache_dir(cls, cache_dir: str | None, devices: Sequence[jax.Device]):
        """The store inside the persistent compilation cache's directory, or None (no cache
        directory, or several processes: each would hold only its own devices' part)."""
        if cache_dir is None or jax.process_count() > 1:
            return None
        return cls(os.path.join(cache_dir, SUBDIR), devices)

    def key(self, *parts: Any) -> str:
        """`program_key` of ``parts`` on this store's devices and environment."""
        return program_key(self._environment, *parts)

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.jpx"

    def __contains__(self, key: str) -> bool:
        return self._path(key).is_file()

    def load(self, key: str, in_tree) -> jax.stages.Compiled | None:
        """The executable stored under ``key``, loaded onto this store's devices; None when
        there is none, when it was made for other arguments than ``in_tree`` (the
        ``((args...), {})`` structure of a call), or when it cannot be read (then it is
        removed)."""
        from jax.experimental import serialize_executable

        path = self._path(key)
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if entry["format"] != FORMAT or entry["in_tree"] != in_tree:
                return None
            _LOADED_IN_PROCESS[0] = True
            return serialize_executable.deserialize_and_load(
                entry["executable"], entry["in_tree"], entry["out_tree"],
                backend=self.devices[0].client, execution_devices=self.devices,
            )  # fmt: skip
        except FileNotFoundError:
            return None
        except Exception as e:  # a torn write, another jaxlib's bytes: compile instead
            _LOG.warning("jpaged: removing unreadable compiled program %s (%s: %s)", path,
                         type(e).__name__, e)  # fmt: skip
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Writes ``compiled`` under ``key`` (atomically: a reader sees all of it or none).
        Returns False where the backend cannot serialize it, or on the CPU after a load in
        this process (see the module docstring)."""
        from jax.experimental import serialize_executable

        if self.devices[0].platform == "cpu" and (_LOADED_IN_PROCESS[0] or process_cache_hits()):
            return False
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError, jax.errors.JaxRuntimeError) as e:
            _LOG.info("jpaged: a compiled program cannot be stored (%s)", e)
            return False
        entry = dict(format=FORMAT, in_tree=in_tree, out_tree=out_tree, executable=executable)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{id(compiled)}")
        with open(tmp, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        return True
