"""Fingerprints of the GPU kernels' device code, lowered for CUDA on CPU (no GPU needed).

For every variant of the decode kernel's cross-lowering list (``_VARIANTS`` of
``tests/kernels/paged_attention/test_paged_attention_gpu_lowering.py``) and for the ragged
kernel's default configuration on the shapes of ``RAGGED_DEFAULTS``, the call is lowered with
``lowering_platforms=("cuda",)``; each Mosaic GPU kernel module in it is parsed
and printed without source locations (which move with any edit), and the XLA program around
the kernels is printed with the kernels' bytecode blanked out. The SHA-256 of each is written
to JSON. Two commits whose fingerprints match run the same device code: a refactor that moves
code between functions or modules can be checked without a GPU.

    python tools/lowered_ir.py --out /tmp/before.json           # at one commit
    python tools/lowered_ir.py --compare /tmp/before.json       # at another: lists the changes
    python tools/lowered_ir.py --only ragged --out /tmp/r.json   # one kernel's variants
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _kernel_texts(lowered) -> tuple[str, list[str]]:
    """(the XLA program without kernel bytecode, each Mosaic GPU module without locations)."""
    from jax._src.interpreters import mlir as jax_mlir  # private: jax 0.11.2's context setup
    from jax.experimental.mosaic.gpu import dialect
    from jaxlib.mlir import ir

    module = lowered.compiler_ir("stablehlo")
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.name == "stablehlo.custom_call":
                        calls.append(inner)
                    walk(inner)

    walk(module.operation)
    kernels = []
    for call in calls:
        config = call.attributes["mhlo.backend_config"]
        if "module" not in config:
            continue
        ctx = jax_mlir._create_ir_context()
        dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        with ctx:
            kernel = ir.Module.parse(bytes(config["module"].value_bytes))
            text = kernel.operation.get_asm(enable_debug_info=False)
            # The dump name counts the kernels of that name lowered so far in this process.
            kernels.append(re.sub(r'dump_basename = "[^"]*"', "dump_basename", text))
    program = module.operation.get_asm(enable_debug_info=False)
    program = re.sub(r'module = "[^"]*"', 'module = "<kernel>"', program)
    program = re.sub(r'kernel_hash = "[^"]*"', 'kernel_hash = "<hash>"', program)
    return program, kernels


# The ragged kernel's defaults (no knob), on shapes that pick each default path: prefill-heavy
# (two warpgroups sharing a tile), decode-heavy (paired warpgroups), split-KV (a small batch at
# long context), a window with a soft cap, head dim 64 in f16 with a layered pool, G = 16
# (Q / O gathered by XLA) and head dim 256.
RAGGED_DEFAULTS = [
    {},
    {"T": 8},
    {"T": 4, "W": 256},
    {"sliding_window": 100, "logits_soft_cap": 30.0},
    {"causal": False, "H": 64, "C": 8, "K": 4, "dtype": "float16", "L": 3},
    {"N": 64, "K": 4},
    {"H": 256, "C": 256, "N": 8, "K": 8},
]


def ragged_call(variant):
    """(f, argument shapes) of a ``RAGGED_DEFAULTS`` entry: B=4 sequences, T query tokens (100
    by default) over a W-page table; the rest are keyword arguments of the kernel."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import kernel_gpu

    v = dict(variant)
    B, T, W = 4, v.pop("T", 100), v.pop("W", 8)
    N, K, H, C = v.pop("N", 32), v.pop("K", 8), v.pop("H", 128), v.pop("C", 16)
    dtype, L = jnp.dtype(v.pop("dtype", "bfloat16")), v.pop("L", None)
    pool = (K, 40, C, H) if L is None else (L, K, 40, C, H)
    sds = jax.ShapeDtypeStruct
    args = (
        sds((T, N, H), dtype), sds(pool, dtype), sds(pool, dtype), sds((B, W), jnp.int32),
        sds((B,), jnp.int32), sds((B + 1,), jnp.int32), sds((), jnp.int32), sds((), jnp.int32),
    )  # fmt: skip

    def f(q, k, vp, bt, kl, cu, ns, layer):
        return kernel_gpu.ragged_paged_attention_pallas_gpu(
            q, k, vp, bt, kl, cu, ns, sm_scale=0.125, layer=None if L is None else layer, **v
        )

    return f, args


def _decode_variants():
    """(name, f, argument shapes) of the decode kernel's cross-lowering variants."""
    sys.path[:0] = [str(ROOT / "tests" / "kernels" / "paged_attention")]
    try:
        import test_paged_attention_gpu_lowering as t
    except ModuleNotFoundError:  # a checkout from before the tests moved
        import test_paged_attention_gpu as t
    for variant in t._VARIANTS:
        yield t.variant_id(variant), *t.variant_call(variant)[:2]


def _ragged_variants():
    for variant in RAGGED_DEFAULTS:
        name = "ragged-" + "-".join(f"{k}{variant[k]}" for k in variant)
        yield name, *ragged_call(variant)


def fingerprints(only: str | None = None) -> dict[str, dict]:
    import jax

    # This checkout's code first: an editable install of another checkout (a git worktree's
    # venv linked to the main one) would otherwise be what gets fingerprinted.
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import _fast_lowering  # the tests' output-identical layout-inference names: half the time

    _fast_lowering.install()
    kinds = {"decode": _decode_variants, "ragged": _ragged_variants}
    out = {}
    for kind, variants in kinds.items():
        if only not in (None, kind):
            continue
        for name, f, args in variants():
            try:
                lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
                program, kernels = _kernel_texts(lowered)
            except Exception as e:  # a variant the code at this commit does not take
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                continue
            digest = lambda s: hashlib.sha256(s.encode()).hexdigest()  # noqa: E731
            out[name] = {"program": digest(program), "kernels": [digest(k) for k in kernels]}
            print(f"{name or 'default'}: {len(kernels)} kernel(s)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the fingerprints here (JSON)")
    p.add_argument("--compare", help="fingerprints of another commit: list what differs")
    p.add_argument("--only", choices=("decode", "ragged"), help="one kernel's variants only")
    ns = p.parse_args(argv)
    prints = fingerprints(ns.only)
    if ns.out:
        Path(ns.out).write_text(json.dumps(prints, indent=1, sort_keys=True))
    if ns.compare:
        before = json.loads(Path(ns.compare).read_text())
        same = changed = 0
        for name in sorted(set(before) - set(prints)):
            print(f"NOT LOWERED NOW {name or 'default'}")
        for name, now in prints.items():
            then = before.get(name)
            if then is None or "error" in then or "error" in now:
                print(f"NOT COMPARED {name or 'default'}: {then and then.get('error')} / "
                      f"{now.get('error')}")  # fmt: skip
            elif then == now:
                same += 1
            else:
                changed += 1
                parts = [k for k in ("program", "kernels") if then[k] != now[k]]
                print(f"CHANGED {name or 'default'}: {', '.join(parts)}")
        print(f"{same} variants identical, {changed} changed")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
