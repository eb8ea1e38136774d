"""``jpaged.LLM`` construction helpers: the model from a config or state, its dtype, the
checkpoint's end-of-sequence ids and the default KV-cache budget."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _with_params(model: Any, params: Any) -> Any:
    from flax import nnx

    from jpaged.models import LlamaForCausalLM, ModelConfig

    if isinstance(model, ModelConfig):
        if params is None:
            raise ValueError("a ModelConfig needs params= (parameter arrays by name)")
        return LlamaForCausalLM(model, params=params)
    if params is not None:
        if not isinstance(model, nnx.Module):
            raise ValueError(f"params= needs an nnx.Module model, got {type(model).__name__}")
        nnx.update(model, params)
    return model


def _default_kv_bytes() -> int:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # backends without memory stats
        stats = {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    if not limit:
        return 512 << 20
    return max(int(0.6 * (limit - used)), 1 << 20)


def _model_dtype(model) -> Any:
    leaves = jax.tree.leaves(getattr(model, "embed_VD", None) or model)
    for leaf in leaves:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.dtype
    return jnp.float32


def _read_eos(path: pathlib.Path) -> list[int] | None:
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return list(np.atleast_1d(eos).astype(int))
    return None
