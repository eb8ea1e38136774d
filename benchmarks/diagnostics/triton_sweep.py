"""The Pallas-Triton kernels' knobs on this GPU, CUPTI kernel time (the defaults' evidence).

Decode: rows of ``decode_attention.QUICK`` (same lengths and tables as the table) through
``pallas_triton`` with each variant of ``--decode-variants``. Prefill: ``--prefill-lengths``
(B = 32k / T causal prompts, prefill_attention's shapes) through the ragged kernel with each of
``--prefill-variants``. XLA: the decode XLA path at ``--xla-rows`` with each ``pages_per_chunk``
of ``--xla-chunks``, beside a module named by ``--old-xla`` (a file holding an earlier XLA
path, e.g. one written by ``git show REV:pallas_kernels/paged_attention/xla.py``).

    python benchmarks/diagnostics/triton_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _timing
import decode_attention as dec
import prefill_attention as pre

from pallas_kernels.paged_attention import kernel_triton, xla
from pallas_kernels.ragged_paged_attention import kernel_triton as ragged_triton


def _kw(spec: str) -> dict:
    return {} if spec == "default" else dec._parse_kwargs(spec)


def _time(name, f, args, nbytes=None, flops=None, ref=None):
    try:
        out = jax.block_until_ready(f(*args))
        us = _timing.cupti_us(f, *args)
        wall = _timing.wall_us(f, *args, calls=20, rounds=3)
        row = {"name": name, "cupti_us": us, "wall_us": wall}
        if nbytes and us:
            row["cupti_tbs"] = nbytes / (us * 1e-6) / 1e12
        if flops and us:
            row["cupti_tflops"] = flops / (us * 1e-6) / 1e12
        if ref is not None:
            a = np.asarray(jnp.asarray(out, jnp.float32))
            row["max_abs_err"] = float(np.max(np.abs(a - ref)))
        print(json.dumps(row), flush=True)
        return row, out
    except Exception as e:
        traceback.print_exc(limit=2)
        row = {"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), flush=True)
        return row, None


def decode_sweep(ns, results):
    for i, case, inp in dec.table_inputs(dec.QUICK, ns.decode_rows, width_multiple=64):
        nbytes = dec.live_bytes(case, inp.lengths_np)
        args = (inp.q, inp.k_pages, inp.v_pages, inp.block_tables, inp.lengths)
        scale = 1.0 / math.sqrt(case.H)
        ref = None
        for spec in ns.decode_variants:
            kw = _kw(spec)
            f = jax.jit(
                lambda q, k, v, t, n, kw=kw, scale=scale: (
                    kernel_triton.paged_attention_pallas_triton(q, k, v, t, n, sm_scale=scale, **kw)
                )
            )
            row, out = _time(f"decode[{i}] {case.label} {spec}", f, args, nbytes=nbytes, ref=ref)
            if ref is None and out is not None:
                ref = np.asarray(out.astype(jnp.float32))
            results.append(row)


def xla_sweep(ns, results):
    old = None
    if ns.old_xla and os.path.exists(ns.old_xla):
        spec = importlib.util.spec_from_file_location("old_xla", ns.old_xla)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    for i, case, inp in dec.table_inputs(dec.QUICK, ns.xla_rows, width_multiple=64):
        nbytes = dec.live_bytes(case, inp.lengths_np)
        args = (inp.q, inp.k_pages, inp.v_pages, inp.block_tables, inp.lengths)
        scale = 1.0 / math.sqrt(case.H)
        ref = None
        impls = [(f"xla_new R={r}", xla.paged_attention_xla, r) for r in ns.xla_chunks]
        if old is not None:  # the other module at its default and at each chunk size
            impls[:0] = [(f"xla_old R={r}", old.paged_attention_xla, r)
                         for r in [None, *ns.xla_chunks]]  # fmt: skip
        for name, fn, r in impls:
            kw = {} if r is None else {"pages_per_chunk": r}
            f = jax.jit(
                lambda q, k, v, t, n, fn=fn, kw=kw, s=scale: fn(q, k, v, t, n, sm_scale=s, **kw)
            )
            row, out = _time(f"xla[{i}] {case.label} {name}", f, args, nbytes=nbytes, ref=ref)
            if ref is None and out is not None:  # the first one is the others' reference
                ref = np.asarray(out.astype(jnp.float32))
            results.append(row)


def prefill_sweep(ns, results):
    rng = np.random.default_rng(0)
    for T in ns.prefill_lengths:
        B = max(1, 32768 // T)
        inp = pre._paged(rng, [T] * B, [T] * B)
        flops = 4 * B * pre.N * pre.H * T * T / 2
        q4, kd, vd = pre._dense_from_paged(inp, B, T)
        cud = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn"
            )
        )
        row, out = _time(f"prefill T={T} cudnn", cud, (q4, kd, vd), flops=flops)
        results.append(row)
        ref = None if out is None else np.asarray(out.reshape(B * T, pre.N, pre.H), np.float32)
        for spec in ns.prefill_variants:
            kw = _kw(spec)
            f = jax.jit(
                lambda *a, kw=kw: ragged_triton.ragged_paged_attention_pallas_triton(
                    *a, sm_scale=1.0 / math.sqrt(pre.H), **kw
                )
            )
            row, _ = _time(f"prefill T={T} triton {spec}", f, inp, flops=flops, ref=ref)
            results.append(row)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decode-rows", type=int, nargs="*", default=[0, 2, 3, 8])
    p.add_argument("--decode-variants", nargs="*", default=["default"])
    p.add_argument("--xla-rows", type=int, nargs="*", default=[3])
    p.add_argument("--xla-chunks", type=int, nargs="*", default=[16, 32])
    p.add_argument("--old-xla", default="")
    p.add_argument("--prefill-lengths", type=int, nargs="*", default=[8192])
    p.add_argument("--prefill-variants", nargs="*", default=["default"])
    p.add_argument("--parts", nargs="*", default=["decode", "xla", "prefill"])
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    results: list = []
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    print(json.dumps(meta), flush=True)
    for part, fn in (("decode", decode_sweep), ("xla", xla_sweep), ("prefill", prefill_sweep)):
        if part in ns.parts:
            fn(ns, results)
            if ns.out:
                with open(ns.out, "w") as f:
                    json.dump({"meta": meta, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
