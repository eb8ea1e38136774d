"""Ragged paged attention on Mosaic TPU (Pallas): prefill, chunked prefill, mixed batches.

Design (the decode kernel's techniques, see ``pallas_kernels/paged_attention/kernel_tpu.py``):

* The wrapper cuts each live sequence's query rows into tiles of ``block_q`` tokens
  (``schedule.tile_schedule``: a static upper bound NT of tiles, empty tiles past the real
  ones) and lays q out as ``[NT, K, block_q * G, H]``: a tile's rows are its tokens times the
  G query heads of one KV head, so every K/V page is fetched once per (tile, KV head).
* Grid ``(NT / tiles_per_program, K)``, both ``"parallel"`` (megacore / two TensorCores):
  programs share no state; within a program the tiles' KV blocks form one double-buffered
  DMA stream (``attend_items``), so a tile's first fetch overlaps the previous tile's work. Per-tile metadata (sequence, rows, first position, KV length), the flattened block
  tables and the layer index are scalar-prefetched into SMEM; K/V stay in HBM.
* A program fetches only the pages its tile can see: with ``causal`` the keys up to its last
  row's position, with a sliding window the keys from its first row's window start. KV
  blocks outside that range, empty tiles and padding tiles issue no DMA at all. Pages come
  in blocks of ``pages_per_compute_block`` through the decode kernel's double-buffered,
  one-DMA-per-page loop; per-row causal/window masks apply inside. Quantized pools (fp8 /
  int8 pages) bring each page's scales in a DMA of their own and dequantize in VMEM.
* Rows past a tile's real rows and rows from ``cu_q_lens[num_seqs]`` on come back as zeros.

Cost to know: q and the output are rearranged into tiles by one XLA gather each (about
2 x T x N x H elements moved), like RPA v3's ``prepare_inputs``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _tpu_common as common
from pallas_kernels.paged_attention.tuning_tpu import max_scalar_prefetch_entries
from pallas_kernels.ragged_paged_attention import schedule, tuning_tpu, validate


def _ragged_kernel(
    tables_ref, layer_ref, seq_ref, rows_ref, pos0_ref, kv_len_ref,  # scalar prefetch
    q_ref, k_hbm, v_hbm,  # inputs: q [tb, R, H] block, K/V in HBM
    *refs,  # (quantized: K/V scales in HBM), output [tb, R, H] block, scratch
    width, group, causal, sm_scale, logits_soft_cap, sliding_window, quantized,
):  # fmt: skip
    o_ref, k_buf, v_buf, sems, scales = common.unpack_refs(refs, quantized)
    c = pl.program_id(0)
    tb, R, _ = q_ref.shape
    C = k_buf.shape[2]

    def visible_keys(i):
        """Keys [lo, hi] that some row of tile i sees, and the tile's scalars."""
        nrows, pos0, kv_len = rows_ref[i], pos0_ref[i], kv_len_ref[i]
        hi = jnp.minimum(pos0 + nrows - 1, kv_len - 1) if causal else kv_len - 1
        lo = 0 if sliding_window is None else jnp.maximum(pos0 - (sliding_window - 1), 0)
        return lo, hi, nrows, pos0, kv_len

    def span(j):
        i = c * tb + j
        lo, hi, nrows, _, _ = visible_keys(i)
        first_page = lax.div(lo, C)  # operands are >= 0
        num_pages = jnp.where((nrows > 0) & (hi >= lo), lax.div(hi, C) + 1 - first_page, 0)
        # kv_lens past W * C break the contract; never read past the table row regardless.
        num_pages = jnp.clip(num_pages, 0, width - first_page)
        return common.Span(seq_ref[i] * width, first_page, num_pages)

    def masks(j):
        _, hi, nrows, pos0, kv_len = visible_keys(c * tb + j)
        # Row r is token r // G of the tile (query head r % G of KV head h). The division
        # runs in f32: (r + 0.5) / G is at least 0.5 / G away from an integer.
        r_R1 = lax.broadcasted_iota(jnp.int32, (R, 1), 0).astype(jnp.float32)
        tok_R1 = jnp.floor((r_R1 + 0.5) * (1.0 / group)).astype(jnp.int32)
        pos_R1 = pos0 + tok_R1
        row_hi = jnp.minimum(pos_R1, kv_len - 1) if causal else jnp.full_like(pos_R1, kv_len - 1)
        row_hi = jnp.where(tok_R1 < nrows, row_hi, -1)  # rows past the real ones see nothing
        row_lo = 0 if sliding_window is None else pos_R1 - (sliding_window - 1)
        return common.Masks(key_hi=hi, row_lo=row_lo, row_hi=row_hi)

    common.attend_program(
        num_items=tb,
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
        "sm_scale", "causal", "logits_soft_cap", "sliding_window", "block_q",
        "pages_per_compute_block", "tiles_per_program", "interpret",
    ),
)  # fmt: skip
def _ragged_tpu(
    q_TNH, k_pages_LKPCH, v_pages_LKPCH, tables_BW, kv_lens_B, cu_q_lens, num_seqs, layer_1,
    k_scale, v_scale, *,
    sm_scale, causal, logits_soft_cap, sliding_window, block_q, pages_per_compute_block,
    tiles_per_program, interpret,
):  # fmt: skip
    T, N, H = q_TNH.shape
    _, K, _, C, _ = k_pages_LKPCH.shape
    W = tables_BW.shape[1]
    G = N // K
    bq, ppcb, tb = block_q, pages_per_compute_block, tiles_per_program
    R = bq * G

    tmap = schedule.token_map(kv_lens_B, cu_q_lens, num_seqs, T)
    tiles = schedule.tile_schedule(
        kv_lens_B, cu_q_lens, num_seqs, num_tokens=T, block_q=bq, tmap=tmap
    )
    NT = tiles.seq.shape[0]
    pad = -NT % tb  # padded tiles have no rows: no DMA, zero output

    def padded(x):
        return jnp.pad(x, (0, pad))

    # q -> [NT, K, bq * G, H]; rows past a tile's real rows gather row 0 (masked in-kernel).
    j_Q = jnp.arange(bq, dtype=jnp.int32)
    src_NQ = jnp.where(j_Q[None, :] < tiles.q_rows[:, None], tiles.q_start[:, None] + j_Q, 0)
    q_NQKGH = q_TNH.reshape(T, K, G, H)[jnp.clip(src_NQ, 0, T - 1)]
    q_NKRH = q_NQKGH.transpose(0, 2, 1, 3, 4).reshape(NT, K, R, H)
    q_NKRH = jnp.pad(q_NKRH, ((0, pad), (0, 0), (0, 0), (0, 0)))

    spec = pl.BlockSpec((tb, None, R, H), lambda c, h, *_: (c, h, 0, 0))
    kernel = functools.partial(
        _ragged_kernel,
        width=W,
        group=G,
        causal=causal,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        quantized=k_scale is not None,
    )
    o_NKRH = common.paged_pallas_call(
        kernel,
        num_scalar_prefetch=6,
        num_programs=(NT + pad) // tb,
        block_spec=spec,
        k_pages_LKPCH=k_pages_LKPCH,
        v_pages_LKPCH=v_pages_LKPCH,
        pages_per_compute_block=ppcb,
        out_shape=jax.ShapeDtypeStruct(q_NKRH.shape, q_TNH.dtype),
        interpret=interpret,
        name=f"jpaged_ragged_paged_attention_tpu_G{G}_C{C}_H{H}_bq{bq}_ppcb{ppcb}_tb{tb}",
        scales=None if k_scale is None else (k_scale, v_scale),
    )(
        tables_BW.reshape(-1),
        layer_1,
        padded(tiles.seq),
        padded(tiles.q_rows),
        padded(tiles.pos0),
        padded(tiles.kv_len),
        q_NKRH,
        k_pages_LKPCH,
        v_pages_LKPCH,
        *(() if k_scale is None else (k_scale, v_scale)),
    )
    # [NT, K, bq, G, H] -> [NT * bq, N, H], then back to the rows of q.
    o_NKRH = o_NKRH[:NT]
    o_XNH = o_NKRH.reshape(NT, K, bq, G, H).transpose(0, 2, 1, 3, 4).reshape(NT * bq, N, H)
    o_TNH = o_XNH[tiles.tile_T * bq + tiles.row_T]
    return jnp.where(tmap.valid_T[:, None, None], o_TNH, 0).astype(q_TNH.dtype)


def _default_block_sizes(q: jax.Array, k_pages: jax.Array, block_tables: jax.Array) -> dict:
    """``tuning_tpu.ragged_block_sizes`` for these shapes (q [T, N, H], pool [..., K, P, C, H])."""
    T, N, H = q.shape
    K, _, C, _ = k_pages.shape[-4:]
    return tuning_tpu.ragged_block_sizes(
        page_size=C, head_dim=H, itemsize=jnp.dtype(k_pages.dtype).itemsize,
        width=block_tables.shape[1], group=N // K, num_tokens=max(T, 1),
    )  # fmt: skip


def unsupported_reason(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_tables: Any,
    kv_lens: Any,
    cu_q_lens: Any,
    num_seqs: Any,
    *,
    sm_scale: float | None = None,
    causal: bool = True,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> str | None:
    """Why the compiled TPU kernel cannot run these arguments, or None if it can.

    Same limits as the decode kernel: f32/bf16, head dim a multiple of 64, page size a
    multiple of the VMEM sublane tile (8 rows for f32, 16 for bf16); and the scalar-prefetched
    block tables plus tile metadata must fit SMEM.
    """
    del v_pages, kv_lens, cu_q_lens, num_seqs, sm_scale, causal
    del logits_soft_cap, sliding_window, layer, k_scale, v_scale
    reason = common.kv_unsupported_reason(q, k_pages)
    if reason is not None:
        return reason
    (B, W), T = block_tables.shape, q.shape[0]
    bq = _default_block_sizes(q, k_pages, block_tables)["block_q"]
    scalars = B * W + 4 * schedule.num_tiles_bound(T, B, bq) + 1
    limit = max_scalar_prefetch_entries()
    if scalars > limit:
        return f"block_tables B * W = {B * W} entries (+ tile metadata) exceed SMEM ({limit})"
    return None


def ragged_paged_attention_pallas_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    causal: bool = True,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: Any = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    interpret: Any = False,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    tiles_per_program: int | None = None,
) -> jax.Array:
    """Ragged paged attention on Mosaic TPU.

    Args:
      q: [T, N, H]; the rows of sequence b are ``q[cu_q_lens[b]:cu_q_lens[b+1]]``.
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W].
      kv_lens: i32[B] keys per sequence, the new query tokens included.
      cu_q_lens: i32[B + 1].
      num_seqs: i32[] or i32[1].
      sm_scale: logit scale (already resolved).
      causal: row i of sequence b (position ``kv_lens[b] - q_len_b + i``) sees keys up to
        its own position; if False every key of the sequence.
      logits_soft_cap: None or the cap.
      sliding_window: None or w: a row at position p sees keys j with ``p - j < w``.
      layer: layer index (int or i32[]) into a 5-D pool.
      k_scale: quantized (fp8, int8) pages: f32 broadcastable to [K, P, C] ([L or 1, K, P, C]
        with a 5-D pool); pages are dequantized in VMEM to ``page.astype(f32) * scale``.
      v_scale: like ``k_scale``, for ``v_pages``.
      interpret: True runs the strict TPU interpreter (``pltpu.InterpretParams()``); an
        ``InterpretParams`` is used as given.
      block_q: query tokens per tile (the tile has ``block_q * G`` rows); default from
        ``tuning_tpu.ragged_block_sizes``.
      pages_per_compute_block: pages per KV block; default from the same heuristic.
      tiles_per_program: query tiles one program streams through as one DMA pipeline (the
        grid is ``(ceil(NT / tiles_per_program), K)``); default from the same heuristic.

    Returns:
      [T, N, H] in ``q.dtype``; padding rows and rows that see no key are zeros.

    Raises:
      ValueError: if a block size is not a positive int.

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((3, 2, 64)); kv = jnp.ones((1, 2, 8, 64))  # row 2 is padding
    >>> out = ragged_paged_attention_pallas_tpu(q, kv, kv, jnp.array([[1, 0]], jnp.int32),
    ...     jnp.array([5], jnp.int32), jnp.array([0, 2], jnp.int32), jnp.array(1, jnp.int32),
    ...     sm_scale=0.125, interpret=True)
    >>> out[:, 0, 0].tolist()
    [1.0, 1.0, 0.0]
    """
    T = q.shape[0]
    W = block_tables.shape[1]
    if T == 0:
        return jnp.zeros(q.shape, q.dtype)
    defaults = _default_block_sizes(q, k_pages, block_tables)
    block_q = defaults["block_q"] if block_q is None else block_q
    ppcb = defaults["pages_per_compute_block"]
    ppcb = ppcb if pages_per_compute_block is None else pages_per_compute_block
    tb = defaults["tiles_per_program"] if tiles_per_program is None else tiles_per_program
    common.check_block_sizes(
        ("block_q", block_q), ("pages_per_compute_block", ppcb), ("tiles_per_program", tb)
    )
    k5, v5, layer_1 = common.as_layered(k_pages, v_pages, layer)
    ks5, vs5 = common.scale_pools(k_pages, k_scale, v_scale)
    return _ragged_tpu(
        q,
        k5,
        v5,
        block_tables,
        kv_lens,
        cu_q_lens,
        num_seqs,
        layer_1,
        ks5,
        vs5,
        **validate.static_options(
            sm_scale=sm_scale,
            causal=causal,
            logits_soft_cap=logits_soft_cap,
            sliding_window=sliding_window,
        ),
        block_q=min(block_q, T),
        pages_per_compute_block=min(ppcb, W),
        tiles_per_program=tb,
        interpret=common.interpret_params(interpret),
    )
