"""Prefill (ragged) attention benchmark: jpaged's Mosaic GPU ragged kernel against cuDNN dense.

In ONE process, per prompt length T (512 .. 16k, B = 32k / T prompts, N=32 / K=8 heads,
H=128, bf16, causal): jpaged ``ragged_paged_attention`` over a paged pool (C=16, randomly
permuted pages) and cuDNN dense causal flash attention (``jax.nn.dot_product_attention(...,
implementation="cudnn")``) on the same data, and JAX's own FA3-style Mosaic GPU example kernel
(``jax.experimental.pallas.ops.gpu.attention_mgpu``, dense, non-paged: what Mosaic GPU reaches
without pages) where it is importable. Then two ragged-specific rows: a decode-only batch
through the ragged kernel beside jpaged's decode kernel (effective TB/s of live K/V), and a
mixed batch (decodes plus one long prefill in one call).

TFLOP/s = 4 * B * N * H * T^2 / 2 / time (causal: half the square; the same count for both).
Timing: wall-clock (``--calls`` back-to-back calls, one sync, median of ``--rounds`` rounds)
and CUPTI kernel-only time side by side (``_timing``).

    python benchmarks/prefill_attention.py                  # the full table (GPU)
    python benchmarks/prefill_attention.py --lengths 512 4096 --variants "block_kv=128"
    python benchmarks/prefill_attention.py --impl xla --lengths 256 --batch-tokens 512  # CPU smoke

Prints a table and writes JSON (``--out``, default ``$OUT/prefill_<date>.json`` or
``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _timing

N, K, H, C = 32, 8, 128, 16
_MODULES = {"xla": "xla", "pallas_gpu": "kernel_gpu", "pallas_triton": "kernel_triton"}
DTYPE = jnp.bfloat16


def _paged(rng, kv_lens, q_lens):
    """Random q, a permuted paged pool holding ``kv_lens`` tokens per sequence, metadata."""
    B = len(kv_lens)
    npages = [-(-int(n) // C) for n in kv_lens]
    W = max(npages)
    P = sum(npages) + 8
    perm = rng.permutation(P).astype(np.int32)
    tables = np.zeros((B, W), np.int32)
    cur = 0
    for b, n in enumerate(npages):
        tables[b, :n] = perm[cur : cur + n]
        tables[b, n:] = perm[cur + n - 1] if n else 0
        cur += n
    key = jax.random.key(int(rng.integers(1 << 30)))
    kk, kv_, kq = jax.random.split(key, 3)
    k_pages = jax.random.normal(kk, (K, P, C, H), DTYPE)
    v_pages = jax.random.normal(kv_, (K, P, C, H), DTYPE)
    T = int(sum(q_lens))
    q = jax.random.normal(kq, (T, N, H), DTYPE)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (
        q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(np.asarray(kv_lens, np.int32)),
        jnp.asarray(cu), jnp.asarray(B, jnp.int32),
    )  # fmt: skip


def _dense_from_paged(args, B, T):
    """The same K/V as dense [B, T, K, H] (prefill-only batches of equal length T)."""
    q, kp, vp, tables, *_ = args

    def dense(pages):  # [K, P, C, H] -> [B, W*C, K, H][:, :T]
        x = pages[:, tables]  # [K, B, W, C, H]
        return x.transpose(1, 2, 3, 0, 4).reshape(B, -1, K, H)[:, :T]

    return q.reshape(B, T, N, H), dense(kp), dense(vp)


def _time(fn, args, calls, rounds):
    wall = _timing.wall_us(fn, *args, calls=calls, rounds=rounds)
    cupti = _timing.cupti_us(fn, *args)
    return wall, cupti


def _entry(times):
    wall, cupti = times
    return {"wall_us": wall, "cupti_us": cupti}


def _ragged_fn(impl, tuning):
    """The implementation module's entry point, jitted (what ``jpaged.ragged_paged_attention``
    dispatches to; called directly so the benchmark depends on nothing else)."""
    mod = importlib.import_module(f"pallas_kernels.ragged_paged_attention.{_MODULES[impl]}")
    fn = getattr(mod, f"ragged_paged_attention_{impl}")

    def f(*a):
        return fn(*a, sm_scale=1.0 / math.sqrt(H), **tuning)

    return jax.jit(f)


def _jax_fa3_entry(q4, kd, vd, args_ns, ref):
    """JAX's FA3 example kernel (dense causal, f16; block_q 64 x 2 compute warpgroups, 128-key
    tiles, 2 stages: the example's own choice), timed like ours."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3

        cfg = fa3.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        fn = jax.jit(lambda q, k, v: fa3.attention(q, k, v, cfg))
        # The example's SMEM buffers are float16: it runs f16 inputs only (same FLOP count).
        # It applies no softmax scale: Q is pre-scaled by 1/sqrt(H), as ours and cuDNN's use.
        args = (
            (q4 / math.sqrt(H)).astype(jnp.float16),
            kd.astype(jnp.float16),
            vd.astype(jnp.float16),
        )
        out = fn(*args)
        wall, cupti = _time(fn, args, args_ns.calls, args_ns.rounds)
        entry = {"wall_us": wall, "cupti_us": cupti}
        if ref is not None:
            entry["rel_err_vs_cudnn"] = _rel_err(out.reshape(ref.shape), ref)
        return entry
    except Exception as e:  # not shipped by every JAX version: report, keep measuring
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _rel_err(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def prefill_rows(args_ns, rng, results):
    for T in args_ns.lengths:
        B = max(1, args_ns.batch_tokens // T)
        inp = _paged(rng, [T] * B, [T] * B)
        flops = 4 * B * N * H * T * T / 2
        row = {"kind": "prefill", "B": B, "T": T, "flops": flops}
        q4, kd, vd = _dense_from_paged(inp, B, T)
        ref = None
        if not args_ns.skip_cudnn and jax.default_backend() == "gpu":
            cud = jax.jit(
                lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, implementation="cudnn"
                )
            )
            try:
                wall, cupti = _time(cud, (q4, kd, vd), args_ns.calls, args_ns.rounds)
                row["cudnn"] = {"wall_us": wall, "cupti_us": cupti}
                ref = cud(q4, kd, vd).reshape(B * T, N, H)
            except Exception as e:  # report, keep measuring the others
                row["cudnn"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if not args_ns.skip_jax_fa3 and jax.default_backend() == "gpu":
            row["jax_fa3"] = _jax_fa3_entry(q4, kd, vd, args_ns, ref)
        variants = args_ns.variant_dicts if T in args_ns.variant_lengths else []
        impls = [("jpaged", {}, args_ns.impl), *[(n, t, args_ns.impl) for n, t in variants]]
        impls += [(impl, {}, impl) for impl in args_ns.also]  # columns beside jpaged's
        for name, tuning, impl in impls:
            try:
                fn = _ragged_fn(impl, tuning)
                out = fn(*inp)
                wall, cupti = _time(fn, inp, args_ns.calls, args_ns.rounds)
                entry = {"wall_us": wall, "cupti_us": cupti, "tuning": tuning}
                kernels = _timing.cupti_kernels_us(fn, *inp)
                if kernels:  # the attention kernel alone vs the XLA ops around it
                    entry["kernels"] = kernels
                    entry["mosaic_us"] = sum(us for k, us in kernels if "ragged_paged" in k)
                if ref is not None:
                    entry["rel_err_vs_cudnn"] = _rel_err(out, ref)
                row[name] = entry
            except Exception as e:
                traceback.print_exc()
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300], "tuning": tuning}
        results.append(row)
        print_row(row)


def decode_and_mixed_rows(args_ns, rng, results):
    Bd = args_ns.decode_batch
    kv_lens = rng.integers(1024, 3072, size=Bd)
    inp = _paged(rng, kv_lens, [1] * Bd)
    nbytes = int(np.sum(kv_lens)) * K * H * 2 * 2
    row = {"kind": "decode", "B": Bd, "T": Bd, "live_bytes": nbytes}
    fn = _ragged_fn(args_ns.impl, {})
    for name, impl in [("jpaged", args_ns.impl), *[(i, i) for i in args_ns.also]]:
        try:
            row[name] = _entry(_time(_ragged_fn(impl, {}), inp, args_ns.calls, 5))
        except Exception as e:
            row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    if jax.default_backend() == "gpu":
        q, kp, vp, bt, kl, _, _ = inp
        from pallas_kernels.paged_attention import kernel_gpu as decode_kernel

        dec = jax.jit(
            lambda q, kp, vp, bt, kl: decode_kernel.paged_attention_pallas_gpu(
                q, kp, vp, bt, kl, sm_scale=1.0 / math.sqrt(H)
            )
        )
        try:
            row["decode_kernel"] = _entry(_time(dec, (q, kp, vp, bt, kl), args_ns.calls, 5))
        except Exception as e:
            row["decode_kernel"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    results.append(row)
    print_row(row)
    # Mixed: 64 decodes (context 2k) + one 4k-token prefill, in one call.
    Tp = min(4096, max(args_ns.lengths))
    Bd = min(64, Bd)
    kv_lens = [2048] * Bd + [Tp]
    q_lens = [1] * Bd + [Tp]
    inp = _paged(rng, kv_lens, q_lens)
    flops = 4 * N * H * (Tp * Tp / 2 + Bd * 2048)
    row = {"kind": "mixed", "B": Bd + 1, "T": Bd + Tp, "flops": flops}
    for name, impl in [("jpaged", args_ns.impl), *[(i, i) for i in args_ns.also]]:
        try:
            f = fn if name == "jpaged" else _ragged_fn(impl, {})
            row[name] = _entry(_time(f, inp, args_ns.calls, args_ns.rounds))
        except Exception as e:
            row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    results.append(row)
    print_row(row)
    # Mixed at long context: 8 decodes at ~32k beside a 512-token prefill chunk (a chunked
    # prefill step): the decodes dominate unless their K/V ranges are split (kv_splits).
    # Anchor: the decode kernel on the 8 decodes alone (a lower bound of the decode share).
    Bl, ctx, Tc = 8, args_ns.long_context, 512
    kv_lens = [int(x) for x in rng.integers(ctx // 2, ctx * 3 // 2, size=Bl)] + [Tc]
    inp = _paged(rng, kv_lens, [1] * Bl + [Tc])
    flops = 4 * N * H * (Tc * Tc / 2 + sum(kv_lens[:Bl]))
    row = {"kind": "mixed32k", "B": Bl + 1, "T": Bl + Tc, "flops": flops}
    tunings = [("jpaged", {}, args_ns.impl), *[(i, {}, i) for i in args_ns.also]]
    if args_ns.impl == "pallas_gpu":
        tunings.append(("jpaged_kv_splits=1", {"kv_splits": 1}, args_ns.impl))
    for name, tuning, impl in tunings:
        try:
            row[name] = _entry(_time(_ragged_fn(impl, tuning), inp, args_ns.calls, 5))
        except Exception as e:
            row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    if jax.default_backend() == "gpu":
        from pallas_kernels.paged_attention import kernel_gpu as decode_kernel

        q, kp, vp, bt, kl, _, _ = inp
        dec = jax.jit(
            lambda q, kp, vp, bt, kl: decode_kernel.paged_attention_pallas_gpu(
                q, kp, vp, bt, kl, sm_scale=1.0 / math.sqrt(H)
            )
        )
        dargs = (q[:Bl], kp, vp, bt[:Bl], kl[:Bl])
        try:
            row["decode_kernel_decodes_only"] = _entry(_time(dec, dargs, args_ns.calls, 5))
        except Exception as e:
            row["decode_kernel_decodes_only"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    results.append(row)
    print_row(row)


def _fmt_time(entry, flops=None, nbytes=None):
    if not entry or "error" in entry:
        return "error" if entry else "-"
    w, c = entry["wall_us"], entry.get("cupti_us")
    s = f"{w:9.1f} us"
    if flops:
        s += f" {flops / (w * 1e-6) / 1e12:6.1f} TF/s"
        if c:
            s += f" (cupti {flops / (c * 1e-6) / 1e12:6.1f})"
    if nbytes:
        s += f" {nbytes / (w * 1e-6) / 1e12:5.2f} TB/s"
        if c:
            s += f" (cupti {nbytes / (c * 1e-6) / 1e12:5.2f})"
    return s


def print_row(row):
    head = f"{row['kind']:8s} B={row['B']:<4d} T={row['T']:<6d}"
    flops, nbytes = row.get("flops"), row.get("live_bytes")
    parts = [head]
    for name in [k for k in row if isinstance(row[k], dict)]:
        parts.append(f"{name}: {_fmt_time(row[name], flops, nbytes)}")
        if row[name].get("mosaic_us") and flops:
            parts.append(f"kernel alone {flops / row[name]['mosaic_us'] / 1e6:6.1f} TF/s")
        if "rel_err_vs_cudnn" in row[name]:
            parts.append(f"err {row[name]['rel_err_vs_cudnn']:.1e}")
    print(" | ".join(parts), flush=True)


def _parse_variant(text):
    out = {}
    for item in text.split(","):
        k, v = item.split("=")
        v = v.strip()
        if v.lower() in ("true", "false"):
            out[k.strip()] = v.lower() == "true"
        else:
            out[k.strip()] = int(v) if v.lstrip("-").isdigit() else v
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="*", default=[4096, 16384, 8192, 2048, 1024, 512])
    p.add_argument("--batch-tokens", type=int, default=32768, help="B = batch_tokens // T")
    p.add_argument("--impl", default="pallas_gpu")
    p.add_argument(
        "--also",
        nargs="*",
        default=[],
        help="implementations timed beside --impl, e.g. pallas_triton",
    )
    p.add_argument("--variants", nargs="*", default=[], help='extra tunings, "block_kv=128"')
    p.add_argument("--variant-lengths", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip-cudnn", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-jax-fa3", action="store_true", help="skip JAX's FA3 example anchor")
    p.add_argument("--decode-batch", type=int, default=128)
    p.add_argument("--long-context", type=int, default=32768, help="decodes of the mixed32k row")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.variant_dicts = [(v, _parse_variant(v)) for v in a.variants]
    dev = jax.devices()[0]
    meta = {
        "device": getattr(dev, "device_kind", str(dev)),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shape": {"N": N, "K": K, "H": H, "C": C, "dtype": str(jnp.dtype(DTYPE)), "causal": True},
        "impl": a.impl,
    }
    print(json.dumps(meta))
    out = a.out
    if out is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d_%H%M")
        folder = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
        out = os.path.join(folder, f"prefill_{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    class Rows(list):
        """Rows that rewrite the JSON after every append (a killed run keeps what it measured)."""

        def append(self, row):
            super().append(row)
            with open(out, "w") as f:
                json.dump({"meta": meta, "rows": list(self)}, f, indent=1)

    rng = np.random.default_rng(0)
    results: list[dict] = Rows()
    prefill_rows(a, rng, results)
    if not a.skip_decode:
        decode_and_mixed_rows(a, rng, results)
    print(f"wrote {out}")
    # Summary: jpaged / cuDNN at each length.
    for row in results:
        if row["kind"] == "prefill" and "wall_us" in row.get("cudnn", {}):
            j = row.get("jpaged", {})
            if "wall_us" in j:
                ratio = row["cudnn"]["wall_us"] / j["wall_us"]
                line = f"T={row['T']:<6d} jpaged/cuDNN throughput = {ratio:.2f}x"
                for name, e in row.items():
                    if name not in ("jpaged", "cudnn") and isinstance(e, dict) and "wall_us" in e:
                        line += f" | {name} {row['cudnn']['wall_us'] / e['wall_us']:.2f}x"
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
