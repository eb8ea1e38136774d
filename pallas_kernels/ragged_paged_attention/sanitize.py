"""What every ragged-attention implementation does with invalid values, and their checks.

``jpaged.ragged_paged_attention`` passes its metadata through `sanitize` before dispatch, so
the XLA path, both Pallas kernels and the reference give one documented result on bad values
(which the kernels alone would turn into different numbers, or an out-of-bounds copy). Once
``cu_q_lens`` is malformed the rows cannot be told apart by sequence, so the rule is for the
whole call: if any of

* ``num_seqs`` outside ``[0, B]``,
* ``cu_q_lens[0] != 0``, ``cu_q_lens`` decreasing over its first ``num_seqs + 1`` entries,
  or ``cu_q_lens[num_seqs] > T``,
* for a live sequence b: ``kv_lens[b] < q_len_b`` (its new tokens' K/V must be in the
  pages) or ``kv_lens[b] > W * C``, or a used page id (table entries ``0 ..
  ceil(kv_lens[b] / C) - 1``) outside ``[0, P)``,
* an array ``layer`` outside ``[0, L)``

holds, the call runs with no live sequence (``num_seqs = 0``, ``cu_q_lens`` and ``kv_lens``
zeros, ``layer`` clamped): every output row is zeros. Valid values pass unchanged (entries
past ``num_seqs`` may hold anything). `check_traced` states the same conditions as
``jax.experimental.checkify`` checks (for ``check=True`` under ``jit``); the eager check with
the full messages is ``validate.validate_dynamic``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

__all__ = ["check_traced", "sanitize"]


def _conditions(block_tables, kv_lens, cu_q_lens, num_seqs, layer, num_rows, k_pages_shape):
    """Each condition of the module docstring as ``(name, ok mask)``, plus values the
    messages need."""
    B, W = block_tables.shape
    P, C = k_pages_shape[-3], k_pages_shape[-2]
    L = k_pages_shape[0] if len(k_pages_shape) == 5 else None
    ns = num_seqs.reshape(())
    ns_ok = (ns >= 0) & (ns <= B)
    live_B = jnp.arange(B, dtype=jnp.int32) < jnp.clip(ns, 0, B)
    q_len_B = cu_q_lens[1:] - cu_q_lens[:-1]
    end = jnp.take(cu_q_lens, jnp.clip(ns, 0, B))
    cu_ok = (cu_q_lens[0] == 0) & (end <= num_rows)
    order_ok_B = ~live_B | (q_len_B >= 0)
    lens_ok_B = ~live_B | ((kv_lens >= q_len_B) & (kv_lens >= 0) & (kv_lens <= W * C))
    used_BW = (
        jnp.arange(W, dtype=jnp.int32)[None, :]
        < ((jnp.clip(kv_lens, 0, W * C) + C - 1) // C)[:, None]
    )
    ids_ok_BW = ~(live_B[:, None] & used_BW) | ((block_tables >= 0) & (block_tables < P))
    layer_ok = jnp.bool_(True)
    if L is not None and layer is not None and hasattr(layer, "dtype"):
        layer_ok = jnp.all((layer >= 0) & (layer < L))
    return ns, ns_ok, end, cu_ok, q_len_B, order_ok_B, lens_ok_B, ids_ok_BW, layer_ok


def sanitize(
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    layer: Any,
    *,
    num_rows: int,
    k_pages_shape: tuple[int, ...],
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, Any]:
    """``(block_tables, kv_lens, cu_q_lens, num_seqs, layer)`` with invalid values replaced
    by the documented ones (module docstring); works on tracers.

    Args:
      block_tables: i32[B, W].
      kv_lens: i32[B].
      cu_q_lens: i32[B + 1].
      num_seqs: i32[] or i32[1].
      layer: None, an int (range-checked by ``validate_static``) or an integer scalar array.
      num_rows: T, rows of q.
      k_pages_shape: ``[K, P, C, H]`` or ``[L, K, P, C, H]``.
    """
    _, ns_ok, _, cu_ok, _, order_ok_B, lens_ok_B, ids_ok_BW, layer_ok = _conditions(
        block_tables, kv_lens, cu_q_lens, num_seqs, layer, num_rows, k_pages_shape
    )
    ok = ns_ok & cu_ok & jnp.all(order_ok_B) & jnp.all(lens_ok_B) & jnp.all(ids_ok_BW) & layer_ok

    def zero(x):
        return jnp.where(ok, x, jnp.zeros((), x.dtype))

    if len(k_pages_shape) == 5 and hasattr(layer, "dtype"):
        layer = jnp.clip(layer, 0, k_pages_shape[0] - 1).astype(layer.dtype)
    return block_tables, zero(kv_lens), zero(cu_q_lens), zero(num_seqs), layer


def _first(bad):
    flat = bad.reshape(-1)
    return jnp.argmax(flat), jnp.any(flat)


def check_traced(
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    layer: Any,
    *,
    num_rows: int,
    k_pages_shape: tuple[int, ...],
) -> None:
    """The value checks as ``checkify.check`` calls, naming the first offending index (the
    caller must be wrapped in ``jax.experimental.checkify.checkify``)."""
    B, W = block_tables.shape
    P, C = k_pages_shape[-3], k_pages_shape[-2]
    # NumPy inputs beside traced ones are indexed by traced positions below.
    block_tables, kv_lens, cu_q_lens, num_seqs = map(
        jnp.asarray, (block_tables, kv_lens, cu_q_lens, num_seqs)
    )
    ns, ns_ok, end, _, q_len_B, order_ok_B, lens_ok_B, ids_ok_BW, layer_ok = _conditions(
        block_tables, kv_lens, cu_q_lens, num_seqs, layer, num_rows, k_pages_shape
    )
    op = "ragged_paged_attention"
    checkify.check(ns_ok, f"{op}: num_seqs={{v}} must be in [0, B = {B}]", v=ns)
    checkify.check(cu_q_lens[0] == 0, f"{op}: cu_q_lens[0]={{v}} must be 0", v=cu_q_lens[0])
    checkify.check(
        end <= num_rows, f"{op}: cu_q_lens[num_seqs]={{v}} must be <= T = {num_rows}", v=end
    )
    b, bad = _first(~order_ok_B)
    checkify.check(
        ~bad, f"{op}: cu_q_lens must be non-decreasing: cu_q_lens[{{b}}]={{u}} > "
        f"cu_q_lens[{{c}}]={{v}}", b=b, c=b + 1, u=cu_q_lens[b], v=cu_q_lens[b + 1],
    )  # fmt: skip
    b, bad = _first(~lens_ok_B)
    checkify.check(
        ~bad, f"{op}: kv_lens[{{b}}]={{v}} must be in [q_len = {{q}}, W * C = {W * C}]",
        b=b, v=kv_lens[b], q=q_len_B[b],
    )  # fmt: skip
    i, bad = _first(~ids_ok_BW)
    r, c = i // W, i % W
    checkify.check(
        ~bad, f"{op}: block_tables[{{r}}, {{c}}]={{v}} (a used page) must be a page id in "
        f"[0, P = {P})", r=r, c=c, v=block_tables[r, c],
    )  # fmt: skip
    if len(k_pages_shape) == 5 and hasattr(layer, "dtype"):
        checkify.check(
            layer_ok, f"{op}: layer={{v}} must be in [0, L = {k_pages_shape[0]})",
            v=layer.reshape(-1)[0],
        )  # fmt: skip
