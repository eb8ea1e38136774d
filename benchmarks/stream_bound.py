"""What any streaming kernel of a given size reaches on this GPU: a Mosaic GPU kernel that only
reads, beside the roofline measured in the same run.

    python benchmarks/stream_bound.py --out OUT.json            # on a GPU
    python benchmarks/stream_bound.py --interpret               # CPU: checks the copies

The decode kernel's percentages are of the HBM read roofline: a 4 GiB ``jnp.sum``, whose
launch, ramp and tail are amortized over about 900 us. The quick table's small rows read
about 268 MB (57 us at the roofline), where a kernel's start (launch, the first copies'
latency) and its end (the last CTAs running alone) are a larger share. This kernel reads
``--sizes`` bytes of one contiguous bf16 array through a TMA ring in each CTA, every CTA an
equal share (the perfect balance no decode batch has), with no math and no table lookups: the
best a streaming kernel of that size can do with ``--ctas-per-sm`` CTAs of ``--stages``
tiles of ``--tile-rows`` x 128 elements. Its time against the roofline is the share of the
roofline that a same-size read can reach; the rest of a decode row's gap is the kernel's own.

Per (size, configuration): CUPTI us, TB/s and % of the CUPTI roofline; JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _timing
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_COLS = 128  # elements a row (bf16: 256 bytes, one row of a head-dim-128 page)
_OUT_ROWS = 8  # rows each CTA writes out (the last tile's first rows: the kernel has a result)

# (tile rows, stages, CTAs per SM): the decode kernel's ring (2 x 64 rows of K and of V, three
# CTAs per SM), deeper rings, and one CTA per SM with most of SMEM in flight.
CONFIGS = [(128, 2, 3), (128, 4, 1), (128, 6, 1), (64, 4, 3), (128, 3, 2)]


def stream_kernel(rows: int, tile_rows: int, stages: int, num_ctas: int, interpret=False):
    """f(x [rows, 128] bf16) -> [num_ctas * 8, 128]: each CTA copies its equal share of the
    rows' tiles (``tile_rows`` rows each) into a ring of ``stages`` SMEM slots, waiting for each
    and refilling its slot at once; the output is each CTA's last slot-0 rows."""
    if rows % tile_rows:
        raise ValueError(f"{rows=} must be a multiple of {tile_rows=}")
    tiles = rows // tile_rows
    base, extra = divmod(tiles, num_ctas)

    def body(x_ref, o_ref, ring, bars):
        c = lax.axis_index("c")
        n = base + (c < extra).astype(jnp.int32)
        start = c * base + jnp.minimum(c, extra)

        def issue(i, slot):
            src = x_ref.at[pl.ds(pl.multiple_of((start + i) * tile_rows, 8), tile_rows)]
            plgpu.copy_gmem_to_smem(src, ring.at[slot], bars.at[slot])

        for i in range(stages):
            pl.when(i < n)(lambda i=i: issue(i, i))

        def step(i, carry):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(bars.at[slot])
            pl.when(i + stages < n)(lambda: issue(i + stages, slot))
            return carry

        lax.fori_loop(0, n, step, jnp.int32(0))
        plgpu.copy_smem_to_gmem(ring.at[0, pl.ds(0, _OUT_ROWS)], o_ref.at[pl.ds(c * _OUT_ROWS, 8)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_ctas * _OUT_ROWS, _COLS), jnp.bfloat16),
        scratch_types=(
            plgpu.SMEM((stages, tile_rows, _COLS), jnp.bfloat16),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        ),
        grid=(num_ctas,),
        grid_names=("c",),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return jax.jit(kernel)


def _check(interpret: bool) -> None:
    """Each CTA's output is the first rows of a tile it read (CPU interpreter or GPU)."""
    rows, T, stages, ctas = 64 * 7, 64, 2, 3
    x = jnp.arange(rows * _COLS, dtype=jnp.float32).reshape(rows, _COLS).astype(jnp.bfloat16)
    out = np.asarray(stream_kernel(rows, T, stages, ctas, interpret)(x).astype(jnp.float32))
    xs = np.asarray(x.astype(jnp.float32))
    # 7 tiles over 3 CTAs: 3, 2, 2 starting at tiles 0, 3, 5; slot 0 last held tile 2, 3, 5
    # (a CTA's tiles i = 0, 2 land in slot 0: the last even one).
    for c, tile in enumerate((2, 3, 5)):
        np.testing.assert_array_equal(out[c * 8 : c * 8 + 8], xs[tile * T : tile * T + 8])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", type=float, nargs="*", default=[0.134, 0.268, 1.07, 4.29], help="GB read"
    )
    p.add_argument("--configs", nargs="*", help="T,stages,ctas_per_sm (default: CONFIGS)")
    p.add_argument("--interpret", action="store_true", help="check the kernel on the CPU")
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    if ns.interpret:
        _check(True)
        print("stream kernel: interpreter check passed")
        return
    _check(False)
    configs = [tuple(int(v) for v in c.split(",")) for c in ns.configs] if ns.configs else CONFIGS
    from jpaged import _backend

    sms = _backend.gpu_num_sms()
    roof_wall, roof_cupti = _timing.read_roofline_tbs()
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}, {sms} SMs, roofline "
          f"{roof_wall:.2f} TB/s wall / {roof_cupti:.2f} CUPTI")  # fmt: skip
    rows_out = []
    print(f"{'GB':>6} {'T':>4} {'st':>3} {'CTAs':>5} {'cupti us':>9} {'TB/s':>5} {'%roof':>6}")
    for gb in ns.sizes:
        rows = round(gb * 1e9 / (_COLS * 2) / 1024) * 1024
        nbytes = rows * _COLS * 2
        x = jax.random.normal(jax.random.key(1), (rows, _COLS), jnp.bfloat16)
        xla = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
        entries = [("xla_sum", xla, None)]
        for T, st, per_sm in configs:
            entries.append(
                (
                    f"T{T}_st{st}_x{per_sm}",
                    stream_kernel(rows, T, st, per_sm * sms),
                    (T, st, per_sm),
                )
            )
        for name, f, cfg in entries:
            try:
                k = _timing.cupti_us(f, x)
                w = _timing.wall_us(f, x, calls=20, rounds=5)
            except Exception as e:  # e.g. a ring past SMEM: reported, the others still run
                print(f"{gb:6.3f} {name}: {type(e).__name__}: {str(e)[:200]}")
                rows_out.append({"gb": nbytes / 1e9, "name": name, "error": str(e)[:300]})
                continue
            tbs = nbytes / (k * 1e-6) / 1e12
            T, st, per_sm = cfg or ("-", "-", "-")
            ctas = per_sm * sms if cfg else "-"
            print(f"{nbytes / 1e9:6.3f} {T!s:>4} {st!s:>3} {ctas!s:>5} {k:9.1f} {tbs:5.2f} "
                  f"{100 * tbs / roof_cupti:6.1f}  {name}")  # fmt: skip
            rows_out.append({
                "gb": nbytes / 1e9, "name": name, "config": cfg, "cupti_us": k, "wall_us": w,
                "cupti_tbs": tbs, "pct_roofline_cupti": 100 * tbs / roof_cupti,
            })  # fmt: skip
        del x
    if ns.out:
        meta = dict(device=dev.device_kind, jax=jax.__version__, sms=sms,
                    roofline_wall_tbs=roof_wall, roofline_cupti_tbs=roof_cupti)  # fmt: skip
        with open(ns.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows_out}, fh, indent=1)
        print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
