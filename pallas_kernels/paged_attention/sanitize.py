"""What every decode-attention implementation does with invalid values, and their checks.

``jpaged.paged_attention`` passes its metadata through `sanitize` before dispatch, so the
XLA path, both Pallas kernels and the reference give one documented result on bad values
(which the kernels alone would turn into different numbers, or an out-of-bounds copy):

* a sequence whose ``lengths[b]`` lies outside ``[0, W * C]``, or one of whose used pages
  (table entries ``0 .. ceil(lengths[b] / C) - 1``) lies outside ``[0, P)``, is treated as
  length 0: its output is zeros;
* an array ``layer`` outside ``[0, L)`` reads layer ``clip(layer, 0, L - 1)`` with every
  length 0: the whole output is zeros.

Valid values pass unchanged. `check_traced` states the same conditions as
``jax.experimental.checkify`` checks (for ``check=True`` under ``jit``); the eager check
with the full messages is ``validate.validate_dynamic``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

__all__ = ["check_traced", "sanitize"]


def _problems(block_tables, lengths, layer, num_pages: int, page_size: int, num_layers):
    """``(lengths ok [B], ids ok [B, W] over the used entries, layer ok [])``."""
    W = block_tables.shape[1]
    C, P = page_size, num_pages
    lengths_ok = (lengths >= 0) & (lengths <= W * C)
    used = (
        jnp.arange(W, dtype=jnp.int32)[None, :]
        < ((jnp.clip(lengths, 0, W * C) + C - 1) // C)[:, None]
    )
    ids_ok = ~used | ((block_tables >= 0) & (block_tables < P))
    layer_ok = jnp.bool_(True)
    if num_layers is not None and layer is not None and hasattr(layer, "dtype"):
        layer_ok = jnp.all((layer >= 0) & (layer < num_layers))
    return lengths_ok, ids_ok, layer_ok


def sanitize(
    block_tables: jax.Array, lengths: jax.Array, layer: Any, *, k_pages_shape: tuple[int, ...]
) -> tuple[jax.Array, jax.Array, Any]:
    """``(block_tables, lengths, layer)`` with invalid values replaced by the documented ones
    (module docstring); works on tracers.

    Args:
      block_tables: i32[B, W].
      lengths: i32[B].
      layer: None, an int (already range-checked by ``validate_static``) or an i32[] array.
      k_pages_shape: ``[K, P, C, H]`` or ``[L, K, P, C, H]``.

    Returns:
      The tables (unchanged), lengths with invalid sequences set to 0, and the layer
      clamped into ``[0, L)``.
    """
    P, C = k_pages_shape[-3], k_pages_shape[-2]
    L = k_pages_shape[0] if len(k_pages_shape) == 5 else None
    lengths_ok, ids_ok, layer_ok = _problems(block_tables, lengths, layer, P, C, L)
    ok_B = lengths_ok & jnp.all(ids_ok, axis=1) & layer_ok
    lengths = jnp.where(ok_B, lengths, jnp.zeros((), lengths.dtype))
    if L is not None and hasattr(layer, "dtype"):
        layer = jnp.clip(layer, 0, L - 1).astype(layer.dtype)
    return block_tables, lengths, layer


def _first(bad):
    """Index of the first True of ``bad`` (flattened), and whether there is one."""
    flat = bad.reshape(-1)
    return jnp.argmax(flat), jnp.any(flat)


def check_traced(
    block_tables: jax.Array, lengths: jax.Array, layer: Any, *, k_pages_shape: tuple[int, ...]
) -> None:
    """The value checks as ``checkify.check`` calls, naming the first offending index (the
    caller must be wrapped in ``jax.experimental.checkify.checkify``)."""
    P, C = k_pages_shape[-3], k_pages_shape[-2]
    L = k_pages_shape[0] if len(k_pages_shape) == 5 else None
    W = block_tables.shape[1]
    # NumPy inputs beside traced ones are indexed by traced positions below.
    block_tables, lengths = jnp.asarray(block_tables), jnp.asarray(lengths)
    lengths_ok, ids_ok, layer_ok = _problems(block_tables, lengths, layer, P, C, L)
    b, bad = _first(~lengths_ok)
    checkify.check(
        ~bad, f"paged_attention: lengths[{{b}}]={{v}} must be in [0, W * C = {W * C}]",
        b=b, v=lengths[b],
    )  # fmt: skip
    i, bad = _first(~ids_ok)
    r, c = i // W, i % W
    checkify.check(
        ~bad, f"paged_attention: block_tables[{{r}}, {{c}}]={{v}} (a used page) must be a page "
        f"id in [0, P = {P})", r=r, c=c, v=block_tables[r, c],
    )  # fmt: skip
    if L is not None and hasattr(layer, "dtype"):
        checkify.check(
            layer_ok,
            f"paged_attention: layer={{v}} must be in [0, L = {L})",
            v=layer.reshape(-1)[0],
        )
