"""The decode kernel's longest-first order of sequences (host side; the in-kernel count is
``_gpu_bodies._kernel_order``).

The order is the ascending order of packed keys ``(0x7FFF - tiles) << 16 | sequence``
(``pallas_kernels._gpu.order``): an XLA array, by a sort or by counting
(``longest_first_order``), from which the kernel reads the sequence as ``key & 0xFFFF``, or
counted in each CTA (``order_method="kernel"``). Lengths compare in tiles (the work a unit
does), capped at 0x7FFF tiles (2M tokens at T=64), so longer sequences tie; ties go in index
order; lengths <= 0 sort last.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._gpu import order

ORDER_BITS = 16
ORDER_MAX_TILES = 0x7FFF
ORDER_METHODS = ("sort", "rank", "kernel")
# Up to this many sequences the order can be computed by counting ("rank": B^2 compares).
RANK_ORDER_MAX_SEQS = 1024
# Up to this many sequences each CTA can count its own place ("kernel"): the lengths reach SMEM
# by one TMA copy, whose bytes must be a multiple of 16 (B % 4 == 0) and whose box <= 256.
KERNEL_ORDER_MAX_SEQS = 256


def packed_order(num_seqs: int) -> bool:
    """Whether the order array holds packed keys (else plain sequence indices)."""
    return num_seqs <= 1 << ORDER_BITS


def kernel_order_reason(num_seqs: int) -> str | None:
    """Why ``order_method="kernel"`` cannot order ``num_seqs`` sequences (None if it can)."""
    if num_seqs > KERNEL_ORDER_MAX_SEQS or num_seqs % 4:
        return (
            f"needs a multiple of 4 sequences, at most {KERNEL_ORDER_MAX_SEQS} (the lengths "
            f"reach SMEM by one TMA copy), got {num_seqs}"
        )
    return None


def check_order_method(name: str, method, num_seqs: int, packed: bool, kernel: bool = True):
    """A ValueError naming ``name`` unless ``method`` can order ``num_seqs`` sequences
    (``kernel=False``: without ``"kernel"``'s own limits, for a call that may not order)."""
    if method not in ORDER_METHODS:
        raise ValueError(f"{name}={method!r} must be one of {ORDER_METHODS}")
    why = kernel_order_reason(num_seqs)
    if kernel and method == "kernel" and why:
        raise ValueError(f'{name}="kernel" {why}')
    if method == "rank" and not packed:
        raise ValueError(
            f'{name}="rank" needs packed keys (at most {1 << ORDER_BITS} sequences), got {num_seqs}'
        )
    if method == "rank" and num_seqs > RANK_ORDER_MAX_SEQS:
        raise ValueError(
            f'{name}="rank" takes at most {RANK_ORDER_MAX_SEQS} sequences, got {num_seqs}'
        )


def packed_key(length, seq, block_kv: int):
    """The sort key of a sequence: ``(0x7FFF - tiles) << 16 | seq``, tiles =
    ceil(max(length, 0) / block_kv) capped at 0x7FFF, on arrays or in-kernel values alike;
    ``block_kv`` is a power of two, so the division is a shift (no int32 overflow near 2**31)."""
    if block_kv & (block_kv - 1):
        raise ValueError(f"{block_kv=} must be a power of two")
    shift = block_kv.bit_length() - 1
    tiles = jnp.minimum(((jnp.maximum(length, 0) - 1) >> shift) + 1, ORDER_MAX_TILES)
    return order.pack(tiles, seq, ORDER_BITS, ORDER_MAX_TILES)


def longest_first_order(lengths_B, block_kv: int, packed: bool, method: str = "sort"):
    """i32[B]: sequence slots longest first, as packed keys (``packed``) or argsort indices.

    ``method="sort"``: a key fusion and a one-operand sort. ``"rank"`` (packed keys, at most
    ``RANK_ORDER_MAX_SEQS`` sequences): the same array without a sort: each key's rank is the
    count of smaller keys (the keys are distinct), and entry i is the key of rank i; two
    reductions over [B, B].
    """
    if method == "kernel":
        raise ValueError('method="kernel" is computed inside the kernel (``_kernel_order``)')
    check_order_method("method", method, lengths_B.shape[0], packed)
    live = jnp.maximum(lengths_B, 0)
    if not packed:
        return jnp.argsort(-live).astype(jnp.int32)
    slot = jnp.arange(lengths_B.shape[0], dtype=jnp.int32)
    keys = packed_key(live, slot, block_kv)
    if method == "sort":
        return order.sort_keys(keys)
    rank = jnp.sum(keys[None, :] < keys[:, None], axis=1, dtype=jnp.int32)
    picked = jnp.where(rank[None, :] == slot[:, None], keys[None, :], 0)
    return jnp.sum(picked, axis=1, dtype=jnp.int32)
