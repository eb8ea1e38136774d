"""What any streaming kernel of a given size reaches on this GPU: a Mosaic GPU kernel that only
reads, beside the roofline measured in the same run.

    python benchmarks/diagnostics/stream_bound.py --out OUT.json            # on a GPU: sizes x ring shapes
    python benchmarks/diagnostics/stream_bound.py --sizes --rows 2 3 8      # quick rows vs their streams
    python benchmarks/diagnostics/stream_bound.py --interpret               # CPU: checks the copies

The decode kernel's percentages are of the HBM read roofline: a 4 GiB ``jnp.sum``, whose
launch, ramp and tail are amortized over about 900 us. The quick table's small rows read
about 268 MB (57 us at the roofline), where a kernel's start (launch, the first copies'
latency) and its end (the last CTAs running alone) are a larger share. This kernel reads
``--sizes`` GB of one contiguous bf16 array through a TMA ring in each CTA, every CTA an
equal share (the perfect balance no decode batch has), with no math and no table lookups: the
best a streaming kernel of that size can do in each ``--configs`` shape (tile rows x 128
elements, stages, CTAs per SM). Its time against the roofline is the share of the roofline that
a same-size read can reach; the rest of a decode row's gap is the kernel's own. ``--rows``
times quick-table rows beside streams of their own units (``rows_mode``).

Per (size, configuration) and per row: CUPTI us, TB/s and % of the CUPTI roofline; JSON with
``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _timing
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_COLS = 128  # elements a row by default (bf16: 256 bytes, one row of a head-dim-128 page)
_OUT_ROWS = 8  # rows each CTA writes out (its slot 0's first rows: the kernel has a result)

# (tile rows, stages, CTAs per SM): the decode kernel's ring (2 x 64 rows of K and of V, three
# CTAs per SM), deeper rings, and one CTA per SM with most of SMEM in flight.
CONFIGS = [(128, 2, 3), (128, 4, 1), (128, 6, 1), (64, 4, 3), (128, 3, 2)]


def stream_kernel(num_ctas, tile_rows: int, stages: int, cols: int = _COLS, interpret=False):
    """f(x [rows, cols] bf16, offsets i32[U], counts i32[U]) -> [U * 8, cols]: CTA u copies
    tiles [offsets[u], offsets[u] + counts[u]) of ``tile_rows`` rows into a ring of ``stages``
    SMEM slots, waiting for each and refilling its slot at once (nothing computed); its output
    is the first rows of the last tile its slot 0 held (zeros where it read none); U =
    ``num_ctas``."""
    U = int(num_ctas)

    def body(x_ref, off_ref, cnt_ref, o_ref, ring, bars):
        c = lax.axis_index("c")
        start, n = off_ref[c], cnt_ref[c]

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

        @pl.when(n == 0)
        def _():
            ring[0, pl.ds(0, _OUT_ROWS)] = jnp.zeros((_OUT_ROWS, cols), jnp.bfloat16)
            plgpu.commit_smem()

        plgpu.copy_smem_to_gmem(ring.at[0, pl.ds(0, _OUT_ROWS)], o_ref.at[pl.ds(c * _OUT_ROWS, 8)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((U * _OUT_ROWS, cols), jnp.bfloat16),
        scratch_types=(
            plgpu.SMEM((stages, tile_rows, cols), jnp.bfloat16),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        ),
        grid=(U,),
        grid_names=("c",),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return jax.jit(kernel)


def equal_shares(tiles: int, num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, counts) of ``tiles`` tiles in ``num_ctas`` equal shares (the first ones one
    tile more where they do not divide)."""
    base, extra = divmod(tiles, num_ctas)
    counts = np.full(num_ctas, base, np.int32) + (np.arange(num_ctas) < extra)
    return (np.cumsum(counts) - counts).astype(np.int32), counts.astype(np.int32)


def decode_units(lengths: np.ndarray, K: int, W: int, C: int, H: int) -> np.ndarray:
    """Tokens of K (as of V) each CTA of the decode kernel's default grid reads, in its dispatch
    order: the (sequence, split, KV head) units of ``kernel_gpu``'s defaults (block_kv, splits,
    the split floor, the longest-first order); 0 for a split past those that read."""
    from pallas_kernels.paged_attention import kernel_gpu

    B = len(lengths)
    lengths = np.maximum(np.asarray(lengths, np.int64), 0)
    T = kernel_gpu.default_block_kv(H)
    S = kernel_gpu.default_num_splits(B, K, W * C, T)
    floor = kernel_gpu.default_min_split_tiles(B, K, S) if S > 1 else 1
    tiles = -(-lengths // T)
    order = np.arange(B)
    if kernel_gpu.default_longest_first(B, K, S, W * C):
        order = np.lexsort((np.arange(B), -tiles))  # longest first, ties by sequence
    units = []
    for b in order:
        t = int(tiles[b])
        splits = min(max(t // floor, 1), S) if floor > 1 else S
        per = -(-t // splits)
        for s in range(S):
            lo = s * per * T
            n = max(min(lo + per * T, int(lengths[b])) - lo, 0) if s < splits else 0
            units += [n] * K
    return np.asarray(units, np.int32)


def _check(interpret: bool) -> None:
    """Each CTA's output is the first rows of a tile it read (CPU interpreter or GPU)."""
    rows, T, stages = 64 * 7, 64, 2
    x = jnp.arange(rows * _COLS, dtype=jnp.float32).reshape(rows, _COLS).astype(jnp.bfloat16)
    off, cnt = equal_shares(7, 3)
    off, cnt = np.append(off, 0).astype(np.int32), np.append(cnt, 0).astype(np.int32)  # + empty
    f = stream_kernel(4, T, stages, interpret=interpret)
    out = np.asarray(f(x, jnp.asarray(off), jnp.asarray(cnt)).astype(jnp.float32))
    xs = np.asarray(x.astype(jnp.float32))
    # 7 tiles over 3 CTAs: 3, 2, 2 starting at tiles 0, 3, 5; slot 0 last held tile 2, 3, 5
    # (a CTA's tiles i = 0, 2 land in slot 0: the last even one); the fourth read none.
    for c, tile in enumerate((2, 3, 5)):
        np.testing.assert_array_equal(out[c * 8 : c * 8 + 8], xs[tile * T : tile * T + 8])
    np.testing.assert_array_equal(out[24:], 0.0)


def _time(f, *args):
    return _timing.cupti_us(f, *args), _timing.wall_us(f, *args, calls=20, rounds=5)


def rows_mode(indices, seed: int, roof_cupti: float, sms: int) -> list[dict]:
    """For quick-table rows (``decode_attention.QUICK`` indices), on the draw each has in the
    quick table (``decode_attention.table_inputs``; ``seed`` 0 is the table's own):
    the decode kernel (default tuning); a stream of its units (each CTA reads its unit's K and
    V, in the same order, through a ring of the same bytes, with no table and no math), by
    whole tiles and by pages (the copies the kernel makes: a page each); and the same tile
    bytes in equal shares (396 CTAs of the decode ring's shape; 132 of 4 x 2-tile stages)."""
    import decode_attention as da

    from pallas_kernels.paged_attention import kernel_gpu

    out = []
    for _, case, inp in da.table_inputs(da.QUICK, indices, seed, width_multiple=64):
        nbytes = da.live_bytes(case, inp.lengths_np)
        tokens = decode_units(inp.lengths_np, case.K, inp.width, case.C, case.H)
        T = kernel_gpu.default_block_kv(case.H)  # the decode kernel's tile
        row_bytes = case.H * 2
        tiles = 2 * -(-tokens // T)  # K and V
        total = int(tiles.sum())
        x = jax.random.normal(jax.random.key(2), (total * T, case.H), jnp.bfloat16)
        f, args = da._ours(inp, case)
        entries = [("decode kernel", f, args, nbytes)]

        def units_entry(name, counts, rows, stages, x=x, H=case.H, row_bytes=row_bytes):
            off = (np.cumsum(counts) - counts).astype(np.int32)
            fn = stream_kernel(len(counts), rows, stages, H)
            args = (x, jnp.asarray(off), jnp.asarray(counts.astype(np.int32)))
            return (name, fn, args, int(counts.sum()) * rows * row_bytes)

        entries.append(units_entry("stream of its units, tiles", tiles, T, 4))
        C = case.C
        if C < T:  # one copy a page, as the kernel makes them (C >= T: the same as tiles)
            pages = 2 * -(-tokens // C)
            entries.append(units_entry("stream of its units, pages", pages, C, 4 * T // C))
        for stages, ctas, rows in ((4, 3 * sms, T), (4, sms, 2 * T)):
            per = rows // T
            o2, c2 = equal_shares(total // per, ctas)
            entries.append((f"equal shares, {ctas} CTAs x {stages} x {rows} rows",
                            stream_kernel(ctas, rows, stages, case.H),
                            (x, jnp.asarray(o2), jnp.asarray(c2)),
                            total // per * rows * row_bytes))  # fmt: skip
        for name, fn, a, nb in entries:
            k, w = _time(fn, *a)
            tbs = nb / (k * 1e-6) / 1e12
            print(f"{case.label:<26} {name:<40} {k:8.1f} us {tbs:5.2f} TB/s "
                  f"{100 * tbs / roof_cupti:5.1f}% ({nb / 1e9:.3f} GB)")  # fmt: skip
            out.append({"case": case.label, "name": name, "cupti_us": k, "wall_us": w,
                        "bytes": nb, "cupti_tbs": tbs, "pct_roofline_cupti": 100 * tbs / roof_cupti,
                        "ctas": len(tokens) if name.startswith("stream") else None})  # fmt: skip
        del x
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", type=float, nargs="*", default=[0.134, 0.268, 1.07, 4.29], help="GB read"
    )
    p.add_argument(
        "--configs",
        nargs="*",
        help="T,stages,ctas_per_sm: T rows of 256 bytes a copy, stages <= 32 (default: CONFIGS)",
    )
    p.add_argument(
        "--rows", type=int, nargs="*", default=[], help="quick-table rows: kernel vs streams"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="lengths and tables of --rows (0: the quick table's)"
    )
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
        entries = [("xla_sum", xla, (x,), None)]
        for T, st, per_sm in configs:
            off, cnt = equal_shares(rows // T, per_sm * sms)
            f = stream_kernel(per_sm * sms, T, st)
            entries.append((f"T{T}_st{st}_x{per_sm}", f, (x, jnp.asarray(off), jnp.asarray(cnt)),
                            (T, st, per_sm)))  # fmt: skip
        for name, f, args, cfg in entries:
            try:
                k, w = _time(f, *args)
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
    rows_out += rows_mode(ns.rows, ns.seed, roof_cupti, sms)
    if ns.out:
        meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    device=dev.device_kind, jax=jax.__version__, sms=sms,
                    roofline_wall_tbs=roof_wall, roofline_cupti_tbs=roof_cupti)  # fmt: skip
        with open(ns.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows_out}, fh, indent=1)
        print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
