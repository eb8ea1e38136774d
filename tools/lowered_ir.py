"""Fingerprints of the decode kernel's device code, lowered for CUDA on CPU (no GPU needed).

For every variant of ``tests/test_paged_attention_gpu.py``'s cross-lowering list, the call is
lowered with ``lowering_platforms=("cuda",)``; each Mosaic GPU kernel module in it is parsed
and printed without source locations (which move with any edit), and the XLA program around
the kernels is printed with the kernels' bytecode blanked out. The SHA-256 of each is written
to JSON. Two commits whose fingerprints match run the same device code: a refactor that moves
code between functions or modules can be checked without a GPU.

    python tools/lowered_ir.py --out /tmp/before.json           # at one commit
    python tools/lowered_ir.py --compare /tmp/before.json       # at another: lists the changes
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


def fingerprints() -> dict[str, dict]:
    import jax

    # This checkout's code first: an editable install of another checkout (a git worktree's
    # venv linked to the main one) would otherwise be what gets fingerprinted.
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import _fast_lowering  # the tests' output-identical layout-inference names: half the time
    import test_paged_attention_gpu as t  # the cross-lowering variants and their calls

    _fast_lowering.install()

    out = {}
    for variant in t._VARIANTS:
        name = t.variant_id(variant)
        f, args = t.variant_call(variant)[:2]
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
    ns = p.parse_args(argv)
    prints = fingerprints()
    if ns.out:
        Path(ns.out).write_text(json.dumps(prints, indent=1, sort_keys=True))
    if ns.compare:
        before = json.loads(Path(ns.compare).read_text())
        same = changed = 0
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
