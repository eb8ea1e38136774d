"""Where each device's part of a tensor-parallel Llama-family model lives.

Megatron's split over one mesh axis of ``size`` devices (default axis name ``"model"``):

- attention: the N query heads in blocks of ``N / size`` per device, with the KV heads they
  read: ``K / size`` per device, or, when there are fewer KV heads than devices, the one KV
  head of the device's query heads (each KV head then lives on ``size / K`` devices). With
  fewer query heads than devices, each query head is computed on ``size / N`` devices and
  only the first copy's output projection is kept (the copies' ``wo`` rows are zero);
- MLP: gate and up column-parallel, down row-parallel, F in blocks of ``ceil(F / size)``
  (the last block padded with zero columns, which add nothing);
- embedding and LM head: the vocabulary in blocks of ``ceil(V / size)`` rows (zero padding
  rows, whose logits are cut off);
- norms and the biases added after a sum (``bo``, ``b_down``): replicated.

Device d's block of every parameter is exactly the parameter of a one-device model with the
*local* config (``local_config``: the device's N, K, F and V), fused as ``_llama`` fuses
(``wqkv_LDX`` = ``[q_d | k_d | v_d]``), so the per-device forward is the ordinary model. The
global arrays are those blocks side by side along the split axis, which `param_spec` names.
Per layer, the forward sums the attention output projection and the MLP down projection over
the axis (two all-reduces of ``[T, D]``), the embedding lookup ends in one all-reduce and the
logits in one all-gather.

The paged pool ``[L, K, P, C, H]`` is split on its KV-head axis the same way (``size * K_local``
heads in all: K, or ``size`` copies when K < size); block tables, lengths and the allocator
are replicated: every device holds the same pages of its own heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
from jax.sharding import PartitionSpec

from jpaged.models._config import ModelConfig
from jpaged.models._llama import _FUSED

__all__ = ["MODEL_AXIS", "TensorParallelLayout"]

MODEL_AXIS = "model"

# Split parameters (``param_shapes`` names, without "layers."): the index kind and the axis of
# one layer's tensor (the stacked array has the L axis in front) that the devices split.
_SPLIT: dict[str, tuple[str, int]] = {
    "wq_LDNH": ("q", 1),
    "bq_LNH": ("q", 0),
    "wk_LDKH": ("kv", 1),
    "wv_LDKH": ("kv", 1),
    "bk_LKH": ("kv", 0),
    "bv_LKH": ("kv", 0),
    "wo_LNHD": ("q", 0),
    "w_gate_LDF": ("ffn", 1),
    "w_up_LDF": ("ffn", 1),
    "b_gate_LF": ("ffn", 0),
    "b_up_LF": ("ffn", 0),
    "w_down_LFD": ("ffn", 0),
    "embed_VD": ("vocab", 0),
    "lm_head_DV": ("vocab", 1),
}
# Fused state arrays: the axis (of one layer's tensor) their parts are concatenated on.
_FUSED_AXIS = {"wqkv_LDX": 1, "bqkv_LX": 0, "w_gate_up_LDX": 1, "b_gate_up_LX": 0}

# Reads one layer's tensor of a parameter (``param_shapes`` name without "layers."; layer None
# for top-level ones), rows ``[lo, hi)`` of ``axis`` (None: the whole tensor), as a NumPy
# array in jpaged's layout.
Reader = Callable[[str, "int | None", "int | None", int, int], np.ndarray]


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    """The split of one model over ``size`` devices of the mesh axis ``axis``.

    Attributes:
      config: the whole model's config.
      size: devices along the axis (1: no split).
      axis: the mesh axis name.

    Raises:
      ValueError: ``size`` is not a positive int, or N or K neither divides nor is divided by
        ``size``.

    >>> from jpaged.models import tiny
    >>> layout = TensorParallelLayout(tiny(num_heads=4, num_kv_heads=2), 8)
    >>> layout.local_config.num_heads, layout.local_config.num_kv_heads, layout.pool_kv_heads
    (1, 1, 8)
    """

    config: ModelConfig
    size: int
    axis: str = MODEL_AXIS

    def __post_init__(self):
        size, c = self.size, self.config
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor parallel size={size!r} must be an int >= 1")
        errors = [
            f"{name}={n} must divide or be divisible by the tensor parallel size {size}"
            for name, n in (("num_heads", c.num_heads), ("num_kv_heads", c.num_kv_heads))
            if n % size and size % n
        ]
        if errors:
            raise ValueError("; ".join(errors))

    # ------------------------------------------------------------------ sizes per device

    @property
    def heads_per_device(self) -> int:
        """N_local: query heads each device computes."""
        return max(self.config.num_heads // self.size, 1)

    @property
    def kv_heads_per_device(self) -> int:
        """K_local: KV heads each device holds in its part of the pool."""
        return max(self.config.num_kv_heads // self.size, 1)

    @property
    def pool_kv_heads(self) -> int:
        """The global pool's KV-head axis: ``size * K_local`` (K, or ``size`` copies)."""
        return self.size * self.kv_heads_per_device

    @property
    def local_config(self) -> ModelConfig:
        """One device's model: its heads, MLP columns and vocabulary rows."""
        c = self.config
        return dataclasses.replace(
            c,
            num_heads=self.heads_per_device,
            num_kv_heads=self.kv_heads_per_device,
            intermediate_size=math.ceil(c.intermediate_size / self.size),
            vocab_size=math.ceil(c.vocab_size / self.size),
        )

    # ------------------------------------------------------------------ index maps

    def indices(self, kind: str) -> np.ndarray:
        """i64[size, n_local]: the global index of each device's rows of ``kind`` ("q",
        "kv", "ffn", "vocab"); -1 marks a zero padding row."""
        c, size = self.config, self.size
        d = np.arange(size)[:, None]
        if kind == "q":
            n = self.heads_per_device
            copies = max(size // c.num_heads, 1)
            return (d // copies) * n + np.arange(n)
        if kind == "kv":
            k = self.kv_heads_per_device
            if c.num_kv_heads >= size:
                return d * k + np.arange(k)
            group = c.num_heads // c.num_kv_heads
            return self.indices("q")[:, :1] // group
        total = {"ffn": c.intermediate_size, "vocab": c.vocab_size}[kind]
        n = math.ceil(total / size)
        idx = d * n + np.arange(n)
        return np.where(idx < total, idx, -1)

    def output_scale(self) -> np.ndarray:
        """f32[size]: 1 for the device whose copy of its query heads feeds the output
        projection, 0 for the other copies (all 1 unless N < size)."""
        copies = max(self.size // self.config.num_heads, 1)
        return (np.arange(self.size) % copies == 0).astype(np.float32)

    # ------------------------------------------------------------------ arrays

    def is_split(self, name: str) -> bool:
        """Whether the state array ``name`` (``nnx`` path, e.g. "layers.wqkv_LDX") is split."""
        short = name.removeprefix("layers.")
        return short in _SPLIT or short in _FUSED_AXIS

    def param_spec(self, name: str, ndim: int) -> PartitionSpec:
        """The PartitionSpec of the global state array ``name`` of rank ``ndim``."""
        short = name.removeprefix("layers.")
        if short in _FUSED_AXIS:
            axis = _FUSED_AXIS[short]
        elif short in _SPLIT:
            axis = _SPLIT[short][1]
        else:
            return PartitionSpec()
        axis += name.startswith("layers.")  # the stacked L axis in front
        return PartitionSpec(*([None] * axis), self.axis, *([None] * (ndim - axis - 1)))

    def device_block(self, name: str, device: int, layer: int | None, read: Reader) -> np.ndarray:
        """Device ``device``'s block of one layer of the state array ``name`` (a top-level
        array when ``layer`` is None), built from ``read`` (one part at a time)."""
        short = name.removeprefix("layers.")
        if short in _FUSED_AXIS:
            axis = _FUSED_AXIS[short]
            parts = [self._part(p, device, layer, read) for p in _FUSED[short]]
            return np.concatenate([x.reshape(*x.shape[:axis], -1) for x in parts], axis=axis)
        return self._part(short, device, layer, read)

    def _part(self, name: str, device: int, layer: int | None, read: Reader) -> np.ndarray:
        if name not in _SPLIT:
            return read(name, layer, None, 0, 0)
        kind, axis = _SPLIT[name]
        idx = self.indices(kind)[device]
        valid = idx[idx >= 0]
        if not len(valid):  # a block of padding only (e.g. F=20 in blocks of 3 over 8)
            one_row = read(name, layer, axis, 0, 1)
            return np.zeros_like(np.repeat(one_row, len(idx), axis=axis))
        lo, hi = int(valid[0]), int(valid[-1]) + 1
        if hi - lo != len(valid):
            raise AssertionError(f"{name}: device {device}'s rows {idx} are not contiguous")
        x = read(name, layer, axis, lo, hi)
        if len(valid) < len(idx):  # zero padding rows at the end
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, len(idx) - len(valid))
            x = np.pad(x, pad)
        if name == "wo_LNHD" and not self.output_scale()[device]:
            x = np.zeros_like(x)
        return x
