"""How fast the decode kernel's loop runs when its CTAs stream alone: the per-tile cost that
sets the split-KV drain, the big rows' last wave and B=1.

    python benchmarks/diagnostics/lone_cta.py --ctas 8 --tokens 65536 --variants num_stages=3 block_kv=128

One sequence of ``--tokens`` tokens, ``--ctas`` KV heads (G=4 query heads each), one split: each
CTA walks the whole sequence alone on its SM. Each row is timed twice:

- ``hbm``: the table's pages are a random permutation of a pool far larger than L2, so every
  tile comes from HBM (``--ctas`` x tokens x 512 bytes a call, K and V at head dim 128);
- ``l2``: every table entry points into the same ``--l2-pages`` pages, so after the first call
  every tile is an L2 hit: what remains is the loop's own chain (copy issue, the barrier waits,
  the two products, the softmax, the refills), without HBM's latency.

Per row: CUPTI us, ns per tile, GB/s per CTA. If ``l2`` is nearly as slow as ``hbm``, a lone
CTA is bound by its own chain, not by the copies' latency; a deeper ring would not help, a
shorter chain would.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _timing
import jax
import jax.numpy as jnp
import numpy as np
from decode_attention import _parse_kwargs

from pallas_kernels.paged_attention import kernel_gpu


def _inputs(ctas: int, tokens: int, C: int, H: int, l2_pages: int | None, seed: int):
    rng = np.random.default_rng(seed)
    W = -(-tokens // C)
    P = W + 16 if l2_pages is None else max(l2_pages, 1) + 16
    if l2_pages is None:
        table = rng.permutation(P)[:W]
    else:
        table = rng.permutation(l2_pages)[np.arange(W) % l2_pages]
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    dt = jnp.bfloat16
    return (
        jax.random.normal(k1, (1, 4 * ctas, H), dt),
        jax.random.normal(k2, (ctas, P, C, H), dt),
        jax.random.normal(k3, (ctas, P, C, H), dt),
        jnp.asarray(table[None].astype(np.int32)),
        jnp.asarray([tokens], jnp.int32),
    )


def add_lone_args(ap: argparse.ArgumentParser) -> None:
    """The setting's arguments."""
    ap.add_argument("--ctas", type=int, default=8, help="KV heads = lone CTAs (one split)")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--l2-pages", type=int, default=64, help="distinct pages of the l2 rows")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_lone_args(ap)
    ap.add_argument("--variants", nargs="*", default=[], help="name=value[,...] tunings")
    ap.add_argument("--interpret", action="store_true", help="Mosaic GPU interpreter (CPU check)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    tunings = [{}] + [_parse_kwargs(v) for v in ns.variants]
    H, C = ns.head_dim, ns.page_size
    print(f"{jax.devices()[0]}, jax {jax.__version__}")
    rows = []
    print(f"{'variant':34} {'pool':4} {'us':>9} {'ns/tile':>8} {'GB/s/CTA':>9}")
    for mode, l2 in (("hbm", None), ("l2", ns.l2_pages)):
        args = _inputs(ns.ctas, ns.tokens, C, H, l2, seed=1)
        ref = None
        for tuning in tunings:
            T = tuning.get("block_kv") or kernel_gpu.default_block_kv(H)
            kw = dict(sm_scale=1 / math.sqrt(H), num_splits=1, interpret=ns.interpret, **tuning)
            f = jax.jit(lambda q, k, v, bt, ln, kw=kw: kernel_gpu.paged_attention_pallas_gpu(
                q, k, v, bt, ln, **kw))  # fmt: skip
            out = np.asarray(jax.block_until_ready(f(*args)).astype(jnp.float32))
            if ref is None:
                ref = out
            err = float(np.max(np.abs(out - ref)))
            us = _timing.cupti_us(f, *args, iterations=10)
            tiles = -(-ns.tokens // T)
            per_cta = ns.tokens * H * 2 * 2
            row = {
                "variant": tuning, "pool": mode, "cupti_us": us, "tiles": tiles,
                "ns_per_tile": us * 1e3 / tiles if us else None,
                "gbs_per_cta": per_cta / (us * 1e-6) / 1e9 if us else None,
                "max_abs_diff_vs_default": err,
            }  # fmt: skip
            rows.append(row)
            name = ",".join(f"{k}={v}" for k, v in tuning.items()) or "default"
            if us:
                print(f"{name:34} {mode:4} {us:9.1f} {row['ns_per_tile']:8.0f} "
                      f"{row['gbs_per_cta']:9.1f}  diff {err:.1e}")  # fmt: skip
            else:
                print(f"{name:34} {mode:4} (no CUPTI)  diff {err:.1e}")
        del args
    meta = dict(ctas=ns.ctas, tokens=ns.tokens, page_size=C, head_dim=H, l2_pages=ns.l2_pages)
    _timing.write_rows(ns.out, [{"meta": meta}, *rows])


if __name__ == "__main__":
    main()
