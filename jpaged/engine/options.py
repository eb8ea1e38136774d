"""``EngineOptions``: the engine's configuration (every ``jpaged.LLM`` keyword but the model,
its params and tokenizer), checked where it enters.

``jpaged.LLM`` documents each option; `assemble` builds the engine's parts from them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from jpaged.kv import quantize
from jpaged.parallel.mesh import engine_mesh

__all__ = ["EngineOptions"]

_PREEMPTION_MODES = ("auto", "recompute", "swap")
# Quantized K/V names ``cache_dtype`` accepts besides dtypes: "fp8" (float8_e4m3fn),
# "fp8_e4m3", "fp8_e5m2" (float8_e5m2), "int8".
QUANTIZED_CACHE_DTYPES = tuple(quantize.KV_DTYPES)
# Floating dtypes of an unquantized cache (other 8-bit floats have no scales in the pool).
_FLOAT_CACHE_DTYPES = ("float32", "bfloat16", "float16")


def cache_dtype_names() -> str:
    """What ``cache_dtype`` accepts, for error messages."""
    quantized = ", ".join(str(d) for d in dict.fromkeys(quantize.KV_DTYPES.values()))
    return (
        f"None, a float dtype ({', '.join(_FLOAT_CACHE_DTYPES)}), one of "
        f"{QUANTIZED_CACHE_DTYPES} or a quantized dtype ({quantized})"
    )


def resolve_cache_dtype(value: Any) -> np.dtype | None:
    """The pool dtype of a valid ``cache_dtype`` (None stays None: the model's dtype).

    >>> resolve_cache_dtype("fp8"), resolve_cache_dtype("fp8_e5m2"), resolve_cache_dtype("int8")
    (dtype(float8_e4m3fn), dtype(float8_e5m2), dtype('int8'))
    """
    return None if value is None else quantize.kv_dtype(value)


def _dtype_problem(name: str, value: Any, *, quantized: bool) -> str | None:
    """Why ``value`` is not a valid ``dtype`` / ``cache_dtype`` (None: it is valid).

    ``dtype`` takes None or a float dtype; ``cache_dtype`` None, float32 / bfloat16 / float16,
    the quantized names (``QUANTIZED_CACHE_DTYPES``) and the quantized dtypes
    (float8_e4m3fn, float8_e5m2, int8).
    """
    if value is None:
        return None
    if quantized:
        problem = f"{name}={value!r} must be {cache_dtype_names()}"
        if isinstance(value, str) and value in QUANTIZED_CACHE_DTYPES:
            return None
        try:
            dt = jnp.dtype(value)
        except (TypeError, ValueError):
            return problem
        if quantize.is_quantized(dt) or dt.name in _FLOAT_CACHE_DTYPES:
            return None
        return problem
    expected = "None or a float dtype (float32, bfloat16, float16)"
    try:
        dt = jnp.dtype(value)
    except (TypeError, ValueError):
        return f"{name}={value!r} must be {expected}"
    if jnp.issubdtype(dt, jnp.floating):
        return None
    return f"{name}={value!r} must be {expected}"


def _is_int(v: Any) -> bool:
    """An ``int`` or numpy integer, never a ``bool``."""
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The engine's options (see ``jpaged.LLM`` for each one's meaning and default).

    Raises:
      ValueError: (when built) an option of the wrong type or out of range, naming it and
        the expected value.
    """

    page_size: int = 16
    num_pages: int | None = None
    num_local_pages: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"
    swap_space: int = 1 << 30
    num_decode_steps: int = 1
    chain_decode: bool = True
    join_running: bool = True
    dtype: Any = None
    cache_dtype: Any = None
    watermark: float = 0.01
    seed: int = 0
    debug: bool = False
    swap_bytes_per_s: float = 16e9
    recompute_tokens_per_s: float = 20e3
    compiler_options: dict[str, Any] | None = None
    keep_finished: int = 4096
    tensor_parallel_size: int = 1
    mesh: Any = None
    compilation_cache: Any = True

    def __post_init__(self):
        for name in ("page_size", "max_num_seqs", "num_decode_steps", "tensor_parallel_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        for name in ("num_pages", "kv_cache_memory", "max_model_len", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"{name}={v!r} must be None or an int >= 1")
        if self.num_local_pages is not None and (
            not _is_int(self.num_local_pages) or self.num_local_pages < 0
        ):
            raise ValueError(
                f"num_local_pages={self.num_local_pages!r} must be None or an int >= 0"
            )
        for name in ("keep_finished", "swap_space", "seed"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name}={v!r} must be an int >= 0")
        if self.preemption_mode not in _PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r} must be one of {_PREEMPTION_MODES}"
            )
        if not isinstance(self.watermark, float | int) or not 0 <= self.watermark < 1:
            raise ValueError(f"watermark={self.watermark!r} must be a number in [0, 1)")
        for name in ("swap_bytes_per_s", "recompute_tokens_per_s"):
            v = getattr(self, name)
            if not isinstance(v, float | int) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name}={v!r} must be a number > 0")
        for name in ("enable_prefix_caching", "debug", "chain_decode", "join_running"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if not self.chain_decode and self.num_decode_steps != 1:
            raise ValueError(
                f"num_decode_steps={self.num_decode_steps!r} needs chain_decode=True (decode "
                "loops run only in chains); with chain_decode=False it must be 1"
            )
        for name, quantized in (("dtype", False), ("cache_dtype", True)):
            problem = _dtype_problem(name, getattr(self, name), quantized=quantized)
            if problem is not None:
                raise ValueError(problem)
        if self.compiler_options is not None and not isinstance(self.compiler_options, dict):
            raise ValueError(f"compiler_options={self.compiler_options!r} must be None or a dict")
        cc = self.compilation_cache
        if cc is not None and not isinstance(cc, bool | str | os.PathLike):
            raise ValueError(
                f"compilation_cache={cc!r} must be True (the default directory), a directory "
                "(str or os.PathLike), or None (no cache)"
            )
        self.engine_mesh()  # raises for a mesh of other axes or a size mismatch

    def engine_mesh(self):
        """The ``("data", "model")`` mesh the engine runs on, or None for one device."""
        return engine_mesh(self.tensor_parallel_size, self.mesh)

    def replica_options(self) -> dict[str, Any]:
        """The options of one data-parallel replica (its model carries its mesh)."""
        opts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return opts | {"tensor_parallel_size": 1, "mesh": None}
