"""Ragged paged attention on Mosaic GPU (Hopper sm90 and newer).

FA3-style forward over paged K/V, grid (query tile, KV head), one or two 64-row compute
warpgroups per CTA:

- A warpgroup's query tile is ``Tw`` consecutive query tokens of ONE sequence x the G query
  heads of one KV head, packed into the 64 rows of a wgmma M tile. Tiles are cut on device from
  ``cu_q_lens`` (``schedule.tile_schedule``; a static upper bound on their number, no host
  sync). A decode row costs one tile; a 1000-token prefill ``1000 / Tq`` tiles: mixed batches
  run in one call without padding to the longest.
- Q and O (``direct_io``, the default with the FA3 body): Q is loaded by TMA straight from
  ``q[T, N, H]``, one ``[Tw, H]`` box per head (row ``r`` is head ``r // Tw``, token
  ``r % Tw``; ``Tw`` a multiple of 8), and O is stored the same way, a sequence's last, partial
  tile row by row so no other sequence's rows are touched; the schedule's empty tiles write the
  zero padding rows. Otherwise (G > 8, head dim 256, no SMEM room for the staging tile, the
  SMEM body's default, or ``direct_io=False``) XLA gathers Q into ``[64, H]``
  tile blocks before the kernel (row ``r`` is token ``r // G``, head ``r % G``) and gathers O
  back after it, which costs 13% of a long prefill.
- K/V tiles of ``block_kv`` keys are gathered page by page with TMA (``copy_gmem_to_smem``
  with a dynamic row start into a ``[stages, block_kv, H]`` SMEM ring, one barrier arrival
  per page copy). The page size is independent of the tile: a tile holds ``block_kv / C``
  whole pages, or a slice of one page when ``C > block_kv``. Page slots past a sequence's last
  page are clamped to it (never skipped: a skipped copy leaves stale SMEM).
- Only the KV tiles some row of the query tile can see are visited (causal end, sliding
  window start): fully masked tiles are never read. Tiles that every row sees entirely run
  a loop without masking; the boundary tiles run the masked loop.
- Online softmax in f32, base 2 (``log2(e)`` folded into the scale). V rows past the sequence
  end are zeroed in SMEM before ``P @ V`` so NaN/stale page tails never reach the output.
- Two bodies. ``_kernel_body_fa3`` (the GPU default): a producer warpgroup issues every K/V
  copy, K and V slots are released separately, P is a register wgmma operand accumulated in
  place, and a schedule barrier alternates the two compute warpgroups' matmuls (ping-pong), as
  in JAX's FA3 example. ``_kernel_body``: Q and P as SMEM operands with fresh accumulators, the
  variant the Mosaic GPU interpreter can run (``research/mosaic_gpu.md`` section 5); CPU CI
  runs it, and cross-lowers both.
- CTAs take the tiles sequence by sequence, longest first within each (``by_sequence``: the
  CTAs running at once share one sequence's K/V in L2), or longest first over the whole batch
  for decode-heavy batches (``tuning_gpu.default_tile_order``; one single-operand sort of
  packed int32 keys, ``_tile_order``).
- Decode-heavy batches (``paired``, the default where ``T <= 2 B``): the FA3 body's two
  compute warpgroups each run their own query tile with their own K/V ring, one producer
  feeding both, instead of sharing one tile whose second warpgroup would hold padding.
- Persistent CTAs (``persistent``; the default, with 64-key tiles, for prefill-heavy batches
  whose block table holds at most 1,024 keys a sequence): one CTA per SM runs its share of the
  (tile, KV head) work items back to back; the producer runs ahead into the next item's K/V
  and each compute warpgroup loads its next Q tile while it computes, so a short prompt's
  tiles do not each pay the CTA's start (schedule reads, block table, Q and first K/V latency).
- Split-KV (``kv_splits``, the default when the batch has too few (tile, KV head) units to
  fill the GPU: small batches at long context, late chunks of a long prefill): each tile's
  K/V range is split over S work units; each stores its normalised partial and base-2
  log-sum-exp in place and ``_merge_splits`` (XLA) combines them.

Correct on the GPU over page sizes 8-128, G 1/4/6/8, head dims 64-256 (in-place Q/O: 64 and
128), bf16/f16 mixed batches, with both bodies. The defaults and the measurements behind them
are ``tuning_gpu.TUNING``; the current figures are in BENCHMARKS.md.

Not covered (``unsupported_reason`` says so; auto dispatch falls back to ``xla``): f32 or mixed
dtypes, page sizes that are not multiples of 8 or neither divide nor are divided by the tile,
head dims other than 64/128/256, G > 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._gpu import quant as gpu_quant
from pallas_kernels._gpu.config import LSE_COLS, ROWS
from pallas_kernels._gpu.merge import merge_splits
from pallas_kernels.ragged_paged_attention import schedule
from pallas_kernels.ragged_paged_attention._gpu_bodies import _kernel_body, _kernel_body_fa3
from pallas_kernels.ragged_paged_attention._gpu_config import (
    SUPPORTED_DTYPES as SUPPORTED_DTYPES,
)
from pallas_kernels.ragged_paged_attention._gpu_config import (
    SUPPORTED_HEAD_DIMS as SUPPORTED_HEAD_DIMS,
)
from pallas_kernels.ragged_paged_attention._gpu_config import TILE_ORDERS as TILE_ORDERS
from pallas_kernels.ragged_paged_attention._gpu_config import _Config
from pallas_kernels.ragged_paged_attention._gpu_config import make_config as make_config
from pallas_kernels.ragged_paged_attention._gpu_config import (
    unsupported_reason as unsupported_reason,
)
from pallas_kernels.ragged_paged_attention._gpu_order import _tile_order


def _merge_splits(o_STNH, lse_STNL, num_rows, dtype):
    """Log-sum-exp merge of the splits' partials (base 2; a split that saw no key has weight
    0; a row no split saw gives zeros; ``_gpu.merge.merge_splits`` over the T x N rows).
    Rows from ``num_rows`` on (padding: no unit wrote them) are zeros."""
    S, T, N, H = o_STNH.shape
    out = merge_splits(o_STNH.reshape(S, T * N, H), lse_STNL[..., 0].reshape(S, T * N), dtype)
    valid = jnp.arange(T, dtype=jnp.int32) < num_rows
    return jnp.where(valid[:, None, None], out.reshape(T, N, H), jnp.zeros((), dtype))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _ragged_attention(
    cfg: _Config, q_TNH, k_pages, v_pages, block_tables_BW, kv_lens_B, cu_q_lens, num_seqs, layer,
    k_scale=None, v_scale=None,
):  # fmt: skip
    out_dtype = q_TNH.dtype
    scales = []
    if cfg.quantized:  # bf16 products (``_gpu.quant``); the output in q's dtype
        q_TNH = q_TNH.astype(cfg.dtype)
        scales = gpu_quant.flat_scales(cfg, k_pages, layer, k_scale, v_scale)
    T, N, H = q_TNH.shape
    K, P, C, G, W = cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.group, cfg.num_wgs
    threads = W + int(cfg.producer)
    Tw = cfg.tokens_per_wg  # tokens per warpgroup (64 rows)
    Tq = cfg.block_q  # tokens per query tile (a CTA's, or with ``paired`` a warpgroup's)
    S = cfg.kv_splits
    if cfg.direct_io:
        # Q and O in place: the empty tiles past the real ones zero the padding rows (split-KV:
        # the merge does, and no unit is spent on them).
        ts = schedule.tile_schedule(
            kv_lens_B, cu_q_lens, num_seqs, num_tokens=T, block_q=Tq,
            extra_tiles=2 if S == 1 else 0, token_rows=False,
        )  # fmt: skip
        NT = ts.seq.shape[0]
        q_start = jnp.where(ts.q_rows > 0, ts.q_start, ts.pad_start)
        store = jnp.where(ts.q_rows > 0, ts.q_rows, jnp.where(ts.pad_start < T, Tq, 0))
        if S > 1:
            q_start = jnp.where(ts.q_rows > 0, ts.q_start, 0)
            store = ts.q_rows
        q_in = q_TNH
        if S > 1:  # each split's normalised partial and its base-2 LSE
            out_type = (
                jax.ShapeDtypeStruct((S, T, N, H), cfg.dtype),
                jax.ShapeDtypeStruct((S, T, N, LSE_COLS), jnp.float32),
            )
        else:
            out_type = jax.ShapeDtypeStruct((T, N, H), cfg.dtype)
    else:
        tm = schedule.token_map(kv_lens_B, cu_q_lens, num_seqs, T)
        ts = schedule.tile_schedule(
            kv_lens_B, cu_q_lens, num_seqs, num_tokens=T, block_q=Tq, tmap=tm
        )
        NT = ts.seq.shape[0]
        q_start = store = jnp.zeros((NT,), jnp.int32)  # unused
        # Q tiles: [NT, W, Tw, K, G, H] -> [K, NT, W, Tw*G (padded to 64), H]: one aligned TMA
        # per warpgroup.
        tok_IQ = jnp.clip(ts.q_start[:, None] + jnp.arange(Tq, dtype=jnp.int32)[None, :], 0, T - 1)
        q_IQKGH = q_TNH.reshape(T, K, G, H)[tok_IQ]
        q_KIWRH = q_IQKGH.reshape(NT, W, Tw, K, G, H).transpose(3, 0, 1, 2, 4, 5)
        q_KIWRH = q_KIWRH.reshape(K, NT, W, Tw * G, H)
        q_KIWRH = jnp.pad(q_KIWRH, ((0, 0), (0, 0), (0, 0), (0, ROWS - Tw * G), (0, 0)))
        q_in = q_KIWRH.reshape(K * NT * W * ROWS, H)
        out_type = jax.ShapeDtypeStruct((K * NT * W * ROWS, H), cfg.dtype)
    k_RH = k_pages.reshape(-1, H)
    v_RH = v_pages.reshape(-1, H)
    base = jnp.asarray(layer, jnp.int32).reshape(1) * jnp.int32(K * P * C)
    units = NT * cfg.kv_splits  # (tile, split) work units
    inert = cfg.paired and units % W != 0  # W units per CTA; the odd one out gets an inert tile
    order = _tile_order(cfg, ts, B=block_tables_BW.shape[0], sentinel=inert)
    tile_arrays = [ts.seq, ts.q_rows, ts.pos0, ts.kv_len, q_start, store]
    grid_i = units
    if inert:
        grid_i = -(-units // W)
        tile_arrays = [jnp.pad(a, (0, 1)) for a in tile_arrays]
    elif cfg.paired:
        grid_i = units // W
    grid = (grid_i, K)
    if cfg.persistent:  # the CTAs deal the units x K work items among themselves
        grid = (cfg.persistent, 1)
    name = (
        f"ragged_paged_mgpu_wg{W}{'fa3' if cfg.fa3 else 'p' if cfg.producer else ''}"
        f"{'_pair' if cfg.paired else ''}{'_io' if cfg.direct_io else ''}_Tq{Tq}"
        f"{f'_S{cfg.kv_splits}' if cfg.kv_splits > 1 else ''}{'_pers' if cfg.persistent else ''}"
        f"_T{cfg.block_kv}_st{cfg.num_stages}_C{C}_G{G}_H{H}{'_causal' if cfg.causal else ''}"
    )
    if cfg.quantized:  # 8-bit pages and the scales' modes (head, page, token)
        name += f"_{cfg.kv_dtype.name}_k{cfg.k_scales[0]}v{cfg.v_scales[0]}"
    body = functools.partial(_kernel_body_fa3 if cfg.fa3 else _kernel_body, cfg)
    body.__name__ = name  # type: ignore[attr-defined]  (names the kernel in profiles)
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=grid,
        grid_names=("i", "h"),
        num_threads=threads if threads > 1 else None,
        thread_name="wg" if threads > 1 else None,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if cfg.interpret else None,
    )
    seq, q_rows, pos0, kv_len, q_start, store = tile_arrays
    o = kernel(
        q_in, k_RH, v_RH, block_tables_BW.astype(jnp.int32), seq, q_rows, pos0, kv_len, base,
        order, q_start, store, *scales,
    )  # fmt: skip
    if cfg.direct_io and S > 1:
        ns = schedule.num_seqs_scalar(num_seqs, cu_q_lens.shape[0] - 1)
        return _merge_splits(*o, cu_q_lens[ns], cfg.dtype).astype(out_dtype)
    if cfg.direct_io:
        return o.astype(out_dtype)
    # [K, NT, W, 64, H] -> rows of [NT * Tq, N, H] -> back to the order of q.
    o_KIWRH = o.reshape(K, NT, W, ROWS, H)[:, :, :, : Tw * G]
    o_rows = o_KIWRH.reshape(K, NT, W, Tw, G, H).transpose(1, 2, 3, 0, 4, 5)
    o_TNH = o_rows.reshape(NT * Tq, N, H)[ts.tile_T * Tq + ts.row_T]
    return jnp.where(tm.valid_T[:, None, None], o_TNH, jnp.zeros((), cfg.dtype)).astype(out_dtype)


def ragged_paged_attention_pallas_gpu(
    q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, **options
) -> jax.Array:
    """Ragged paged attention with the Mosaic GPU kernel; semantics of ``reference``.

    Args:
      q: [T, N, H] bf16 or f16; the rows of sequence b are ``q[cu_q_lens[b]:cu_q_lens[b+1]]``.
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W].
      kv_lens: i32[B] keys per sequence, the new query tokens included.
      cu_q_lens: i32[B + 1].
      num_seqs: i32[] or i32[1]; rows from ``cu_q_lens[num_seqs]`` on are zeros.
      **options: ``sm_scale`` (required), ``k_scale`` / ``v_scale`` for quantized pages (fp8,
        int8: each tile is dequantized into bf16, ``pallas_kernels._gpu.quant``) and the knobs
        of ``make_config``, which documents them and resolves their defaults.

    Returns:
      [T, N, H] in ``q.dtype``.

    Raises:
      ValueError: if the kernel cannot run these shapes/dtypes or a knob is out of range.
    """
    cfg, layer = make_config(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, **options
    )
    return _ragged_attention(
        cfg, q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, layer,
        options.get("k_scale"), options.get("v_scale"),
    )  # fmt: skip
