"""Compiled step programs kept on disk and loaded without tracing or lowering them.

JAX's persistent compilation cache (`compile_cache`) skips XLA's compile, but it finds an
entry by the lowered program, so a hit still traces and lowers it: for a Llama-3-8B step
program 1.2-2.4 s of single-threaded Python (H100, JAX 0.11.2, 2026-12-06), most of it the
attention kernel's lowering. The store keeps each warm-up program's executable
(``jax.experimental.serialize_executable``) under a key made of everything that decides the
program, computed without tracing it:

- the store's format; the versions of JAX, jaxlib, its plugins, flax and jpaged; a hash of
  every source file of ``jpaged`` and ``pallas_kernels`` (an edited checkout is a new key);
- the backend: platform, platform version, the kinds, ids and core counts of the program's
  devices, the process count; JAX's flags (all but the cache's, logging's and the platform
  list) and ``XLA_FLAGS``-style environment variables (not the memory-fraction ones);
- the program (`program_key`): its name and static arguments, the model's graphdef (which
  holds its config), and the tree structure, shapes, dtypes and shardings of the state, the
  pool and the batch; the compiler options.

What the key cannot see is code patched at run time into jpaged or JAX (a reassigned module
global); a store directory is as trusted as the compiled code in it (loading one runs it).
It lives inside the persistent cache's directory (local paths only), so
``compilation_cache=None`` turns both off. An entry that cannot be read or loaded, or whose
first run fails in warm-up, is removed and the program compiles as without a store; a
failed write is logged and skipped.

On the CPU the store is off unless ``JPAGED_EXECUTABLE_STORE_ON_CPU=1``: XLA's CPU backend
shares JIT-compiled functions between the executables of a process, so a program compiled
after others may serialize without code it borrowed (then it fails elsewhere with "Function
... not found", or could resolve a same-named function of another program). With the
variable set (the test suite, in fresh processes), an executable is written only by a
process that has loaded none (from the store or JAX's cache, counted from jpaged's first
cache configuration). On GPU and TPU an executable is self-contained, and one that came
from JAX's cache is stored too, so a store key that changed while the program did not (an
edited docstring) is filled again by the next start.

A stored executable's pickle holds JAX's ``AutoLayout`` marker, an instance of a class with no
``__eq__`` or ``__reduce__``: unpickled, it is a second instance that equals nothing. On JAX
0.12 the arrays a loaded executable returns from donated inputs carry that instance into the
next trace, where a scan over them failed ("the layouts do not match"). Before it pickles or
unpickles, the store makes the marker pickle by name (`_pickle_auto_layout_by_name`), so that
it loads as JAX's own instance.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["ExecutableStore", "describe_tree", "program_key"]

_LOG = logging.getLogger(__name__)
FORMAT = "jpaged-executable-store-1"
SUBDIR = "jpaged-executables"
# JAX flags that change where compiles are cached or what is logged, never a program.
_IGNORED_FLAGS = ("jax_compilation_cache", "jax_persistent_cache", "jax_enable_compilation_cache",
                  "jax_log", "jax_debug_log_modules", "jax_explain_cache_misses",
                  "jax_raise_persistent_cache_errors", "jax_platforms")  # fmt: skip
_ENV_PREFIXES = ("XLA_", "LIBTPU_", "TPU_", "NVIDIA_TF32", "MOSAIC_", "JAX_")
_ENV_IGNORED = ("JAX_COMPILATION_CACHE_DIR", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")  # fmt: skip
_LOADED_IN_PROCESS = [False]  # any executable loaded from a store in this process
CPU_ENV_VAR = "JPAGED_EXECUTABLE_STORE_ON_CPU"


@functools.cache
def _pickle_auto_layout_by_name() -> None:
    """Makes ``jax._src.layout.AutoLayout`` pickle as a reference to itself (module
    docstring); nothing where JAX has no such singleton or already pickles it so."""
    try:
        from jax._src import layout
    except ImportError:
        return
    cls = getattr(layout, "AutoLayoutSingleton", None)
    marker = getattr(layout, "AutoLayout", None)
    if cls is None or type(marker) is not cls or "__reduce__" in vars(cls):
        return
    cls.__reduce__ = lambda self: "AutoLayout"  # a name in the class's module: the singleton


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
             [(d.id, d.device_kind, getattr(d, "core_count", None)) for d in devices], flags,
             env)  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def describe_tree(tree: Any) -> str:
    """The tree structure and each leaf's shape, dtype and sharding (a key part).

    >>> import numpy as np
    >>> describe_tree({"a": np.zeros((2, 3), np.int32)})
    "PyTreeDef({'a': *}) [((2, 3), 'int32', 'None')]"
    """
    leaves, treedef = jax.tree.flatten(tree)
    return f"{treedef} " + repr([(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))
                                 for x in leaves])  # fmt: skip


def program_key(*parts: Any) -> str:
    """The store key of one program: sha256 of ``parts`` (its name, static arguments,
    described inputs, ...) and of this jpaged's sources and JAX's versions
    (`ExecutableStore.key` adds the backend's environment).

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
        directory, a remote one such as ``gs://...``, several processes: each would hold
        only its own devices' part, or the CPU without ``JPAGED_EXECUTABLE_STORE_ON_CPU=1``)."""
        if cache_dir is None or "://" in str(cache_dir) or jax.process_count() > 1:
            return None
        if devices[0].platform == "cpu" and os.environ.get(CPU_ENV_VAR, "") != "1":
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
        there is none, or when it was written under another key (a renamed file) or for
        other arguments than ``in_tree`` (the ``((args...), {})`` structure of a call), or
        cannot be read or loaded (then it is removed)."""
        from jax.experimental import serialize_executable

        _pickle_auto_layout_by_name()
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if (entry["format"], entry["key"], entry["in_tree"]) != (FORMAT, key, in_tree):
                raise ValueError("written under another key or for other arguments")
            compiled = serialize_executable.deserialize_and_load(
                entry["executable"], entry["in_tree"], entry["out_tree"],
                backend=self.devices[0].client, execution_devices=self.devices,
            )  # fmt: skip
            _LOADED_IN_PROCESS[0] = True
            return compiled
        except FileNotFoundError:
            return None
        except Exception as e:  # a torn write, another jaxlib's bytes: compile instead
            self.remove(key, f"{type(e).__name__}: {e}")
            return None

    def remove(self, key: str, why: str) -> None:
        """Deletes the entry under ``key`` (logged with ``why``)."""
        _LOG.warning("jpaged: removing stored compiled program %s (%s)", self._path(key), why)
        self._path(key).unlink(missing_ok=True)

    def save(self, key: str, compiled: jax.stages.Compiled, *, from_jax_cache: bool) -> bool:
        """Writes ``compiled`` under ``key`` (atomically: a reader sees all of it or none).

        Args:
          from_jax_cache: it was loaded from JAX's persistent cache.

        Returns:
          False where it was not written: the backend cannot serialize it, on the CPU after a
          load in this process (module docstring), or the write failed (logged).
        """
        from jax.experimental import serialize_executable

        _pickle_auto_layout_by_name()
        cpu = self.devices[0].platform == "cpu"
        if cpu and (from_jax_cache or _LOADED_IN_PROCESS[0] or process_cache_hits()):
            return False
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError, jax.errors.JaxRuntimeError) as e:
            _LOG.info("jpaged: a compiled program cannot be stored (%s)", e)
            return False
        entry = dict(format=FORMAT, key=key, in_tree=in_tree, out_tree=out_tree,
                     executable=executable)  # fmt: skip
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{id(compiled)}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)  # concurrent writers: the last whole file wins
        except OSError as e:  # read-only or full disk: the program still runs, unstored
            _LOG.warning("jpaged: cannot store a compiled program in %s (%s)", self.directory, e)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        return True
