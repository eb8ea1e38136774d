"""Split-KV merge epilogue: which jnp formulation XLA compiles to the fewest, cheapest kernels.

The decode kernel's split partials (o f32[S, R, H], base-2 lse f32[S, R, 32]) are merged by a
small XLA epilogue after the Mosaic GPU kernel; at B=1 it was 4 kernels and 7-8 us of a
53-57 us call (H200, seventh session). Each formulation here computes the same merge (checked
against the first); the script prints each one's kernels (CUPTI) and wall time and writes
JSON. ``kernel_gpu._merge_splits`` is the form chosen.

    python benchmarks/split_merge.py --out merge.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _timing

from pallas_kernels.paged_attention import kernel_gpu


def merge_max_sums_divide(o_SRH, lse_SRL, dtype):
    """The sixth session's form: max, weighted sums, then one divide (four kernels at S=32)."""
    lse_SR = lse_SRL[..., 0]
    mx_R = jnp.max(lse_SR, axis=0)
    mx_R = jnp.where(jnp.isfinite(mx_R), mx_R, 0.0)
    w_SR = jnp.exp2(lse_SR - mx_R)
    den_R = jnp.sum(w_SR, axis=0)
    num_RH = jnp.einsum("sr,srh->rh", w_SR, o_SRH.astype(jnp.float32))
    return (num_RH / jnp.where(den_R == 0.0, 1.0, den_R)[:, None]).astype(dtype)


def merge_softmax(o_SRH, lse_SRL, dtype):
    """Clamp -inf (empty split) to a finite floor, so no row needs a NaN guard."""
    lse_SR = jnp.maximum(lse_SRL[..., 0], -1e30)
    w_SR = jnp.exp2(lse_SR - jnp.max(lse_SR, axis=0))
    num_RH = jnp.einsum("sr,srh->rh", w_SR, o_SRH.astype(jnp.float32))
    return (num_RH / jnp.sum(w_SR, axis=0)[:, None]).astype(dtype)


def merge_weights_first(o_SRH, lse_SRL, dtype):
    """Normalised weights first ([S, R], tiny), then one weighted sum over S."""
    lse_SR = jnp.maximum(lse_SRL[..., 0], -1e30)
    w_SR = jnp.exp2(lse_SR - jnp.max(lse_SR, axis=0))
    w_SR = w_SR / jnp.sum(w_SR, axis=0)
    return jnp.einsum("sr,srh->rh", w_SR, o_SRH.astype(jnp.float32)).astype(dtype)


def merge_variadic_reduce(o_SRH, lse_SRL, dtype):
    """One ``lax.reduce`` over S of (lse, o) pairs with an associative combiner:
    (a, o_a) + (b, o_b) = (m + log2(1 + e), (o_big + e o_small) / (1 + e)), m = max(a, b),
    e = 2^(min(a, b) - m). Two kernels on the H200, but slower than ``weights_first`` (ninth
    session: 4.9 vs 3.6 us at S=32, 3.7 vs 2.5 at S=8)."""
    lowest = float(jnp.finfo(jnp.float32).min)

    def combine(x, y):
        (la, oa), (lb, ob) = x, y
        a_big = la >= lb
        m = jnp.maximum(la, lb)
        e = jnp.exp2(jnp.minimum(la, lb) - m)
        big, small = jnp.where(a_big, oa, ob), jnp.where(a_big, ob, oa)
        return m + jnp.log2(1.0 + e), (big + e * small) / (1.0 + e)

    lse = jnp.broadcast_to(jnp.maximum(lse_SRL[..., :1], lowest), o_SRH.shape)
    init = (jnp.float32(lowest), jnp.float32(0.0))
    _, out = jax.lax.reduce((lse, o_SRH.astype(jnp.float32)), init, combine, (0,))
    return out.astype(dtype)


def merge_transposed(o_SRH, lse_SRL, dtype):
    """Softmax over the minor axis ([R, S]): the pattern XLA's GPU softmax rewriter fuses."""
    lse_RS = lse_SRL[..., 0].T * jnp.float32(math.log(2.0))
    lse_RS = jnp.where(jnp.isneginf(lse_RS), -1e30, lse_RS)
    w_RS = jax.nn.softmax(lse_RS, axis=-1)
    return jnp.einsum("rs,srh->rh", w_RS, o_SRH.astype(jnp.float32)).astype(dtype)


VARIANTS = {
    "max_sums_divide": merge_max_sums_divide,
    "softmax_clamped": merge_softmax,
    "weights_first": merge_weights_first,
    "kernel_gpu._merge_splits": kernel_gpu._merge_splits,
    "transposed_softmax": merge_transposed,
    "variadic_reduce": merge_variadic_reduce,
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=["32,32,128", "8,256,128", "4,1024,128"])
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for spec in ns.shapes:
        S, R, H = (int(x) for x in spec.split(","))
        lse = rng.standard_normal((S, R)).astype(np.float32) * 8
        lse[rng.random((S, R)) < 0.2] = -np.inf  # empty splits
        lse[:, 0] = -np.inf  # a row no split saw
        o = rng.standard_normal((S, R, H)).astype(np.float32)
        o[np.isinf(lse)] = 0.0  # as the kernel writes an empty split
        o = jnp.asarray(o)
        lse_SRL = jnp.asarray(np.repeat(lse[..., None], 32, axis=-1))
        ref = np.asarray(merge_max_sums_divide(o, lse_SRL, jnp.float32))
        for name, fn in VARIANTS.items():
            f = jax.jit(lambda a, b, fn=fn: fn(a, b, jnp.bfloat16))
            out = np.asarray(f(o, lse_SRL).astype(jnp.float32))
            err = float(np.max(np.abs(out - ref)))
            row = {"S": S, "R": R, "H": H, "variant": name, "max_abs_err": err}
            row.update(_timing.kernel_costs(f, o, lse_SRL))
            kernels = row["kernels_us"]
            rows.append(row)
            print(
                f"S={S:<3} R={R:<5} {name:<20} err {err:.1e}  wall {row['wall_us']:6.1f} us  "
                f"kernels {len(kernels or [])}  cupti {row['cupti_us'] or 0:6.1f} us",
                flush=True,
            )
    _timing.write_rows(ns.out, rows)


if __name__ == "__main__":
    main()
