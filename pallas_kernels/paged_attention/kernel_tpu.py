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

``attend_items`` is the shared pipeline; the ragged kernel
(``pallas_kernels/ragged_paged_attention/kernel_tpu.py``) reuses it with per-row masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention import tuning_tpu

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def interpret_params(interpret: Any) -> Any:
    """Maps the public ``interpret`` flag to ``pallas_call``'s argument.

    ``True`` means the strict TPU interpreter (``pltpu.InterpretParams()``: DMAs run when
    awaited and scratch starts as NaN, so a missing wait or an uninitialised read shows up
    as NaN); an ``InterpretParams`` instance is passed through (tests use it for
    ``detect_races=True``); anything false compiles for a real TPU.
    """
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams() if interpret else False


def sublane_multiple(dtype: Any) -> int:
    """Rows of one native VMEM tile for ``dtype`` (8 for 32-bit, 16 for 16-bit)."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def compute_dtype(q_dtype: Any, kv_dtype: Any) -> Any:
    """Dtype fed to the MXU: f32 if either side is f32, else the KV dtype."""
    if jnp.dtype(jnp.float32) in (jnp.dtype(q_dtype), jnp.dtype(kv_dtype)):
        return jnp.float32
    return jnp.dtype(kv_dtype)


def kv_unsupported_reason(q: Any, k_pages: Any) -> str | None:
    """Shape/dtype limits shared by the decode and ragged TPU kernels (compiled mode)."""
    kv_dtype, q_dtype = jnp.dtype(k_pages.dtype), jnp.dtype(q.dtype)
    if kv_dtype not in _SUPPORTED_DTYPES:
        return f"k_pages.dtype={kv_dtype} must be float32 or bfloat16 on TPU"
    if q_dtype not in _SUPPORTED_DTYPES:
        return f"q.dtype={q_dtype} must be float32 or bfloat16 on TPU"
    C, H = k_pages.shape[-2], k_pages.shape[-1]
    if H % 64:
        return f"head_dim={H} must be a multiple of 64 (64, 128, 256, ...)"
    sub = sublane_multiple(kv_dtype)
    if C % sub:
        return f"page_size={C} must be a multiple of {sub} for {kv_dtype} pages"
    return None


def as_layered(k_pages: jax.Array, v_pages: jax.Array, layer: Any):
    """Returns ([L, K, P, C, H] pools, i32[1] layer): a 4-D pool becomes L = 1 (a bitcast)."""
    if k_pages.ndim == 4:
        return k_pages[None], v_pages[None], jnp.zeros((1,), jnp.int32)
    return k_pages, v_pages, jnp.asarray(layer, jnp.int32).reshape(1)


class Span(NamedTuple):
    """The pages of one work item (a sequence, or a query tile of one) that a kernel reads.

    Attributes:
      table_base: index of the sequence's first entry in the flattened tables (b * W).
      first_page: first table entry to read.
      num_pages: how many entries to read (0: the item issues no DMA).
    """

    table_base: jax.Array
    first_page: jax.Array
    num_pages: jax.Array


class Masks(NamedTuple):
    """Which keys of a work item each query row sees.

    Attributes:
      key_hi: keys past this position are never visible; their values are zeroed too, since
        the unused tail of the last page (and pages not fetched) may hold NaN.
      row_lo: lowest visible key of each row, broadcastable to [R, block tokens].
      row_hi: highest visible key of each row, broadcastable like ``row_lo``.
    """

    key_hi: jax.Array
    row_lo: Any
    row_hi: Any


def attend_items(
    *,
    num_items: int,
    span: Callable[[jax.Array], Span],
    masks: Callable[[jax.Array], Masks],
    load_q: Callable[[jax.Array], jax.Array],
    store_o: Callable[[jax.Array, jax.Array], None],
    k_hbm: Any,
    v_hbm: Any,
    k_buf: Any,
    v_buf: Any,
    sems: Any,
    tables_ref: Any,
    layer: jax.Array,
    head: jax.Array,
    sm_scale: float,
    logits_soft_cap: float | None,
) -> None:
    """Attention of a program's work items over their pages, as one DMA pipeline (in a kernel).

    Item j reads table entries ``span(j)`` in blocks of ``k_buf.shape[1]`` pages with an
    online softmax. The blocks of all items form one double-buffered stream: while block i
    is computed, block i + 1 is in flight, whether it belongs to the same item or to the
    next item that has pages, so short sequences do not expose DMA latency one by one.

    Args:
      num_items: static number of work items of the program.
      span: item index -> its ``Span`` (scalar reads only).
      masks: item index -> its ``Masks``.
      load_q: item index -> [R, H] query rows (in the MXU dtype).
      store_o: (item index, [R, H] f32 output) -> None; rows that see no key get zeros,
        and items without pages get all zeros.
      k_hbm: [L, K, P, C, H] key pool ref in HBM.
      v_hbm: like ``k_hbm``.
      k_buf: VMEM scratch [2, pages_per_block, C, H].
      v_buf: like ``k_buf``.
      sems: DMA semaphores [2, 2] indexed (K or V, slot).
      tables_ref: SMEM i32[B * W] flattened block tables.
      layer: layer index into the pool.
      head: KV head index.
      sm_scale: logit scale.
      logits_soft_cap: None or the cap.
    """
    _, ppcb, C, H = k_buf.shape
    bk = ppcb * C

    def num_blocks(sp):
        return lax.div(sp.num_pages + ppcb - 1, ppcb)  # operands are >= 0

    def copy(sp, blk, slot, j, which):  # which: 0 for K, 1 for V
        page = tables_ref[sp.table_base + sp.first_page + blk * ppcb + j]
        hbm, buf = (k_hbm, k_buf) if which == 0 else (v_hbm, v_buf)
        return pltpu.make_async_copy(
            hbm.at[layer, head, page], buf.at[slot, j], sems.at[which, slot]
        )

    def pages_in(sp, blk):
        return jnp.minimum(ppcb, sp.num_pages - blk * ppcb)

    def start(sp, blk, slot):
        # One page id per iteration: a block of any size costs one scalar register.
        def body(j, carry):
            copy(sp, blk, slot, j, 0).start()
            copy(sp, blk, slot, j, 1).start()
            return carry

        lax.fori_loop(0, pages_in(sp, blk), body, 0)

    def wait(sp, blk, slot, which):
        def body(j, carry):
            copy(sp, blk, slot, j, which).wait()
            return carry

        lax.fori_loop(0, pages_in(sp, blk), body, 0)

    def next_with_pages(j):
        """First item >= j that has pages, or ``num_items``."""

        def has_none(i):
            return (i < num_items) & (span(jnp.minimum(i, num_items - 1)).num_pages <= 0)

        return lax.while_loop(has_none, lambda i: i + 1, j)

    first = next_with_pages(jnp.int32(0))

    @pl.when(first < num_items)
    def _():
        start(span(first), 0, 0)

    def item(j, done):  # done: blocks computed so far by the program (sets the slot parity)
        sp = span(j)
        nb = num_blocks(sp)
        nxt = next_with_pages(j + 1)
        mk = masks(j)
        q_RH = load_q(j)
        R = q_RH.shape[0]

        def block(blk, carry):
            m_R1, l_R1, acc_RH = carry
            slot = lax.rem(done + blk, 2)

            @pl.when(blk + 1 < nb)
            def _():
                start(sp, blk + 1, 1 - slot)

            @pl.when((blk + 1 == nb) & (nxt < num_items))
            def _():
                start(span(nxt), 0, 1 - slot)

            key0 = (sp.first_page + blk * ppcb) * C
            wait(sp, blk, slot, 0)
            k_SH = k_buf[slot].reshape(bk, H).astype(q_RH.dtype)
            s_RS = lax.dot_general(
                q_RH, k_SH, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            s_RS = s_RS * sm_scale
            if logits_soft_cap is not None:
                s_RS = logits_soft_cap * jnp.tanh(s_RS / logits_soft_cap)
            key_RS = key0 + lax.broadcasted_iota(jnp.int32, (R, bk), 1)
            visible_RS = (key_RS <= mk.key_hi) & (key_RS >= mk.row_lo) & (key_RS <= mk.row_hi)
            s_RS = jnp.where(visible_RS, s_RS, -jnp.inf)
            m_new = jnp.maximum(m_R1, jnp.max(s_RS, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m_R1 - m_safe)
            p_RS = jnp.exp(s_RS - m_safe)
            l_R1 = alpha * l_R1 + jnp.sum(p_RS, axis=1, keepdims=True)

            wait(sp, blk, slot, 1)
            v_SH = v_buf[slot].reshape(bk, H)
            key_SH = key0 + lax.broadcasted_iota(jnp.int32, (bk, H), 0)
            v_SH = jnp.where(key_SH <= mk.key_hi, v_SH, 0).astype(q_RH.dtype)
            pv_RH = jnp.dot(p_RS.astype(v_SH.dtype), v_SH, preferred_element_type=jnp.float32)
            return m_new, l_R1, alpha * acc_RH + pv_RH

        init = (
            jnp.full((R, 1), -jnp.inf, jnp.float32),
            jnp.zeros((R, 1), jnp.float32),
            jnp.zeros((R, H), jnp.float32),
        )
        _, l_R1, acc_RH = lax.fori_loop(0, nb, block, init)
        store_o(j, jnp.where(l_R1 > 0, acc_RH / jnp.where(l_R1 > 0, l_R1, 1.0), 0.0))
        return done + nb

    lax.fori_loop(0, num_items, item, jnp.int32(0))


def _decode_kernel(
    tables_ref, lengths_ref, layer_ref,  # scalar prefetch (SMEM)
    q_ref, k_hbm, v_hbm,  # inputs: q [bb, G, H] block, K/V in HBM
    o_ref,  # output [bb, G, H] block
    k_buf, v_buf, sems,  # scratch
    *, width, sm_scale, logits_soft_cap, sliding_window,
):  # fmt: skip
    c, h = pl.program_id(0), pl.program_id(1)
    bb = q_ref.shape[0]
    C = k_buf.shape[2]
    cdt = compute_dtype(q_ref.dtype, k_buf.dtype)

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

    def store_o(j, o_GH):
        o_ref[j] = o_GH.astype(o_ref.dtype)

    attend_items(
        num_items=bb,
        span=span,
        masks=masks,
        load_q=lambda j: q_ref[j].astype(cdt),
        store_o=store_o,
        k_hbm=k_hbm,
        v_hbm=v_hbm,
        k_buf=k_buf,
        v_buf=v_buf,
        sems=sems,
        tables_ref=tables_ref,
        layer=layer_ref[0],
        head=h,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "logits_soft_cap", "sliding_window", "pages_per_compute_block",
        "seqs_per_program", "interpret",
    ),
)  # fmt: skip
def _paged_attention_tpu(
    q_BNH, k_pages_LKPCH, v_pages_LKPCH, tables_BW, lengths_B, layer_1, *,
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
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=((B + pad) // bb, K),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, ppcb, C, H), k_pages_LKPCH.dtype),
                pltpu.VMEM((2, ppcb, C, H), v_pages_LKPCH.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_BKGH.shape, q_BNH.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name=f"jpaged_paged_attention_tpu_G{G}_C{C}_H{H}_ppcb{ppcb}_bb{bb}",
    )(tables_BW.reshape(-1), lengths_B, layer_1, q_BKGH, k_pages_LKPCH, v_pages_LKPCH)
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
) -> str | None:
    """Why the compiled TPU kernel cannot run these arguments, or None if it can.

    Shapes and dtypes are assumed valid (``validate.validate_static`` ran). The kernel
    supports f32 and bf16 pages and queries, head dims that are multiples of 64, and page
    sizes that are a multiple of the VMEM sublane tile (8 rows for f32, 16 for bf16).
    """
    del v_pages, block_tables, lengths, sm_scale, logits_soft_cap, sliding_window, layer
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
    for name, value in (("pages_per_compute_block", ppcb), ("seqs_per_program", bb)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    k5, v5, layer_1 = as_layered(k_pages, v_pages, layer)
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
        return call(q, k5, v5, block_tables, lengths, layer_1)
    outs = [
        call(q[i : i + rows], k5, v5, block_tables[i : i + rows], lengths[i : i + rows], layer_1)
        for i in range(0, B, rows)
    ]
    return jnp.concatenate(outs, axis=0)
