"""Registers, spills and barriers of the decode kernel's variants, as ptxas reports them.

Compiles (and runs once) the GPU decode kernel for a few ``decode_attention`` cases with
``MOSAIC_GPU_DUMP_PTXAS=1`` set, so ptxas prints each kernel's resource usage; the lines that
matter are printed at the end. Registers decide how many CTAs share an SM (65536 per SM; 128
threads a CTA): 106 a thread leaves room for four, so SMEM is the bound.

    python benchmarks/diagnostics/ptxas_decode.py --cases 128,2048,8 8,32768,8 --variants "" block_kv=128
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _compile_all(cases, variants) -> None:
    import decode_attention as da
    import jax
    import numpy as np

    from pallas_kernels.paged_attention import kernel_gpu

    rng = np.random.default_rng(0)
    for spec in cases:
        case = da.parse_case(spec)
        inp = da.make_inputs(case, rng)
        for variant in variants:
            kw = da._parse_kwargs(variant) if variant else {}
            print(f"### case {spec} variant {variant or 'default'}", flush=True)
            f = jax.jit(
                lambda q, k, v, bt, ln, kw=kw, H=case.H: kernel_gpu.paged_attention_pallas_gpu(
                    q, k, v, bt, ln, sm_scale=1 / math.sqrt(H), **kw
                )
            )
            jax.block_until_ready(f(inp.q, inp.k_pages, inp.v_pages, inp.block_tables, inp.lengths))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["128,2048,8", "8,32768,8"])
    p.add_argument("--variants", nargs="*", default=[""], help='"" is the default tuning')
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        _compile_all(ns.cases, ns.variants)
        return
    # The child compiles on the same GPU: this process must not preallocate its memory.
    child_env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    if jax.default_backend() != "gpu":
        raise SystemExit("ptxas_decode.py compiles Mosaic GPU kernels: it needs a CUDA GPU")
    cmd = [sys.executable, __file__, "--child", "--cases", *ns.cases, "--variants", *ns.variants]
    out = subprocess.run(cmd, env=child_env, capture_output=True, text=True)
    keep = re.compile(r"###|Compiling entry|registers|spill|wgmma|serializ|warning", re.IGNORECASE)
    for line in (out.stdout + out.stderr).splitlines():
        if keep.search(line):
            print(line)
    if out.returncode:
        print(out.stderr[-2000:])
        raise SystemExit(out.returncode)


if __name__ == "__main__":
    main()
