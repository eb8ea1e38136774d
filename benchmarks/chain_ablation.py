"""What a lone CTA's tile chain is made of: the decode kernel's loop timed with parts of a tile
left out. A diagnostic: the outputs of the ablated kernels are WRONG by construction and only
their time means something.

    python benchmarks/chain_ablation.py --ctas 8 --tokens 65536 --out OUT.json

Setting as ``lone_cta.py``'s ``l2`` rows (one split, every table entry in the same 64 pages, so
after the first call every tile is an L2 hit and what remains is the chain itself). Each
ablation is a textual edit of ``_gpu_tile``'s source (``ABLATIONS``), executed into a copy of
the module whose ``_attend`` the kernel is then built with; the library is not changed. Per row:
CUPTI us, ns a tile, and the ns a tile it saves against the full kernel. The kernel ablated
is the one with a running max in every tile (``fixed_max=False``, as measured in the
seventeenth session, ``chain_ablation_s17_*.json``); ``--fixed-max`` ablates today's bf16
default, whose max is taken in a unit's first tile only.

- ``no_qk``: the scores are zeros (no Q K^T wgmma; K's barrier is still waited on);
- ``no_max``: the max is not taken across the tile's keys (no cross-warp reduction);
- ``no_p_store``: P is not written to SMEM (no store, proxy fence or barrier before P @ V);
- ``no_pv``: no P @ V wgmma (V's barrier is still waited on);
- ``no_tile_barrier``: no warpgroup barrier after a tile, before its slot is refilled;
- combinations, down to ``copies_only`` (waits and copies, no math).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _timing
import jax
import jax.numpy as jnp
from lone_cta import _inputs, add_lone_args

from pallas_kernels.paged_attention import _gpu_bodies, _gpu_tile, kernel_gpu

# name -> [(source text of _gpu_tile, its replacement)]; each must occur exactly once.
_EDITS = {
    "no_qk": [
        (
            "    sc = pl.run_scoped(qk, plgpu.ACC(sc_shape, jnp.float32))",
            "    sc = plgpu.layout_cast(jnp.zeros(sc_shape, jnp.float32), plgpu.Layout.WGMMA)",
        )
    ],
    "no_max": [
        (
            "        return jnp.maximum(m, sc.max(axis=keys) * scale if fold else sc.max(axis=keys))",
            "        return jnp.maximum(m, 0.0)",
        )
    ],
    "no_p_store": [
        (
            "        p_smem.transpose((1, 0))[...] = p.astype(cfg.dtype)\n"
            "    else:\n"
            "        p_smem[...] = p.astype(cfg.dtype)\n"
            "    if cfg.per_thread:  # V's cp.async group, made visible by P's fence and barrier\n"
            "        _cp_async.wait(later - 1)\n"
            "    # tcgen05: this tile's scores and the last tile's P @ V are read out of TMEM before the\n"
            "    # next products overwrite them.\n"
            "    tmem_sync(cfg, plgpu.commit_smem)\n",
            "        pass\n",
        )
    ],
    "no_pv": [
        (
            "    o = pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))",
            "    o = jnp.zeros_like(acc)",
        )
    ],
    "no_tile_barrier": [
        (
            "            # refills the slot or writes the next P.\n            wg_barrier(cfg)\n",
            "            # refills the slot or writes the next P.\n",
        )
    ],
}
ABLATIONS = {
    "full": [],
    **{name: [name] for name in _EDITS},
    "no_qk+no_max": ["no_qk", "no_max"],
    "no_pv+no_p_store": ["no_pv", "no_p_store"],
    "copies_only": ["no_qk", "no_max", "no_p_store", "no_pv"],
}


def ablated_attend(names):
    """``_gpu_tile._attend`` of a copy of the module with the edits of ``names`` applied."""
    src = inspect.getsource(_gpu_tile)
    for name in names:
        for old, new in _EDITS[name]:
            if src.count(old) != 1:
                raise SystemExit(f"{name}: {old[:60]!r} is not in _gpu_tile once (edited since?)")
            src = src.replace(old, new)
    mod = types.ModuleType("_gpu_tile_ablated")
    mod.__file__ = _gpu_tile.__file__
    exec(compile(src, f"<ablated _gpu_tile: {'+'.join(names) or 'full'}>", "exec"), mod.__dict__)
    return mod._attend


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_lone_args(ap)
    ap.add_argument("--only", nargs="*", default=None, help="ablation names (default: all)")
    ap.add_argument(
        "--fixed-max",
        action="store_true",
        help="ablate the kernel with fixed_max (the bf16 default since the seventeenth session); "
        "without it the running max of every tile, as measured then",
    )
    ap.add_argument("--interpret", action="store_true", help="Mosaic GPU interpreter (CPU check)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    H, C = ns.head_dim, ns.page_size
    T = kernel_gpu.default_block_kv(H)
    tiles = -(-ns.tokens // T)
    args = _inputs(ns.ctas, ns.tokens, C, H, ns.l2_pages, seed=1)
    print(f"{jax.devices()[0]}, jax {jax.__version__}; outputs of ablated rows are wrong")
    print(f"{'ablation':20} {'us':>9} {'ns/tile':>8} {'saves ns/tile':>14}")
    rows, base, ref = [], None, None
    original = _gpu_bodies._attend
    try:
        for name in ns.only or list(ABLATIONS):
            _gpu_bodies._attend = ablated_attend(ABLATIONS[name])
            kw = dict(
                sm_scale=1 / math.sqrt(H), num_splits=1, interpret=ns.interpret,
                fixed_max=ns.fixed_max,
            )  # fmt: skip
            f = jax.jit(lambda q, k, v, bt, ln, kw=kw: kernel_gpu.paged_attention_pallas_gpu(
                q, k, v, bt, ln, **kw))  # fmt: skip
            out = jax.block_until_ready(f(*args)).astype(jnp.float32)
            if name == "full":
                ref = out
            diff = float(jnp.max(jnp.abs(out - ref)))  # > 0: the edit took effect
            us = _timing.cupti_us(f, *args, iterations=10)
            per_tile = us * 1e3 / tiles if us else None
            if name == "full":
                base = per_tile
            saves = base - per_tile if base and per_tile else None
            rows.append(
                dict(ablation=name, cupti_us=us, ns_per_tile=per_tile, saves_ns=saves, diff=diff)
            )
            if us:
                s = f"{saves:14.0f}" if saves is not None else f"{'-':>14}"
                print(f"{name:20} {us:9.1f} {per_tile:8.0f} {s}  diff {diff:.1e}")
            else:
                print(f"{name:20} (no CUPTI: compiled and ran)  diff {diff:.1e}")
            jax.clear_caches()
    finally:
        _gpu_bodies._attend = original
    meta = dict(ctas=ns.ctas, tokens=ns.tokens, page_size=C, head_dim=H, l2_pages=ns.l2_pages)
    _timing.write_rows(ns.out, [{"meta": meta}, *rows])


if __name__ == "__main__":
    main()
