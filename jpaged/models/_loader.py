"""Loading a local Hugging Face checkpoint directory into a ``LlamaForCausalLM``.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or sharded
``model-XXXXX-of-YYYYY.safetensors`` files with ``model.safetensors.index.json``
(what ``save_pretrained`` writes), and optionally ``tokenizer.json``. Only local paths are
read: jpaged never touches the network.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jpaged.models._config import ModelConfig, read_json_file
from jpaged.models._llama import LlamaForCausalLM, param_shapes

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")

# jpaged name -> (Hugging Face name inside a layer, or at top level).
_LAYER_NAMES = {
    "attn_norm_LD": "input_layernorm.weight",
    "mlp_norm_LD": "post_attention_layernorm.weight",
    "wq_LDNH": "self_attn.q_proj.weight",
    "wk_LDKH": "self_attn.k_proj.weight",
    "wv_LDKH": "self_attn.v_proj.weight",
    "wo_LNHD": "self_attn.o_proj.weight",
    "bq_LNH": "self_attn.q_proj.bias",
    "bk_LKH": "self_attn.k_proj.bias",
    "bv_LKH": "self_attn.v_proj.bias",
    "bo_LD": "self_attn.o_proj.bias",
    "w_gate_LDF": "mlp.gate_proj.weight",
    "w_up_LDF": "mlp.up_proj.weight",
    "w_down_LFD": "mlp.down_proj.weight",
    "b_gate_LF": "mlp.gate_proj.bias",
    "b_up_LF": "mlp.up_proj.bias",
    "b_down_LD": "mlp.down_proj.bias",
}
_TOP_NAMES = {
    "embed_VD": "model.embed_tokens.weight",
    "norm_D": "model.norm.weight",
    "lm_head_DV": "lm_head.weight",
}


def _checkpoint_dir(path: str | pathlib.Path) -> pathlib.Path:
    p = pathlib.Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(
            f"no checkpoint directory at {str(p)!r}: jpaged loads local paths only "
            "(download a Hugging Face model first, e.g. with `hf download <repo> --local-dir`)"
        )
    return p


def load_config(path: str | pathlib.Path) -> ModelConfig:
    """Reads ``config.json`` of a checkpoint directory.

    Raises:
      FileNotFoundError: if the directory or its ``config.json`` does not exist.
      ValueError: naming the file: not valid JSON, a required key missing or of the wrong
        type (named), an unsupported ``model_type`` or configuration.
    """
    config_file = _checkpoint_dir(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{str(config_file)!r} not found: a checkpoint needs config.json")
    try:
        return ModelConfig.from_hf(read_json_file(config_file))
    except ValueError as e:
        if str(config_file) in str(e):
            raise
        raise ValueError(f"{str(config_file)!r}: {e}") from e


def _tensor_files(ckpt: pathlib.Path) -> dict[str, pathlib.Path]:
    """Maps every tensor name to the safetensors file that holds it."""
    index = ckpt / "model.safetensors.index.json"
    single = ckpt / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: ckpt / file for name, file in weight_map.items()}
    if single.is_file():
        with safe_open(single, framework="numpy") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {str(ckpt)!r} "
        "(jpaged reads safetensors checkpoints only)"
    )


def _hf_name(name: str, layer: int | None) -> str:
    if layer is None:
        return _TOP_NAMES[name]
    return f"model.layers.{layer}.{_LAYER_NAMES[name]}"


def _to_jpaged_layout(name: str, w: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Converts one Hugging Face tensor (torch Linear [out, in]) to jpaged's layout."""
    c = config
    N, K, H, D = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
    match name:
        case "wq_LDNH":
            return w.T.reshape(D, N, H)
        case "wk_LDKH" | "wv_LDKH":
            return w.T.reshape(D, K, H)
        case "wo_LNHD":
            return w.T.reshape(N, H, D)
        case "bq_LNH":
            return w.reshape(N, H)
        case "bk_LKH" | "bv_LKH":
            return w.reshape(K, H)
        case "w_gate_LDF" | "w_up_LDF" | "w_down_LFD" | "lm_head_DV":
            return w.T
        case _:
            return w


def _default_dtype(ckpt: pathlib.Path, files: dict[str, pathlib.Path]) -> Any:
    hf = json.loads((ckpt / "config.json").read_text())
    name = hf.get("dtype") or hf.get("torch_dtype")
    if name in ("float32", "bfloat16", "float16"):
        return jnp.dtype(name)
    embed = _TOP_NAMES["embed_VD"]
    with safe_open(files[embed], framework="numpy") as f:
        stored = f.get_slice(embed).get_dtype()
    return jnp.dtype(
        {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(stored, "float32")
    )


def load_params(
    path: str | pathlib.Path, config: ModelConfig, *, dtype: Any = None
) -> dict[str, np.ndarray]:
    """Reads a checkpoint's tensors into jpaged's parameter layout (host NumPy arrays).

    Args:
      path: checkpoint directory.
      config: its ``ModelConfig`` (``load_config(path)``).
      dtype: cast every tensor to this dtype; None keeps the checkpoint's dtype.

    Returns:
      Arrays by ``param_shapes(config)`` name, layers stacked along a leading L axis.

    Raises:
      ValueError: if tensors are missing, unexpected, or of the wrong shape.
    """
    ckpt = _checkpoint_dir(path)
    files = _tensor_files(ckpt)
    if dtype is None:
        dtype = _default_dtype(ckpt, files)
    np_dtype = jnp.dtype(dtype)
    shapes = param_shapes(config)
    wanted: dict[str, tuple[str, int | None]] = {}  # hf name -> (jpaged name, layer)
    for name in shapes:
        if name.startswith("layers."):
            for i in range(config.num_layers):
                wanted[_hf_name(name.removeprefix("layers."), i)] = (name, i)
        else:
            wanted[_hf_name(name, None)] = (name, None)
    missing = sorted(set(wanted) - set(files), key=_natural_key)
    if missing:
        raise ValueError(
            f"checkpoint {str(ckpt)!r} is missing {len(missing)} tensor(s) that "
            f"model_type={config.model_type!r} needs: {missing[:8]}"
            + (" ..." if len(missing) > 8 else "")
        )
    ignorable = {n for n in files if _IGNORED.match(n)}
    if config.tie_word_embeddings:
        ignorable.add(_TOP_NAMES["lm_head_DV"])  # some checkpoints store the tied head too
    unexpected = sorted(set(files) - set(wanted) - ignorable, key=_natural_key)
    if unexpected:
        raise ValueError(
            f"checkpoint {str(ckpt)!r} has {len(unexpected)} tensor(s) that "
            f"model_type={config.model_type!r} does not use: {unexpected[:8]}"
            + (" ..." if len(unexpected) > 8 else "")
        )

    params = {name: np.empty(shape, np_dtype) for name, shape in shapes.items()}
    by_file: dict[pathlib.Path, list[str]] = {}
    for hf_name in wanted:
        by_file.setdefault(files[hf_name], []).append(hf_name)
    for file, names in by_file.items():
        with safe_open(file, framework="numpy") as f:
            for hf_name in names:
                name, layer = wanted[hf_name]
                short = name.removeprefix("layers.")
                target = params[name] if layer is None else params[name][layer]
                try:
                    w = _to_jpaged_layout(short, f.get_tensor(hf_name), config)
                except ValueError:  # a reshape to the config's heads failed
                    w = None
                if w is None or w.shape != target.shape:
                    raise ValueError(
                        f"tensor {hf_name!r} has shape {f.get_slice(hf_name).get_shape()}, "
                        f"which does not fit {name} of shape {shapes[name]} for this config"
                    )
                target[...] = w.astype(np_dtype)
    return params


def from_pretrained(path: str | pathlib.Path, *, dtype: Any = None) -> LlamaForCausalLM:
    """Loads a local Hugging Face checkpoint directory (Llama 2/3, Mistral, Qwen2).

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or sharded
        ``model-*.safetensors`` + ``model.safetensors.index.json``).
      dtype: parameter dtype (e.g. ``jnp.bfloat16``); None keeps the checkpoint's.

    Returns:
      The model, parameters on the default device.

    Raises:
      FileNotFoundError: if the directory, config.json or the weights are absent.
      ValueError: for an unsupported ``model_type``, missing or unexpected tensors.

    >>> import jpaged.models
    >>> m = jpaged.models.from_pretrained("tests/checkpoints/llama2")
    >>> m.config.model_type, m.config.num_layers
    ('llama', 2)
    """
    config = load_config(path)
    params = load_params(path, config, dtype=dtype)
    # Host arrays: q/k/v and gate/up are fused on the host before moving to the device.
    return LlamaForCausalLM(config, params=params)


def load_tokenizer(path: str | pathlib.Path):
    """The checkpoint's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or None if absent.

    Raises:
      ValueError: naming the file, when it cannot be read as a tokenizer (corrupt JSON).

    >>> tok = load_tokenizer("tests/checkpoints/llama2")
    >>> len(tok.encode("The quick brown fox jumps").ids)
    19
    """
    file = _checkpoint_dir(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{str(file)!r} is not a valid tokenizer file: {e}") from e


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
