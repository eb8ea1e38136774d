"""Does a scan over stacked layer weights copy each layer's weights before its GEMMs (GPU)?

A toy decoder MLP (L layers of x + silu(x @ w1[l]) @ w2[l], bf16, x [B, D]) four ways:
``scan`` (stacked weights sliced by the loop index, as ``jpaged.models`` ran its layers),
``scan-unroll`` (the same scan, ``unroll=True``: static slices), ``list`` (a Python loop over
separate per-layer arrays) and ``scan`` again under each XLA flag set given. Prints time per
forward, weight bytes / time over the HBM read roofline, and the device copies per forward
(``MemcpyD2D`` in a profiler trace). Each flag set runs in its own process.

    python benchmarks/layer_weights_probe.py --flag-sets="|--xla_gpu_enable_dynamic_slice_fusion=true"
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def _child(args) -> None:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(HERE))
    import _timing
    from decode_step import summarize_trace

    L, B, D, F = args.layers, args.batch, args.hidden, args.ffn
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    w1 = (jax.random.normal(k1, (L, D, F), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (L, F, D), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(k3, (B, D), jnp.bfloat16)
    w1s, w2s = list(w1), list(w2)

    def mlp(x, a, b):
        return x + jax.nn.silu(x @ a) @ b

    def scan(x, w1, w2, unroll=1):
        return jax.lax.scan(lambda x, w: (mlp(x, *w), None), x, (w1, w2), unroll=unroll)[0]

    fns = {
        "scan": (jax.jit(scan), (x, w1, w2)),
        "scan-unroll": (jax.jit(lambda x, a, b: scan(x, a, b, unroll=True)), (x, w1, w2)),
        "list": (jax.jit(lambda x, a, b: _loop(mlp, x, a, b)), (x, w1s, w2s)),
    }
    roof, _ = _timing.read_roofline_tbs((4 << 30) if jax.default_backend() == "gpu" else 1 << 24)
    nbytes = 2 * L * D * F * 2
    out = {"flags": args.child_flags, "roofline_tbs": roof, "rows": {}}
    for name, (fn, a) in fns.items():
        if args.child_flags and name != "scan":
            continue
        us = _timing.wall_us(fn, *a, calls=20, rounds=5)
        d = tempfile.mkdtemp()
        with jax.profiler.trace(d):
            for _ in range(3):
                r = fn(*a)
            jax.block_until_ready(r)
        tr = summarize_trace(d, 3)
        copies = next((t["calls_per_step"] for t in tr.get("top", []) if t["name"] == "MemcpyD2D"),
                      0.0)  # fmt: skip
        out["rows"][name] = {"us": us, "tbs": nbytes / us / 1e6, "roof_frac": nbytes / us / 1e6 / roof,
                             "memcpy_per_call": copies, "kernels": tr.get("kernels_per_step")}  # fmt: skip
        print(f"[{args.child_flags or 'default'}] {name:12s} {us:8.1f} us  "
              f"{nbytes / us / 1e6:5.2f} TB/s ({nbytes / us / 1e6 / roof:.0%} of {roof:.2f})  "
              f"memcpy/call {copies:.0f}", flush=True)  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)


def _loop(mlp, x, a, b):
    for wa, wb in zip(a, b, strict=True):
        x = mlp(x, wa, wb)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--flag-sets", default="", help="XLA_FLAGS values separated by '|'")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child-flags", default=None, help=argparse.SUPPRESS)  # internal
    args = ap.parse_args()
    if args.child_flags is not None:
        return _child(args)
    results = []
    for flags in args.flag_sets.split("|"):
        env = dict(os.environ, XLA_FLAGS=flags)
        cmd = [sys.executable, __file__, "--layers", str(args.layers), "--batch",
               str(args.batch), "--hidden", str(args.hidden), "--ffn", str(args.ffn),
               f"--child-flags={flags}"]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        print(proc.stdout, end="")
        res = next((json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")),
                   {"flags": flags, "error": proc.stderr[-2000:]})  # fmt: skip
        if "error" in res:
            print(f"[{flags}] failed: {res['error']}")
        results.append(res)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
