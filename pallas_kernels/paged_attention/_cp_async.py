"""Per-thread page gathers for the Mosaic GPU decode kernel: pages below 8 tokens, on hardware.

A TMA copy into the (8, 64)-tiled, 128-byte-swizzled SMEM ring that wgmma reads must start on
an 8-row boundary (the swizzle repeats every 1024 bytes, and TMA wants a swizzled destination
aligned to it), so a page of 1, 2 or 4 tokens cannot be one TMA copy into the ring, and one TMA
copy a page issued by one thread costs about 80 cycles (H200, jax 0.11.2; commit d00beb5).
Here every thread of the warpgroup copies 16-byte pieces of a tile's rows with ``cp.async``
(the per-thread copy FlashInfer gathers small pages with), straight to their swizzled places:
thread t takes piece ``t % (H / 8)`` of rows ``t // (H / 8) + r * 128 / (H / 8)``, reading each
row's page from the block table itself. A tile's K copies are one ``cp.async`` group and its V
copies the next; ``wait(pending)`` (``cp.async.wait_group``) and ``plgpu.commit_smem`` (a proxy
fence and a warpgroup barrier) make a group visible to wgmma. A warpgroup barrier before the
copies keeps them from overwriting a slot that another warp's wgmma still reads.

Mosaic GPU's interpreter cannot run inline Mosaic GPU code, so interpreted kernels copy small
pages by TMA into an untiled staging ring instead (``kernel_gpu._relayout``); this path is
checked by CUDA lowering on CPU and by the GPU tests.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, llvm, memref, nvvm

PIECE = 16  # bytes one cp.async copies (its largest size; .cg caches in L2 only, as TMA reads)
THREADS = 128  # one warpgroup
_SWIZZLE = 128  # bytes of a swizzled line; 8 lines form the 1024-byte repeat
_LINES = 8


def _i32(v: int) -> ir.Value:
    return arith.constant(ir.IntegerType.get_signless(32), v)


def _i64(v) -> ir.Value:
    i64 = ir.IntegerType.get_signless(64)
    return arith.constant(i64, v) if isinstance(v, int) else arith.extui(i64, v)


def _index(v: ir.Value) -> ir.Value:
    return arith.index_cast(ir.IndexType.get(), v)


def _scalar(x) -> ir.Value:
    """The value of a scalar argument (a splat FragmentedArray at the lane level)."""
    return x.registers.flat[0]


def _swizzled_offset(row: ir.Value, piece: ir.Value, row_bytes: int) -> ir.Value:
    """Byte offset of 16-byte piece ``piece`` of ``row`` in a tile of ``row_bytes``-byte rows
    with Mosaic GPU's (8, 128 bytes) tiling and 128-byte swizzle: tile (row // 8, piece // 8)
    of 1024 bytes, line row % 8, and the piece's place in the line XORed with row % 8."""
    per_line, col_tiles = _SWIZZLE // PIECE, row_bytes // _SWIZZLE
    tile = arith.addi(
        arith.muli(arith.divui(row, _i32(_LINES)), _i32(col_tiles)),
        arith.divui(piece, _i32(per_line)),
    )
    line = arith.remui(row, _i32(_LINES))
    swizzled = arith.xori(arith.remui(piece, _i32(per_line)), line)
    off = arith.addi(arith.muli(tile, _i32(_LINES * _SWIZZLE)), arith.muli(line, _i32(_SWIZZLE)))
    return arith.addi(off, arith.muli(swizzled, _i32(PIECE)))


def _read_only_ref() -> plgpu.RefType:
    """A ref ``issue`` only reads (the table and the pools): JAX 0.12 checks that a kernel
    writes no input passed as an array, and counts every ref an ``inline_mgpu`` function takes
    as written unless its type says otherwise; 0.11's ``RefType`` has no ``write`` field."""
    try:
        return plgpu.RefType(write=False)
    except TypeError:
        return plgpu.RefType()


@functools.cache
def _issue_fn(page_size: int, num_pages: int, block_kv: int, head_dim: int, itemsize: int, tr):
    pieces = head_dim * itemsize // PIECE  # 16-byte pieces of a row
    rows_per_pass = THREADS // pieces
    row_bytes = head_dim * itemsize
    splat = plgpu.Layout.WG_SPLAT(())
    smem = plgpu.RefType(tr)

    @plgpu.inline_mgpu(
        arg_types=(
            _read_only_ref(),
            (_read_only_ref(), _read_only_ref()),
            (smem, smem),
            *[splat] * 6,
        )
    )
    def issue(ctx, bt, srcs, rings, live, b, tile_tok, last_page, head_base, slot):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        live, b, tile_tok, last_page, head_base, slot = map(
            _scalar, (live, b, tile_tok, last_page, head_base, slot)
        )
        tid = arith.index_cast(
            ir.IntegerType.get_signless(32),
            arith.remui(gpu.thread_id(gpu.Dimension.x), _index(_i32(THREADS))),
        )
        piece, row0 = arith.remui(tid, _i32(pieces)), arith.divui(tid, _i32(pieces))
        slot_off = _i64(arith.muli(slot, _i32(block_kv * row_bytes)))
        global_ptr = llvm.PointerType.get(1)  # cp.async reads the global state space
        src_ptrs = [llvm.addrspacecast(global_ptr, mgpu_utils.memref_ptr(s)) for s in srcs]
        ring_ptrs = [mgpu_utils.memref_ptr(r) for r in rings]
        # Every row's page first (clamped to the last page: in bounds even past the length),
        # so the table reads are in flight together; then K's pieces, one group, V's, another.
        offsets = []
        for p in range(block_kv // rows_per_pass):
            row = arith.addi(row0, _i32(p * rows_per_pass))
            tok = arith.addi(tile_tok, row)
            entry = arith.minsi(arith.divsi(tok, _i32(page_size)), last_page)
            page = memref.load(bt, [_index(b), _index(entry)])
            # An id out of [0, P) reads a page of this pool, never out of bounds (TMA would
            # zero-fill; a cp.async out of bounds faults). The row arithmetic is
            # ``kernel_gpu._lookup`` and ``_page_row``'s for TMA copies, with this clamp.
            page = arith.maxsi(arith.minsi(page, _i32(num_pages - 1)), _i32(0))
            in_page = arith.remsi(tok, _i32(page_size))
            pool_row = arith.addi(head_base, arith.addi(arith.muli(page, _i32(page_size)), in_page))
            src = arith.addi(
                arith.muli(_i64(pool_row), _i64(row_bytes)),
                _i64(arith.muli(piece, _i32(PIECE))),
            )
            dst = arith.addi(slot_off, _i64(_swizzled_offset(row, piece, row_bytes)))
            offsets.append((src, dst))
        # The slot's last P @ V may still be read by another warp's wgmma: every warp has
        # waited for its own before any thread overwrites the slot (TMA copies get the same
        # barrier from Pallas). Placed after the table reads, whose latency it overlaps.
        mgpu_utils.warpgroup_barrier()
        is_live = arith.cmpi(arith.CmpIPredicate.ne, live, _i32(0))
        for src_ptr, ring_ptr in zip(src_ptrs, ring_ptrs, strict=True):
            with mgpu_utils.when(is_live):
                for src, dst in offsets:
                    nvvm.cp_async_shared_global(
                        mgpu_utils.getelementptr(ring_ptr, [dst], i8),
                        mgpu_utils.getelementptr(src_ptr, [src], i8),
                        PIECE,
                        nvvm.LoadCacheModifierKind.CG,
                    )
            nvvm.cp_async_commit_group()  # always: every thread counts the same groups
        return ()

    return issue


def issue(cfg, bt_ref, k_ref, v_ref, k_ring, v_ring, unit, i, slot, live, transforms):
    """K, then V, of tile i of ``unit`` into ring slot ``slot`` (when ``live``): two cp.async
    groups, committed by every thread whether or not the tile is live."""
    fn = _issue_fn(
        cfg.page_size, cfg.num_pages, cfg.block_kv, cfg.head_dim, cfg.dtype.itemsize,
        tuple(transforms),
    )  # fmt: skip
    scalars = (live, unit.b, (unit.start + i) * cfg.block_kv, unit.last_page, unit.head_base, slot)
    fn(bt_ref, (k_ref, v_ref), (k_ring, v_ring), *(jnp.asarray(x, jnp.int32) for x in scalars))


@functools.cache
def _wait_fn(pending: int):
    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(pending)
        return ()

    return wait


def wait(pending: int) -> None:
    """Waits until at most ``pending`` of this thread's cp.async groups are in flight. The
    landed copies reach wgmma after a proxy fence and a warpgroup barrier (``commit_smem``),
    which the caller runs (with SMEM writes of its own that need one too)."""
    _wait_fn(pending)()
