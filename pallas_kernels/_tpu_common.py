"""Helpers shared by the Mosaic TPU attention kernels (decode and ragged).

``attend_items`` is the double-buffered one-DMA-per-page pipeline both kernels run (see the
design notes of ``pallas_kernels/paged_attention/kernel_tpu.py``); ``attend_program`` runs
it for one program of their ``(programs, K)`` grid and ``paged_pallas_call`` builds that
grid's ``pallas_call``. The rest are the shape/dtype limits, the ``interpret`` flag and the
pool layout both wrappers share.

Quantized pools (fp8 / int8 pages with f32 scales, ``pallas_kernels._quant``): each page's
scales travel beside it, one more DMA a page into a VMEM block ``[2, pages, C', 1]`` (C' = C
per token, else 1), and a block is dequantized in VMEM (``page.astype(f32) * scale``) before
it feeds the MXU in the query's dtype; the copies move the pages' own (smaller) bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _quant

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
    """Dtype fed to the MXU: f32 if either side is f32, else the KV dtype (the query's for a
    quantized pool, whose pages are dequantized first)."""
    if jnp.dtype(jnp.float32) in (jnp.dtype(q_dtype), jnp.dtype(kv_dtype)):
        return jnp.float32
    return jnp.dtype(q_dtype) if _quant.is_quantized(kv_dtype) else jnp.dtype(kv_dtype)


def kv_unsupported_reason(q: Any, k_pages: Any) -> str | None:
    """Shape/dtype limits shared by the decode and ragged TPU kernels (compiled mode)."""
    kv_dtype, q_dtype = jnp.dtype(k_pages.dtype), jnp.dtype(q.dtype)
    if kv_dtype not in _SUPPORTED_DTYPES and not _quant.is_quantized(kv_dtype):
        return (
            f"k_pages.dtype={kv_dtype} must be float32 or bfloat16 on TPU (or quantized: "
            "float8_e4m3fn, float8_e5m2, int8 with scales)"
        )
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


def scale_pools(k_pages: jax.Array, k_scale: Any, v_scale: Any) -> tuple[Any, Any]:
    """A quantized pool's scales as f32[L', K', P', C', 1] (``_quant.layered_scale`` with a
    trailing unit dim: one page's scales are a ``[C', 1]`` VMEM tile that broadcasts over the
    head dim), or (None, None) for an unquantized pool."""
    k_scale, v_scale = _quant.canonical_scales(k_pages, k_scale, v_scale)
    if k_scale is None:
        return None, None
    return k_scale[..., None], v_scale[..., None]


class ScaleRefs(NamedTuple):
    """A quantized pool's scales inside a kernel (``attend_items``).

    Attributes:
      k_hbm: f32[L', K', P', C', 1] key scales in HBM (``scale_pools``).
      v_hbm: like ``k_hbm``, for the values.
      k_buf: VMEM scratch f32[2, pages_per_block, C', 1].
      v_buf: like ``k_buf``.
      sems: DMA semaphores [2, 2] indexed (K or V, slot).
    """

    k_hbm: Any
    v_hbm: Any
    k_buf: Any
    v_buf: Any
    sems: Any

    def copy(self, which: int, layer, head, page, slot, j):
        """The DMA of one page's key (``which`` 0) or value (1) scales into block ``slot``."""
        hbm, buf = (self.k_hbm, self.k_buf) if which == 0 else (self.v_hbm, self.v_buf)
        L1, K1, P1 = hbm.shape[:3]
        index = (layer if L1 > 1 else 0, head if K1 > 1 else 0, page if P1 > 1 else 0)
        return pltpu.make_async_copy(hbm.at[index], buf.at[slot, j], self.sems.at[which, slot])

    def dequantize(self, which: int, slot, pages_PCH: jax.Array) -> jax.Array:
        """f32 ``pages * scale`` of block ``slot`` ([pages, C, H] as stored)."""
        buf = self.k_buf if which == 0 else self.v_buf
        return pages_PCH.astype(jnp.float32) * buf[slot]


def unpack_refs(refs: tuple, quantized: bool) -> tuple[Any, Any, Any, Any, ScaleRefs | None]:
    """A kernel's refs after q, K and V: (o_ref, k_buf, v_buf, sems, scales); with
    ``quantized`` the two scale pools come first and three more scratch refs last
    (``paged_pallas_call``'s order)."""
    if not quantized:
        o_ref, k_buf, v_buf, sems = refs
        return o_ref, k_buf, v_buf, sems, None
    ks_hbm, vs_hbm, o_ref, k_buf, v_buf, sems, ks_buf, vs_buf, s_sems = refs
    return o_ref, k_buf, v_buf, sems, ScaleRefs(ks_hbm, vs_hbm, ks_buf, vs_buf, s_sems)


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
    scales: ScaleRefs | None = None,
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
      scales: a quantized pool's scales (``ScaleRefs``), None otherwise.
    """
    _, ppcb, C, H = k_buf.shape
    bk = ppcb * C

    def num_blocks(sp):
        return lax.div(sp.num_pages + ppcb - 1, ppcb)  # operands are >= 0

    def copy(sp, blk, slot, j, which):  # which: 0 for K, 1 for V; with scales, theirs too
        page = tables_ref[sp.table_base + sp.first_page + blk * ppcb + j]
        hbm, buf = (k_hbm, k_buf) if which == 0 else (v_hbm, v_buf)
        copies = [
            pltpu.make_async_copy(hbm.at[layer, head, page], buf.at[slot, j], sems.at[which, slot])
        ]
        if scales is not None:
            copies.append(scales.copy(which, layer, head, page, slot, j))
        return copies

    def pages_in(sp, blk):
        return jnp.minimum(ppcb, sp.num_pages - blk * ppcb)

    def start(sp, blk, slot):
        # One page id per iteration: a block of any size costs one scalar register.
        def body(j, carry):
            for c in copy(sp, blk, slot, j, 0) + copy(sp, blk, slot, j, 1):
                c.start()
            return carry

        lax.fori_loop(0, pages_in(sp, blk), body, 0)

    def wait(sp, blk, slot, which):
        def body(j, carry):
            for c in copy(sp, blk, slot, j, which):
                c.wait()
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
            k_PCH = k_buf[slot] if scales is None else scales.dequantize(0, slot, k_buf[slot])
            k_SH = k_PCH.reshape(bk, H).astype(q_RH.dtype)
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
            v_PCH = v_buf[slot] if scales is None else scales.dequantize(1, slot, v_buf[slot])
            v_SH = v_PCH.reshape(bk, H)
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
        store_o(j, jnp.where(l_R1 != 0, acc_RH / jnp.where(l_R1 != 0, l_R1, 1.0), 0.0))
        return done + nb

    lax.fori_loop(0, num_items, item, jnp.int32(0))


def attend_program(
    *,
    num_items: int,
    span: Callable[[jax.Array], Span],
    masks: Callable[[jax.Array], Masks],
    q_ref: Any,
    o_ref: Any,
    k_hbm: Any,
    v_hbm: Any,
    k_buf: Any,
    v_buf: Any,
    sems: Any,
    tables_ref: Any,
    layer_ref: Any,
    sm_scale: float,
    logits_soft_cap: float | None,
    scales: ScaleRefs | None = None,
) -> None:
    """``attend_items`` for one program of a ``(programs, K)`` grid (in a kernel).

    Item j's query rows are ``q_ref[j]`` (fed to the MXU in ``compute_dtype``) and its
    output goes to ``o_ref[j]``; the KV head is the grid's second index.

    Args:
      num_items: static number of work items of the program.
      span: item index -> its ``Span``.
      masks: item index -> its ``Masks``.
      q_ref: [items, R, H] query block.
      o_ref: [items, R, H] output block, like ``q_ref``.
      k_hbm: [L, K, P, C, H] key pool ref in HBM.
      v_hbm: like ``k_hbm``.
      k_buf: VMEM scratch [2, pages_per_block, C, H].
      v_buf: like ``k_buf``.
      sems: DMA semaphores [2, 2].
      tables_ref: SMEM i32[B * W] flattened block tables.
      layer_ref: SMEM i32[1] layer index.
      sm_scale: logit scale.
      logits_soft_cap: None or the cap.
      scales: a quantized pool's scales (``ScaleRefs``), None otherwise.
    """
    cdt = compute_dtype(q_ref.dtype, k_buf.dtype)

    def store_o(j, o_RH):
        o_ref[j] = o_RH.astype(o_ref.dtype)

    attend_items(
        num_items=num_items,
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
        head=pl.program_id(1),
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        scales=scales,
    )


def paged_pallas_call(
    kernel: Callable[..., None],
    *,
    num_scalar_prefetch: int,
    num_programs: int,
    block_spec: pl.BlockSpec,
    k_pages_LKPCH: jax.Array,
    v_pages_LKPCH: jax.Array,
    pages_per_compute_block: int,
    out_shape: jax.ShapeDtypeStruct,
    interpret: Any,
    name: str,
    scales: tuple[jax.Array, jax.Array] | None = None,
) -> Callable[..., jax.Array]:
    """The ``pallas_call`` of a kernel that runs ``attend_program`` on a ``(programs, K)`` grid.

    Both grid dimensions are ``"parallel"``; q and the output use ``block_spec``, K/V stay in
    HBM, and the scratch is the double-buffered K and V blocks
    ``[2, pages_per_compute_block, C, H]`` plus the ``[2, 2]`` DMA semaphores.

    Args:
      kernel: the kernel (scalar-prefetch refs, q, K, V, output, k_buf, v_buf, sems).
      num_scalar_prefetch: how many leading operands are prefetched into SMEM.
      num_programs: the grid's first dimension.
      block_spec: BlockSpec of q and of the output.
      k_pages_LKPCH: the key pool (its K, C, H and dtype size the grid and scratch).
      v_pages_LKPCH: the value pool (its dtype sizes the V scratch).
      pages_per_compute_block: pages per KV block.
      out_shape: shape and dtype of the output.
      interpret: ``pallas_call``'s ``interpret`` argument (``interpret_params``).
      name: the call's name (with its block sizes).
      scales: a quantized pool's key and value scales (``scale_pools``; only the shapes are
        read): the call then takes them after K and V (in HBM) and the kernel gets their VMEM
        blocks and semaphores after its own scratch (``unpack_refs``).
    """
    _, K, _, C, H = k_pages_LKPCH.shape
    buf = (2, pages_per_compute_block, C, H)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scratch = [
        pltpu.VMEM(buf, k_pages_LKPCH.dtype),
        pltpu.VMEM(buf, v_pages_LKPCH.dtype),
        pltpu.SemaphoreType.DMA((2, 2)),
    ]
    in_specs = [block_spec, any_spec, any_spec]
    if scales is not None:
        in_specs += [any_spec, any_spec]
        scratch += [
            pltpu.VMEM((2, pages_per_compute_block, s.shape[3], 1), jnp.float32) for s in scales
        ]
        scratch.append(pltpu.SemaphoreType.DMA((2, 2)))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_scalar_prefetch,
            grid=(num_programs, K),
            in_specs=in_specs,
            out_specs=block_spec,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name=name,
    )


def check_block_sizes(*knobs: tuple[str, Any]) -> None:
    """Raises ``ValueError`` for the first ``(name, value)`` that is not a positive int."""
    for name, value in knobs:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
