"""Prints the ``benchmarks/diagnostics/decode_step.py`` JSON files given: per variant and
batch, the floor, the engine step and the trace's top kernels (a compact view for device
logs)."""

import json
import sys

for path in sys.argv[1:]:
    with open(path) as f:
        d = json.load(f)
    for v in d["variants"]:
        if "error" in v:
            print(v["variant"], "ERROR", v["error"][-1500:])
        for r in v.get("rows", []):
            t = r.get("trace", {})
            e = r.get("engine", {})
            print(
                f"{v['variant']} B={r['batch']} floor {r['floor_step_ms']:.3f} ms "
                f"MBU {r['floor_mbu']:.1%} dispatch {r['dispatch_ms_per_call']:.2f} ms "
                f"compile {r['compile_s']:.1f} s | engine "
                f"{e.get('step_s', 0) * 1e3:.3f} ms MBU {e.get('mbu', 0):.1%} "
                f"host {e.get('host_fraction', 0):.1%}"
            )
            if t:
                print(
                    "   kernels/step", t.get("kernels_per_step"), "busy", t.get("busy_ms_per_step")
                )
                for x in t.get("top", [])[:10]:
                    print(
                        f"   {x['ms_per_step']:.3f} ms x{x['calls_per_step']:.1f} {x['name'][:70]}"
                    )
                    if x["name"].startswith("Memcpy"):
                        print("      ", x.get("stats", "")[:300])
