"""Ragged paged attention on Mosaic GPU (Hopper sm90 and newer).

FA3-style forward over paged K/V, one warpgroup per CTA, grid (query tile, KV head):

- A query tile is ``Tq = 64 // G`` consecutive query tokens of ONE sequence x the G query heads
  of one KV head, packed into the 64 rows of a wgmma M tile (row ``r`` is token ``r // G``,
  head ``r % G``). Tiles are cut on device from ``cu_q_lens`` (``schedule.tile_schedule``; a
  static upper bound on their number, no host sync) and the Q rows of each tile are gathered
  into a contiguous ``[64, H]`` block by XLA before the kernel, so the Q load and the output
  store are one aligned TMA each. A decode row costs one tile; a 1000-token prefill
  ``1000 / Tq`` tiles: mixed batches run in one call without padding to the longest.
- K/V tiles of ``block_kv`` keys are gathered page by page with TMA (``copy_gmem_to_smem``
  with a dynamic row start into a ``[stages, block_kv, H]`` SMEM ring, one barrier arrival
  per page copy). The page size is independent of the tile: a tile holds ``block_kv / C``
  whole pages, or a slice of one page when ``C > block_kv``. Page slots past a sequence's last
  page are clamped to it (never skipped: a skipped copy leaves stale SMEM).
- Only the KV tiles some row of the query tile can see are visited (causal end, sliding
  window start): fully masked tiles are never read. Tiles that every row sees entirely run
  a loop without masking; the boundary tiles run the masked loop.
- Online softmax in f32, base 2 (``log2(e)`` folded into the scale). Q and P are wgmma
  operands in SMEM and each wgmma gets a fresh accumulator: the variant the Mosaic GPU
  interpreter can run (``research/mosaic_gpu.md`` section 5). V rows past the sequence end are
  zeroed in SMEM before ``P @ V`` so NaN/stale page tails never reach the output.

Measured on an H200 (BENCHMARKS.md, "Prefill / ragged attention"): 0.57-0.67x cuDNN dense
causal at T >= 4k with the defaults; correct on the GPU over page sizes 8-128, G 1/4/8, head dims
64-256, bf16/f16 mixed batches.

Not covered (``unsupported_reason`` says so; auto dispatch falls back to ``xla``): f32 or mixed
dtypes, page sizes that are not multiples of 8 or neither divide nor are divided by the tile,
head dims other than 64/128/256, G > 64.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention import schedule, tuning_gpu

_ROWS = tuning_gpu.ROWS
_LOG2E = math.log2(math.e)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static description of one kernel instance (hashable: a jit static argument)."""

    num_tokens: int  # T
    num_q_heads: int  # N
    num_kv_heads: int  # K
    num_pages: int  # P
    page_size: int  # C
    head_dim: int  # H
    dtype: Any
    sm_scale: float
    causal: bool
    logits_soft_cap: float | None
    sliding_window: int | None
    block_kv: int
    num_stages: int
    num_wgs: int  # compute warpgroups per CTA (64 rows each), sharing the K/V ring
    producer: bool  # an extra warpgroup issues every K/V copy (FA3-style warp specialization)
    longest_first: bool
    interpret: bool

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def block_q(self) -> int:
        return self.num_wgs * tuning_gpu.tokens_per_tile(self.group)

    @property
    def copies_per_tile(self) -> int:
        return max(1, self.block_kv // self.page_size)

    @property
    def rows_per_copy(self) -> int:
        return min(self.page_size, self.block_kv)


def unsupported_reason(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=None,
    causal=True,
    logits_soft_cap=None,
    sliding_window=None,
    layer=None,
    block_kv: int | None = None,
    check_backend: bool = True,
) -> str | None:
    """Why this kernel cannot run these arguments, or None if it can (shapes/dtypes only).

    Args:
      q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs: as in
        ``ragged_paged_attention_pallas_gpu``; only shapes and dtypes are read.
      sm_scale, causal, logits_soft_cap, sliding_window, layer: accepted for signature parity.
      block_kv: the K/V tile the kernel would use (default ``tuning_gpu.default_block_kv``).
      check_backend: also require a Hopper (sm90) GPU as the default backend.
    """
    del sm_scale, causal, logits_soft_cap, sliding_window, layer
    del block_tables, kv_lens, cu_q_lens, num_seqs
    reasons = []
    if check_backend:
        from jpaged import _backend

        cc = _backend.gpu_compute_capability()
        if cc is None or cc[0] != 9:  # wgmma is sm90a-only; Blackwell has tcgen05 instead
            reasons.append(
                f"the kernel uses Hopper wgmma: it needs compute capability 9.x (got {cc})"
            )
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_pages.dtype), jnp.dtype(v_pages.dtype)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
        reasons.append(
            f"q/k_pages/v_pages dtypes ({q.dtype}, {k_pages.dtype}, {v_pages.dtype}) must all be "
            "bfloat16 or all float16"
        )
    *_, C, H = k_pages.shape
    if H not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim={H} must be one of {SUPPORTED_HEAD_DIMS}")
    T = tuning_gpu.default_block_kv(H) if block_kv is None else block_kv
    if C % 8 or (T % C and C % T):
        reasons.append(
            f"page_size={C} must be a multiple of 8 that divides or is a multiple of the "
            f"K/V tile block_kv={T}"
        )
    N = q.shape[-2]
    K = k_pages.shape[-4]
    G = N // K if K else 0
    if not 1 <= G <= _ROWS:
        reasons.append(f"group size G={G} must be in [1, {_ROWS}]")
    rows = math.prod(k_pages.shape[:-1])
    if rows >= 2**31:
        reasons.append(f"the pool has {rows} rows; the kernel indexes rows with int32")
    return "; ".join(reasons) if reasons else None


def _smem_transforms():
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _kernel_body(
    cfg: _Config, q_ref, k_ref, v_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref,
    order_ref, o_ref,
):  # fmt: skip
    """One CTA: query tile ``i`` (through ``order``) x KV head ``h``, ``num_wgs`` warpgroups.

    Warpgroup ``w`` owns rows ``[64 w, 64 (w + 1))`` of the tile (tokens ``[w Tq, (w+1) Tq)``);
    all warpgroups share the K/V ring, which warpgroup 0 refills once every warpgroup has
    consumed a slot (``c_bar``).
    """
    T, H, C, G, W = cfg.block_kv, cfg.head_dim, cfg.page_size, cfg.group, cfg.num_wgs
    stages, dtype = cfg.num_stages, cfg.dtype
    n_cp, r = cfg.copies_per_tile, cfg.rows_per_copy
    NT = q_ref.shape[0] // (cfg.num_kv_heads * _ROWS * W)
    Tq = cfg.block_q // W  # tokens per warpgroup

    h = lax.axis_index("h")
    threads = W + int(cfg.producer)
    wg = lax.axis_index("wg") if threads > 1 else jnp.int32(0)
    cwg = jnp.minimum(wg, W - 1)  # compute warpgroup index (the producer's is unused)
    i = order_ref[lax.axis_index("i")]
    seq = seq_ref[i]
    ntok = ntok_ref[i]  # real query tokens in the tile (0: empty tile)
    pos0 = pos0_ref[i]  # position of the tile's first token
    kv_len = kvlen_ref[i]
    pos_last = pos0 + ntok - 1
    # Keys any row of the tile may see: [lo, hi).
    hi = jnp.minimum(kv_len, pos_last + 1) if cfg.causal else kv_len
    hi = jnp.where(ntok > 0, hi, 0)
    if cfg.sliding_window is not None:
        lo = jnp.maximum(pos0 - cfg.sliding_window + 1, 0)
    else:
        lo = jnp.int32(0)
    t_lo = lo // T
    n = jnp.maximum((hi + T - 1) // T - t_lo, 0)
    # Leading tiles every row sees entirely (no mask needed): whole tiles below the first
    # row's position (causal) / below kv_len (non-causal). With a window every tile is masked.
    if cfg.sliding_window is not None:
        n_full = jnp.int32(0)
    elif cfg.causal:
        n_full = jnp.clip(jnp.minimum(pos0 + 1, kv_len) // T, 0, n)
    else:
        n_full = jnp.clip(kv_len // T, 0, n)
    last_page = jnp.clip((kv_len + C - 1) // C - 1, 0, bt_ref.shape[1] - 1)
    head_base = base_ref[0] + h * (cfg.num_pages * C)
    q_row = pl.multiple_of(((h * NT + i) * W + cwg) * _ROWS, _ROWS)

    def scoped(q_smem2, k_smem, v_smem, p_smem2, q_bar, k_bar, v_bar, c_bar):
        q_smem, p_smem = q_smem2.at[cwg], p_smem2.at[cwg]

        def tile_rows(step):
            """Pool rows of the n_cp page copies of K/V tile ``step`` (clamped to real pages).

            Loaded a whole step ahead of the copies so the block-table reads' latency hides
            behind the current tile's math.
            """
            rows = []
            for j in range(n_cp):
                tok = (t_lo + step) * T + j * r
                page = bt_ref[seq, jnp.minimum(tok // C, last_page)]
                page = jnp.clip(page, 0, cfg.num_pages - 1)
                rows.append(head_base + page * C + tok % C)
            return rows

        def issue(rows, slot):
            for j, row in enumerate(rows):
                row = pl.multiple_of(row, 8)
                dst = pl.ds(j * r, r)
                plgpu.copy_gmem_to_smem(
                    k_ref.at[pl.ds(row, r)], k_smem.at[slot, dst], k_bar.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    v_ref.at[pl.ds(row, r)], v_smem.at[slot, dst], v_bar.at[slot]
                )

        def drain_consumed():
            """Observes each slot's last 'consumed' completion (the refills skipped them).

            Free on hardware (nothing is refilled after them); keeps every completion observed,
            which the Mosaic GPU interpreter checks when the barrier is freed.
            """
            for d in range(stages):
                pl.when(d < n)(
                    lambda d=d: plgpu.barrier_wait(c_bar.at[lax.rem(n - 1 - d, jnp.int32(stages))])
                )

        def compute():
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_row, _ROWS)], q_smem, q_bar.at[cwg])
            if not cfg.producer:
                for s in range(stages):
                    pl.when((s < n) & (wg == 0))(functools.partial(issue, tile_rows(s), s))
            plgpu.barrier_wait(q_bar.at[cwg])

            acc = plgpu.layout_cast(jnp.zeros((_ROWS, H), jnp.float32), plgpu.Layout.WGMMA)
            m = plgpu.layout_cast(
                jnp.full((_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
            )
            l = plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

            def step(masked: bool, st, carry):
                acc, m, l = carry
                slot = lax.rem(st, jnp.int32(stages))
                tile_tok = (t_lo + st) * T
                next_rows = None if cfg.producer else tile_rows(st + stages)
                plgpu.barrier_wait(k_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((_ROWS, T), jnp.float32))
                if cfg.logits_soft_cap:
                    cap = cfg.logits_soft_cap
                    sc = (cap * _LOG2E) * jnp.tanh(sc * (cfg.sm_scale / cap))
                else:
                    sc = sc * (cfg.sm_scale * _LOG2E)
                if masked:
                    shape = (_ROWS, T)
                    col = tile_tok + plgpu.broadcasted_iota(
                        jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA
                    )
                    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                    # Padding rows (token >= ntok) repeat the last real token: never all-masked.
                    tok = jnp.minimum(cwg * Tq + lax.div(row, jnp.int32(G)), ntok - 1)
                    pos = pos0 + tok
                    visible = col < kv_len
                    if cfg.causal:
                        visible = visible & (col <= pos)
                    if cfg.sliding_window is not None:
                        visible = visible & (pos - col < cfg.sliding_window)
                    sc = jnp.where(visible, sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1))
                if cfg.sliding_window is not None:  # a row may see nothing in its first tiles
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                else:
                    m_use = m_new
                alpha = jnp.exp2(m - m_use)
                p = jnp.exp2(sc - lax.broadcast_in_dim(m_use, sc.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p_smem[...] = p.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_wait(v_bar.at[slot])
                if masked:

                    @pl.when(tile_tok + T > kv_len)
                    def _zero_tail():  # stale/NaN rows past the end: 0 * NaN would poison P @ V
                        # (with several warpgroups each writes the same values: a benign overlap)
                        tile = v_smem.at[slot]
                        rows = tile_tok + plgpu.broadcasted_iota(
                            jnp.int32, (T, H), 0, layout=plgpu.Layout.WGMMA
                        )
                        vals = plgpu.load(tile, layout=plgpu.Layout.WGMMA)
                        tile[...] = jnp.where(rows < kv_len, vals, jnp.zeros_like(vals))
                        plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                    return acc_ref[...]

                o = pl.run_scoped(pv, plgpu.ACC((_ROWS, H), jnp.float32))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o
                if W > 1 or cfg.producer:
                    plgpu.barrier_arrive(c_bar.at[slot])

                if not cfg.producer:

                    @pl.when((st + stages < n) & (wg == 0))
                    def _refill():
                        if W > 1:  # every warpgroup is done with the slot
                            plgpu.barrier_wait(c_bar.at[slot])
                        issue(next_rows, slot)

                return acc, m_new, l

            carry = lax.fori_loop(0, n_full, functools.partial(step, False), (acc, m, l))
            acc, m, l = lax.fori_loop(n_full, n, functools.partial(step, True), carry)
            if W > 1 and not cfg.producer:
                pl.when(wg == 0)(drain_consumed)
            empty = l == 0.0
            inv_l = 1.0 / jnp.where(empty, 1.0, l)
            out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
            q_smem[...] = out.astype(dtype)  # Q is no longer needed: reuse its tile for O
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[pl.ds(q_row, _ROWS)])
            plgpu.wait_smem_to_gmem(0)

        if not cfg.producer:
            compute()
            return

        @pl.when(wg == W)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            @pl.loop(0, n)
            def _(st):
                slot = lax.rem(st, jnp.int32(stages))

                @pl.when(st >= stages)
                def _():  # every compute warpgroup is done with the slot
                    plgpu.barrier_wait(c_bar.at[slot])

                issue(tile_rows(st), slot)

            drain_consumed()

        @pl.when(wg < W)
        def _compute():
            plgpu.set_max_registers(232 if W == 2 else 240, action="increase")
            compute()

    tr = _smem_transforms()
    pl.run_scoped(
        scoped,
        plgpu.SMEM((W, _ROWS, H), dtype, transforms=tr),
        plgpu.SMEM((stages, T, H), dtype, transforms=tr),
        plgpu.SMEM((stages, T, H), dtype, transforms=tr),
        plgpu.SMEM((W, _ROWS, T), dtype, transforms=tr),
        plgpu.Barrier(num_arrivals=1, num_barriers=W),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=stages),
        plgpu.Barrier(num_arrivals=W, num_barriers=stages) if threads > 1 else None,
        **({"collective_axes": "wg"} if threads > 1 else {}),
    )


@functools.partial(jax.jit, static_argnames=("cfg",))
def _ragged_attention(
    cfg: _Config, q_TNH, k_pages, v_pages, block_tables_BW, kv_lens_B, cu_q_lens, num_seqs, layer
):
    T, N, H = q_TNH.shape
    K, P, C, G, W = cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.group, cfg.num_wgs
    threads = W + int(cfg.producer)
    Tw = tuning_gpu.tokens_per_tile(G)  # tokens per warpgroup (64 rows)
    Tq = W * Tw  # tokens per query tile (CTA)
    tm = schedule.token_map(kv_lens_B, cu_q_lens, num_seqs, T)
    ts = schedule.tile_schedule(kv_lens_B, cu_q_lens, num_seqs, num_tokens=T, block_q=Tq, tmap=tm)
    NT = ts.seq.shape[0]
    # Q tiles: [NT, W, Tw, K, G, H] -> [K, NT, W, Tw*G (padded to 64), H]: one aligned TMA per
    # warpgroup.
    tok_IQ = jnp.clip(ts.q_start[:, None] + jnp.arange(Tq, dtype=jnp.int32)[None, :], 0, T - 1)
    q_IQKGH = q_TNH.reshape(T, K, G, H)[tok_IQ]
    q_KIWRH = q_IQKGH.reshape(NT, W, Tw, K, G, H).transpose(3, 0, 1, 2, 4, 5)
    q_KIWRH = q_KIWRH.reshape(K, NT, W, Tw * G, H)
    q_KIWRH = jnp.pad(q_KIWRH, ((0, 0), (0, 0), (0, 0), (0, _ROWS - Tw * G), (0, 0)))
    q_RH = q_KIWRH.reshape(K * NT * W * _ROWS, H)
    k_RH = k_pages.reshape(-1, H)
    v_RH = v_pages.reshape(-1, H)
    base = jnp.asarray(layer, jnp.int32).reshape(1) * jnp.int32(K * P * C)
    if cfg.longest_first:  # KV tiles visited per query tile, most first
        work = jnp.minimum(ts.kv_len, ts.pos0 + ts.q_rows) if cfg.causal else ts.kv_len
        order = jnp.argsort(-jnp.where(ts.q_rows > 0, work, -1)).astype(jnp.int32)
    else:
        order = jnp.arange(NT, dtype=jnp.int32)
    name = (
        f"ragged_paged_mgpu_wg{W}{'p' if cfg.producer else ''}_Tq{Tq}_T{cfg.block_kv}_st{cfg.num_stages}_C{C}_G{G}_H{H}"
        f"{'_causal' if cfg.causal else ''}"
    )
    body = functools.partial(_kernel_body, cfg)
    body.__name__ = name  # type: ignore[attr-defined]  (names the kernel in profiles)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((K * NT * W * _ROWS, H), cfg.dtype),
        grid=(NT, K),
        grid_names=("i", "h"),
        num_threads=threads if threads > 1 else None,
        thread_name="wg" if threads > 1 else None,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if cfg.interpret else None,
    )
    o_RH = kernel(
        q_RH, k_RH, v_RH, block_tables_BW.astype(jnp.int32), ts.seq, ts.q_rows, ts.pos0,
        ts.kv_len, base, order,
    )  # fmt: skip
    # [K, NT, W, 64, H] -> rows of [NT * Tq, N, H] -> back to the order of q.
    o_KIWRH = o_RH.reshape(K, NT, W, _ROWS, H)[:, :, :, : Tw * G]
    o_rows = o_KIWRH.reshape(K, NT, W, Tw, G, H).transpose(1, 2, 3, 0, 4, 5)
    o_TNH = o_rows.reshape(NT * Tq, N, H)[ts.tile_T * Tq + ts.row_T]
    return jnp.where(tm.valid_T[:, None, None], o_TNH, jnp.zeros((), cfg.dtype))


def ragged_paged_attention_pallas_gpu(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    causal: bool = True,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,
    interpret: bool = False,
    block_kv: int | None = None,
    num_stages: int | None = None,
    num_wgs: int | None = None,
    producer: bool = False,
    longest_first: bool = True,
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
      sm_scale: logit scale (already resolved).
      causal, logits_soft_cap, sliding_window: as in ``reference``.
      layer: int or i32[] layer index into a 5-D pool (a row offset; nothing is sliced).
      interpret: run in the Mosaic GPU interpreter (``plgpu.InterpretGPUParams()``), any backend.
      block_kv: keys per K/V tile (64 or 128; default ``tuning_gpu.default_block_kv``).
      num_stages: depth of the TMA ring (default ``tuning_gpu.default_num_stages``).
      num_wgs: compute warpgroups per CTA, 1 or 2 (64 query rows each, one shared K/V ring);
        default ``tuning_gpu.default_num_wgs`` (2 for prefill-heavy batches; 1 in interpret
        mode).
      producer: add a warpgroup that only issues the K/V copies (FA3-style warp
        specialization); compute warpgroups then never wait on the block table or each other.
        Matched the oracle in the interpreter (run by hand) and cross-lowers for CUDA, but has
        not yet run on a GPU: opt-in until it has.
      longest_first: run the query tiles with the most K/V work first (an on-device argsort).

    Returns:
      [T, N, H] in ``q.dtype``.

    Raises:
      ValueError: if the kernel cannot run these shapes/dtypes or a knob is out of range.
    """
    T, N, H = q.shape
    block_kv = tuning_gpu.default_block_kv(H) if block_kv is None else int(block_kv)
    reason = unsupported_reason(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
        block_kv=block_kv, check_backend=False,
    )  # fmt: skip
    if reason is not None:
        raise ValueError(f"ragged_paged_attention_pallas_gpu cannot run this call: {reason}")
    if block_kv not in tuning_gpu.BLOCK_KV_CHOICES:
        raise ValueError(f"{block_kv=} must be one of {tuning_gpu.BLOCK_KV_CHOICES}")
    if k_pages.ndim == 5:
        if layer is None:
            raise ValueError("layer must be given with a 5-D [L, K, P, C, H] pool")
        _, K, P, C, _ = k_pages.shape
    else:
        K, P, C, _ = k_pages.shape
        layer = 0
    B = block_tables.shape[0]
    if num_wgs is None:
        # The interpreter runs each warpgroup as a Python thread whose barrier waits block
        # inside host callbacks; with two of them it was seen to hang (thread starvation) on
        # a 2-core machine, so interpret mode defaults to one warpgroup.
        wgs = 1 if interpret else tuning_gpu.default_num_wgs(T, B)
    else:
        wgs = int(num_wgs)
    if wgs not in (1, 2):
        raise ValueError(f"num_wgs={wgs} must be 1 or 2")
    stages = (
        tuning_gpu.default_num_stages(H, block_kv, wgs) if num_stages is None else int(num_stages)
    )
    if stages < 1 or tuning_gpu.smem_bytes(H, block_kv, stages, wgs) > tuning_gpu.SMEM_BYTES:
        raise ValueError(f"num_stages={stages} must be >= 1 and fit in 227 KB of SMEM")
    cfg = _Config(
        num_tokens=T,
        num_q_heads=N,
        num_kv_heads=K,
        num_pages=P,
        page_size=C,
        head_dim=H,
        dtype=jnp.dtype(q.dtype),
        sm_scale=float(sm_scale),
        causal=bool(causal),
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        block_kv=block_kv,
        num_stages=stages,
        num_wgs=wgs,
        producer=bool(producer),
        longest_first=bool(longest_first),
        interpret=bool(interpret),
    )
    return _ragged_attention(
        cfg, q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, layer
    )
