"""Static configuration of the Mosaic GPU decode kernel (``kernel_gpu``): the kernel instance
(``_Config``), ``make_config`` (every option resolved and checked, one place) and
``unsupported_reason``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._gpu import checks, quant
from pallas_kernels._gpu.config import (
    ROWS,
    TILE_ROWS,
    AttentionConfig,
    check_smem,
    common_fields,
    int_knob,
    pool_dims,
)
from pallas_kernels.paged_attention import _gpu_sizes, tuning_gpu
from pallas_kernels.paged_attention._gpu_order import check_order_method, packed_order

SUPPORTED_DTYPES = checks.SUPPORTED_DTYPES
SUPPORTED_HEAD_DIMS = checks.SUPPORTED_HEAD_DIMS
# How pages reach the tiled SMEM ring (``page_copy``): copied by every thread in 16-byte
# pieces (the default below 8 tokens on a GPU), or by TMA a page (into a staging ring below 8
# tokens: what the interpreter runs).
PAGE_COPIES = ("cp_async", "tma")
# How split partials are merged (``split_merge``): an XLA epilogue or a second Mosaic GPU
# kernel (``_merge_gpu.merge_partials``).
SPLIT_MERGES = ("xla", "mosaic")
# The products' instructions (``mma``): Hopper's wgmma, or Blackwell's tcgen05 MMA.
MMAS = ("wgmma", "tcgen05")
# tcgen05 runs the ``swap_ab`` form at 128-key tiles: every product has M = 128 (the keys; 128
# rows of the head dim, two such products at H = 256). M = 64 does not lower through Pallas on
# jax 0.11.2 (its TMEM slice of the kernel's 128-lane allocation gets no layout).
TCGEN05_BLOCK_KV = 128
TCGEN05_HEAD_DIMS = (128, 256)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config(AttentionConfig):
    """One decode kernel instance (hashable: a jit static argument).

    Attributes:
      num_seqs: B.
      num_splits: S, CTAs a (sequence, KV head) pair's keys are split over.
      longest_first: the grid takes the sequences longest first (an on-device order).
      order_method: how that order is computed (``_gpu_order.ORDER_METHODS``).
      swap_ab: scores as K Q^T (keys x queries): the G heads are a wgmma N of ``qcols``.
      deferred_sum: swap_ab: l kept per (key row, query) and summed over keys at the end.
      profile_dir: Mosaic GPU on-device profiler trace directory ("": off).
      page_copy: "cp_async" (per thread, the default below 8 tokens) or "tma".
      mosaic_merge: splits merged by a second kernel (``_merge_gpu.merge_partials``).
      auto_barriers: Pallas's automatic warpgroup barriers (else the kernel's own three,
        ``_gpu_tile.wg_barrier``).
      min_split_tiles: a sequence is split only into as many splits as keep this many tiles.
      fixed_max: the first tile's max is every later tile's softmax reference; a unit whose
        scores rise more than ``fixed_max_headroom`` above it is redone with the running max.
      mma: "wgmma" (Hopper) or "tcgen05" (Blackwell: accumulators in tensor memory).
      out_blocks: swap_ab: each unit's output leaves as its whole ``qcols``-row block into a
        staging array and XLA gathers the G real rows (the form newer Mosaic GPU lowers).
      k_registers: quantized pages with swap_ab: each 8-bit K tile is converted in registers
        and is the scores' wgmma A operand there (no bf16 K tile in SMEM; GPU only, the
        interpreter's wgmma reads A from SMEM).
    """

    num_seqs: int
    num_splits: int
    longest_first: bool
    order_method: str
    swap_ab: bool
    deferred_sum: bool
    profile_dir: str = ""
    page_copy: str = "tma"
    mosaic_merge: bool = False
    auto_barriers: bool = True
    min_split_tiles: int = 1
    fixed_max: bool = False
    mma: str = "wgmma"
    out_blocks: bool = False
    k_registers: bool = False

    @property
    def tcgen05(self) -> bool:
        return self.mma == "tcgen05"

    @property
    def heads_inner(self) -> bool:
        """Grid (B, S, K), a sequence's KV heads adjacent CTAs (so longest first orders every
        CTA); blockIdx.z (B) is at most 65535, past which the grid is (K, S, B)."""
        return self.num_seqs <= 65535

    @property
    def fixed_max_headroom(self) -> float:
        """``fixed_max``: how far (base 2) a score may rise above the first tile's max. P is
        at most 2^headroom, stored in q.dtype for P @ V: f16 holds up to 65504, so 15; bf16
        has f32's range, and at 32 the f32 sums stay finite for |v| up to about 1e22 over a
        million keys."""
        return 15.0 if self.dtype == jnp.float16 else 32.0

    @property
    def xla_order(self) -> bool:
        """The longest-first order comes in as an array computed by XLA (else the kernel
        counts it: ``order_method="kernel"``, or there is none)."""
        return self.longest_first and self.order_method != "kernel"

    @property
    def staged(self) -> bool:
        """Pages below 8 tokens copied by TMA: each page lands in an untiled staging ring and a
        tile is re-laid into the tiled wgmma tiles before it is read (``_relayout``)."""
        return self.page_size < TILE_ROWS and self.page_copy == "tma"

    @property
    def per_thread(self) -> bool:
        """Pages copied by every thread: 16-byte ``cp.async`` pieces (``_cp_async``)."""
        return self.page_copy == "cp_async"

    @property
    def qcols(self) -> int:
        """``swap_ab``: query rows a CTA loads (its G heads at offset ``qoff`` in an 8-row
        aligned block), the N of both products (a multiple of 16 for tcgen05)."""
        return _gpu_sizes.qcols(self.num_seqs, self.num_q_heads, self.num_kv_heads, self.tcgen05)

    @property
    def q_rows(self) -> int:
        """Query rows of a CTA's Q and P tiles: ``qcols`` with ``swap_ab``, else 64."""
        return self.qcols if self.swap_ab else ROWS

    @property
    def whole_blocks(self) -> bool:
        """``swap_ab``'s output leaves as whole ``qcols``-row blocks: asked for
        (``out_blocks``), or where the G heads fill the block (then exactly the unit's rows)."""
        return self.swap_ab and (self.out_blocks or self.qcols == self.group)


def swap_ab_lowers(version: str | None = None) -> bool:
    """Whether this JAX's Mosaic GPU lowers ``swap_ab``'s direct store (``version``: a JAX
    version string, default the installed one). jax 0.12's layout inference runs out of search
    fuel wherever an output tile written through a transposed SMEM view is copied out from a
    dynamic offset or as a slice short of the whole tile; there ``swap_ab`` stores whole blocks
    (``out_blocks``), or, where the G heads fill the tile (G == ``qcols``), the whole tile,
    which lowers on any JAX."""
    if version is None:
        version = jax.__version__
    major, minor = (int(x) for x in version.split(".")[:2])
    return (major, minor) < (0, 12)


def unsupported_reason(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    *,
    sm_scale=None,
    logits_soft_cap=None,
    sliding_window=None,
    layer=None,
    k_scale=None,
    v_scale=None,
    block_kv: int | None = None,
    check_backend: bool = True,
) -> str | None:
    """Why this kernel cannot run these arguments, or None if it can.

    Args:
      q: [B, N, H]; k_pages, v_pages: [K, P, C, H] or [L, K, P, C, H] (bf16 / f16 like q, or
        quantized: fp8 / int8 with scales of any granularity, pages of 8+ tokens, Hopper);
        block_tables: i32[B, W]; lengths: i32[B]. Only shapes and dtypes are read.
      sm_scale, logits_soft_cap, sliding_window, layer, k_scale, v_scale: accepted for
        signature parity.
      block_kv: the token tile T the kernel would use (default ``default_block_kv(H)``, or
        ``TCGEN05_BLOCK_KV`` on Blackwell).
      check_backend: also require a Hopper (sm90) or Blackwell (sm100 / sm103 / sm110, head dims
        128 and 256: ``mma="tcgen05"``) GPU as the default backend.
    """
    del sm_scale, logits_soft_cap, sliding_window, layer, block_tables, lengths, k_scale, v_scale
    reasons = checks.device_and_dtype_reasons(
        q, k_pages, v_pages, check_backend=check_backend, majors=(9, *tuning_gpu.TCGEN05_MAJORS)
    )
    *_, C, H = k_pages.shape
    blackwell = check_backend and tuning_gpu.default_mma() == "tcgen05"
    if blackwell and H not in TCGEN05_HEAD_DIMS:
        reasons.append(f"on Blackwell (tcgen05) head_dim={H} must be one of {TCGEN05_HEAD_DIMS}")
    if block_kv is None:
        block_kv = TCGEN05_BLOCK_KV if blackwell else tuning_gpu.default_block_kv(H)
    if C < 1 or (block_kv % C and C % block_kv):
        reasons.append(f"page_size={C} must divide or be a multiple of the tile {block_kv=}")
    N = q.shape[1]
    K = k_pages.shape[-4]
    G = N // K if K else 0
    if G > ROWS or (G % 8 and G > ROWS - 7):
        reasons.append(f"group size G={G} must be <= 56 (or a multiple of 8 up to 64)")
    reasons += checks.pool_rows_reasons(k_pages)
    return "; ".join(reasons) if reasons else None


def make_config(
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
    interpret: bool | plgpu.InterpretGPUParams = False,
    block_kv: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    longest_first: bool | None = None,
    swap_ab: bool | None = None,
    order_method: str | None = None,
    profile_dir: str | None = None,
    page_copy: str | None = None,
    split_merge: str | None = None,
    min_split_tiles: int | None = None,
    fixed_max: bool | None = None,
    mma: str | None = None,
    out_blocks: bool | None = None,
    k_registers: bool | None = None,
) -> tuple[_Config | None, object]:
    """The kernel instance ``paged_attention_pallas_gpu`` runs these arguments with (every
    default resolved from ``tuning_gpu``, every knob checked) and the layer offset; arguments
    as there, of which only shapes and dtypes are read. The instance is None where there is
    nothing to launch (B = 0, or a table of width 0): the output is zeros.

    Raises:
      ValueError: if the kernel cannot run these shapes/dtypes or a knob is out of range.
    """
    quantized = quant.config_fields(q, k_pages, k_scale, v_scale)
    if mma is None:
        mma = "wgmma" if quantized else tuning_gpu.default_mma(bool(interpret))
    if mma not in MMAS:
        raise ValueError(f"{mma=} must be one of {MMAS}")
    tcgen05 = mma == "tcgen05"
    if block_kv is None:
        block_kv = TCGEN05_BLOCK_KV if tcgen05 else tuning_gpu.default_block_kv(q.shape[-1])
    reason = unsupported_reason(
        q, k_pages, v_pages, block_tables, lengths, block_kv=block_kv, check_backend=False
    )
    if reason is not None:
        raise ValueError(f"paged_attention_pallas_gpu cannot run this call: {reason}")
    if block_kv not in (64, 128):
        raise ValueError(f"{block_kv=} must be 64 or 128")
    if tcgen05 and quantized:
        raise ValueError('mma="tcgen05" does not take quantized pages: pass mma=None or "wgmma"')
    if tcgen05 and (block_kv != TCGEN05_BLOCK_KV or q.shape[-1] not in TCGEN05_HEAD_DIMS):
        raise ValueError(
            f'mma="tcgen05" needs block_kv={TCGEN05_BLOCK_KV} (got {block_kv}) and a head dim in '
            f"{TCGEN05_HEAD_DIMS} (got {q.shape[-1]}): its products are M=128 MMAs"
        )
    B, N, H = q.shape
    K, _, C, layer = pool_dims(k_pages, layer)
    W = block_tables.shape[1]
    if order_method is None:
        order_method = tuning_gpu.default_order_method(B)
    # "kernel"'s own limits are checked once the order is known to be on (below).
    check_order_method("order_method", order_method, B, packed_order(B), kernel=False)
    if B == 0:
        return None, layer
    small = C < TILE_ROWS  # pages below 8 tokens: not one TMA copy into the tiled ring
    if page_copy is None:  # the interpreter cannot run cp.async (inline Mosaic GPU code)
        page_copy = "cp_async" if small and not interpret else "tma"
    if page_copy not in PAGE_COPIES:
        raise ValueError(f"{page_copy=} must be one of {PAGE_COPIES}")
    if page_copy == "cp_async" and interpret:
        raise ValueError(
            'page_copy="cp_async" runs only on a GPU: the Mosaic GPU interpreter cannot '
            'run its inline Mosaic GPU code (use page_copy="tma", the default there)'
        )
    if quantized and page_copy == "cp_async":
        raise ValueError('quantized pages are copied by TMA: pass page_copy=None or "tma"')
    staged = small and page_copy == "tma"  # land untiled, then re-laid (_relayout)
    splits = (
        tuning_gpu.default_num_splits(B, K, W * C, block_kv)
        if num_splits is None
        else int_knob("num_splits", num_splits)
    )
    if splits < 1:
        raise ValueError(f"num_splits={splits} must be >= 1")
    qcols = _gpu_sizes.qcols(B, N, K, tcgen05)
    # The interpreter does not lower the kernel: swap_ab's direct store runs there on any JAX.
    lowers = bool(interpret) or swap_ab_lowers()
    fills = qcols == N // K  # the G heads fill the block: the whole-block store is the direct one
    if swap_ab is None:
        swap_ab = tcgen05 or tuning_gpu.default_swap_ab(H, qcols)
    swap_ab = bool(swap_ab)
    if out_blocks is None:
        out_blocks = not lowers and not fills
    out_blocks = bool(out_blocks) and swap_ab
    if tcgen05 and not swap_ab:
        raise ValueError('mma="tcgen05" runs the swap_ab form only: pass swap_ab=None or True')
    if split_merge is not None and split_merge not in SPLIT_MERGES:
        raise ValueError(f"{split_merge=} must be one of {SPLIT_MERGES}")
    if tcgen05 and split_merge == "mosaic" and splits > 1:
        raise ValueError(
            f'mma="tcgen05" merges splits in XLA: pass split_merge=None or "xla" (got '
            f"{split_merge!r})"
        )
    if split_merge == "mosaic" and splits > 1 and not swap_ab:
        raise ValueError(
            'split_merge="mosaic" merges swap_ab partials: it needs swap_ab=True (got '
            f'swap_ab={swap_ab}); use split_merge="xla"'
        )
    if split_merge is None:
        split_merge = "xla" if tcgen05 else tuning_gpu.default_split_merge(splits, swap_ab)
    tile_cols = qcols if swap_ab else None  # SMEM and stage defaults of the swap_ab tiles
    # Quantized: 1-byte pages in the ring, one bf16 tile on top, rings of per-token scales.
    sizes = {}
    if quantized:
        tokens = [quantized["k_scales"], quantized["v_scales"]].count("token")
        sizes = dict(kv_itemsize=1, token_scales=tokens)
    if num_stages is None:
        stages = tuning_gpu.default_num_stages(
            H, block_kv, qcols=tile_cols, staged=staged, quantized=bool(quantized)
        )
    else:
        stages = int_knob("num_stages", num_stages)
    if stages < 1:
        raise ValueError(f"num_stages={stages} must be >= 1")
    smem = _gpu_sizes.smem_bytes(H, block_kv, stages, qcols=tile_cols, staged=staged, **sizes)
    check_smem(smem, num_stages=stages, block_kv=block_kv, head_dim=H)
    if fixed_max is None:
        fixed_max = tuning_gpu.default_fixed_max(quantized.get("dtype", q.dtype))
    if min_split_tiles is None:
        min_split_tiles = tuning_gpu.default_min_split_tiles(B, K, splits)
    min_split_tiles = int_knob("min_split_tiles", min_split_tiles)
    if min_split_tiles < 1:
        raise ValueError(f"{min_split_tiles=} must be >= 1")
    if W == 0:  # no page to read: every length must be 0 (checked arguments, no launch)
        return None, layer
    if longest_first is None:
        lf = tuning_gpu.default_longest_first(B, K, splits, W * C)
    else:
        lf = bool(longest_first)
    if lf:  # the in-kernel count's limits matter only where there is an order to count
        check_order_method("order_method", order_method, B, packed_order(B))
    if k_registers is None:  # the interpreter's wgmma reads its A operand from SMEM only
        k_registers = bool(quantized) and not interpret and tuning_gpu.default_k_registers(swap_ab)
    if k_registers and interpret:
        raise ValueError(
            "k_registers=True runs only on a GPU: the Mosaic GPU interpreter's wgmma takes its "
            "A operand from SMEM only (pass k_registers=None or False there)"
        )
    if k_registers and not (quantized and swap_ab):
        raise ValueError(
            "k_registers=True converts quantized K tiles into swap_ab's register operand: it "
            f"needs quantized pages and swap_ab=True (got {k_registers=}, swap_ab={swap_ab}, "
            f"pages {jnp.dtype(k_pages.dtype).name})"
        )
    if swap_ab and not lowers and not (out_blocks or fills):
        raise ValueError(
            f"swap_ab=True with out_blocks=False does not lower on jax {jax.__version__}: "
            "Mosaic GPU's layout inference exhausts its search on a slice of its transposed "
            "output tile (jax 0.11.2 lowers it); pass out_blocks=None or swap_ab=None"
        )
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
        interpret=(
            interpret
            if isinstance(interpret, plgpu.InterpretGPUParams)
            else plgpu.InterpretGPUParams()
            if interpret
            else False
        ),
        num_seqs=B,
        num_splits=splits,
        longest_first=lf,
        order_method=order_method,
        swap_ab=swap_ab,
        deferred_sum=swap_ab and tuning_gpu.default_deferred_sum(qcols),
        profile_dir=str(profile_dir) if profile_dir else "",
        page_copy=page_copy,
        mosaic_merge=splits > 1 and split_merge == "mosaic",
        auto_barriers=tuning_gpu.default_auto_barriers(staged),
        min_split_tiles=min_split_tiles if splits > 1 else 1,
        fixed_max=bool(fixed_max),
        mma=mma,
        out_blocks=out_blocks,
        k_registers=bool(k_registers),
    )  # fmt: skip
    return cfg, layer
