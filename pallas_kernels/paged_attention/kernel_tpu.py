"""Decode attention over a paged KV cache on Mosaic TPU (Pallas).

Design (see ``docs/architecture.md`` for the contract):

* Grid ``(ceil(B / seqs_per_program), K)``, both dimensions ``"parallel"``: a program owns
  a few consecutive sequences and one KV head and carries no state to the next program, so
  Mosaic may split the grid across the two TensorCores of a megacore chip (v4, v5p).
* The G query heads of the KV head are the rows of one ``[G, H]`` tile, so each K/V page
  is fetched once per KV head, not once per query head.
* Block tables (flattened), lengths and the layer index are scalar-prefetched into SMEM
  (a batch whose tables do not fit runs as several calls). K/V stay in HBM (``pl.ANY``).
  A program walks the visible pages of its sequences in blocks of
  ``pages_per_compute_block`` pages: one DMA per page into a double-buffered VMEM scratch
  ``[2, pages, C, H]`` with one DMA semaphore per (K/V, slot). The blocks of all its
  sequences form one stream: block ``i + 1`` (of the same sequence or of the next one with
  pages) is in flight while block ``i`` is computed (online softmax in f32).
* DMAs are issued and awaited by a ``fori_loop`` over the pages of a block, so each step
  holds one page id in a scalar register whatever the block size (no SREG spill for long
  sequences), and the trip count stops at the sequence's last page: no page past
  ``ceil(length / C) - 1`` is read, zero-length sequences issue no DMA at all, and with a
  sliding window the pages before the window are never fetched.
* Pages are copied as stored (``[C, H]``): the kernel adds no padding of its own, so head
  dim 64 moves half the bytes of head dim 128 as far as the pool's HBM layout allows. Caveat
  (unverified, no TPU here): XLA's default TPU tiling of an array whose minor dim is 64 may
  itself pad lanes to 128 in HBM; removing that needs a packed pool layout (two tokens per
  128-lane row, as RPA v3's hd64 kernel does), which the cache does not use today.
* Quantized pools (fp8 / int8 pages, ``k_scale`` / ``v_scale``): each page's scales come in a
  DMA of their own beside it and a block is dequantized in VMEM (``_tpu_common.ScaleRefs``).

The pipeline itself (``attend_items``) lives in ``pallas_kernels/_tpu_common.py``: the ragged
kernel (``pallas_kernels/ragged_paged_attention/kernel_tpu.py``) runs it with per-row masks.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._tpu_common import (
    Masks,
    Span,
    as_layered,
    attend_program,
    check_block_sizes,
    interpret_params,
    kv_unsupported_reason,
    paged_pallas_call,
    scale_pools,
    unpack_refs,
)
from pallas_kernels.paged_attention import tuning_tpu


def _decode_kernel(
    tables_ref, lengths_ref, layer_ref,  # scalar prefetch (SMEM)
    q_ref, k_hbm, v_hbm,  # inputs: q [bb, G, H] block, K/V in HBM
    *refs,  # (quantized: K/V scales in HBM), output [bb, G, H] block, scratch (unpack_refs)
    width, sm_scale, logits_soft_cap, sliding_window, quantized,
):  # fmt: skip
    o_ref, k_buf, v_buf, sems, scales = unpack_refs(refs, quantized)
    c = pl.program_id(0)
    bb = q_ref.shape[0]
    C = k_buf.shape[2]

    def window_start(length):
        return 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)

    def span(j):
        b = c * bb + j
        length = lengths_ref[b]
        first_page = lax.div(window_start(length), C)  # operands are >= 0
        num_pages = jnp.where(length > 0, lax.div(length + C - 1, C) - first_page, 0)
        # Lengths past W * C break the contract; never read past the table row regardless.
        num_pages = jnp.clip(num_pages, 0, width - first_page)
        return Span(b * width, first_page, num_pages)

    def masks(j):
        length = lengths_ref[c * bb + j]
        return Masks(key_hi=length - 1, row_lo=window_start(length), row_hi=length - 1)

    attend_program(
        num_items=bb,
        span=span,
        masks=masks,
        q_ref=q_ref,
        o_ref=o_ref,
        k_hbm=k_hbm,
        v_hbm=v_hbm,
        k_buf=k_buf,
        v_buf=v_buf,
        sems=sems,
        tables_ref=tables_ref,
        layer_ref=layer_ref,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        scales=scales,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "logits_soft_cap", "sliding_window", "pages_per_compute_block",
        "seqs_per_program", "interpret",
    ),
)  # fmt: skip
def _paged_attention_tpu(
    q_BNH, k_pages_LKPCH, v_pages_LKPCH, tables_BW, lengths_B, layer_1, k_scale, v_scale, *,
    sm_scale, logits_soft_cap, sliding_window, pages_per_compute_block, seqs_per_program,
    interpret,
):  # fmt: skip
    B, N, H = q_BNH.shape
    _, K, _, C, _ = k_pages_LKPCH.shape
    W = tables_BW.shape[1]
    G = N // K
    ppcb, bb = pages_per_compute_block, seqs_per_program
    pad = -B % bb  # padded sequences have length 0: no DMA, zero output, sliced off
    q_BKGH = jnp.pad(q_BNH, ((0, pad), (0, 0), (0, 0))).reshape(B + pad, K, G, H)
    tables_BW = jnp.pad(tables_BW, ((0, pad), (0, 0)))
    lengths_B = jnp.pad(lengths_B, (0, pad))
    q_spec = pl.BlockSpec((bb, None, G, H), lambda c, h, *_: (c, h, 0, 0))
    kernel = functools.partial(
        _decode_kernel,
        width=W,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        quantized=k_scale is not None,
    )
    scales = () if k_scale is None else (k_scale, v_scale)
    out = paged_pallas_call(
        kernel,
        num_scalar_prefetch=3,
        num_programs=(B + pad) // bb,
        block_spec=q_spec,
        k_pages_LKPCH=k_pages_LKPCH,
        v_pages_LKPCH=v_pages_LKPCH,
        pages_per_compute_block=ppcb,
        out_shape=jax.ShapeDtypeStruct(q_BKGH.shape, q_BNH.dtype),
        interpret=interpret,
        name=f"jpaged_paged_attention_tpu_G{G}_C{C}_H{H}_ppcb{ppcb}_bb{bb}",
        scales=None if k_scale is None else (k_scale, v_scale),
    )(tables_BW.reshape(-1), lengths_B, layer_1, q_BKGH, k_pages_LKPCH, v_pages_LKPCH, *scales)
    return out[:B].reshape(B, N, H)


def unsupported_reason(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_tables: Any,
    lengths: Any,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> str | None:
    """Why the compiled TPU kernel cannot run these arguments, or None if it can.

    Shapes and dtypes are assumed valid (``validate.validate_static`` ran). The kernel
    supports f32 and bf16 pages and queries (and fp8 / int8 pages with scales of any
    granularity), head dims that are multiples of 64, and page sizes that are a multiple of
    the VMEM sublane tile (8 rows for f32, 16 for bf16, 32 for 8-bit pages).
    """
    del v_pages, block_tables, lengths, sm_scale, logits_soft_cap, sliding_window, layer
    del k_scale, v_scale
    return kv_unsupported_reason(q, k_pages)


def paged_attention_pallas_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    interpret: Any = False,
    pages_per_compute_block: int | None = None,
    seqs_per_program: int | None = None,
) -> jax.Array:
    """Decode attention on Mosaic TPU: one query token per sequence over paged K/V.

    Args:
      q: [B, N, H]; the query of sequence b sits at position ``lengths[b] - 1``.
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W].
      lengths: i32[B].
      sm_scale: logit scale (already resolved).
      logits_soft_cap: None or the cap.
      sliding_window: None or the window w (key j visible iff ``lengths[b] - 1 - j < w``).
      layer: layer index (int or i32[]) for a 5-D pool.
      k_scale: quantized (fp8, int8) pages: f32 broadcastable to [K, P, C] ([L or 1, K, P, C]
        with a 5-D pool); pages are dequantized in VMEM to ``page.astype(f32) * scale``.
      v_scale: like ``k_scale``, for ``v_pages``.
      interpret: True runs the strict TPU interpreter (``pltpu.InterpretParams()``); an
        ``InterpretParams`` is used as given.
      pages_per_compute_block: pages per KV block (DMA batch and compute tile); default
        from ``tuning_tpu.decode_block_sizes``.
      seqs_per_program: sequences one program walks through as one DMA stream (the grid
        is ``(ceil(B / seqs_per_program), K)``); default from the same heuristic.

    Returns:
      [B, N, H] in ``q.dtype``; zeros for length-0 sequences.

    Raises:
      ValueError: if a knob is not a positive int.

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 2, 64)); kv = jnp.ones((1, 3, 8, 64))
    >>> out = paged_attention_pallas_tpu(q, kv, kv, jnp.array([[2, 0]], jnp.int32),
    ...     jnp.array([11], jnp.int32), sm_scale=0.125, interpret=True)
    >>> out.shape, float(out[0, 1, 0])
    ((1, 2, 64), 1.0)
    """
    B, W = block_tables.shape
    K = k_pages.shape[-4]
    if B == 0:
        return jnp.zeros(q.shape, q.dtype)
    defaults = tuning_tpu.decode_block_sizes(
        page_size=k_pages.shape[-2],
        head_dim=k_pages.shape[-1],
        itemsize=jnp.dtype(k_pages.dtype).itemsize,
        width=W,
        batch=B,
        num_kv_heads=K,
    )
    ppcb = defaults["pages_per_compute_block"]
    ppcb = ppcb if pages_per_compute_block is None else pages_per_compute_block
    bb = defaults["seqs_per_program"] if seqs_per_program is None else seqs_per_program
    check_block_sizes(("pages_per_compute_block", ppcb), ("seqs_per_program", bb))
    k5, v5, layer_1 = as_layered(k_pages, v_pages, layer)
    ks5, vs5 = scale_pools(k_pages, k_scale, v_scale)
    # The flattened tables (+ lengths) must fit SMEM: a larger batch runs as several calls.
    rows = (tuning_tpu.max_scalar_prefetch_entries() - 2 - bb) // (W + 1)
    rows = max(1, min(B, rows))
    bb = min(bb, rows)
    rows -= rows % bb
    call = functools.partial(
        _paged_attention_tpu,
        sm_scale=float(sm_scale),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        sliding_window=sliding_window,
        pages_per_compute_block=min(ppcb, W),
        seqs_per_program=bb,
        interpret=interpret_params(interpret),
    )
    if rows >= B:
        return call(q, k5, v5, block_tables, lengths, layer_1, ks5, vs5)
    parts = [slice(i, i + rows) for i in range(0, B, rows)]
    outs = [call(q[r], k5, v5, block_tables[r], lengths[r], layer_1, ks5, vs5) for r in parts]
    return jnp.concatenate(outs, axis=0)
