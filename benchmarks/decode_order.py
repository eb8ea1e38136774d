"""The decode kernel's longest-first order: which formulation costs the fewest, cheapest kernels.

Past one wave of CTAs the decode kernel runs sequences longest first (LPT list scheduling), and
the order is computed on the device in every call (``kernel_gpu._longest_first_order``): a key
fusion, a copy into the sort's buffer and a one-operand sort (``"sort"``), or two O(B^2)
counting reductions (``"rank"``); ``"kernel"`` (each CTA counts its own place, no XLA kernel:
``kernel_gpu._kernel_order``) is timed in whole calls by ``decode_attention.py``, not here.
Each method here gives the same array (checked); the script
prints each one's kernels (CUPTI), their sum and the wall time of back-to-back calls, and
writes JSON.

    python benchmarks/decode_order.py --batches 64 256 1024 --out order.json
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _timing

from pallas_kernels.paged_attention import kernel_gpu


def rank_split_keys(lengths_B, block_kv: int):
    """The counting order with each reduction computing its own keys from the lengths (two
    different but equal formulas, so XLA cannot merge them into one shared key fusion). On the
    H200 (ninth session) this removed the key fusion only at B=64; at 128-512 XLA made 3-4
    kernels of it, so ``kernel_gpu`` keeps the shared keys."""
    B = lengths_B.shape[0]
    top, bits = kernel_gpu._ORDER_MAX_TILES, kernel_gpu._ORDER_BITS
    slot = jnp.arange(B, dtype=jnp.int32)
    live = jnp.maximum(lengths_B, 0)
    keys = ((top - jnp.minimum((live - 1) // block_kv + 1, top)) << bits) | slot
    rank = jnp.sum(keys[None, :] < keys[:, None], axis=1, dtype=jnp.int32)
    live2 = jnp.where(lengths_B > 0, lengths_B, 0)
    tiles2 = jnp.minimum(live2 // block_kv + (live2 % block_kv > 0).astype(jnp.int32), top)
    keys2 = (top - tiles2) * (1 << bits) + slot
    return jnp.sum(jnp.where(rank[None, :] == slot[:, None], keys2[None, :], 0), axis=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="*", default=[8, 64, 128, 256, 512, 1024])
    p.add_argument("--block-kv", type=int, default=64)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for B in ns.batches:
        lengths = jnp.asarray(rng.integers(0, 4096, size=B).astype(np.int32))
        ref = None
        xla_methods = [m for m in kernel_gpu.ORDER_METHODS if m != "kernel"]
        for method in (*xla_methods, "rank_split_keys"):
            if method != "sort" and B > kernel_gpu._RANK_ORDER_MAX_SEQS:
                continue
            if method == "rank_split_keys":
                f = jax.jit(lambda x: rank_split_keys(x, ns.block_kv))
            else:
                f = jax.jit(
                    lambda x, m=method: kernel_gpu._longest_first_order(x, ns.block_kv, True, m)
                )
            out = np.asarray(f(lengths))
            ref = out if ref is None else ref
            row = {"B": B, "method": method, "same_as_sort": bool(np.array_equal(out, ref))}
            row.update(_timing.kernel_costs(f, lengths))
            kernels = row["kernels_us"]
            rows.append(row)
            print(
                f"B={B:<5} {method:<5} same {row['same_as_sort']}  wall {row['wall_us']:6.1f} us  "
                f"kernels {len(kernels or [])}  cupti {row['cupti_us'] or 0:6.1f} us  "
                + " ".join(f"{n[:24]}:{us:.1f}" for n, us in kernels or []),
                flush=True,
            )
    _timing.write_rows(ns.out, rows)


if __name__ == "__main__":
    main()
