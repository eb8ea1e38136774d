"""Model configuration: one frozen dataclass for the Llama family (Llama 2/3, Mistral, Qwen2).

The family differs only in switches: RoPE scaling (Llama 3), a sliding window (Mistral),
q/k/v biases (Qwen2), tied or untied embeddings. ``ModelConfig.from_hf`` reads a Hugging
Face ``config.json`` dict; ``llama3_8b``, ``llama3_2_1b`` and ``tiny`` build the shapes the
benchmarks and tests use.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


def read_json_file(file: str | pathlib.Path) -> dict[str, Any]:
    """The JSON object in ``file`` (a checkpoint's ``config.json``,
    ``generation_config.json``, ...).

    Raises:
      ValueError: naming the file, when it is not valid JSON (or not UTF-8) or holds
        something other than a JSON object.
    """
    try:
        data = json.loads(pathlib.Path(file).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(file)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(
            f"{str(file)!r} must hold a JSON object, got a {type(data).__name__} at the top"
        )
    return data


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's ``rope_scaling`` / ``rope_parameters``.

    Attributes:
      rope_type: "linear" (positions divided by ``factor``) or "llama3" (Llama 3.1's
        frequency-dependent scaling).
      factor: the scale factor.
      low_freq_factor: llama3 only.
      high_freq_factor: llama3 only.
      original_max_position_embeddings: llama3 only; the pre-training context length.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and switches of a Llama-family decoder-only transformer.

    Attributes:
      model_type: "llama", "mistral" or "qwen2" (informational; the switches below decide).
      vocab_size: V.
      hidden_size: D.
      intermediate_size: F, the SwiGLU width.
      num_layers: L.
      num_heads: N query heads.
      num_kv_heads: K key/value heads (GQA when K < N).
      head_dim: H.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta: RoPE base.
      rope_scaling: None, or a ``RopeScaling``.
      max_position_embeddings: the context length the model was trained for.
      sliding_window: None, or w: a query sees only the last w keys (its own included).
      qkv_bias: q/k/v projections have biases (Qwen2; Llama with ``attention_bias``).
      o_bias: the output projection has a bias (Llama with ``attention_bias``).
      mlp_bias: the MLP projections have biases (Llama with ``mlp_bias``).
      tie_word_embeddings: the LM head is the transposed embedding.
    """

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        errors = []
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                errors.append(f"{name}={value!r} must be a positive int")
        if not errors and self.num_heads % self.num_kv_heads:
            errors.append(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            errors.append(f"sliding_window={self.sliding_window!r} must be None or positive")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in (
            SUPPORTED_ROPE_TYPES
        ):
            errors.append(
                f"rope_scaling.rope_type={self.rope_scaling.rope_type!r} must be one of "
                f"{SUPPORTED_ROPE_TYPES}"
            )
        if errors:
            raise ValueError("invalid ModelConfig: " + "; ".join(errors))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from a Hugging Face ``config.json`` dict.

        Raises:
          ValueError: for an unsupported ``model_type``, RoPE type, or a layout jpaged cannot
            run (e.g. Qwen2 with sliding window on some layers only); a missing required
            key or a value of the wrong type (named).
        """
        try:
            return cls._from_hf(hf)
        except KeyError as e:
            raise ValueError(f"config.json has no {e.args[0]!r}, which jpaged needs") from e
        except (TypeError, AttributeError) as e:
            raise ValueError(f"config.json holds a value of the wrong type: {e}") from e

    @classmethod
    def _from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type={model_type!r} in config.json; jpaged supports "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(
                f"unsupported hidden_act={act!r} in config.json; jpaged supports 'silu'"
            )
        num_heads = _int(hf, "num_attention_heads")
        hidden = _int(hf, "hidden_size")
        head_dim = _int(hf, "head_dim", None) or hidden // max(num_heads, 1)
        rope_theta, rope_scaling = _rope_from_hf(hf)
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        return cls(
            model_type=model_type,
            vocab_size=_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(hf, "intermediate_size"),
            num_layers=_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_int(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(hf, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(hf, "max_position_embeddings", 4096),
            sliding_window=_sliding_window_from_hf(model_type, hf),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


_REQUIRED = object()


def _int(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """``hf[key]`` as an int (``default`` when absent or null; a KeyError when required)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json: {key}={value!r} must be an integer")
    return value


def _float(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """``hf[key]`` as a float (``default`` when absent or null; a KeyError when required)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"config.json: {key}={value!r} must be a number")
    return float(value)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers < 5 writes `rope_theta` + `rope_scaling`; 5 writes `rope_parameters`.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"config.json: rope parameters {params!r} must be a JSON object")
    theta = _float(params, "rope_theta", _float(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type={rope_type!r} in config.json; jpaged supports "
            f"{SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return theta, None
    kwargs: dict[str, Any] = {"rope_type": rope_type, "factor": _float(params, "factor")}
    if rope_type == "llama3":
        kwargs.update(
            low_freq_factor=_float(params, "low_freq_factor"),
            high_freq_factor=_float(params, "high_freq_factor"),
            original_max_position_embeddings=_int(params, "original_max_position_embeddings"),
        )
    return theta, RopeScaling(**kwargs)


def _sliding_window_from_hf(model_type: str, hf: Mapping[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if model_type == "llama" or window is None:
        return None
    layer_types = hf.get("layer_types")
    if model_type == "qwen2" and layer_types is None:
        if not hf.get("use_sliding_window", False):
            return None
        start = _int(hf, "max_window_layers", 0)
        n = _int(hf, "num_hidden_layers")
        layer_types = ["full_attention"] * start + ["sliding_attention"] * (n - start)
    if layer_types is None:
        return int(window)
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return int(window)
    raise ValueError(
        f"layer_types={sorted(kinds)} mixes full and sliding-window layers; jpaged runs one "
        "attention kind for all layers of a model"
    )


def llama3_8b(**overrides: Any) -> ModelConfig:
    """Llama-3-8B shapes (32 layers, D=4096, GQA 32/8, H=128, V=128256), untied embeddings."""
    kwargs: dict[str, Any] = dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
    )  # fmt: skip
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def llama3_2_1b(**overrides: Any) -> ModelConfig:
    """Llama-3.2-1B shapes (16 layers, D=2048, GQA 32/8, H=64), llama3 RoPE scaling, tied."""
    kwargs: dict[str, Any] = dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=RopeScaling(
            rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )  # fmt: skip
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def tiny(**overrides: Any) -> ModelConfig:
    """A tiny Llama (2 layers, D=64, GQA 4/2, H=16, V=256) for tests and demos."""
    kwargs: dict[str, Any] = dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        max_position_embeddings=512,
    )  # fmt: skip
    kwargs.update(overrides)
    return ModelConfig(**kwargs)
