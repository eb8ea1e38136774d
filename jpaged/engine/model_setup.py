"""``jpaged.LLM`` construction helpers: the model from a config or state, its dtype, the
checkpoint's end-of-sequence ids and the default KV-cache budget."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.models import LlamaForCausalLM, ModelConfig
from jpaged.models._config import read_json_file

__all__ = ["default_kv_bytes", "model_dtype", "read_eos", "with_params"]


def with_params(model: Any, params: Any) -> Any:
    """The model to serve: built from a ``ModelConfig`` and ``params``, or ``model`` with
    ``params`` (an ``nnx.State``) loaded into it.

    Raises:
      ValueError: a ``ModelConfig`` without params, or params for a non-NNX model.
    """
    if isinstance(model, ModelConfig):
        if params is None:
            raise ValueError("a ModelConfig needs params= (parameter arrays by name)")
        return LlamaForCausalLM(model, params=params)
    if params is not None:
        if not isinstance(model, nnx.Module):
            raise ValueError(f"params= needs an nnx.Module model, got {type(model).__name__}")
        nnx.update(model, params)
    return model


def default_kv_bytes() -> int:
    """60% of the device memory left (512 MiB where the backend reports none)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # backends without memory stats
        stats = {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    if not limit:
        return 512 << 20
    return max(int(0.6 * (limit - used)), 1 << 20)


def model_dtype(model) -> Any:
    """The model's floating dtype (its embedding's, else its first float leaf's)."""
    leaves = jax.tree.leaves(getattr(model, "embed_VD", None) or model)
    for leaf in leaves:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.dtype
    return jnp.float32


def read_eos(path: pathlib.Path) -> list[int] | None:
    """The checkpoint's end-of-sequence ids (generation_config.json, then config.json).

    Raises:
      ValueError: naming the file: not valid JSON, or an ``eos_token_id`` that is not an
        int or a list of ints.
    """
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = read_json_file(f).get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                if not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
                    raise ValueError(
                        f"{str(f)!r}: eos_token_id={eos!r} must be an int or a list of ints"
                    )
                return ids
    return None
