"""The printed table of ``decode_attention.py``: one line a row (ours, the anchors, % of the
roofline), then its loop, same-size read, kernels, variants and quantized figures."""

from __future__ import annotations


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def print_table(rows, roofline, roofline_loop=None):
    print(f"\nHBM read roofline: {roofline:.2f} TB/s wall, {_fmt(roofline_loop, '.2f')} TB/s loop")
    hdr = (
        f"{'case':<26} {'us':>7} {'cupti':>7} {'TB/s':>5} {'%roof':>5} "
        f"{'cuDNN':>5} {'xla':>5} {'trit':>5} {'vsCuDNN':>7} {'vsTrit':>6} S"
        f" | {'pl_trt':>6} {'vsCuDNN':>7} {'vsTrit':>6}"
    )
    print(hdr)
    for r in rows:
        res = r["results"]
        o = res.get("pallas_gpu", {})

        def tb(k, field="wall_tbs", res=res):
            return _fmt(res.get(k, {}).get(field), ".2f")

        print(
            f"{r['label']:<26} {_fmt(o.get('wall_us'), '7.1f')} {_fmt(o.get('cupti_us'), '7.1f')} "
            f"{tb('pallas_gpu'):>5} {_fmt(r.get('pct_roofline'), '5.0f')} {tb('cudnn'):>5} "
            f"{tb('xla'):>5} {tb('triton_deprecated'):>5} {_fmt(r.get('vs_cudnn'), '7.2f')} "
            f"{_fmt(r.get('vs_triton_deprecated'), '6.2f')} {r['default_splits']}"
            f" | {tb('pallas_triton'):>6} {_fmt(r.get('pallas_triton_vs_cudnn'), '7.2f')} "
            f"{_fmt(r.get('pallas_triton_vs_triton_deprecated'), '6.2f')}"
        )
        if "vs_bf16_wall" in o:
            print(
                f"      quantized: {_fmt(r.get('pct_roofline_cupti'), '.1f')}% roofline (CUPTI), "
                f"{o['vs_bf16_wall']:.2f}x the bf16 kernel's tokens/s (wall), "
                f"{_fmt(o.get('vs_bf16_cupti'), '.2f')}x (CUPTI)"
            )
        if "loop_us" in o:
            print(
                f"      loop {o['loop_us']:7.1f} us {o['loop_tbs']:5.2f} TB/s "
                f"{_fmt(r.get('pct_roofline_loop'), '3.0f')}% roof; cuDNN "
                f"{tb('cudnn', 'loop_tbs')} TB/s ({_fmt(r.get('vs_cudnn_loop'), '.2f')}x), "
                f"Triton {_fmt(r.get('vs_triton_deprecated_loop'), '.2f')}x"
            )
        same = res.get("same_size_read", {})
        if same.get("cupti_us"):
            print(
                f"      same-size read {same['wall_us']:7.1f} / {same['cupti_us']:7.1f} us "
                f"(wall / CUPTI): ours at {_fmt(r.get('pct_same_size_read_cupti'), '.1f')}% of it"
            )
        for name, us in o.get("kernels_us") or []:
            print(f"      kernel {us:7.1f} us  {name[:60]}")
        for k, v in res.items():
            if k.startswith("pallas_gpu_") and "wall_tbs" in v:
                loop = f"  loop {v['loop_us']:7.1f}" if "loop_us" in v else ""
                vs = ""
                if "vs_bf16_wall" in v:
                    vs = (
                        f"  vs bf16 {v['vs_bf16_wall']:.2f} / {_fmt(v.get('vs_bf16_cupti'), '.2f')}"
                    )
                print(
                    f"    {k:<22} {v['wall_us']:7.1f} {_fmt(v['cupti_us'], '7.1f')} "
                    f"{v['wall_tbs']:5.2f}{loop}{vs}"
                )
            if "error" in v:
                print(f"    {k}: {v['error'][:160]}")
