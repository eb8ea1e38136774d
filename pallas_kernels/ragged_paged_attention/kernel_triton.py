"""Ragged paged attention in Pallas on the Triton backend (prefill, chunked prefill,
multi-token decode, mixed batches) for GPUs without Mosaic GPU's wgmma (Ampere sm80, sm86,
Ada sm89); it runs on Hopper and newer too (how it is tested on an H200).

One program per (KV head, split, query tile). A query tile is ``block_q`` consecutive query
tokens of ONE sequence (``schedule.tile_schedule``, computed on device from ``cu_q_lens``: no
host sync) times the G query heads of one KV head, packed into the ``block_m`` rows of one
Triton dot (row ``m`` is token ``m // G``, head ``m % G``; ``block_q = block_m // G``), so a
KV head's keys are read once for its whole group. Keys are gathered a token row at a time from
the pages (``_triton.token_rows``: any page size), in tiles of ``block_kv``.

Only the key tiles some row can see are visited (causal end, sliding-window start). Tiles that
every row sees whole run without masks; the boundary tiles run masked loads and scores, so
keys past ``kv_len`` (NaN or stale tails, free pages) are never fetched. Online softmax in f32,
base 2. The schedule's spare tiles (``extra_tiles=2``) write the zero padding rows past
``cu_q_lens[num_seqs]``.

Quantized pages (fp8, int8 with f32 ``k_scale`` / ``v_scale``, ``pallas_kernels._triton_quant``)
are loaded as stored, one byte an element, and converted in registers to the query's dtype;
key scales multiply the scores' columns, value scales P's columns (per head: the output).

Split-KV (``num_splits`` > 1, the default when (tile, KV head) programs are too few to fill
the GPU: a few long chunks, decode batches at long context) cuts each tile's key range into
contiguous parts; each stores its normalised partial and base-2 log-sum-exp per tile row, and
XLA merges them (``_gpu.merge.merge_splits``) and gathers the rows back into ``[T, N, H]``.
Prefill-like batches take their tiles longest first (``_tile_order``, one small XLA sort).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _triton, _triton_quant
from pallas_kernels._gpu.merge import merge_splits
from pallas_kernels.ragged_paged_attention import schedule, validate

MAX_SPLITS = 32


def default_block_m(num_tokens: int, num_seqs: int, group: int, head_dim: int, dtype) -> int:
    """Rows of a program's dot: decode-like batches (``T <= 2 B``) the group rounded up to a
    power of two (>= 16); prefill 128 (64 at head dim 256 or f32), at least the group."""
    floor = _triton.pow2_at_least(group, 16)
    if num_tokens <= 2 * num_seqs:
        return floor
    big = 64 if head_dim >= 256 or jnp.dtype(dtype) == jnp.float32 else 128
    return max(floor, big)


def default_block_kv(block_m: int, head_dim: int, dtype) -> int:
    """Keys per tile: 64 for prefill-sized tiles (32 at head dim 256 or f32), else the decode
    kernel's 8192 / H."""
    if block_m >= 64:
        return 32 if head_dim >= 256 or jnp.dtype(dtype) == jnp.float32 else 64
    t = min(128, max(32, 8192 // head_dim))
    return t // 2 if jnp.dtype(dtype) == jnp.float32 else t


def default_num_splits(num_programs: int, max_tokens: int, block_kv: int) -> int:
    """About 4 programs an SM: splits only where (tile, KV head) programs are fewer, >= 4 key
    tiles a split, at most ``MAX_SPLITS``; ``num_programs`` is a static bound, so a batch
    whose tile bound is high never splits."""
    target = 4 * _backend.gpu_num_sms()
    max_tiles = -(-max_tokens // block_kv)
    return max(1, min(-(-target // max(num_programs, 1)), max_tiles // 4, MAX_SPLITS))


@dataclasses.dataclass(frozen=True)
class TritonRaggedConfig:
    """One kernel instance (hashable: a jit static argument).

    Attributes:
      num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim: T, B, N, K, H.
      num_pages, page_size, width: P, C, W.
      block_m: rows of a program's dot; block_q = block_m // G query tokens.
      block_kv: keys per tile.
      num_tiles: NT, the static bound on query tiles (schedule) plus 2 spare tiles.
      num_splits: S.
      num_warps, num_stages: Triton's compile options.
      sm_scale, causal, soft_cap, window: the attention options.
      interpret: Pallas's interpreter.
      kv_dtype: the pages' dtype name when quantized (fp8, int8), else None.
      k_scales, v_scales: the scales' modes (``_triton_quant.MODES``) when quantized.
    """

    num_tokens: int
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    width: int
    block_m: int
    block_kv: int
    num_tiles: int
    num_splits: int
    num_warps: int
    num_stages: int
    sm_scale: float
    causal: bool
    soft_cap: float | None
    window: int | None
    interpret: bool
    kv_dtype: str | None = None
    k_scales: str | None = None
    v_scales: str | None = None

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def block_q(self) -> int:
        return self.block_m // self.group


def unsupported_reason(
    q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, **kwargs
) -> str | None:
    """Why the kernel cannot run these arguments (None if it can): no GPU backend, no Pallas
    Triton backend in this JAX, dtypes differ or are not bf16/f16/f32 (or quantized pages with
    their scales; float8_e4m3fn needs sm89+), head dim not a power of two in 16..256 (f32: up
    to 128), a group of more than 128 query heads."""
    del block_tables, kv_lens, cu_q_lens, num_seqs
    scales = (kwargs.get("k_scale"), kwargs.get("v_scale"))
    return _triton.platform_reason(k_pages) or _reason(q, k_pages, v_pages, *scales)


def _reason(q, k_pages, v_pages, k_scale=None, v_scale=None) -> str | None:
    reason = _triton.common_reason(q, k_pages, v_pages, k_scale, v_scale)
    if reason is None and q.shape[1] // k_pages.shape[-4] > 128:
        reason = f"group {q.shape[1] // k_pages.shape[-4]} > 128 query heads per KV head"
    return reason


def _int_knob(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} must be an int in [{lo}, {hi}]")
    return value


def _pow2_knob(name, value, lo, hi):
    _int_knob(name, value, lo, hi)
    if value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two (Triton tile sizes)")
    return value


def make_config(
    q, k_pages, block_tables, *, sm_scale, causal=True, logits_soft_cap=None,
    sliding_window=None, interpret=False, block_m=None, block_kv=None, num_splits=None,
    num_warps=None, num_stages=None, k_scale=None, v_scale=None,
) -> TritonRaggedConfig:  # fmt: skip
    """Every option resolved from static shapes and checked, in one place.

    Raises:
      ValueError: a knob out of range, naming it and the expected value.
    """
    T, N, H = q.shape
    K, P, C, _ = k_pages.shape[-4:]
    B, W = block_tables.shape
    G = N // K
    dt = q.dtype
    block_m = default_block_m(T, B, G, H, dt) if block_m is None else block_m
    _pow2_knob("block_m", block_m, max(16, _triton.pow2_at_least(G, 16)), 256)
    block_kv = default_block_kv(block_m, H, dt) if block_kv is None else block_kv
    _pow2_knob("block_kv", block_kv, 16, 256)
    NT = schedule.num_tiles_bound(T, B, block_m // G) + 2
    if num_splits is None:
        num_splits = default_num_splits(NT * K, W * C, block_kv)
    _int_knob("num_splits", num_splits, 1, 256)
    if num_warps is None:  # 8 warps: 7.33 ms at 8k prefill on the H200, 4: 5.32 (CUPTI)
        num_warps = 4
    _int_knob("num_warps", num_warps, 1, 16)
    if num_stages is None:
        num_stages = _triton.default_num_stages(block_kv, H, k_pages.dtype)
    _int_knob("num_stages", num_stages, 1, 8)
    opts = validate.static_options(
        sm_scale=sm_scale, causal=causal, logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
    )  # fmt: skip
    return TritonRaggedConfig(
        num_tokens=T, num_seqs=B, num_q_heads=N, num_kv_heads=K, head_dim=H, num_pages=P,
        page_size=C, width=W, block_m=block_m, block_kv=block_kv, num_tiles=NT,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        sm_scale=opts["sm_scale"], causal=opts["causal"], soft_cap=opts["logits_soft_cap"],
        window=opts["sliding_window"], interpret=bool(interpret),
        **_triton_quant.config_fields(k_pages, k_scale, v_scale),
    )  # fmt: skip


def _key_ranges(cfg: TritonRaggedConfig, pos0, q_rows, kv_len):
    """(first, a, b, end) tiles of a query tile's keys: [first, end) holds every key some row
    sees, [a, b) the tiles every row sees whole (run unmasked)."""
    T = cfg.block_kv
    live = q_rows > 0
    last = pos0 + q_rows - 1
    hi = jnp.minimum(kv_len, last + 1) if cfg.causal else kv_len
    hi = jnp.where(live, hi, 0)
    hi_all = jnp.minimum(kv_len, pos0 + 1) if cfg.causal else kv_len
    if cfg.window is None:
        lo, lo_all = jnp.int32(0), jnp.int32(0)
    else:
        lo = jnp.maximum(pos0 - cfg.window + 1, 0)
        lo_all = jnp.maximum(last - cfg.window + 1, 0)
    first = jnp.minimum(lo // T, (hi + T - 1) // T)
    end = (hi + T - 1) // T
    a = jnp.clip((lo_all + T - 1) // T, first, end)
    b = jnp.clip(hi_all // T, a, end)
    return first, a, b, end


def _kernel(cfg: TritonRaggedConfig, q_ref, k_ref, v_ref, tab_ref, layer_ref, order_ref,
            seq_ref, qstart_ref, qrows_ref, pos0_ref, kvlen_ref, pad_ref, *refs):  # fmt: skip
    """One (KV head, split, query tile) program (module docstring); ``refs``: the flat key and
    value scales and their bases (quantized pages), then the outputs."""
    quantized = cfg.kv_dtype is not None
    ks_ref, vs_ref, sbase_ref = refs[:3] if quantized else (None, None, None)
    outs = refs[3:] if quantized else refs
    h, split = pl.program_id(0), pl.program_id(1)
    i = order_ref[pl.program_id(2)]
    K, G, H, T, M = cfg.num_kv_heads, cfg.group, cfg.head_dim, cfg.block_kv, cfg.block_m
    seq, q_start, q_rows = seq_ref[i], qstart_ref[i], qrows_ref[i]
    pos0, kv_len = pos0_ref[i], kvlen_ref[i]
    m = jnp.arange(M, dtype=jnp.int32)
    tok, g = m // G, m % G
    cols = jnp.arange(H, dtype=jnp.int32)
    q_tok = q_start + jnp.minimum(tok, jnp.maximum(q_rows - 1, 0))
    q_idx = q_tok * cfg.num_q_heads + h * G + g
    q = q_ref[q_idx[:, None], cols[None, :]]
    pos_m = pos0 + tok
    head_base = (layer_ref[0] * K + h) * cfg.num_pages
    offs = jnp.arange(T, dtype=jnp.int32)

    def factor(mode, ref, which, page_T, pos, valid):
        return _triton_quant.factor(
            mode, ref, sbase_ref[which], h, page_T, pos, num_pages=cfg.num_pages,
            page_size=cfg.page_size, valid=valid,
        )  # fmt: skip

    def load(page_T, pos, valid):
        """The tile's K and V (in q's dtype) and the per-key factors (quantized pages)."""
        rows = _triton.token_rows(page_T, pos, page_size=cfg.page_size, head_base=head_base)
        if valid is None:
            k, v = k_ref[rows[:, None], cols[None, :]], v_ref[rows[:, None], cols[None, :]]
        else:
            k = _triton.load_rows(k_ref, rows, cols, valid)
            v = _triton.load_rows(v_ref, rows, cols, valid)
        if not quantized:
            return k, v, None, None
        k = _triton_quant.dequantize(k, cfg.kv_dtype, q.dtype)
        v = _triton_quant.dequantize(v, cfg.kv_dtype, q.dtype)
        kf = factor(cfg.k_scales, ks_ref, 0, page_T, pos, valid)
        vf = None if cfg.v_scales == "head" else factor(cfg.v_scales, vs_ref, 1, page_T, pos, valid)
        return k, v, kf, vf

    def step(masked):
        def body(t, carry):
            pos = t * T + offs
            page_T = _triton.token_pages(
                tab_ref, seq, pos, page_size=cfg.page_size, width=cfg.width,
                num_pages=cfg.num_pages,
            )  # fmt: skip
            if not masked:
                k, v, kf, vf = load(page_T, pos, None)
                s = _triton.scores(q, k, sm_scale=cfg.sm_scale, soft_cap=cfg.soft_cap, k_factor=kf)
                return _triton.softmax_step(carry, s, v, None, v_factor=vf)
            in_len = pos < kv_len
            k, v, kf, vf = load(page_T, pos, in_len)
            s = _triton.scores(q, k, sm_scale=cfg.sm_scale, soft_cap=cfg.soft_cap, k_factor=kf)
            visible = in_len[None, :]
            if cfg.causal:
                visible = visible & (pos[None, :] <= pos_m[:, None])
            if cfg.window is not None:
                visible = visible & (pos_m[:, None] - pos[None, :] < cfg.window)
            return _triton.softmax_step(carry, s, v, visible, v_factor=vf)

        return body

    first, a, b, end = _key_ranges(cfg, pos0, q_rows, kv_len)
    per = (end - first + cfg.num_splits - 1) // cfg.num_splits
    u0 = first + split * per
    u1 = jnp.minimum(u0 + per, end)
    carry = (
        jnp.full((M,), -jnp.inf, jnp.float32),
        jnp.zeros((M,), jnp.float32),
        jnp.zeros((M, H), jnp.float32),
    )
    a_, b_ = jnp.clip(a, u0, u1), jnp.clip(b, u0, u1)
    carry = jax.lax.fori_loop(u0, a_, step(True), carry)
    carry = jax.lax.fori_loop(a_, b_, step(False), carry)
    carry = jax.lax.fori_loop(b_, u1, step(True), carry)
    o, lse = _triton.finish(carry)
    if quantized and cfg.v_scales == "head":  # one value scale for the whole KV head
        o = o * factor("head", vs_ref, 1, None, None, None)
    plt = _triton.triton_module()
    if cfg.num_splits > 1:  # [S, NT, K, M] partials, merged and gathered by XLA
        o_ref, lse_ref = outs
        blk = ((split * cfg.num_tiles + i) * K + h) * M + m
        plt.store(o_ref.at[blk[:, None], cols[None, :]], o)
        plt.store(lse_ref.at[blk], lse)
        return
    (o_ref,) = outs
    # A real tile stores its rows; a spare tile (q_rows == 0) zeros a chunk of padding rows.
    live = q_rows > 0
    base = jnp.where(live, q_start, pad_ref[i])
    count = jnp.where(live, q_rows, jnp.clip(cfg.num_tokens - base, 0, cfg.block_q))
    ok = (tok < count) & (m < cfg.block_q * G)
    out_idx = (base + tok) * cfg.num_q_heads + h * G + g
    if cfg.interpret:  # the interpreter's store writes masked rows too: give them spare rows
        out_idx = jnp.where(ok, out_idx, cfg.num_tokens * cfg.num_q_heads + m)
    plt.store(o_ref.at[out_idx[:, None], cols[None, :]], o.astype(o_ref.dtype), mask=ok[:, None])


def _tile_order(cfg: TritonRaggedConfig, ts: schedule.TileSchedule) -> jax.Array:
    """i32[NT]: the tile each program takes. Prefill-like batches (``T > 2 B``) go longest
    first (key tiles visited, descending: a causal prompt's last tiles do the most work, and
    the GPU hands out programs in grid order, so the last wave holds the shortest); other
    batches in schedule order (no sort to pay for)."""
    NT = cfg.num_tiles
    if cfg.num_tokens <= 2 * cfg.num_seqs:
        return jnp.arange(NT, dtype=jnp.int32)
    first, _, _, end = _key_ranges(cfg, ts.pos0, ts.q_rows, ts.kv_len)
    return jnp.argsort(first - end, stable=True).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _ragged(cfg: TritonRaggedConfig, q, k_pages, v_pages, tables, kv_lens, cu_q_lens, num_seqs,
            layer, k_scale=None, v_scale=None):  # fmt: skip
    Tn, N, H = q.shape
    K, M, S, NT = cfg.num_kv_heads, cfg.block_m, cfg.num_splits, cfg.num_tiles
    ts = schedule.tile_schedule(
        kv_lens, cu_q_lens, num_seqs, num_tokens=Tn, block_q=cfg.block_q, extra_tiles=2,
        token_rows=S > 1,
    )  # fmt: skip
    scales = []
    if cfg.kv_dtype is not None:  # the flat scales and their bases; fp8 pools seen as uint8
        modes = (cfg.k_scales, cfg.v_scales)
        scales = _triton_quant.flat_scales(modes, k_pages, layer, k_scale, v_scale)
        k_pages, v_pages = _triton_quant.pool_view(k_pages), _triton_quant.pool_view(v_pages)
    k_rows, layer = _triton.flat_rows(k_pages, layer)
    v_rows, _ = _triton.flat_rows(v_pages, None)
    order = _tile_order(cfg, ts)
    if S > 1:
        out_shape = (
            jax.ShapeDtypeStruct((S * NT * K * M, H), jnp.float32),
            jax.ShapeDtypeStruct((S * NT * K * M,), jnp.float32),
        )
    else:
        spare = M if cfg.interpret else 0
        out_shape = jax.ShapeDtypeStruct((Tn * N + spare, H), q.dtype)
    plt = _triton.triton_module()
    name = (
        f"ragged_paged_triton_M{M}_T{cfg.block_kv}_S{S}_C{cfg.page_size}_G{cfg.group}_H{H}"
        f"_w{cfg.num_warps}_st{cfg.num_stages}" + ("_causal" if cfg.causal else "")
    )
    if cfg.kv_dtype is not None:
        name += f"_{cfg.kv_dtype}_k{cfg.k_scales[0]}v{cfg.v_scales[0]}"
    with _triton.quiet_deprecation():
        out = pl.pallas_call(
            functools.partial(_kernel, cfg),
            grid=(K, S, NT),
            out_shape=out_shape,
            compiler_params=plt.CompilerParams(
                num_warps=cfg.num_warps, num_stages=cfg.num_stages
            ),
            interpret=cfg.interpret,
            name=name,
        )(
            q.reshape(Tn * N, H), k_rows, v_rows, tables.astype(jnp.int32), layer, order, ts.seq,
            ts.q_start, ts.q_rows, ts.pos0, ts.kv_len, ts.pad_start, *scales,
        )  # fmt: skip
    if S == 1:
        return out[: Tn * N].reshape(Tn, N, H)
    o, lse = out
    G = cfg.group
    merged = merge_splits(o.reshape(S, NT * K * M, H), lse.reshape(S, NT * K * M), q.dtype)
    # Row m = token * G + head of a tile: token t of the batch is row_T[t] of tile tile_T[t].
    rows = merged.reshape(NT, K, M, H)[:, :, : cfg.block_q * G].reshape(NT, K, cfg.block_q, G, H)
    o_TNH = rows[ts.tile_T, :, ts.row_T].reshape(Tn, N, H)
    tm = schedule.token_map(kv_lens, cu_q_lens, num_seqs, Tn)
    return jnp.where(tm.valid_T[:, None, None], o_TNH, jnp.zeros((), q.dtype))


def ragged_paged_attention_pallas_triton(
    q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *, sm_scale: float,
    causal: bool = True, logits_soft_cap: float | None = None,
    sliding_window: int | None = None, layer=None, k_scale=None, v_scale=None,
    interpret: bool = False, **knobs,
) -> jax.Array:  # fmt: skip
    """Ragged paged attention with the Pallas-Triton kernel; semantics of ``reference``.

    Args:
      q: [T, N, H] bf16, f16 or f32 (the pages' dtype, or any of them with quantized pages);
        the rows of sequence b are ``q[cu_q_lens[b]:cu_q_lens[b+1]]``.
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``; or quantized
        (``float8_e4m3fn`` on sm89+, ``float8_e5m2``, ``int8``) with ``k_scale``/``v_scale``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W].
      kv_lens: i32[B] keys per sequence, the new query tokens included.
      cu_q_lens: i32[B + 1].
      num_seqs: i32[] or i32[1]; rows from ``cu_q_lens[num_seqs]`` on are zeros.
      sm_scale, causal, logits_soft_cap, sliding_window: as in ``reference``.
      layer: int or i32[] into a 5-D pool.
      k_scale: quantized pages: f32 broadcastable to [K, P, C] ([L or 1, K, P, C] with a 5-D
        pool), as in ``paged_attention.kernel_triton``.
      v_scale: like ``k_scale``, for ``v_pages``.
      interpret: run in Pallas's interpreter (any backend, tiny shapes).
      **knobs: ``block_m`` (rows of a program's dot), ``block_kv`` (keys per tile),
        ``num_splits``, ``num_warps``, ``num_stages``; None or absent: ``make_config``'s.

    Returns:
      [T, N, H] in ``q.dtype``.

    Raises:
      ValueError: if the kernel cannot run these arguments or a knob is out of range.
    """
    reason = _reason(q, k_pages, v_pages, k_scale, v_scale)
    if reason is None and not interpret:
        reason = _triton.platform_reason(k_pages)
    if reason is not None:
        raise ValueError(f"pallas_triton cannot run this call: {reason}")
    cfg = make_config(
        q, k_pages, block_tables, sm_scale=sm_scale, causal=causal,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, interpret=interpret,
        k_scale=k_scale, v_scale=v_scale, **knobs,
    )  # fmt: skip
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    with _triton.quiet_deprecation():  # lowered here when called outside a jit
        return _ragged(
            cfg, q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, layer,
            k_scale, v_scale,
        )  # fmt: skip
