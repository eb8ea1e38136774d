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
- Split-KV (``kv_splits``, the default when the batch has too few (tile, KV head) units to
  fill the GPU: small batches at long context, late chunks of a long prefill): each tile's
  K/V range is split over S work units; each stores its normalised partial and base-2
  log-sum-exp in place and ``_merge_splits`` (XLA) combines them.

Measured on an H200 (BENCHMARKS.md, "Prefill / ragged attention", fifth session): 0.95-0.96x
cuDNN dense causal wall-clock at T = 4k-16k with the defaults (0.57-0.67x before the FA3 body,
in-place Q/O and the tile order); decode batches at 0.89-1.05x jpaged's decode kernel; correct
on the GPU over page sizes 8-128, G 1/4/6/8, head dims 64-256 (in-place Q/O: 64 and 128),
bf16/f16 mixed batches, with both bodies.

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

from pallas_kernels import _gpu_checks
from pallas_kernels._split_merge import merge_splits
from pallas_kernels.ragged_paged_attention import schedule, tuning_gpu

_ROWS = tuning_gpu.ROWS
_LSE_COLS = 32  # split partial LSE rows are 32 f32 = 128 B: TMA's SMEM row-slice alignment
_LOG2E = math.log2(math.e)
SUPPORTED_DTYPES = _gpu_checks.SUPPORTED_DTYPES
SUPPORTED_HEAD_DIMS = _gpu_checks.SUPPORTED_HEAD_DIMS
# setmaxnreg split of a warp-specialized CTA: the producer warpgroup needs few registers; the
# compute warpgroups take the rest of the 64K (1 or 2 of them + the producer, 128 threads each).
_PRODUCER_REGISTERS = 40


def _compute_registers(num_compute_wgs: int) -> int:
    return 232 if num_compute_wgs == 2 else 240


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
    num_wgs: int  # compute warpgroups per CTA (64 rows each): one tile's K/V ring, or paired
    producer: bool  # an extra warpgroup issues every K/V copy (FA3-style warp specialization)
    fa3: bool  # _kernel_body_fa3: producer + register P + ping-pong (implies producer)
    paired: bool  # fa3 only: each compute warpgroup runs its own query tile and K/V stream
    kv_splits: int  # S: each query tile's K/V range split over S work units (LSE-merged)
    direct_io: bool  # Q / O read and written in place in [T, N, H] (no XLA gather / scatter)
    tile_order: str  # one of TILE_ORDERS
    interpret: bool

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def block_q(self) -> int:
        """Query tokens per schedule tile (one warpgroup's with ``paired``)."""
        return self.tokens_per_wg if self.paired else self.num_wgs * self.tokens_per_wg

    @property
    def tokens_per_wg(self) -> int:
        return tuning_gpu.tokens_per_tile(self.group, self.direct_io)

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
    reasons = _gpu_checks.device_and_dtype_reasons(q, k_pages, v_pages, check_backend=check_backend)
    *_, C, H = k_pages.shape
    T = (
        tuning_gpu.default_block_kv(H, tuning_gpu.default_fa3(False), page_size=C)
        if block_kv is None
        else block_kv
    )
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
    reasons += _gpu_checks.pool_rows_reasons(k_pages)
    return "; ".join(reasons) if reasons else None


def _smem_transforms():
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class _Tile:
    """What one warpgroup knows about its work unit (a query tile x KV head ``h``, or with
    ``kv_splits`` one split of the tile's K/V range), shared by both kernel bodies."""

    wg: Any  # this warpgroup's index (0 without warp specialization)
    cwg: Any  # compute warpgroup index (the producer's is clamped; unused)
    seq: Any
    ntok: Any  # real query tokens in the tile (0: empty tile)
    pos0: Any  # position of the tile's first token
    kv_len: Any
    t_lo: Any  # first K/V tile visited
    n: Any  # K/V tiles visited
    n_full: Any  # leading tiles every row sees entirely (no mask)
    last_page: Any
    head_base: Any
    q_row: Any  # first row of this warpgroup's Q/O tile in the [K*NT*W*64, H] slabs (gather)
    t0: Any  # direct_io: first query row of this warpgroup in [T, N, H]
    n_store: Any  # direct_io: rows of this warpgroup to store (0 .. tokens_per_wg)
    head0: Any  # first query head of the KV head
    tok_off: Any  # first token of this warpgroup within the tile (0 with ``paired``)
    split: Any  # this work unit's part of the tile's K/V range (0 .. kv_splits - 1)


def _tile(
    cfg: _Config, q_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref, order_ref,
    qs_ref, store_ref, pick=None,
):  # fmt: skip
    """This warpgroup's tile; with ``paired`` tile ``pick`` (0 or 1, default this compute
    warpgroup's) of the CTA's two."""
    T, C, W, Tw = cfg.block_kv, cfg.page_size, cfg.num_wgs, cfg.tokens_per_wg
    NT = order_ref.shape[0]
    h = lax.axis_index("h")
    threads = W + int(cfg.producer)
    wg = lax.axis_index("wg") if threads > 1 else jnp.int32(0)
    cwg = jnp.minimum(wg, W - 1)
    # Work unit u = (tile order[u // S], split u % S); with ``paired`` a CTA runs units
    # W i .. W i + W - 1, one per compute warpgroup.
    S = cfg.kv_splits
    if cfg.paired:
        u = W * lax.axis_index("i") + (cwg if pick is None else pick)
        tok_off = jnp.int32(0)
    else:
        u = lax.axis_index("i")
        tok_off = cwg * Tw
    i, split = (order_ref[u], jnp.int32(0)) if S == 1 else (order_ref[u // S], lax.rem(u, S))
    bits = _order_index_bits(cfg, NT)
    if bits is not None:  # packed longest-first keys: the tile is the low bits
        i = i & ((1 << bits) - 1)
    ntok, pos0, kv_len = ntok_ref[i], pos0_ref[i], kvlen_ref[i]
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
    if S > 1:  # this split's share of the n tiles: [first, first + n) of the range
        per = (n + S - 1) // S
        first = split * per
        n_split = jnp.clip(n - first, 0, per)
        t_lo, n_full, n = t_lo + first, jnp.clip(n_full - first, 0, n_split), n_split
    return _Tile(
        wg=wg,
        cwg=cwg,
        seq=seq_ref[i],
        ntok=ntok,
        pos0=pos0,
        kv_len=kv_len,
        t_lo=t_lo,
        n=n,
        n_full=n_full,
        last_page=jnp.clip((kv_len + C - 1) // C - 1, 0, bt_ref.shape[1] - 1),
        head_base=base_ref[0] + h * (cfg.num_pages * C),
        q_row=pl.multiple_of(((h * NT + i) * W + cwg) * _ROWS, _ROWS),
        t0=qs_ref[i] + tok_off,
        n_store=jnp.clip(store_ref[i] - tok_off, 0, Tw),
        head0=h * cfg.group,
        tok_off=tok_off,
        split=split,
    )


def _tile_rows(cfg: _Config, t: _Tile, bt_ref, step):
    """Pool rows of the page copies of K/V tile ``step`` (clamped to the sequence's pages)."""
    T, C, r = cfg.block_kv, cfg.page_size, cfg.rows_per_copy
    rows = []
    for j in range(cfg.copies_per_tile):
        tok = (t.t_lo + step) * T + j * r
        page = bt_ref[t.seq, jnp.minimum(tok // C, t.last_page)]
        page = jnp.clip(page, 0, cfg.num_pages - 1)
        rows.append(t.head_base + page * C + tok % C)
    return rows


def _issue(cfg: _Config, src_ref, smem, bar, rows, slot):
    """Page copies of one K (or V) tile into ``smem[slot]``, one arrival on ``bar[slot]`` each."""
    r = cfg.rows_per_copy
    for j, row in enumerate(rows):
        row = pl.multiple_of(row, 8)
        plgpu.copy_gmem_to_smem(
            src_ref.at[pl.ds(row, r)], smem.at[slot, pl.ds(j * r, r)], bar.at[slot]
        )


def _visible(cfg: _Config, t: _Tile, tile_tok, shape):
    """[64, block_kv] mask of the keys each row of this warpgroup's Q tile may see."""
    G, Tw = cfg.group, cfg.tokens_per_wg
    col = tile_tok + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    # Row r is (token r // G, head r % G), or with direct_io (head r // Tw, token r % Tw).
    # Padding rows (token >= ntok) repeat the last real token: never all-masked.
    in_wg = lax.rem(row, jnp.int32(Tw)) if cfg.direct_io else lax.div(row, jnp.int32(G))
    tok = jnp.minimum(t.tok_off + in_wg, t.ntok - 1)
    pos = t.pos0 + tok
    visible = col < t.kv_len
    if cfg.causal:
        visible = visible & (col <= pos)
    if cfg.sliding_window is not None:
        visible = visible & (pos - col < cfg.sliding_window)
    return visible


def _zero_v_tail(cfg: _Config, t: _Tile, v_tile, tile_tok):
    """Zeroes the V rows of the tile past the sequence end (stale or NaN page tails: 0 * NaN
    would poison P @ V). With several warpgroups each zeroes the same rows while the other may
    be reading the tile (its own P @ V): formally a data race (the interpreter's race detector
    flags it), harmless because every write stores the value already there or a zero that the
    first writer already stored; the reader never sees a third value."""

    @pl.when(tile_tok + cfg.block_kv > t.kv_len)
    def _():
        shape = (cfg.block_kv, cfg.head_dim)
        rows = tile_tok + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        vals = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
        v_tile[...] = jnp.where(rows < t.kv_len, vals, jnp.zeros_like(vals))
        plgpu.commit_smem()


def _load_q(cfg: _Config, t: _Tile, q_ref, q_smem, o_smem, bar):
    """Starts the Q tile's TMA: one aligned [64, H] block of the gathered slab, or with
    ``direct_io`` one [Tw, H] box per query head straight from q[T, N, H] into the untiled O
    staging tile (rows past T read as zeros; rows of the next sequence in a partial tile are
    computed and never stored). A tiled destination would need 8-aligned row starts, which
    sequence boundaries do not give; ``_wait_q`` moves the tile into the tiled Q buffer."""
    if not cfg.direct_io:
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(t.q_row, _ROWS)], q_smem, bar)
        return
    Tw = cfg.tokens_per_wg
    for g in range(cfg.group):
        plgpu.copy_gmem_to_smem(
            q_ref.at[pl.ds(t.t0, Tw), t.head0 + g], o_smem.at[pl.ds(g * Tw, Tw)], bar
        )


def _wait_q(cfg: _Config, q_smem, o_smem, bar):
    """Waits for the Q tile; with ``direct_io`` copies it (through registers) from the untiled
    staging tile into the tiled, swizzled wgmma operand. Staging rows past ``G * Tw`` are never
    written: their garbage stays in their own rows, which are computed and never stored."""
    plgpu.barrier_wait(bar)
    if cfg.direct_io:
        q_smem[...] = plgpu.load(o_smem, layout=plgpu.Layout.WGMMA)
        plgpu.commit_smem()


def _finish(cfg: _Config, t: _Tile, acc, m, l, q_smem, o_smem, o_ref, lse_smem, lse_ref):
    """Normalises the accumulator (rows that saw no key give zeros) and stores the O tile.

    With ``direct_io`` the tile goes through an untiled SMEM staging tile straight into
    o[T, N, H]: a whole warpgroup tile as one [Tw, H] box per head, a partial one (a
    sequence's last tile) row by row, so no row of another sequence is overwritten. Without
    split-KV the tiles past
    the real ones write the zero rows of the padding (``n_store``).

    With ``kv_splits`` S > 1 (always ``direct_io``) the output is this split's partial: the
    normalised tile into plane ``split`` of o[S, T, N, H] (``q.dtype``, as FlashInfer's and
    vLLM's merged states) and its base-2 log-sum-exp (-inf where no key was seen) into
    lse[S, T, N, 32] f32, merged by ``_merge_splits``.
    """
    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    out = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(cfg.dtype)
    split = cfg.kv_splits > 1
    if split:
        o_ref = o_ref.at[t.split]
        lse_ref = lse_ref.at[t.split]
        lse = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
        lse_smem[...] = lax.broadcast_in_dim(lse, (_ROWS, _LSE_COLS), [0])
    if not cfg.direct_io:
        q_smem[...] = out  # Q is no longer needed: reuse its tile for O
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[pl.ds(t.q_row, _ROWS)])
        plgpu.wait_smem_to_gmem(0)
        return
    G, Tw = cfg.group, cfg.tokens_per_wg
    o_smem[...] = out
    plgpu.commit_smem()

    def store(src, dst, row, rows):  # rows [g Tw + row, + rows) of each head g
        for g in range(G):
            plgpu.copy_smem_to_gmem(
                src.at[pl.ds(g * Tw + row, rows)], dst.at[pl.ds(t.t0 + row, rows), t.head0 + g]
            )

    @pl.when(t.n_store == Tw)
    def _whole():
        store(o_smem, o_ref, 0, Tw)
        if split:
            store(lse_smem, lse_ref, 0, Tw)

    @pl.when((t.n_store > 0) & (t.n_store < Tw))
    def _partial():
        @pl.loop(0, t.n_store)
        def _(j):
            store(o_smem, o_ref, j, 1)
            if split:
                store(lse_smem, lse_ref, j, 1)

    plgpu.wait_smem_to_gmem(0)


def _init_state(H):
    acc = plgpu.layout_cast(jnp.zeros((_ROWS, H), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    return acc, m, l


def _kernel_body(
    cfg: _Config, q_ref, k_ref, v_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref,
    order_ref, qs_ref, store_ref, o_ref, lse_ref=None,
):  # fmt: skip
    """One CTA: work unit ``i`` (query tile ``order[i // S]``, split ``i % S``) x KV head ``h``,
    ``num_wgs`` warpgroups.

    Warpgroup ``w`` owns rows ``[64 w, 64 (w + 1))`` of the tile (tokens ``[w Tw, (w+1) Tw)``);
    all warpgroups share the K/V ring, which warpgroup 0 refills once every warpgroup has
    consumed a slot (``c_bar``).
    """
    H, W = cfg.head_dim, cfg.num_wgs
    stages, dtype = cfg.num_stages, cfg.dtype
    t = _tile(
        cfg, q_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref, order_ref, qs_ref,
        store_ref,
    )  # fmt: skip
    wg, cwg, n, n_full, t_lo = t.wg, t.cwg, t.n, t.n_full, t.t_lo
    T = cfg.block_kv

    def scoped(q_smem2, k_smem, v_smem, p_smem2, o_smem2, lse_smem2, q_bar, k_bar, v_bar, c_bar):
        q_smem, p_smem = q_smem2.at[cwg], p_smem2.at[cwg]
        o_smem = None if o_smem2 is None else o_smem2.at[cwg]
        lse_smem = None if lse_smem2 is None else lse_smem2.at[cwg]

        def tile_rows(step):
            # Loaded a whole step ahead of the copies so the block-table reads' latency hides
            # behind the current tile's math.
            return _tile_rows(cfg, t, bt_ref, step)

        def issue(rows, slot):
            _issue(cfg, k_ref, k_smem, k_bar, rows, slot)
            _issue(cfg, v_ref, v_smem, v_bar, rows, slot)

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
            _load_q(cfg, t, q_ref, q_smem, o_smem, q_bar.at[cwg])
            if not cfg.producer:
                for s in range(stages):
                    pl.when((s < n) & (wg == 0))(functools.partial(issue, tile_rows(s), s))
            _wait_q(cfg, q_smem, o_smem, q_bar.at[cwg])
            acc, m, l = _init_state(H)

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
                    sc = jnp.where(_visible(cfg, t, tile_tok, sc.shape), sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1))
                if cfg.sliding_window is not None or cfg.kv_splits > 1:
                    # a row may see nothing in its first tiles (window) or a whole split
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
                    _zero_v_tail(cfg, t, v_smem.at[slot], tile_tok)

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
            _finish(cfg, t, acc, m, l, q_smem, o_smem, o_ref, lse_smem, lse_ref)

        if not cfg.producer:
            compute()
            return

        @pl.when(wg == W)
        def _producer():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

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
            plgpu.set_max_registers(_compute_registers(W), action="increase")
            compute()

    tr = _smem_transforms()
    threads = W + int(cfg.producer)
    n_cp = cfg.copies_per_tile
    q_arrivals = cfg.group if cfg.direct_io else 1
    pl.run_scoped(
        scoped,
        plgpu.SMEM((W, _ROWS, H), dtype, transforms=tr),
        plgpu.SMEM((stages, T, H), dtype, transforms=tr),
        plgpu.SMEM((stages, T, H), dtype, transforms=tr),
        plgpu.SMEM((W, _ROWS, T), dtype, transforms=tr),
        plgpu.SMEM((W, _ROWS, H), dtype) if cfg.direct_io else None,
        plgpu.SMEM((W, _ROWS, _LSE_COLS), jnp.float32) if cfg.kv_splits > 1 else None,
        plgpu.Barrier(num_arrivals=q_arrivals, num_barriers=W),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=stages),
        plgpu.Barrier(num_arrivals=W, num_barriers=stages) if threads > 1 else None,
        **({"collective_axes": "wg"} if threads > 1 else {}),
    )


def _kernel_body_fa3(
    cfg: _Config, q_ref, k_ref, v_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref,
    order_ref, qs_ref, store_ref, o_ref, lse_ref=None,
):  # fmt: skip
    """FA3-style CTA: a producer warpgroup issues every K/V page copy; ``num_wgs`` compute
    warpgroups take P as a register wgmma operand and accumulate ``P @ V`` onto the running
    output in place; K and V slots are released separately (K right after ``Q K^T``); with two
    compute warpgroups a schedule barrier alternates their tensor-core phases (ping-pong), so one
    warpgroup's softmax overlaps the other's matmuls. Needs the GPU: the Mosaic GPU interpreter
    cannot run register wgmma operands (``research/mosaic_gpu.md`` section 5).

    With ``paired`` the two compute warpgroups run two different query tiles (decode-heavy
    batches: a tile there is one token, and a second warpgroup on the same K/V would compute
    padding): each has its own K/V ring, and the producer feeds both rings, so one CTA per SM
    keeps two independent K/V streams in flight without a second CTA's registers.
    """
    H, W, T = cfg.head_dim, cfg.num_wgs, cfg.block_kv
    stages, dtype = cfg.num_stages, cfg.dtype
    pingpong = W == 2 and not cfg.paired
    tile_refs = (
        q_ref, bt_ref, seq_ref, ntok_ref, pos0_ref, kvlen_ref, base_ref, order_ref, qs_ref,
        store_ref,
    )  # fmt: skip
    t = _tile(cfg, *tile_refs)
    wg, cwg, n = t.wg, t.cwg, t.n
    # Scores stay unscaled; the scale is folded into exp2's argument (one FMA per score).
    fold = not cfg.logits_soft_cap and cfg.sm_scale > 0
    c = cfg.sm_scale * _LOG2E

    def scoped(
        q_smem2, k_smem, v_smem, o_smem2, lse_smem2, q_bar, k_bar, v_bar, kc_bar, vc_bar,
        sched_bar,
    ):  # fmt: skip
        def sched():  # the other compute warpgroup's matching phase has begun
            plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(sched_bar)

        @pl.when(wg == W)
        def _producer():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
            # The tiles whose rings this warpgroup fills: the CTA's one, or (paired) each
            # compute warpgroup's, ring r in slots [r * stages, (r + 1) * stages).
            tiles = [_tile(cfg, *tile_refs, pick=r) for r in range(W)] if cfg.paired else [t]
            n_max = functools.reduce(jnp.maximum, [tr.n for tr in tiles])

            @pl.loop(0, n_max)
            def _(st):
                slot = lax.rem(st, jnp.int32(stages))
                rows = [_tile_rows(cfg, tr, bt_ref, st) for tr in tiles]
                for src, smem, bar, consumed in ((k_ref, k_smem, k_bar, kc_bar),
                                                 (v_ref, v_smem, v_bar, vc_bar)):  # fmt: skip
                    for r, tr in enumerate(tiles):

                        @pl.when(st < tr.n)
                        def _(r=r, src=src, smem=smem, bar=bar, consumed=consumed):
                            s = slot + r * stages
                            pl.when(st >= stages)(lambda: plgpu.barrier_wait(consumed.at[s]))
                            _issue(cfg, src, smem, bar, rows[r], s)

        @pl.when(wg < W)
        def _compute():
            plgpu.set_max_registers(_compute_registers(W), action="increase")
            q_smem = q_smem2.at[cwg]
            o_smem = None if o_smem2 is None else o_smem2.at[cwg]
            lse_smem = None if lse_smem2 is None else lse_smem2.at[cwg]
            ring = cwg * stages if cfg.paired else 0  # first slot of this warpgroup's ring
            _load_q(cfg, t, q_ref, q_smem, o_smem, q_bar.at[cwg])
            _wait_q(cfg, q_smem, o_smem, q_bar.at[cwg])
            acc, m, l = _init_state(H)
            pl.when(n > 0)(lambda: plgpu.barrier_wait(k_bar.at[ring]))
            if pingpong:
                pl.when(wg == 1)(sched)

            def step(masked: bool, st, carry):
                acc, m, l = carry
                slot = ring + lax.rem(st, jnp.int32(stages))
                tile_tok = (t.t_lo + st) * T

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    if pingpong:
                        sched()
                    return acc_ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((_ROWS, T), jnp.float32))
                plgpu.barrier_arrive(kc_bar.at[slot])
                if cfg.logits_soft_cap:
                    cap = cfg.logits_soft_cap
                    sc = (cap * _LOG2E) * jnp.tanh(sc * (cfg.sm_scale / cap))
                elif not fold:
                    sc = sc * c
                if masked:
                    sc = jnp.where(_visible(cfg, t, tile_tok, sc.shape), sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1) * c if fold else sc.max(axis=1))
                if cfg.sliding_window is not None or cfg.kv_splits > 1:
                    # a row may see nothing in its first tiles (window) or a whole split
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                else:
                    m_use = m_new
                alpha = jnp.exp2(m - m_use)
                m_b = lax.broadcast_in_dim(m_use, sc.shape, [0])
                p = jnp.exp2(sc * c - m_b if fold else sc - m_b)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                # The order of these barriers against the softmax's tail matters for speed
                # (JAX's FA3 example found the same); keep the math above them.
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                if pingpong:
                    plgpu.barrier_arrive(sched_bar)  # softmax done
                plgpu.barrier_wait(v_bar.at[slot])
                if masked:
                    _zero_v_tail(cfg, t, v_smem.at[slot], tile_tok)
                if pingpong:
                    plgpu.barrier_wait(sched_bar)  # the tensor cores are free

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    nxt = st + 1

                    @pl.when(nxt < n)
                    def _():  # overlaps the wgmma in flight
                        plgpu.barrier_wait(k_bar.at[ring + lax.rem(nxt, jnp.int32(stages))])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(vc_bar.at[slot])
                return acc, m_new, l

            carry = lax.fori_loop(0, t.n_full, functools.partial(step, False), (acc, m, l))
            acc, m, l = lax.fori_loop(t.n_full, n, functools.partial(step, True), carry)
            if pingpong:
                pl.when(wg == 0)(sched)
            _finish(cfg, t, acc, m, l, q_smem, o_smem, o_ref, lse_smem, lse_ref)

    tr = _smem_transforms()
    n_cp = cfg.copies_per_tile
    rings, users = (W, 1) if cfg.paired else (1, W)  # K/V rings; warpgroups reading each slot
    pl.run_scoped(
        scoped,
        plgpu.SMEM((W, _ROWS, H), dtype, transforms=tr),
        plgpu.SMEM((rings * stages, T, H), dtype, transforms=tr),
        plgpu.SMEM((rings * stages, T, H), dtype, transforms=tr),
        plgpu.SMEM((W, _ROWS, H), dtype) if cfg.direct_io else None,
        plgpu.SMEM((W, _ROWS, _LSE_COLS), jnp.float32) if cfg.kv_splits > 1 else None,
        plgpu.Barrier(num_arrivals=cfg.group if cfg.direct_io else 1, num_barriers=W),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=rings * stages),
        plgpu.Barrier(num_arrivals=n_cp, num_barriers=rings * stages),
        plgpu.Barrier(num_arrivals=users, num_barriers=rings * stages),
        plgpu.Barrier(num_arrivals=users, num_barriers=rings * stages),
        plgpu.Barrier(num_arrivals=W) if pingpong else None,
        collective_axes="wg",
    )


TILE_ORDERS = ("longest_first", "by_sequence", "index")


def _merge_splits(o_STNH, lse_STNL, num_rows, dtype):
    """Log-sum-exp merge of the splits' partials (base 2; a split that saw no key has weight
    0; a row no split saw gives zeros; ``_split_merge.merge_splits`` over the T x N rows).
    Rows from ``num_rows`` on (padding: no unit wrote them) are zeros."""
    S, T, N, H = o_STNH.shape
    out = merge_splits(o_STNH.reshape(S, T * N, H), lse_STNL[..., 0].reshape(S, T * N), dtype)
    valid = jnp.arange(T, dtype=jnp.int32) < num_rows
    return jnp.where(valid[:, None, None], out.reshape(T, N, H), jnp.zeros((), dtype))


# The longest-first tile order is one single-operand sort of packed int32 keys
# (``_longest_first_order``), so the kernel reads the tile as ``key & (2**bits - 1)``; an order
# of more than ``_ORDER_MAX_LEN`` entries (tiles and the paired sentinel) holds plain indices.
_ORDER_MAX_LEN = 1 << 16


def _order_index_bits(cfg: _Config, length: int) -> int | None:
    """Low bits holding the tile in the order's entries, for an order of ``length`` entries
    (the tiles, plus the paired sentinel where there is one): packed longest-first keys need
    the largest entry, ``length - 1``; None where the entries are plain tile indices (other
    orders, or more than ``_ORDER_MAX_LEN`` entries). Host and kernel both call this on the
    same static length, so they agree on the encoding."""
    if cfg.tile_order != "longest_first" or length > _ORDER_MAX_LEN:
        return None
    return max(1, (length - 1).bit_length())


def _longest_first_order(work_NT, real_NT, bits: int | None) -> jax.Array:
    """Tiles by decreasing ``work``, ties in index order, tiles not ``real`` last: the stable
    ``argsort(-where(real, work, -1))``, as packed keys when ``bits`` (else those indices).

    Keys: ``(top - w) << bits | tile`` with ``w = clip(where(real, work, -1), -1, top)`` and
    ``top = 2**(31 - bits) - 2``, sorted by one single-operand ``lax.sort``; the tile is
    ``key & (2**bits - 1)``. ``(top - w) << bits`` stays below 2**31 (no int32 overflow).
    ``work`` is in tokens: with ``bits = 16`` (2**16 entries) ``top`` is 0x7FFE, 32k tokens;
    with 2**9 entries (decode-heavy batches of ~256 sequences) it is 4M. Work past ``top``
    ties (index order), acceptable for scheduling. The tile takes only the bits the order
    needs, not the decode kernel's fixed 16: work here is in tokens (the old order's key,
    kept exactly), and 15 bits would tie every decode past 32k tokens. Real tiles with work < -1 (only from
    invalid lengths, kv_len < q_len) tie with the empty tiles instead of sorting after them.

    Why: in the decode kernel's profile (H200, seventh session, ncu; ``_longest_first_order``
    in ``pallas_kernels/paged_attention/kernel_gpu.py``) ``jnp.argsort(-x)`` at 256 elements
    was a negate kernel and a two-operand sort, 7.3 us, and a one-operand sort of packed int32
    keys 2.5-4.7 us. Not measured for this kernel.
    """
    if bits is None:
        return jnp.argsort(-jnp.where(real_NT, work_NT, -1)).astype(jnp.int32)
    top = (1 << (31 - bits)) - 2  # largest work kept apart; the empty tiles' key is top + 1
    w = jnp.clip(jnp.where(real_NT, work_NT, -1), -1, top).astype(jnp.int32)
    tile = jnp.arange(work_NT.shape[0], dtype=jnp.int32)
    return lax.sort(((top - w) << bits) | tile)


def _tile_order(
    cfg: _Config, ts: schedule.TileSchedule, B: int, sentinel: bool = False
) -> jax.Array:
    """The order CTAs take the query tiles in (an on-device sort; empty tiles last).

    ``longest_first``: the tiles with the most K/V to visit first (``work``, in tokens), over
    the whole batch (the best tail when tiles are few, as in decode-heavy batches); the
    entries are packed sort keys (``_longest_first_order``: one single-operand sort instead of
    a negate and a two-operand argsort) that the kernel decodes with ``_order_index_bits``.
    ``by_sequence``: sequence by sequence, longest first within each, so the CTAs running at
    once share one sequence's K/V in L2 (long prefills); a lexsort (three fields: sequence,
    work and tile do not fit one int32 key without tying long tiles). ``index``: schedule
    order. ``sentinel``: one more entry, ``NT``, for the paired grid's inert unit (it is
    below ``2**bits``, so it decodes to itself).
    """
    NT = ts.seq.shape[0]
    if cfg.tile_order == "index":
        order = jnp.arange(NT, dtype=jnp.int32)
    else:
        work = jnp.minimum(ts.kv_len, ts.pos0 + ts.q_rows) if cfg.causal else ts.kv_len
        if cfg.sliding_window is not None:  # keys before the first row's window are never read
            work = work - jnp.maximum(ts.pos0 - cfg.sliding_window + 1, 0)
        real = ts.q_rows > 0
        if cfg.tile_order == "longest_first":
            bits = _order_index_bits(cfg, NT + int(sentinel))
            order = _longest_first_order(work, real, bits)
        else:
            order = jnp.lexsort((-work, jnp.where(real, ts.seq, B))).astype(jnp.int32)
    if sentinel:
        order = jnp.concatenate([order, jnp.full((1,), NT, jnp.int32)])
    return order


@functools.partial(jax.jit, static_argnames=("cfg",))
def _ragged_attention(
    cfg: _Config, q_TNH, k_pages, v_pages, block_tables_BW, kv_lens_B, cu_q_lens, num_seqs, layer
):
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
                jax.ShapeDtypeStruct((S, T, N, _LSE_COLS), jnp.float32),
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
        q_KIWRH = jnp.pad(q_KIWRH, ((0, 0), (0, 0), (0, 0), (0, _ROWS - Tw * G), (0, 0)))
        q_in = q_KIWRH.reshape(K * NT * W * _ROWS, H)
        out_type = jax.ShapeDtypeStruct((K * NT * W * _ROWS, H), cfg.dtype)
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
    name = (
        f"ragged_paged_mgpu_wg{W}{'fa3' if cfg.fa3 else 'p' if cfg.producer else ''}"
        f"{'_pair' if cfg.paired else ''}{'_io' if cfg.direct_io else ''}_Tq{Tq}"
        f"{f'_S{cfg.kv_splits}' if cfg.kv_splits > 1 else ''}"
        f"_T{cfg.block_kv}_st{cfg.num_stages}_C{C}_G{G}_H{H}{'_causal' if cfg.causal else ''}"
    )
    body = functools.partial(_kernel_body_fa3 if cfg.fa3 else _kernel_body, cfg)
    body.__name__ = name  # type: ignore[attr-defined]  (names the kernel in profiles)
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(grid_i, K),
        grid_names=("i", "h"),
        num_threads=threads if threads > 1 else None,
        thread_name="wg" if threads > 1 else None,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if cfg.interpret else None,
    )
    seq, q_rows, pos0, kv_len, q_start, store = tile_arrays
    o = kernel(
        q_in, k_RH, v_RH, block_tables_BW.astype(jnp.int32), seq, q_rows, pos0, kv_len, base,
        order, q_start, store,
    )  # fmt: skip
    if cfg.direct_io and S > 1:
        ns = schedule.num_seqs_scalar(num_seqs, cu_q_lens.shape[0] - 1)
        return _merge_splits(*o, cu_q_lens[ns], cfg.dtype)
    if cfg.direct_io:
        return o
    # [K, NT, W, 64, H] -> rows of [NT * Tq, N, H] -> back to the order of q.
    o_KIWRH = o.reshape(K, NT, W, _ROWS, H)[:, :, :, : Tw * G]
    o_rows = o_KIWRH.reshape(K, NT, W, Tw, G, H).transpose(1, 2, 3, 0, 4, 5)
    o_TNH = o_rows.reshape(NT * Tq, N, H)[ts.tile_T * Tq + ts.row_T]
    return jnp.where(tm.valid_T[:, None, None], o_TNH, jnp.zeros((), cfg.dtype))


def make_config(
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
    fa3: bool | None = None,
    direct_io: bool | None = None,
    tile_order: str | None = None,
    paired: bool | None = None,
    kv_splits: int | None = None,
) -> tuple[_Config, Any]:
    """The static configuration ``ragged_paged_attention_pallas_gpu`` runs these arguments
    with (every default resolved, every knob checked) and the layer offset; arguments as
    there. Only shapes and dtypes are read: call it on ``jax.ShapeDtypeStruct`` s to see what
    a batch shape will run (paired warpgroups, split count, tile sizes).

    Args:
      q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs: as in
        ``ragged_paged_attention_pallas_gpu`` (only shapes and dtypes are read).
      sm_scale: logit scale (already resolved).
      causal, logits_soft_cap, sliding_window: as in ``reference``.
      layer: int or i32[] layer index into a 5-D pool (a row offset; nothing is sliced).
      interpret: run in the Mosaic GPU interpreter (``plgpu.InterpretGPUParams()``), any backend.
      block_kv: keys per K/V tile (64 or 128; default ``tuning_gpu.default_block_kv``, which
        depends on ``fa3``).
      num_stages: depth of the TMA ring (default ``tuning_gpu.default_num_stages``).
      num_wgs: compute warpgroups per CTA, 1 or 2 (64 query rows each, sharing one tile's K/V
        ring; with ``paired`` two, one tile each);
        default ``tuning_gpu.default_num_wgs`` (2 for prefill-heavy batches; 1 in interpret
        mode).
      producer: add a warpgroup that only issues the K/V copies (warp specialization);
        compute warpgroups then never wait on the block table or each other.
      fa3: the FA3-style body (``_kernel_body_fa3``: producer warpgroup, P as a register wgmma
        operand accumulated in place, K and V released separately, ping-pong of two compute
        warpgroups). Default ``tuning_gpu.default_fa3(interpret)``; the interpreter cannot run
        it, so ``fa3=True`` with ``interpret=True`` is an error.
      direct_io: read Q and write O by TMA straight from/to ``[T, N, H]`` (one box per query
        head; a sequence's last, partial tile stored row by row; the padding rows zeroed by
        the empty tiles) instead of an XLA gather into tile order before the kernel and a
        gather back after it, which cost 13% of a long prefill. Needs G <= 8, head dim <= 128
        and SMEM room for an untiled O tile per warpgroup (``tuning_gpu.direct_io_supported``).
        Default: on with ``fa3`` where supported.
      tile_order: the order CTAs take the query tiles in, one of ``TILE_ORDERS`` (see
        ``_tile_order``); default ``tuning_gpu.default_tile_order``.
      paired: with ``fa3``, two compute warpgroups per CTA each run their own query tile
        (own K/V ring, one producer feeding both) instead of sharing one tile's K/V. Needs
        ``direct_io``. Default ``tuning_gpu.default_paired``: on for decode-heavy batches
        (``T <= 2 B``); its defaults are ``num_wgs=2``, ``tuning_gpu.paired_block_kv`` and
        ``PAIRED_STAGES`` stages per ring.
      kv_splits: split each query tile's K/V range over this many work units (split-KV;
        each writes a normalised partial and its log-sum-exp, merged by a small XLA epilogue).
        Needs ``direct_io``. Default ``tuning_gpu.default_kv_splits`` (1 in interpret mode):
        more than 1 only when the batch has too few (query tile, KV head) units to fill the
        GPU, as in small decode batches at long context.

    Raises:
      ValueError: if the kernel cannot run these shapes/dtypes or a knob is out of range.
    """
    T, N, H = q.shape
    fa3 = tuning_gpu.default_fa3(interpret) if fa3 is None else bool(fa3)
    if fa3 and interpret:
        raise ValueError(
            "fa3=True cannot run in the Mosaic GPU interpreter (it has no register wgmma "
            "operands); pass fa3=False with interpret=True"
        )
    C = k_pages.shape[-2]
    B = block_tables.shape[0]
    G = N // max(1, k_pages.shape[-4])
    if paired is None:
        paired = (
            fa3
            and num_wgs in (None, 2)
            and direct_io in (None, True)
            and tuning_gpu.default_paired(T, B, G, H)
        )
        if paired:  # and the two rings fit with any tile / depth the caller chose
            bkv = tuning_gpu.paired_block_kv(H, page_size=C) if block_kv is None else block_kv
            st = tuning_gpu.PAIRED_STAGES if num_stages is None else num_stages
            paired = tuning_gpu.direct_io_supported(
                G, H, int(bkv), int(st), 2, True, True, 1 if kv_splits is None else int(kv_splits)
            )
    paired = bool(paired)
    if paired and not fa3:
        raise ValueError(
            "paired=True needs the FA3-style body (fa3=True, not in interpret mode): pass "
            "paired=False or None"
        )
    if block_kv is not None:
        block_kv = int(block_kv)
    elif paired:
        block_kv = tuning_gpu.paired_block_kv(H, page_size=C)
    else:
        block_kv = tuning_gpu.default_block_kv(H, fa3, page_size=C)
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
    if num_wgs is None and paired:
        wgs = 2
    elif num_wgs is None:
        # The interpreter runs each warpgroup as a Python thread whose barrier waits block
        # inside host callbacks; with two of them it was seen to hang (thread starvation) on
        # a 2-core machine, so interpret mode defaults to one warpgroup.
        wgs = 1 if interpret else tuning_gpu.default_num_wgs(T, B)
    else:
        wgs = int(num_wgs)
    if wgs not in (1, 2):
        raise ValueError(f"num_wgs={wgs} must be 1 or 2")
    if paired and wgs != 2:
        raise ValueError(f"paired=True runs two compute warpgroups: num_wgs={wgs} must be 2")
    if num_stages is None:
        stages = (
            tuning_gpu.PAIRED_STAGES
            if paired
            else tuning_gpu.default_num_stages(H, block_kv, wgs, fa3)
        )
    else:
        stages = int(num_stages)
    order = tuning_gpu.default_tile_order(T, B) if tile_order is None else str(tile_order)
    if order not in TILE_ORDERS:
        raise ValueError(f"tile_order={order!r} must be one of {TILE_ORDERS}")
    io_fits = tuning_gpu.direct_io_supported(
        G, H, block_kv, stages, wgs, fa3, paired, 1 if kv_splits is None else int(kv_splits)
    )
    if direct_io is None:
        direct_io = fa3 and io_fits
    if paired and not direct_io:
        raise ValueError(
            "paired=True needs direct_io (Q / O in place), which these arguments do not allow "
            f"(direct_io={direct_io}, G={G}, head_dim={H}, num_stages={stages}, "
            f"block_kv={block_kv}); pass paired=False or None"
        )
    if direct_io and not io_fits:
        raise ValueError(
            f"direct_io=True needs a group size G <= 8 (got G={G}), head_dim <= 128 (got {H}) "
            f"and SMEM for an untiled O tile per warpgroup (num_wgs={wgs}, "
            f"num_stages={stages}, block_kv={block_kv}); pass direct_io=False or None"
        )
    direct_io = bool(direct_io)
    if kv_splits is None:
        block_q = tuning_gpu.tokens_per_tile(G, direct_io) * (1 if paired else wgs)
        num_tiles = schedule.num_tiles_bound(T, B, block_q)
        max_kv = block_tables.shape[1] * C
        splits = (
            tuning_gpu.default_kv_splits(num_tiles, K, max_kv, block_kv, sliding_window, block_q)
            if direct_io and not interpret
            else 1
        )
        if tuning_gpu.smem_bytes(H, block_kv, stages, wgs, fa3, True, paired, splits) > (
            tuning_gpu.SMEM_BYTES
        ):
            splits = 1  # no room for the LSE staging tiles
    else:
        splits = int(kv_splits)
    if not 1 <= splits <= 256:
        raise ValueError(f"kv_splits={splits} must be in [1, 256]")
    if splits > 1 and not direct_io:
        raise ValueError(
            f"kv_splits={splits} needs direct_io (the partials are stored in place); "
            "pass kv_splits=1 or None"
        )
    if stages < 1 or (fa3 and stages < 2):
        raise ValueError(f"num_stages={stages} must be >= {2 if fa3 else 1}")
    smem = tuning_gpu.smem_bytes(H, block_kv, stages, wgs, fa3, direct_io, paired, splits)
    if smem > tuning_gpu.SMEM_BYTES:
        raise ValueError(
            f"this configuration needs {smem} bytes of SMEM, over the "
            f"{tuning_gpu.SMEM_BYTES} a CTA has (num_stages={stages}, block_kv={block_kv}, "
            f"num_wgs={wgs}, paired={paired}, kv_splits={splits}, direct_io={direct_io}): "
            "lower num_stages or block_kv"
        )
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
        producer=bool(producer) or fa3,
        fa3=fa3,
        paired=paired,
        kv_splits=splits,
        direct_io=direct_io,
        tile_order=order,
        interpret=bool(interpret),
    )
    return cfg, layer


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
      **options: ``sm_scale`` (required) and the knobs of ``make_config``, which documents
        them and resolves their defaults.

    Returns:
      [T, N, H] in ``q.dtype``.

    Raises:
      ValueError: if the kernel cannot run these shapes/dtypes or a knob is out of range.
    """
    cfg, layer = make_config(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, **options
    )
    return _ragged_attention(
        cfg, q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, layer
    )
