"""Decode attention benchmark: jpaged's Mosaic GPU kernel against its anchors, on one GPU.

In ONE process it measures the HBM read roofline (``jnp.sum`` over 4 GiB), then per case:
jpaged ``pallas_gpu`` and ``pallas_triton`` (the Pallas-Triton kernel for sm80-sm89, forced
here), cuDNN non-paged (``jax.nn.dot_product_attention`` with
``key_value_seq_lengths`` on the same lengths), JAX's deprecated Pallas-Triton paged kernel and
the XLA path. Data are random (never zeros), lengths uniform in [0.5, 1.5] x ctx, block tables
a random permutation of the pool. Timing: wall-clock (``--calls`` back-to-back calls, one sync,
median of ``--rounds`` rounds) and CUPTI kernel-only side by side; ``--loop`` adds the per-call
time of ``--calls`` chained calls in one jitted program (no per-call host dispatch, but the
program's own overhead spread over the calls: not a device-only time, see ``_timing.loop_us``
and ``diagnostics/profile_launch_gaps.py``). Effective TB/s = live K/V bytes / time.

    python benchmarks/decode_attention.py --quick            # the issue's 9-row table
    python benchmarks/decode_attention.py                    # the full sweep
    python benchmarks/decode_attention.py --quick --out r.json
    python benchmarks/decode_attention.py --quick --kv-dtype fp8 --skip-triton  # quantized

``--kv-dtype fp8|fp8_e5m2|int8`` times the kernel on quantized pages (the same random values,
quantized on the device with ``--kv-scales`` granularity, ``jpaged.kv.quantize``) beside the
bf16 kernel on the bf16 pages of the same draw (``pallas_gpu_bf16``: the tokens/s ratio
``vs_bf16``); its effective bandwidth counts the bytes it reads (codes and scales),
``--also-scales`` times other granularities too, and its outputs are checked against the XLA
path on the same quantized pages.

Prints a table and writes JSON (to ``--out``, default ``$OUT/decode_<tag>.json`` or
``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _decode_quantized
import _timing
from _decode_table import _fmt, print_table

from pallas_kernels.paged_attention import kernel_gpu

N_HEADS = 32


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    ctx: int
    K: int
    C: int = 16
    H: int = 128
    N: int = N_HEADS

    @property
    def label(self) -> str:
        s = f"B={self.B} ctx={self.ctx} K={self.K}"
        if self.C != 16:
            s += f" C={self.C}"
        if self.H != 128:
            s += f" H={self.H}"
        if self.N != N_HEADS:
            s += f" N={self.N}"
        return s


QUICK = [
    Case(1, 32768, 8),
    Case(8, 32768, 8),
    Case(32, 2048, 8),
    Case(128, 2048, 8),
    Case(64, 4096, 8),
    Case(64, 2048, 32),
    Case(256, 1024, 8),
    Case(128, 2048, 8, C=64),
    Case(128, 2048, 4, H=64),
]

# The issue's anchors (TB/s, H200, JAX 0.11.2): cuDNN non-paged and deprecated Pallas-Triton.
ISSUE_ANCHORS = {
    Case(1, 32768, 8): (2.19, 1.55),
    Case(8, 32768, 8): (3.73, 1.89),
    Case(32, 2048, 8): (2.91, 1.74),
    Case(128, 2048, 8): (4.08, 1.98),
    Case(64, 4096, 8): (3.96, 2.13),
    Case(64, 2048, 32): (4.42, 1.98),
    Case(256, 1024, 8): (4.13, 1.73),
    Case(128, 2048, 8, C=64): (4.04, None),
    Case(128, 2048, 4, H=64): (3.09, 1.59),
}


def full_sweep(max_live_gb: float) -> list[Case]:
    cases = []
    for B, ctx, K, C in itertools.product(
        (1, 8, 32, 128, 256), (512, 2048, 8192, 32768), (8, 32), (16, 64)
    ):
        c = Case(B, ctx, K, C=C)
        if B * ctx * K * c.H * 4 / 1e9 <= max_live_gb:
            cases.append(c)
    return cases


@dataclasses.dataclass
class Inputs:
    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    block_tables: jax.Array
    lengths: jax.Array
    lengths_np: np.ndarray
    width: int
    quantized: dict = dataclasses.field(default_factory=dict)  # granularity -> (k, v, ks, vs)


def _draw(
    case: Case,
    rng: np.random.Generator,
    *,
    width_multiple: int = 1,
    sequential: bool = False,
    table_tokens: int = 0,
):
    """The host side of a row's draw: (lengths, block tables, pool pages, key seed), taking
    from ``rng`` exactly what ``make_inputs`` takes. Page tables randomly permuted, or
    (``sequential``) each sequence's pages consecutive in the pool, so its K/V is one
    contiguous range per head; ``table_tokens``: the table is at least this many tokens wide
    (as an engine's, sized for its longest allowed sequence), its extra entries valid random
    pages; its width a multiple of ``width_multiple``."""
    B, C = case.B, case.C
    lengths = rng.integers(case.ctx // 2, case.ctx * 3 // 2 + 1, size=B).astype(np.int32)
    pages = -(-lengths // C)
    W = max(int(pages.max()), -(-table_tokens // C))
    W = -(-W // width_multiple) * width_multiple
    P = int(pages.sum()) + 16
    perm = np.arange(P, dtype=np.int32) if sequential else rng.permutation(P).astype(np.int32)
    tables = np.empty((B, W), np.int32)
    cur = 0
    for b in range(B):
        n = int(pages[b])
        tables[b, :n] = perm[cur : cur + n]
        tables[b, n:] = perm[rng.integers(0, P, W - n)]  # unused slots: valid random ids
        cur += n
    return lengths, tables, P, int(rng.integers(1 << 30))


def make_inputs(case: Case, rng: np.random.Generator, **draw) -> Inputs:
    """Random q/K/V, lengths and page tables (``draw``: ``_draw``'s keywords)."""
    B, K, C, H = case.B, case.K, case.C, case.H
    lengths, tables, P, seed = _draw(case, rng, **draw)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    dt = jnp.bfloat16
    return Inputs(
        q=jax.random.normal(k1, (B, case.N, H), dt),
        k_pages=jax.random.normal(k2, (K, P, C, H), dt),
        v_pages=jax.random.normal(k3, (K, P, C, H), dt),
        block_tables=jnp.asarray(tables),
        lengths=jnp.asarray(lengths),
        lengths_np=lengths,
        width=tables.shape[1],
    )


def table_inputs(cases, indices=None, seed: int = 0, **kw):
    """(index, case, Inputs) for ``cases[i]``, i in ``indices`` (default: all, in order), each
    row drawn as a run of the whole list from ``default_rng(seed)`` draws it: the rows before
    it take their lengths and tables from the generator first (host arrays only), so
    ``--only 3`` times the same lengths and tables as row 3 of the full table. ``kw`` goes to
    ``make_inputs``."""
    indices = range(len(cases)) if indices is None else indices
    rng, pos = None, 0
    for i in indices:
        if not 0 <= i < len(cases):
            raise SystemExit(f"row index {i} is out of range: the table has {len(cases)} rows")
        if rng is None or i < pos:
            rng, pos = np.random.default_rng(seed), 0
        for c in cases[pos:i]:
            _draw(c, rng, **kw)
        yield i, cases[i], make_inputs(cases[i], rng, **kw)
        pos = i + 1


def live_bytes(case: Case, lengths: np.ndarray) -> int:
    return int(lengths.astype(np.int64).sum()) * case.K * case.H * 2 * 2


def _ours(inp: Inputs, case: Case, **tuning):
    scale = 1.0 / math.sqrt(case.H)
    f = jax.jit(
        lambda q, k, v, bt, ln: kernel_gpu.paged_attention_pallas_gpu(
            q, k, v, bt, ln, sm_scale=scale, **tuning
        )
    )
    return f, (inp.q, inp.k_pages, inp.v_pages, inp.block_tables, inp.lengths)


def _ragged(inp: Inputs, case: Case, **tuning):
    """The same decode batch through jpaged's ragged kernel (one query token per sequence)."""
    from pallas_kernels.ragged_paged_attention import kernel_gpu as ragged_gpu

    scale = 1.0 / math.sqrt(case.H)
    cu = jnp.arange(case.B + 1, dtype=jnp.int32)
    ns = jnp.int32(case.B)
    f = jax.jit(
        lambda q, k, v, bt, ln: ragged_gpu.ragged_paged_attention_pallas_gpu(
            q, k, v, bt, ln, cu, ns, sm_scale=scale, **tuning
        )
    )
    return f, (inp.q, inp.k_pages, inp.v_pages, inp.block_tables, inp.lengths)


def _pallas_triton(inp: Inputs, case: Case, **tuning):
    """jpaged's Pallas-Triton decode kernel (auto dispatch's kernel on sm80-sm89), forced."""
    from pallas_kernels.paged_attention import kernel_triton

    scale = 1.0 / math.sqrt(case.H)
    f = jax.jit(
        lambda q, k, v, bt, ln: kernel_triton.paged_attention_pallas_triton(
            q, k, v, bt, ln, sm_scale=scale, **tuning
        )
    )
    return f, (inp.q, inp.k_pages, inp.v_pages, inp.block_tables, inp.lengths)


def _xla(inp: Inputs, case: Case):
    from pallas_kernels.paged_attention import xla

    scale = 1.0 / math.sqrt(case.H)
    f = jax.jit(lambda q, k, v, bt, ln: xla.paged_attention_xla(q, k, v, bt, ln, sm_scale=scale))
    return f, (inp.q, inp.k_pages, inp.v_pages, inp.block_tables, inp.lengths)


def _dense_kv(inp: Inputs, case: Case):
    """Contiguous [B, S, K, H] K/V holding the same tokens (for cuDNN)."""
    S = inp.width * case.C
    gather = jax.jit(
        lambda pages, bt: pages[:, bt].reshape(case.K, case.B, S, case.H).transpose(1, 2, 0, 3)
    )
    return gather(inp.k_pages, inp.block_tables), gather(inp.v_pages, inp.block_tables)


def _cudnn(inp: Inputs, case: Case, k_dense, v_dense):
    scale = 1.0 / math.sqrt(case.H)

    def f(q, k, v, ln):
        o = jax.nn.dot_product_attention(
            q[:, None],
            k,
            v,
            scale=scale,
            key_value_seq_lengths=ln,
            implementation="cudnn",
        )
        return o[:, 0]

    return jax.jit(f), (inp.q, k_dense, v_dense, inp.lengths)


def _triton(inp: Inputs, case: Case, k_splits: int = 16, ppcb: int = 4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as pa_triton
    scale = jnp.asarray(1.0 / math.sqrt(case.H), inp.q.dtype)

    def f(q, k, v, bt, ln):
        return pa_triton.paged_attention(
            q * scale, k, v, bt, ln, k_splits=k_splits, pages_per_compute_block=ppcb
        )

    return jax.jit(f), (inp.q, inp.k_pages, inp.v_pages, inp.block_tables, inp.lengths)


def _measure(name, builder, nbytes, args_ns, results, ref=None):
    try:
        f, args = builder()
        out = jax.block_until_ready(f(*args))
        a = np.asarray(out.astype(jnp.float32))
        err = None if ref is None else float(np.max(np.abs(a - ref)))
        nonfinite = int(np.size(a) - np.count_nonzero(np.isfinite(a)))
        if nonfinite or (err is not None and not err < 0.05):  # bf16 outputs of unit-scale data
            print(f"    WARNING {name}: {nonfinite} non-finite outputs, max |err| vs XLA {err}")
        w = _timing.wall_us(f, *args, calls=args_ns.calls, rounds=args_ns.rounds)
        k = _timing.cupti_us(f, *args)
        results[name] = {
            "wall_us": w,
            "cupti_us": k,
            "wall_tbs": nbytes / (w * 1e-6) / 1e12,
            "cupti_tbs": (nbytes / (k * 1e-6) / 1e12) if k else None,
            "max_abs_err_vs_xla": err,
            "nonfinite": nonfinite,
        }
        if args_ns.loop:
            lp = _timing.loop_us(f, *args, iterations=args_ns.calls, rounds=args_ns.rounds)
            results[name].update(loop_us=lp, loop_tbs=nbytes / (lp * 1e-6) / 1e12)
        return out
    except Exception as e:
        results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        traceback.print_exc(limit=2)
        return None


def _parse_kwargs(spec: str) -> dict:
    """``"num_stages=3,swap_ab=false,order_method=rank"`` -> keyword arguments: integers,
    true / false / none (any case) as Python's, anything else as a string."""
    named = {"true": True, "false": False, "none": None}

    def value(v: str):
        if v.lower() in named:
            return named[v.lower()]
        try:
            return int(v)
        except ValueError:
            return v

    pairs = [kv.split("=", 1) for kv in spec.split(",")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"--variants {spec!r}: expected name=value[,name=value...]")
    return {k: value(v) for k, v in pairs}


def parse_case(spec: str) -> Case:
    """``"B,ctx,K"`` or ``"B,ctx,K,C[,H[,N]]"`` -> a Case (C 16, H 128 and N 32 by default)."""
    try:
        nums = [int(x) for x in spec.split(",")]
    except ValueError:
        nums = []
    if len(nums) not in (3, 4, 5, 6):
        raise SystemExit(f"--cases {spec!r}: expected B,ctx,K or B,ctx,K,C[,H[,N]] (integers)")
    return Case(*nums)


def run_case(
    case: Case, inp: Inputs, ns, roofline, roofline_loop=None, roofline_cupti=None
) -> dict:
    nbytes = live_bytes(case, inp.lengths_np)
    res: dict = {}
    row = {"case": dataclasses.asdict(case), "label": case.label, "live_bytes": nbytes}
    ref = None
    quantized = ns.kv_dtype != "bf16"
    if quantized:
        pass  # checked against XLA on the quantized pages (_run_quantized)
    elif not ns.skip_xla:
        out = _measure("xla", lambda: _xla(inp, case), nbytes, ns, res)
        ref = None if out is None else np.asarray(out.astype(jnp.float32))
    else:  # not timed, but every output is still checked against it (one call)
        try:
            f, args = _xla(inp, case)
            ref = np.asarray(jax.block_until_ready(f(*args)).astype(jnp.float32))
        except Exception:  # e.g. out of memory: the outputs go unchecked
            traceback.print_exc(limit=1)
    ours = _ours(inp, case)
    if quantized:
        _decode_quantized.run(
            case,
            inp,
            ns,
            res,
            row,
            measure=_measure,
            bf16=_ours,
            bf16_bytes=live_bytes,
            parse_kwargs=_parse_kwargs,
        )
        nbytes = row["live_bytes"]
    else:
        _measure("pallas_gpu", lambda: ours, nbytes, ns, res, ref)
    if ns.kernels and "wall_us" in res.get("pallas_gpu", {}):
        # What one call launches (order, kernel, merge) and what each costs, CUPTI.
        res["pallas_gpu"]["kernels_us"] = _timing.cupti_kernels_us(ours[0], *ours[1])
    for S in ns.splits:
        f = lambda S=S: _ours(inp, case, num_splits=S)  # noqa: E731
        _measure(f"pallas_gpu_S{S}", f, nbytes, ns, res, ref)
    for spec in [] if quantized else ns.variants:  # "num_stages=3": checked against XLA too
        kw = _parse_kwargs(spec)
        _measure(f"pallas_gpu_{spec}", lambda kw=kw: _ours(inp, case, **kw), nbytes, ns, res, ref)
    for spec in ns.ragged_variants:  # "default" or "paired=0,block_kv=64"
        kw = {} if spec == "default" else _parse_kwargs(spec)
        name = f"pallas_gpu_ragged_{spec}"
        _measure(name, lambda kw=kw: _ragged(inp, case, **kw), nbytes, ns, res, ref)
    anchor_bytes = live_bytes(case, inp.lengths_np)  # the anchors read bf16
    if not ns.skip_pallas_triton:
        _measure("pallas_triton", lambda: _pallas_triton(inp, case), anchor_bytes, ns, res, ref)
    if not ns.skip_cudnn:
        kd, vd = _dense_kv(inp, case)
        _measure("cudnn", lambda: _cudnn(inp, case, kd, vd), anchor_bytes, ns, res, ref)
        del kd, vd
    if not ns.skip_triton and case.H >= 64:
        _measure("triton_deprecated", lambda: _triton(inp, case), anchor_bytes, ns, res, ref)
    if ns.same_size_read:
        # A reduction over the live K/V bytes: what one streaming kernel of this size reaches,
        # its launch, ramp and tail included (the roofline's 4 GiB amortizes them). On the H200
        # XLA's reduction of [rows, 4096] bf16 ran at 3.5-3.6 TB/s at some
        # row counts (109417, 131959) and 4.5 at others of about the same bytes (127755,
        # 135952): the rows are now a multiple of 1024 (the 4 GiB roofline's are), the times
        # scaled to exactly the live bytes. Not yet run on a GPU in this form.
        try:
            rows = max(1024, round(nbytes / 8192 / 1024) * 1024)
            x = jax.random.normal(jax.random.key(1), (rows, 4096), jnp.bfloat16)
            f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
            scale = nbytes / (rows * 8192)
            w = _timing.wall_us(f, x, calls=ns.calls, rounds=ns.rounds) * scale
            k = _timing.cupti_us(f, x)
            k = k * scale if k else None
            res["same_size_read"] = {
                "read_bytes": rows * 8192,
                "wall_us": w,
                "cupti_us": k,
                "wall_tbs": nbytes / (w * 1e-6) / 1e12,
                "cupti_tbs": (nbytes / (k * 1e-6) / 1e12) if k else None,
            }
            del x
        except Exception as e:
            res["same_size_read"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    row["results"] = res
    ours = res.get("pallas_gpu", {})
    for anchor in ("cudnn", "triton_deprecated"):
        a = res.get(anchor, {})
        if "wall_us" in ours and "wall_us" in a:
            row[f"vs_{anchor}"] = a["wall_us"] / ours["wall_us"]
        if "loop_us" in ours and "loop_us" in a:
            row[f"vs_{anchor}_loop"] = a["loop_us"] / ours["loop_us"]
    trit = res.get("pallas_triton", {})
    for anchor in ("cudnn", "triton_deprecated", "xla"):
        a = res.get(anchor, {})
        if "wall_us" in trit and "wall_us" in a:
            row[f"pallas_triton_vs_{anchor}"] = a["wall_us"] / trit["wall_us"]
    if "wall_tbs" in trit:
        row["pallas_triton_pct_roofline"] = 100 * trit["wall_tbs"] / roofline
    if "wall_tbs" in ours:
        row["pct_roofline"] = 100 * ours["wall_tbs"] / roofline
    if ours.get("cupti_tbs") and roofline_cupti:
        row["pct_roofline_cupti"] = 100 * ours["cupti_tbs"] / roofline_cupti
    if "loop_tbs" in ours and roofline_loop:
        row["pct_roofline_loop"] = 100 * ours["loop_tbs"] / roofline_loop
    same = res.get("same_size_read", {})
    if ours.get("cupti_us") and same.get("cupti_us"):  # kernel time: launches excluded
        row["pct_same_size_read_cupti"] = 100 * same["cupti_us"] / ours["cupti_us"]
    T = kernel_gpu.default_block_kv(case.H)
    row["default_splits"] = kernel_gpu.default_num_splits(case.B, case.K, inp.width * case.C, T)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the issue's 9-row table only")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--splits", type=int, nargs="*", default=[], help="extra split counts")
    p.add_argument("--variants", nargs="*", default=[], help='tuning sets, e.g. "num_stages=3"')
    p.add_argument(
        "--ragged-variants",
        nargs="*",
        default=[],
        help='the batch through the ragged kernel too: "default" or tunings, e.g. "paired=0"',
    )
    p.add_argument("--max-live-gb", type=float, default=4.0)
    p.add_argument(
        "--sequential-pages",
        action="store_true",
        help="consecutive pages per sequence (isolates the cost of random page order)",
    )
    p.add_argument(
        "--table-tokens",
        type=int,
        default=0,
        help="block tables at least this many tokens wide (an engine's max_model_len), so the "
        "static split count sees the table, not the lengths",
    )
    p.add_argument(
        "--kernels", action="store_true", help="record each kernel of the default call (CUPTI)"
    )
    p.add_argument(
        "--loop",
        action="store_true",
        help="also time --calls chained calls in one jitted program (no host dispatch)",
    )
    p.add_argument(
        "--same-size-read",
        action="store_true",
        help="also time a reduction over exactly each row's live K/V bytes (its own ramp and tail)",
    )
    p.add_argument(
        "--kv-dtype",
        default="bf16",
        choices=("bf16", "fp8", "fp8_e5m2", "int8"),
        help="time the kernel on quantized pages (beside the bf16 kernel on the same draw)",
    )
    p.add_argument(
        "--kv-scales", default="token", choices=("token", "page", "head", "tensor"),
        help="the quantized pages' scale granularity",
    )  # fmt: skip
    p.add_argument(
        "--also-scales", nargs="*", default=[], help="other granularities timed too (quantized)"
    )
    p.add_argument("--skip-xla", action="store_true")
    p.add_argument("--skip-cudnn", action="store_true")
    p.add_argument("--skip-triton", action="store_true")
    p.add_argument("--skip-pallas-triton", action="store_true")
    p.add_argument(
        "--only",
        type=int,
        nargs="*",
        help="indices of rows to run, each with the lengths and tables it has in the whole table",
    )
    p.add_argument(
        "--cases", nargs="*", default=[], help='cases instead of a table: "B,ctx,K[,C[,H]]"'
    )
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    cases = (
        [parse_case(c) for c in ns.cases]
        if ns.cases
        else QUICK
        if ns.quick
        else full_sweep(ns.max_live_gb)
    )
    dev = jax.devices()[0]
    roof_wall, roof_cupti = _timing.read_roofline_tbs()
    roof_loop = _timing.read_roofline_loop_tbs() if ns.loop else None
    print(
        f"device {dev.device_kind}, jax {jax.__version__}, roofline {roof_wall:.2f} TB/s wall, "
        f"{roof_cupti:.2f} TB/s cupti, {_fmt(roof_loop, '.2f')} TB/s loop",
        flush=True,
    )
    rows = []
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": dev.device_kind,
        "jax": jax.__version__,
        "roofline_wall_tbs": roof_wall,
        "roofline_cupti_tbs": roof_cupti,
        "roofline_loop_tbs": roof_loop,
        "calls": ns.calls,
        "rounds": ns.rounds,
        "sequential_pages": ns.sequential_pages,
        "table_tokens": ns.table_tokens,
        "loop": ns.loop,
        "kv_dtype": ns.kv_dtype,
        "kv_scales": ns.kv_scales if ns.kv_dtype != "bf16" else None,
        "issue_anchors": {c.label: v for c, v in ISSUE_ANCHORS.items()},
    }
    tag = "cases" if ns.cases else "quick" if ns.quick else "sweep"
    if ns.kv_dtype != "bf16":
        tag += f"_{ns.kv_dtype}"
    out = ns.out or os.path.join(
        os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")),
        f"decode_{tag}.json",
    )
    draws = table_inputs(
        cases,
        ns.only or None,
        width_multiple=64,
        sequential=ns.sequential_pages,
        table_tokens=ns.table_tokens,
    )
    for _, c, inp in draws:
        print(f"-- {c.label}", flush=True)
        rows.append(run_case(c, inp, ns, roof_wall, roof_loop, roof_cupti))
        del inp  # before the next row's arrays are drawn
        r = rows[-1]["results"].get("pallas_gpu", {})
        print(f"   ours {r.get('wall_tbs', r.get('error'))}", flush=True)
        with open(out, "w") as f:  # after every case: a time-limited run keeps what it measured
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print_table(rows, roof_wall, roof_loop)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
