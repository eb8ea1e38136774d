"""The persistent compilation cache of the step programs (JAX's, in a jpaged directory).

A step program of a large model takes seconds to compile; JAX's persistent compilation
cache keeps the compiled executables on disk, so a later process loads them instead.
`configure` turns it on in a directory named after the JAX, jaxlib and jpaged versions and
the device (`default_cache_dir`), so an upgrade starts a fresh directory and never loads a
stale entry (JAX's own key already covers the program, the compile options, the backend and
its versions). It leaves a cache directory set by the user (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.update("jax_compilation_cache_dir", ...)``) alone.

JAX's cache is process-wide: every program compiled after `configure` (not only jpaged's)
goes through it, under JAX's own rules (by default, programs that took more than a second
to compile). ``count_cache_hits`` counts the persistent-cache hits of the compiles made in
the calling thread (warm-up compiles in a thread pool, one program per task).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pathlib
import re
import threading
from typing import Any

import jax

__all__ = ["ENV_VAR", "configure", "count_cache_hits", "default_cache_dir", "process_cache_hits"]

# The environment's say over the default cache (``compilation_cache=True``): a directory, or
# "off" (also "0", "false", "none" or empty) for none. The test suite sets it.
ENV_VAR = "JPAGED_COMPILATION_CACHE"
_OFF = ("", "0", "off", "false", "none")

_SET_BY_JPAGED: list[str | None] = [None]  # the directory jpaged set in this process
_LOCK = threading.Lock()
_HITS = threading.local()
_LISTENING = [False]
_PROCESS_HITS = [0]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def default_cache_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/jpaged`` (``~/.cache/jpaged``) / ``jax-<v>-jaxlib-<v>-jpaged-<v>-
    <platform>-<device kind>``: one directory per versions and device, so that an upgrade
    never reads the entries of another.

    >>> default_cache_dir().parent.name
    'jpaged'
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    device = jax.devices()[0]
    kind = re.sub(r"[^A-Za-z0-9.]+", "-", str(device.device_kind)).strip("-") or "device"
    name = (f"jax-{jax.__version__}-jaxlib-{_version('jaxlib')}-jpaged-{_version('jpaged')}"
            f"-{device.platform}-{kind}")  # fmt: skip
    return pathlib.Path(base) / "jpaged" / name


def _resolve(setting: Any) -> str | None:
    """The directory ``setting`` asks for (None: no cache)."""
    if setting is None or setting is False:
        return None
    if setting is True:
        env = os.environ.get(ENV_VAR)
        if env is not None:
            return None if env.strip().lower() in _OFF else os.path.abspath(env)
        return str(default_cache_dir())
    return os.path.abspath(os.fspath(setting))


def configure(setting: Any) -> str | None:
    """Points JAX's persistent compilation cache at the directory ``setting`` asks for.

    Args:
      setting: True (`default_cache_dir`, or the directory in ``$JPAGED_COMPILATION_CACHE``;
        "off" there turns it off), a directory (str or ``os.PathLike``), or None / False (no
        cache: a directory jpaged set earlier in this process is unset).

    Returns:
      The directory compiles now go through (None: none). A directory the user gave JAX
      (its environment variable or config) is kept whatever ``setting`` says, and returned.

    Raises:
      ValueError: ``setting`` is not a bool, None, str or ``os.PathLike``.
    """
    if not isinstance(setting, bool | str | os.PathLike) and setting is not None:
        raise ValueError(
            f"compilation_cache={setting!r} must be True (the default directory), a directory "
            "(str or os.PathLike), or None (no cache)"
        )
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    with _LOCK:
        current = jax.config.jax_compilation_cache_dir
        if current is not None and current != _SET_BY_JPAGED[0]:
            return current if jax.config.jax_enable_compilation_cache else None
        target = _resolve(setting)
        if target != current:
            if target is not None:
                os.makedirs(target, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", target)
            jax_cache.reset_cache()  # the next compile opens the new directory
            _SET_BY_JPAGED[0] = target
        _listen()
        return target if jax.config.jax_enable_compilation_cache else None


def _listen() -> None:
    if not _LISTENING[0]:
        jax.monitoring.register_event_listener(_on_event)
        _LISTENING[0] = True


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _HITS.count = getattr(_HITS, "count", 0) + 1
        _PROCESS_HITS[0] += 1


def process_cache_hits() -> int:
    """Persistent-cache hits in this process, every thread, since jpaged first configured
    the cache."""
    return _PROCESS_HITS[0]


@contextlib.contextmanager
def count_cache_hits():
    """Counts the persistent-cache hits of the compiles made in this thread inside the block.

    >>> with count_cache_hits() as hits:
    ...     pass
    >>> hits()
    0
    """
    _listen()
    start = getattr(_HITS, "count", 0)
    end: list[int | None] = [None]

    def hits() -> int:
        now = getattr(_HITS, "count", 0) if end[0] is None else end[0]
        return now - start

    try:
        yield hits
    finally:
        end[0] = getattr(_HITS, "count", 0)
