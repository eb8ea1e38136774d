"""Static configuration of the Mosaic GPU ragged kernel (``kernel_gpu``): the kernel instance
(``_Config``), ``make_config`` (every option resolved from ``tuning_gpu`` and checked) and
``unsupported_reason``."""

from __future__ import annotations

import dataclasses
from typing import Any

from pallas_kernels import _backend
from pallas_kernels._gpu import checks, quant
from pallas_kernels._gpu.config import (
    ROWS,
    SMEM_BYTES,
    AttentionConfig,
    check_smem,
    common_fields,
    pool_dims,
)
from pallas_kernels.ragged_paged_attention import schedule, tuning_gpu

SUPPORTED_DTYPES = checks.SUPPORTED_DTYPES
SUPPORTED_HEAD_DIMS = checks.SUPPORTED_HEAD_DIMS
TILE_ORDERS = ("longest_first", "by_sequence", "index")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config(AttentionConfig):
    """One ragged kernel instance (hashable: a jit static argument); the fields past
    ``AttentionConfig``'s are commented."""

    num_tokens: int  # T
    causal: bool
    num_wgs: int  # compute warpgroups per CTA (64 rows each): one tile's K/V ring, or paired
    producer: bool  # an extra warpgroup issues every K/V copy (FA3-style warp specialization)
    fa3: bool  # _kernel_body_fa3: producer + register P + ping-pong (implies producer)
    paired: bool  # fa3 only: each compute warpgroup runs its own query tile and K/V stream
    kv_splits: int  # S: each query tile's K/V range split over S work units (LSE-merged)
    direct_io: bool  # Q / O read and written in place in [T, N, H] (no XLA gather / scatter)
    tile_order: str  # one of TILE_ORDERS
    persistent: int  # CTAs of a persistent grid, each running many work items (0: one each)

    @property
    def block_q(self) -> int:
        """Query tokens per schedule tile (one warpgroup's with ``paired``)."""
        return self.tokens_per_wg if self.paired else self.num_wgs * self.tokens_per_wg

    @property
    def tokens_per_wg(self) -> int:
        return tuning_gpu.tokens_per_tile(self.group, self.direct_io)


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
    k_scale=None,
    v_scale=None,
    block_kv: int | None = None,
    check_backend: bool = True,
) -> str | None:
    """Why this kernel cannot run these arguments, or None if it can (shapes/dtypes only).

    Args:
      q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs: as in
        ``ragged_paged_attention_pallas_gpu``; only shapes and dtypes are read (pages bf16 /
        f16 like q, or quantized: fp8 / int8 with scales, on Hopper).
      sm_scale, causal, logits_soft_cap, sliding_window, layer, k_scale, v_scale: accepted for
        signature parity.
      block_kv: the K/V tile the kernel would use (default ``tuning_gpu.default_block_kv``).
      check_backend: also require a Hopper (sm90) GPU as the default backend.
    """
    del sm_scale, causal, logits_soft_cap, sliding_window, layer, k_scale, v_scale
    del block_tables, kv_lens, cu_q_lens, num_seqs
    reasons = checks.device_and_dtype_reasons(q, k_pages, v_pages, check_backend=check_backend)
    *_, C, H = k_pages.shape
    fa3 = tuning_gpu.default_fa3(False) and not quant.is_quantized_pool(k_pages)
    T = tuning_gpu.default_block_kv(H, fa3, page_size=C) if block_kv is None else block_kv
    if C % 8 or (T % C and C % T):
        reasons.append(
            f"page_size={C} must be a multiple of 8 that divides or is a multiple of the "
            f"K/V tile block_kv={T}"
        )
    N = q.shape[-2]
    K = k_pages.shape[-4]
    G = N // K if K else 0
    if not 1 <= G <= ROWS:
        reasons.append(f"group size G={G} must be in [1, {ROWS}]")
    reasons += checks.pool_rows_reasons(k_pages)
    return "; ".join(reasons) if reasons else None


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
    k_scale=None,
    v_scale=None,
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
    persistent: bool | None = None,
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
      k_scale, v_scale: quantized pages' scales (``pallas_kernels._gpu.quant``): the
        SMEM-operand body dequantizes each tile (``fa3`` does not take quantized pages).
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
      persistent: one CTA per SM (``_backend.gpu_num_sms``), each running its share of the
        work items back to back, the next item's K/V and Q loads overlapping the current
        item's math and store. Needs ``fa3`` and ``direct_io``, not ``paired``, and SMEM
        for a second untiled staging tile per warpgroup (``tuning_gpu.persistent_supported``).
        With it, ``block_kv`` and ``num_stages`` default to the 64-key tiles and 3-deep ring
        measured for it where the page size allows. Default ``tuning_gpu.default_persistent``:
        prefill-heavy batches whose block table holds at most 1,024 keys a sequence, where
        no ``block_kv``, ``num_stages``, ``num_wgs`` other than 2, ``kv_splits`` other than
        1 or ``direct_io=False`` was asked for.

    Raises:
      ValueError: if the kernel cannot run these shapes/dtypes or a knob is out of range.
    """
    T, N, H = q.shape
    quantized = quant.config_fields(q, k_pages, k_scale, v_scale)
    if fa3 is None:
        fa3 = tuning_gpu.default_fa3(interpret) and not quantized
    fa3 = bool(fa3)
    if fa3 and quantized:
        raise ValueError(
            "fa3=True does not take quantized pages (the SMEM-operand body dequantizes them): "
            "pass fa3=False or None"
        )
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
            and not persistent
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
    if persistent and (paired or not fa3):
        raise ValueError(
            "persistent=True needs the FA3-style body (fa3=True, not in interpret mode) and "
            f"not paired (fa3={fa3}, paired={paired}); pass persistent=False or None"
        )
    if persistent is None:  # the default only where no knob it sets was chosen
        persistent = (
            fa3
            and not paired
            and block_kv is None
            and num_stages is None
            and num_wgs in (None, 2)
            and direct_io in (None, True)
            and kv_splits in (None, 1)
            and tuning_gpu.default_persistent(
                T, B, block_tables.shape[1] * C, G, H, C, k_pages.shape[-4]
            )
        )
        if persistent:
            block_kv, num_stages = tuning_gpu.PERSISTENT_BLOCK_KV, tuning_gpu.PERSISTENT_STAGES
    elif persistent and block_kv is None and (C % 64 == 0 or 64 % C == 0):
        # the persistent grid's measured tile (128-key tiles ran slower on it); its ring too
        block_kv = tuning_gpu.PERSISTENT_BLOCK_KV
        num_stages = tuning_gpu.PERSISTENT_STAGES if num_stages is None else num_stages
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
    sizes = {}
    if quantized:
        tokens = [quantized["k_scales"], quantized["v_scales"]].count("token")
        sizes = dict(quantized=True, token_scales=tokens)
    if block_kv not in tuning_gpu.BLOCK_KV_CHOICES:
        raise ValueError(f"{block_kv=} must be one of {tuning_gpu.BLOCK_KV_CHOICES}")
    K, _, C, layer = pool_dims(k_pages, layer)
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
            else tuning_gpu.default_num_stages(H, block_kv, wgs, fa3, **sizes)
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
    persistent = bool(persistent)
    if persistent and not direct_io:
        raise ValueError(
            "persistent=True needs the FA3-style body's in-place Q/O, which these arguments "
            f"do not take (direct_io={direct_io}); pass persistent=False or None"
        )
    if kv_splits is None:
        block_q = tuning_gpu.tokens_per_tile(G, direct_io) * (1 if paired else wgs)
        num_tiles = schedule.num_tiles_bound(T, B, block_q)
        max_kv = block_tables.shape[1] * C
        splits = (
            tuning_gpu.default_kv_splits(num_tiles, K, max_kv, block_kv, sliding_window, block_q)
            if direct_io and not interpret
            else 1
        )
        if (
            tuning_gpu.smem_bytes(H, block_kv, stages, wgs, fa3, True, paired, splits,
                                  persistent=persistent)
            > SMEM_BYTES
        ):  # fmt: skip
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
    smem = tuning_gpu.smem_bytes(
        H, block_kv, stages, wgs, fa3, direct_io, paired, splits, **sizes, persistent=persistent
    )
    check_smem(
        smem, num_stages=stages, block_kv=block_kv, num_wgs=wgs, paired=paired,
        kv_splits=splits, direct_io=direct_io, persistent=persistent,
    )  # fmt: skip
    num_ctas = 0
    if persistent:  # one CTA per SM, never more than the work items
        block_q = tuning_gpu.tokens_per_tile(G, True) * wgs
        items = schedule.num_tiles_bound(T, B, block_q) + (2 if splits == 1 else 0)
        num_ctas = max(1, min(_backend.gpu_num_sms(), items * splits * K))
    cfg = _Config(
        **{
            **common_fields(
                q, k_pages, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                sliding_window=sliding_window,
            ),
            **quantized,
        },
        block_kv=block_kv,
        num_stages=stages,
        interpret=bool(interpret),
        num_tokens=T,
        causal=bool(causal),
        num_wgs=wgs,
        producer=bool(producer) or fa3,
        fa3=fa3,
        paired=paired,
        kv_splits=splits,
        direct_io=direct_io,
        tile_order=order,
        persistent=num_ctas,
    )  # fmt: skip
    return cfg, layer
