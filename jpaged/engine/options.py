"""``EngineOptions``: the engine's configuration (every ``jpaged.LLM`` keyword but the model,
its params and tokenizer), checked where it enters.

``jpaged.LLM`` documents each option; `assemble` builds the engine's parts from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["EngineOptions"]

_PREEMPTION_MODES = ("auto", "recompute", "swap")
# Quantized K/V names ``cache_dtype`` accepts besides float dtypes.
QUANTIZED_CACHE_DTYPES = ("fp8", "int8")


def _dtype_problem(name: str, value: Any, *, quantized: bool) -> str | None:
    """Why ``value`` is not a valid ``dtype`` / ``cache_dtype`` (None: it is valid).

    ``dtype`` takes None or a float dtype; ``cache_dtype`` also the quantized names
    ``"fp8"``, ``"int8"`` and the dtypes ``int8`` and float8.
    """
    if value is None or (quantized and isinstance(value, str) and value in QUANTIZED_CACHE_DTYPES):
        return None
    expected = "None or a float dtype (float32, bfloat16, float16)"
    if quantized:
        expected += f", or one of {QUANTIZED_CACHE_DTYPES}"
    try:
        dt = jnp.dtype(value)
    except (TypeError, ValueError):
        return f"{name}={value!r} must be {expected}"
    if jnp.issubdtype(dt, jnp.floating) or (quantized and dt == jnp.int8):
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
    kv_cache_memory: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"
    swap_space: int = 1 << 30
    num_decode_steps: int = 8
    dtype: Any = None
    cache_dtype: Any = None
    watermark: float = 0.01
    seed: int = 0
    debug: bool = False
    swap_bytes_per_s: float = 16e9
    recompute_tokens_per_s: float = 20e3
    compiler_options: dict[str, Any] | None = None
    keep_finished: int = 4096

    def __post_init__(self):
        for name in ("page_size", "max_num_seqs", "num_decode_steps"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        for name in ("num_pages", "kv_cache_memory", "max_model_len", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"{name}={v!r} must be None or an int >= 1")
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
        for name in ("enable_prefix_caching", "debug"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        for name, quantized in (("dtype", False), ("cache_dtype", True)):
            problem = _dtype_problem(name, getattr(self, name), quantized=quantized)
            if problem is not None:
                raise ValueError(problem)
        if self.compiler_options is not None and not isinstance(self.compiler_options, dict):
            raise ValueError(f"compiler_options={self.compiler_options!r} must be None or a dict")
