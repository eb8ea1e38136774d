"""Rotary position embeddings (RoPE) as Hugging Face's Llama family computes them.

Half-split layout ("rotate_half"): dimension i pairs with i + H/2, which is the layout of
Hugging Face checkpoints. Frequencies follow ``transformers``' ``rope_init_fns``: default,
linear, and Llama 3's frequency-dependent scaling.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models._config import RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:
    """The RoPE inverse frequencies, f32[H / 2] (host constants, folded into the graph).

    Args:
      head_dim: H (even).
      theta: the RoPE base.
      scaling: None, or linear / llama3 scaling.

    Returns:
      f32[H / 2]: ``theta ** (-2i / H)``, scaled as ``scaling`` says.

    Raises:
      ValueError: if ``head_dim`` is odd.

    >>> inverse_frequencies(4, 10000.0).tolist()
    [1.0, 0.009999999776482582]
    """
    if head_dim % 2:
        raise ValueError(f"{head_dim=} must be even for RoPE")
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates ``x`` by its positions.

    Args:
      x: [..., N, H] queries or keys (any leading dims, e.g. [T, N, H] or [B, S, N, H]).
      positions: i32[...] matching the leading dims of ``x``.
      inv_freq: f32[H / 2] from ``inverse_frequencies``.

    Returns:
      ``x`` rotated, same shape and dtype (the rotation is computed in f32).
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., 1, H]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
