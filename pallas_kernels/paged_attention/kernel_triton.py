"""Paged decode attention in Pallas on the Triton backend: the kernel for GPUs without Mosaic
GPU's wgmma or tcgen05 (Ampere sm80 A100, sm86 A10 / RTX 30xx, Ada sm89 L4 / RTX 40xx), which
also runs on Hopper and newer (how it is tested on an H200).

One program per (KV head x head block, split, sequence): it loads the G query heads of its KV
head once as a ``[rows, H]`` tile (``rows`` a power of two >= 16, the Triton dot's smallest M;
rows past G repeat the last head and are not stored) and walks its sequence's keys in tiles of
``block_kv`` tokens, so every K/V byte is read once per KV head (per 64 heads of a group).
A tile's tokens are gathered row by row: token ``t`` lives in page ``table[b, t // C]`` at
offset ``t % C``, so any page size works, a tile holding ``block_kv / C`` pages or part of one.
Loads past the sequence end (or before the window) are masked: never fetched, read as zeros,
so NaN or stale page tails and free pages never reach the output. Scores and the online softmax
are f32 in base 2 (``log2(e)`` folded into the scale); Triton pipelines the tile loads over
``num_stages`` stages (cp.async on sm80+).

A sliding window starts each sequence at the tile holding its first visible key: tiles before
it are never read. Quantized pages (fp8, int8 with f32 ``k_scale`` / ``v_scale``, ``pallas_kernels._triton_quant``)
are loaded as stored, one byte an element, and converted in registers to the query's dtype;
key scales multiply the scores' columns, value scales P's columns (per head: the output).

Split-KV (``num_splits`` > 1, the default when (sequence, KV head) pairs
are too few to fill the GPU: small batches at long context) cuts each sequence's tiles into
that many contiguous ranges; each program writes its normalised partial and base-2
log-sum-exp, merged by ``pallas_kernels._gpu.merge.merge_splits`` (XLA).

The defaults come from static shapes only (no host sync): ``default_block_kv``,
``default_num_splits``, ``default_num_warps``, ``default_num_stages`` (``TUNING``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _triton, _triton_quant
from pallas_kernels._gpu.merge import merge_splits
from pallas_kernels._gpu.tuning import Measured

# Most query heads of one group a program holds (rows of its Q tile); larger groups are cut
# into head blocks, each reading the group's K/V once.
MAX_GROUP_ROWS = 64
MAX_SPLITS = 64

# Measured on the H200 (CUPTI, quick-table rows; benchmarks/results/triton_sweep_h200.json,
# benchmarks/diagnostics/triton_sweep.py). Unmeasured on sm80-sm89.
TUNING: dict[str, Measured] = {
    "default_block_kv": Measured(
        knob="block_kv",
        rule="128 keys at H <= 128 (64 at H=128 with more than 8 splits or on 100 KiB-SMEM "
        "parts), 32 at H=256; f32: half",
        evidence="B=128 / 2k: 250.4 us at 128 vs 262.7 at 64; B=32 / 2k: 73.6 vs 78.9; "
        "B=1 / 32k (64 splits): 57.5 vs 50.8; H=64: 128 (78.7) vs 32 (87.4)",
        date="2026-12-05",
        commit="(branch h-triton)",
    ),
    "default_num_splits": Measured(
        knob="num_splits",
        rule="ceil(2 * SMs / (B * K * head blocks)), >= 4 tiles a split, <= 64",
        evidence="256 pairs: 2 splits 73.2 us, 3 78.9, 1 89.1; 512 pairs (H=64): 1 split "
        "72.9, 2 79.1; 1024 pairs: 1 264.0, 2 253.2; B=1 / 32k: 64 splits 50.8, 1 1007.6",
        date="2026-12-05",
        commit="(branch h-triton)",
    ),
    "default_num_warps": Measured(
        knob="num_warps",
        rule="4",
        evidence="8 warps 8-26% slower on all four rows; 2 within 3% of 4",
        date="2026-12-05",
        commit="(branch h-triton)",
    ),
}


def default_block_kv(head_dim: int, dtype, num_splits: int = 1) -> int:
    """Tokens per K/V tile (``TUNING["default_block_kv"]``)."""
    t = 128 if head_dim <= 128 else 32
    if head_dim == 128 and (num_splits > 8 or _triton.smem_budget() < 2 * 2 * 128 * 128 * 2):
        t = 64  # (or where two stages of 128-key bf16 tiles do not fit: sm86/sm89's 100 KiB)
    return t // 2 if jnp.dtype(dtype) == jnp.float32 else t


def default_num_splits(num_programs: int, max_tokens: int, block_kv: int) -> int:
    """Split-KV factor from static shapes (``TUNING["default_num_splits"]``); ``num_programs``:
    (sequence, KV head, head block) triples; ``max_tokens``: the table's width x page size."""
    target = 2 * _backend.gpu_num_sms()
    max_tiles = -(-max_tokens // block_kv)
    return max(1, min(-(-target // max(num_programs, 1)), max_tiles // 4, MAX_SPLITS))


def default_num_warps(group_rows: int, head_dim: int) -> int:
    """4 warps (``TUNING["default_num_warps"]``), 8 for the largest Q tiles (64 x 256)."""
    return 8 if group_rows * head_dim >= 64 * 256 else 4


@dataclasses.dataclass(frozen=True)
class TritonDecodeConfig:
    """One kernel instance (hashable: a jit static argument).

    Attributes:
      num_seqs, num_q_heads, num_kv_heads, head_dim: B, N, K, H.
      num_pages, page_size, width: P, C, W.
      group_rows: rows of the Q tile (a power of two >= 16, <= 64).
      head_blocks: ceil(G / group_rows) programs share a KV head's group.
      block_kv: tokens per K/V tile.
      num_splits: S, programs each sequence's tiles are split over.
      num_warps, num_stages: Triton's compile options.
      sm_scale, soft_cap, window: the attention options.
      interpret: run in Pallas's interpreter (any backend).
      kv_dtype: the pages' dtype name when quantized (fp8, int8), else None.
      k_scales, v_scales: the scales' modes (``_triton_quant.MODES``) when quantized.
    """

    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    width: int
    group_rows: int
    head_blocks: int
    block_kv: int
    num_splits: int
    num_warps: int
    num_stages: int
    sm_scale: float
    soft_cap: float | None
    window: int | None
    interpret: bool
    kv_dtype: str | None = None
    k_scales: str | None = None
    v_scales: str | None = None

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def unsupported_reason(q, k_pages, v_pages, block_tables, lengths, **kwargs) -> str | None:
    """Why the kernel cannot run these arguments (None if it can): no GPU backend, this JAX
    has no Pallas Triton backend, dtypes differ or are not bf16/f16/f32 (or quantized pages
    with their scales; float8_e4m3fn needs sm89+), head dim not a power of two in 16..256
    (f32: up to 128). Any page size, group size and table width run."""
    del block_tables, lengths
    scales = (kwargs.get("k_scale"), kwargs.get("v_scale"))
    return _triton.platform_reason(k_pages) or _triton.common_reason(q, k_pages, v_pages, *scales)


def _int_knob(name, value, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}={value!r} must be an int >= {lo}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}={value!r} must be <= {hi}")
    return value


def make_config(
    q, k_pages, block_tables, *, sm_scale, logits_soft_cap=None, sliding_window=None,
    interpret=False, block_kv=None, num_splits=None, num_warps=None, num_stages=None,
    k_scale=None, v_scale=None,
) -> TritonDecodeConfig:  # fmt: skip
    """Every option resolved (defaults from static shapes) and checked in one place.

    Raises:
      ValueError: a knob out of range (naming it and the expected value).
    """
    B, N, H = q.shape
    K, P, C, _ = k_pages.shape[-4:]
    W = block_tables.shape[1]
    G = N // K
    rows = min(MAX_GROUP_ROWS, _triton.pow2_at_least(G, 16))
    head_blocks = -(-G // rows)
    if num_splits is None:  # from the tile the splits' default would see (64 keys at H=128)
        tile = block_kv or default_block_kv(H, q.dtype, num_splits=MAX_SPLITS)
        num_splits = default_num_splits(B * K * head_blocks, W * C, tile)
    if block_kv is None:
        block_kv = default_block_kv(H, q.dtype, num_splits)
    _int_knob("block_kv", block_kv, 16, 256)
    if block_kv & (block_kv - 1):
        raise ValueError(f"block_kv={block_kv} must be a power of two (Triton tile sizes)")
    _int_knob("num_splits", num_splits, 1, 1024)
    num_warps = _int_knob(
        "num_warps", default_num_warps(rows, H) if num_warps is None else num_warps, 1, 16
    )
    if num_stages is None:
        num_stages = _triton.default_num_stages(block_kv, H, k_pages.dtype)
    _int_knob("num_stages", num_stages, 1, 8)
    return TritonDecodeConfig(
        num_seqs=B, num_q_heads=N, num_kv_heads=K, head_dim=H, num_pages=P, page_size=C,
        width=W, group_rows=rows, head_blocks=head_blocks, block_kv=block_kv,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        sm_scale=float(sm_scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret), **_triton_quant.config_fields(k_pages, k_scale, v_scale),
    )  # fmt: skip


def _kernel(cfg: TritonDecodeConfig, q_ref, k_ref, v_ref, tab_ref, len_ref, layer_ref, *refs):
    """One (KV head x head block, split, sequence) program (module docstring); ``refs``: the
    flat key and value scales and their bases (quantized pages), then the outputs."""
    quantized = cfg.kv_dtype is not None
    ks_ref, vs_ref, sbase_ref = refs[:3] if quantized else (None, None, None)
    outs = refs[3:] if quantized else refs
    hx, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    K, G, H, T = cfg.num_kv_heads, cfg.group, cfg.head_dim, cfg.block_kv
    kvh, hb = hx // cfg.head_blocks, hx % cfg.head_blocks
    n = jnp.clip(len_ref[b], 0, cfg.width * cfg.page_size)
    lo = jnp.maximum(n - cfg.window, 0) if cfg.window is not None else jnp.int32(0)
    first, end = lo // T, (n + T - 1) // T
    per = (end - first + cfg.num_splits - 1) // cfg.num_splits
    t0 = first + split * per
    t1 = jnp.minimum(t0 + per, end)

    cols = jnp.arange(H, dtype=jnp.int32)
    g = hb * cfg.group_rows + jnp.arange(cfg.group_rows, dtype=jnp.int32)
    row_ok = g < G
    q_rows = b * cfg.num_q_heads + kvh * G + jnp.minimum(g, G - 1)
    q = q_ref[q_rows[:, None], cols[None, :]]
    head_base = (layer_ref[0] * K + kvh) * cfg.num_pages
    offs = jnp.arange(T, dtype=jnp.int32)

    def factor(mode, ref, which, page_T, pos, visible):
        return _triton_quant.factor(
            mode, ref, sbase_ref[which], kvh, page_T, pos, num_pages=cfg.num_pages,
            page_size=cfg.page_size, valid=visible,
        )  # fmt: skip

    def body(t, carry):
        pos = t * T + offs
        page_T = _triton.token_pages(
            tab_ref, b, pos, page_size=cfg.page_size, width=cfg.width, num_pages=cfg.num_pages
        )
        rows = _triton.token_rows(page_T, pos, page_size=cfg.page_size, head_base=head_base)
        visible = (pos < n) & (pos >= lo)
        k = _triton.load_rows(k_ref, rows, cols, visible)
        v = _triton.load_rows(v_ref, rows, cols, visible)
        kf = vf = None
        if quantized:  # codes -> q's dtype; scales on the scores and on P (module docstring)
            k = _triton_quant.dequantize(k, cfg.kv_dtype, q.dtype)
            v = _triton_quant.dequantize(v, cfg.kv_dtype, q.dtype)
            kf = factor(cfg.k_scales, ks_ref, 0, page_T, pos, visible)
            if cfg.v_scales != "head":
                vf = factor(cfg.v_scales, vs_ref, 1, page_T, pos, visible)
        s = _triton.scores(q, k, sm_scale=cfg.sm_scale, soft_cap=cfg.soft_cap, k_factor=kf)
        return _triton.softmax_step(carry, s, v, visible[None, :], v_factor=vf)

    M = cfg.group_rows
    init = (
        jnp.full((M,), -jnp.inf, jnp.float32),
        jnp.zeros((M,), jnp.float32),
        jnp.zeros((M, H), jnp.float32),
    )
    o, lse = _triton.finish(jax.lax.fori_loop(t0, t1, body, init))
    if quantized and cfg.v_scales == "head":  # one value scale for the whole KV head
        o = o * factor("head", vs_ref, 1, None, None, None)
    plt = _triton.triton_module()
    R = cfg.num_seqs * cfg.num_q_heads
    if cfg.interpret:  # rows past G go to spare rows (module docstring: ``_spare_rows``)
        q_rows = jnp.where(row_ok, q_rows, R + g % cfg.group_rows)
    if cfg.num_splits == 1:
        (o_ref,) = outs
        dst = o_ref.at[q_rows[:, None], cols[None, :]]
        plt.store(dst, o.astype(o_ref.dtype), mask=row_ok[:, None])
        return
    o_ref, lse_ref = outs
    out_rows = split * (R + _spare_rows(cfg)) + q_rows
    plt.store(o_ref.at[out_rows[:, None], cols[None, :]], o, mask=row_ok[:, None])
    plt.store(lse_ref.at[out_rows], lse, mask=row_ok)


def _spare_rows(cfg: TritonDecodeConfig) -> int:
    """Rows after the B * N output rows that the interpreter's stores of the Q tile's rows past
    G land in (sliced off after the kernel). On a GPU those rows are masked out of the store;
    the interpreter's masked store is a scatter that writes every row, the masked ones with
    their old values, and rows past G alias row G - 1 of the tile (its Q row), so they need
    places of their own."""
    return cfg.group_rows if cfg.interpret else 0


@functools.partial(jax.jit, static_argnames=("cfg",))
def _paged_attention(
    cfg: TritonDecodeConfig, q, k_pages, v_pages, block_tables, lengths, layer, k_scale=None,
    v_scale=None,
):  # fmt: skip
    B, N, H = q.shape
    S = cfg.num_splits
    scales = []
    if cfg.kv_dtype is not None:  # the flat scales and their bases; fp8 pools seen as uint8
        modes = (cfg.k_scales, cfg.v_scales)
        scales = _triton_quant.flat_scales(modes, k_pages, layer, k_scale, v_scale)
        k_pages, v_pages = _triton_quant.pool_view(k_pages), _triton_quant.pool_view(v_pages)
    k_rows, layer = _triton.flat_rows(k_pages, layer)
    v_rows, _ = _triton.flat_rows(v_pages, None)
    R = B * N + _spare_rows(cfg)
    if S == 1:
        out_shape = jax.ShapeDtypeStruct((R, H), q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((S * R, H), jnp.float32),
            jax.ShapeDtypeStruct((S * R,), jnp.float32),
        )
    plt = _triton.triton_module()
    name = (
        f"paged_decode_triton_T{cfg.block_kv}_S{S}_C{cfg.page_size}_G{cfg.group}"
        f"_H{H}_w{cfg.num_warps}_st{cfg.num_stages}"
    )
    if cfg.kv_dtype is not None:
        name += f"_{cfg.kv_dtype}_k{cfg.k_scales[0]}v{cfg.v_scales[0]}"
    with _triton.quiet_deprecation():
        out = pl.pallas_call(
            functools.partial(_kernel, cfg),
            grid=(cfg.num_kv_heads * cfg.head_blocks, S, B),
            out_shape=out_shape,
            compiler_params=plt.CompilerParams(
                num_warps=cfg.num_warps, num_stages=cfg.num_stages
            ),
            interpret=cfg.interpret,
            name=name,
        )(
            q.reshape(B * N, H), k_rows, v_rows, block_tables.astype(jnp.int32),
            lengths.astype(jnp.int32), layer, *scales,
        )  # fmt: skip
    if S == 1:
        return out[: B * N].reshape(B, N, H)
    o, lse = out
    o, lse = o.reshape(S, R, H)[:, : B * N], lse.reshape(S, R)[:, : B * N]
    return merge_splits(o, lse, q.dtype).reshape(B, N, H)


def paged_attention_pallas_triton(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer=None,
    k_scale=None,
    v_scale=None,
    interpret: bool = False,
    **knobs,
) -> jax.Array:
    """Decode attention over a paged KV cache with the Pallas-Triton kernel.

    Args:
      q: [B, N, H] bf16, f16 or f32 (the pages' dtype, or any of them with quantized pages);
        the query of sequence b sits at position ``lengths[b] - 1``.
      k_pages: [K, P, C, H], or [L, K, P, C, H] with ``layer``; or quantized
        (``float8_e4m3fn`` on sm89+, ``float8_e5m2``, ``int8``) with ``k_scale``/``v_scale``.
      v_pages: like ``k_pages``.
      block_tables: i32[B, W]; entry (b, i) is the page of tokens [i*C, (i+1)*C) of b.
      lengths: i32[B] tokens per sequence (the query's own included); 0 gives zeros.
      sm_scale: logit scale (already resolved).
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      sliding_window: if set, only the last ``sliding_window`` keys are seen; tiles before
        the window are never read.
      layer: int or i32[] layer index into a 5-D pool (a row offset; nothing is sliced).
      k_scale: quantized pages: f32 broadcastable to [K, P, C] ([L or 1, K, P, C] with a 5-D
        pool): per tensor, KV head, page and head, or token and head (``_quant``). The tile
        is converted to q's dtype after its load; key scales multiply the scores, value
        scales P (per head: the output), f32 accumulation.
      v_scale: like ``k_scale``, for ``v_pages``.
      interpret: run in Pallas's interpreter (any backend, tiny shapes).
      **knobs: ``block_kv`` (tokens per tile, a power of two 16..256), ``num_splits``,
        ``num_warps``, ``num_stages`` (pipeline depth; default ``_triton.default_num_stages``:
        what fits the GPU's shared memory, at most 3); each None or absent takes its default.

    Returns:
      [B, N, H] in ``q.dtype``.

    Raises:
      ValueError: if the kernel cannot run these arguments (``unsupported_reason``) or a knob
        is out of range.
    """
    reason = _triton.common_reason(q, k_pages, v_pages, k_scale, v_scale)
    if reason is None and not interpret:
        reason = _triton.platform_reason(k_pages)
    if reason is not None:
        raise ValueError(f"pallas_triton cannot run this call: {reason}")
    cfg = make_config(
        q, k_pages, block_tables, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window, interpret=interpret, k_scale=k_scale, v_scale=v_scale,
        **knobs,
    )  # fmt: skip
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    with _triton.quiet_deprecation():  # lowered here when called outside a jit
        return _paged_attention(
            cfg, q, k_pages, v_pages, block_tables, lengths, layer, k_scale, v_scale
        )
