"""What the host spends to dispatch one jitted call on the GPU, per implementation and per XLA
setting: the quick table's wall-clock column at B=1 (49 us of kernels, 70-90 us a call).

    python benchmarks/diagnostics/dispatch_cost.py --out OUT.json                # on a GPU
    python benchmarks/diagnostics/dispatch_cost.py --case 1,32768,8 --flags default,no_cmd_buffer
    python benchmarks/diagnostics/dispatch_cost.py --cases noop,mgpu_copy1 --interpret   # CPU smoke run

Each ``--flags`` setting runs in its own process (XLA reads ``XLA_FLAGS`` once). Per case:
``host_us``, the time to enqueue ``--calls`` back-to-back calls without a sync, per call (what
the host spends on one call while the GPU keeps up); ``wall_us``, the same calls and one sync
(the quick table's wall figure); ``cupti_us``, the sum of one call's kernels, and how many
kernels a call launches. The wall figures are taken in a fresh process before any CUPTI
profiling and again after it (``wall_after_cupti_us``). Cases:

- ``noop``: ``x + 1`` on 8 floats (JAX's and the runtime's own floor);
- ``mgpu_copy1`` / ``mgpu_copy8``: a one-CTA Mosaic GPU kernel issuing 1 or 8 TMA loads of
  distinct inputs and one bulk store of their sum (1 or 8 TMA descriptors, encoded on the host
  at every launch; the whole-array store takes none): the Mosaic GPU custom call's own cost;
- ``mgpu_args8``: the same kernel with 8 inputs of which it loads one (1 descriptor): what
  each input costs the host without a descriptor;
- ``mgpu_desc8``: one input loaded 8 times, each a different number of rows (8, 16, .. 64:
  a descriptor each; 8 descriptors): what each descriptor costs the host without an input;
- ``mgpu_copy1_x20``: 20 of those chained in one jitted program (per call: a launch inside a
  program);
- ``ours`` / ``ours_xla_merge`` / ``ours_x20``: jpaged's decode kernel at ``--case`` with its
  defaults (splits merged by a second Mosaic GPU kernel), with ``split_merge="xla"`` (an XLA
  epilogue merges), and 20 chained calls in one program;
- ``cudnn``, ``triton``: the anchors of the quick table at ``--case``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLAG_SETS = {
    "default": "",
    # XLA's command buffers (CUDA graphs) off: every thunk launched on its own
    "no_cmd_buffer": "--xla_gpu_enable_command_buffer=",
    # every command type that can hold these programs, even a program of one op
    "cmd_buffer_all": (
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
        " --xla_gpu_graph_min_graph_size=1"
    ),
}
CASES = [
    "noop",
    "mgpu_copy1",
    "mgpu_copy8",
    "mgpu_args8",
    "mgpu_desc8",
    "mgpu_copy1_x20",
    "ours",
    "ours_xla_merge",
    "ours_x20",
    "cudnn",
    "triton",
]
_CHAIN = 20


def mgpu_copy(n: int, interpret: bool = False, loads: int | None = None):
    """A one-CTA Mosaic GPU kernel: f(x_0 .. x_{n-1} [64, 128] bf16) -> x_0 + ... + x_{loads-1}
    (TMA loads of the first ``loads`` inputs, default all, into SMEM, one bulk store of their
    sum): ``loads`` TMA descriptors (the whole-array store takes none)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    shape, loads = (64, 128), n if loads is None else loads
    if not 1 <= loads <= n:
        raise ValueError(f"loads={loads} must be in [1, n={n}]")

    def body(*refs):
        xs, o_ref, smem, bars = refs[:loads], refs[n], refs[n + 1], refs[n + 2]
        for i, x in enumerate(xs):
            plgpu.copy_gmem_to_smem(x, smem.at[i], bars.at[i])
        for i in range(loads):
            plgpu.barrier_wait(bars.at[i])
        acc = smem[0].astype(jnp.float32)
        for i in range(1, loads):
            acc = acc + smem[i].astype(jnp.float32)
        smem[0] = acc.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem.at[0], o_ref)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(shape, jnp.bfloat16),
        scratch_types=(
            plgpu.SMEM((loads, *shape), jnp.bfloat16),
            plgpu.Barrier(num_arrivals=1, num_barriers=loads),
        ),
        grid=(1,),
        grid_names=("c",),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def mgpu_descriptors(n: int, interpret: bool = False):
    """A one-CTA Mosaic GPU kernel: f(x [64, 128] bf16) -> n * x[:8] by n TMA loads of x's
    first 8, 16, .. 8 n rows (each slice shape its own descriptor) and one bulk store of 8
    rows: n TMA descriptors for one input (``n`` <= 8)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not 1 <= n <= 8:
        raise ValueError(f"n={n} must be in [1, 8]")

    def body(x, o_ref, smem, out_smem, bars):
        for i in range(n):
            rows = 8 * (i + 1)
            plgpu.copy_gmem_to_smem(x.at[:rows], smem.at[i, :rows], bars.at[i])
        for i in range(n):
            plgpu.barrier_wait(bars.at[i])
        acc = smem[0, :8].astype(jnp.float32)
        for i in range(1, n):
            acc = acc + smem[i, :8].astype(jnp.float32)
        out_smem[...] = acc.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((8, 128), jnp.bfloat16),
        scratch_types=(
            plgpu.SMEM((n, 64, 128), jnp.bfloat16),
            plgpu.SMEM((8, 128), jnp.bfloat16),
            plgpu.Barrier(num_arrivals=1, num_barriers=n),
        ),
        grid=(1,),
        grid_names=("c",),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def build(name: str, case, interpret: bool):
    """(jitted fn, args, calls a dispatch stands for) of one case."""
    import _timing
    import decode_attention as da
    import jax
    import jax.numpy as jnp
    import numpy as np

    if name == "noop":
        return jax.jit(lambda x: x + 1), (jnp.arange(8, dtype=jnp.float32),), 1
    if name.startswith("mgpu_args"):  # n inputs, the first loaded: 1 descriptor
        n = int(name.removeprefix("mgpu_args"))
        xs = [jax.random.normal(jax.random.key(i), (64, 128), jnp.bfloat16) for i in range(n)]
        return jax.jit(mgpu_copy(n, interpret, loads=1)), tuple(xs), 1
    if name.startswith("mgpu_desc"):
        n = int(name.removeprefix("mgpu_desc"))
        x = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
        return jax.jit(mgpu_descriptors(n, interpret)), (x,), 1
    if name.startswith("mgpu_copy"):
        n = int(name.removeprefix("mgpu_copy").split("_")[0])
        xs = [jax.random.normal(jax.random.key(i), (64, 128), jnp.bfloat16) for i in range(n)]
        f = mgpu_copy(n, interpret)
        if name.endswith(f"_x{_CHAIN}"):
            return _timing.chained(f, _CHAIN), tuple(xs), _CHAIN
        return jax.jit(f), tuple(xs), 1
    rng = np.random.default_rng(0)
    inp = da.make_inputs(case, rng, width_multiple=64)  # as the quick table (Triton's splits)
    if name in ("ours", "ours_xla_merge", f"ours_x{_CHAIN}"):
        tuning = {"ours_xla_merge": {"split_merge": "xla"}}
        tuning = tuning.get(name, {})
        f, args = da._ours(inp, case, **tuning)
        if name.endswith(f"_x{_CHAIN}"):
            return _timing.chained(f, _CHAIN), args, _CHAIN
        return f, args, 1
    if name == "cudnn":
        k_dense, v_dense = da._dense_kv(inp, case)
        f, args = da._cudnn(inp, case, k_dense, v_dense)
        return f, args, 1
    if name == "triton":
        f, args = da._triton(inp, case)
        return f, args, 1
    raise ValueError(f"--cases: unknown case {name!r}; expected some of {', '.join(CASES)}")


def host_and_wall_us(fn, args, *, calls: int, rounds: int) -> tuple[float, float]:
    """Medians over ``rounds`` of (enqueue time / call, enqueue + one sync / call), in us."""
    import jax

    jax.block_until_ready(fn(*args))
    host, wall = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


def run_cases(args) -> list[dict]:
    """All ``--cases`` in this process (one XLA setting)."""
    import _timing
    import decode_attention as da
    import jax

    B, ctx, K = (int(x) for x in args.case.split(","))
    case = da.Case(B, ctx, K)
    on_gpu = jax.default_backend() == "gpu"
    built, rows = {}, []
    for name in args.cases.split(","):
        if not on_gpu and not (name == "noop" or (args.interpret and "mgpu" in name)):
            rows.append({"case": name, "skipped": "needs a GPU"})
            continue
        try:
            built[name] = f, fargs, _ = build(name, case, args.interpret)
            jax.block_until_ready(f(*fargs))  # compiles: a case that fails here is reported
        except Exception as e:  # an anchor missing on this JAX: report, keep the others
            rows.append({"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    for name, (f, fargs, per) in built.items():  # every wall figure before any CUPTI profiling
        h, w = host_and_wall_us(f, fargs, calls=args.calls, rounds=args.rounds)
        rows.append({"case": name, "host_us": h / per, "wall_us": w / per})
    by_name = {r["case"]: r for r in rows}
    for name, (f, fargs, per) in built.items():
        kernels = _timing.cupti_kernels_us(f, *fargs) if on_gpu else None
        r = by_name[name]
        if kernels:
            r["cupti_us"] = sum(us for _, us in kernels) / per
            r["kernels_per_call"] = len(kernels) / per
            r["kernels"] = kernels[:8]
        h, w = host_and_wall_us(f, fargs, calls=args.calls, rounds=args.rounds)
        r["host_after_cupti_us"], r["wall_after_cupti_us"] = h / per, w / per
    return rows


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", default="1,32768,8", help="B,ctx,KV heads of the decode cases")
    p.add_argument("--cases", default=",".join(CASES), help=f"some of {','.join(CASES)}")
    p.add_argument("--flags", default=",".join(FLAG_SETS), help=f"some of {','.join(FLAG_SETS)}")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--interpret", action="store_true", help="Mosaic GPU cases in the interpreter")
    p.add_argument("--out", default=None)
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for s in args.flags.split(","):
        if s not in FLAG_SETS:
            p.error(f"--flags: unknown setting {s!r}; expected some of {', '.join(FLAG_SETS)}")
    if args._child:
        print(json.dumps(run_cases(args)))
        return
    results = {}
    for s in args.flags.split(","):
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG_SETS[s]).strip()
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", "--case", args.case]
        cmd += ["--cases", args.cases, "--calls", str(args.calls), "--rounds", str(args.rounds)]
        cmd += ["--interpret"] if args.interpret else []
        print(f"[{s}] XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        try:
            results[s] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            results[s] = [{"case": "*", "error": (proc.stderr or proc.stdout)[-600:]}]
            print(results[s][0]["error"])
            continue
        print(f"{'case':<16} {'host us':>8} {'wall us':>8} {'cupti us':>9} {'kernels':>7} "
              f"{'host/wall after cupti':>22}")  # fmt: skip
        for r in results[s]:
            if "error" in r or "skipped" in r:
                print(f"{r['case']:<16} {r.get('error') or r.get('skipped')}")
                continue
            after = f"{_fmt(r.get('host_after_cupti_us'))} / {_fmt(r.get('wall_after_cupti_us'))}"
            print(f"{r['case']:<16} {_fmt(r['host_us']):>8} {_fmt(r['wall_us']):>8} "
                  f"{_fmt(r.get('cupti_us')):>9} {_fmt(r.get('kernels_per_call'), '.0f'):>7} "
                  f"{after:>22}")  # fmt: skip
    if args.out:
        import jax

        meta = {
            "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "case": args.case,
            "calls": args.calls,
            "rounds": args.rounds,
            "flag_sets": {s: FLAG_SETS[s] for s in results},
        }
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
