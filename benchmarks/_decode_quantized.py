"""The quantized rows of ``decode_attention.py`` (``--kv-dtype fp8|fp8_e5m2|int8``): each
row's bf16 pages quantized on the device (``jpaged.kv.quantize``), the kernel timed on them
beside the bf16 kernel on the bf16 pages of the same draw, its outputs checked against the XLA
path on the same quantized pages."""

from __future__ import annotations

import math
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.kv import quantize
from pallas_kernels.paged_attention import kernel_gpu


def quantized_pool(inp, dtype, granularity: str):
    """``inp``'s bf16 pages quantized on the device: (k codes, v codes, k_scale, v_scale),
    cached on ``inp`` per granularity."""
    if granularity not in inp.quantized:
        f = jax.jit(lambda x: quantize.quantize(x, dtype, granularity))
        inp.quantized[granularity] = (*zip(f(inp.k_pages), f(inp.v_pages), strict=True),)
        k, v = inp.quantized[granularity][0]
        ks, vs = inp.quantized[granularity][1]
        inp.quantized[granularity] = (k, v, ks, vs)
    return inp.quantized[granularity]


def quantized_bytes(case, lengths: np.ndarray, dtype, granularity: str) -> int:
    """Bytes a quantized decode reads for the live tokens: 1-byte codes, and per token 4 bytes
    of scale ("token"), per page 4 ("page"; the tail page rounded up), else none."""
    tokens = int(lengths.astype(np.int64).sum())
    itemsize = jnp.dtype(quantize.kv_dtype(dtype)).itemsize
    scales = {"token": tokens * 4, "page": int((-(-lengths // case.C)).sum()) * 4}
    return (tokens * case.H * itemsize + scales.get(granularity, 0)) * case.K * 2


def ours_quantized(inp, case, dtype, granularity: str, **tuning):
    """The kernel on ``inp``'s pages quantized to ``dtype`` at ``granularity``."""
    k, v, ks, vs = quantized_pool(inp, dtype, granularity)
    scale = 1.0 / math.sqrt(case.H)
    f = jax.jit(
        lambda q, k, v, bt, ln, ks, vs: kernel_gpu.paged_attention_pallas_gpu(
            q, k, v, bt, ln, sm_scale=scale, k_scale=ks, v_scale=vs, **tuning
        )
    )
    return f, (inp.q, k, v, inp.block_tables, inp.lengths, ks, vs)


def xla_quantized(inp, case, dtype, granularity: str):
    from pallas_kernels.paged_attention import xla

    k, v, ks, vs = quantized_pool(inp, dtype, granularity)
    scale = 1.0 / math.sqrt(case.H)
    f = jax.jit(
        lambda q, k, v, bt, ln, ks, vs: xla.paged_attention_xla(
            q, k, v, bt, ln, sm_scale=scale, k_scale=ks, v_scale=vs
        )
    )
    return f, (inp.q, k, v, inp.block_tables, inp.lengths, ks, vs)


def run(case, inp, ns, res: dict, row: dict, *, measure, bf16, bf16_bytes, parse_kwargs) -> None:
    """``--kv-dtype``: the bf16 kernel on the bf16 pages (``pallas_gpu_bf16``), then the kernel
    on the quantized pages (``pallas_gpu``, its bytes the codes and scales read), its variants
    and other granularities (``--also-scales``), each checked against XLA on the same pages."""
    measure("pallas_gpu_bf16", lambda: bf16(inp, case), bf16_bytes(case, inp.lengths_np), ns, res)
    for gran in [ns.kv_scales, *ns.also_scales]:
        qbytes = quantized_bytes(case, inp.lengths_np, ns.kv_dtype, gran)
        ref = None
        try:
            f, args = xla_quantized(inp, case, ns.kv_dtype, gran)
            ref = np.asarray(jax.block_until_ready(f(*args)).astype(jnp.float32))
        except Exception:
            traceback.print_exc(limit=1)
        name = "pallas_gpu" if gran == ns.kv_scales else f"pallas_gpu_scales_{gran}"
        build = lambda g=gran: ours_quantized(inp, case, ns.kv_dtype, g)  # noqa: E731
        measure(name, build, qbytes, ns, res, ref)
        res.setdefault(name, {})["bytes"] = qbytes
        if gran == ns.kv_scales:
            row["live_bytes"] = qbytes
            for spec in ns.variants:
                kw = parse_kwargs(spec)
                build = lambda kw=kw, g=gran: ours_quantized(inp, case, ns.kv_dtype, g, **kw)  # noqa: E731
                measure(f"pallas_gpu_{spec}", build, qbytes, ns, res, ref)
        inp.quantized.pop(gran, None)  # its memory back before the next
    base = res.get("pallas_gpu_bf16", {})
    for name, r in res.items():
        if name.startswith("pallas_gpu") and name != "pallas_gpu_bf16" and "wall_us" in r:
            if "wall_us" in base:
                r["vs_bf16_wall"] = base["wall_us"] / r["wall_us"]
            if base.get("cupti_us") and r.get("cupti_us"):
                r["vs_bf16_cupti"] = base["cupti_us"] / r["cupti_us"]
