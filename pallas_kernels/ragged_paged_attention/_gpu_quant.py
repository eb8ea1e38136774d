"""Quantized pages in the Mosaic GPU ragged kernel's SMEM-operand body (``_gpu_bodies``;
the scheme is ``pallas_kernels._gpu.quant``'s): a tile's scales, their SMEM rings and copies,
and the per-key factors of its scores and probabilities (keys along the columns of the
[64, T] tiles).

Each compute warpgroup dequantizes the shared ring's slot into a bf16 tile of its own, K and
then V. Per-page scales are read at the start of the step (their table entries first), per-
token ones come by bulk copies beside the pages (one copy a page copy, key and value scales
both on the K pages' barrier: the value scales multiply P before V is waited for) into a ring
``[stages, T]`` shared like the page ring.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._gpu import quant
from pallas_kernels._gpu.config import smem_transforms
from pallas_kernels.ragged_paged_attention._gpu_config import _Config

_KEYS = plgpu.Layout.WGMMA.reduce(0)  # a vector over the columns (keys) of a [64, T] tile


class TileScales(NamedTuple):
    """A KV head's scale refs and indices (traced scalars), with the token rings."""

    k_ref: Any
    v_ref: Any
    k_base: Any  # index of the KV head's first key scale
    v_base: Any
    k_head: Any  # "head" mode: the KV head's key scale; else None
    v_head: Any
    k_ring: Any = None  # "token" mode: SMEM [stages, T] f32
    v_ring: Any = None


def _per_head(cfg: _Config, mode: str) -> int:
    return {"head": 1, "page": cfg.num_pages, "token": cfg.num_pages * cfg.page_size}[mode]


def scratch(cfg: _Config, num_wgs: int) -> tuple:
    """The bf16 tiles [W, T, H] (one a compute warpgroup), then a [stages, T] f32 ring for each
    of the key and value scales in "token" mode; () unquantized."""
    if not cfg.quantized:
        return ()
    T, stages = cfg.block_kv, cfg.num_stages
    tiles = plgpu.SMEM((num_wgs, T, cfg.head_dim), cfg.dtype, transforms=smem_transforms())
    rings = [
        plgpu.SMEM((stages, T), jnp.float32) for m in (cfg.k_scales, cfg.v_scales) if m == "token"
    ]
    return (tiles, *rings)


def ring_transforms(cfg: _Config):
    """The transforms of the K/V ring: the 8-bit pages' own when quantized."""
    if cfg.quantized:
        return quant.ring_transforms(cfg.kv_dtype, cfg.head_dim)
    return smem_transforms()


def tile_scales(cfg: _Config, refs, h, rings) -> TileScales:
    """KV head ``h``'s scales (``refs``: the flattened key and value scales and i32[2] bases)
    with the token rings (``scratch``'s after the tiles)."""
    ks_ref, vs_ref, sbase_ref = refs
    k_base = sbase_ref[0] + h * _per_head(cfg, cfg.k_scales)
    v_base = sbase_ref[1] + h * _per_head(cfg, cfg.v_scales)
    rings = list(rings)
    return TileScales(
        k_ref=ks_ref,
        v_ref=vs_ref,
        k_base=k_base,
        v_base=v_base,
        k_head=ks_ref[k_base] if cfg.k_scales == "head" else None,
        v_head=vs_ref[v_base] if cfg.v_scales == "head" else None,
        k_ring=rings.pop(0) if cfg.k_scales == "token" else None,
        v_ring=rings.pop(0) if cfg.v_scales == "token" else None,
    )


def arrivals(cfg: _Config) -> tuple[int, int]:
    """Arrivals on a slot's K and V barriers: the page copies, and on K's as many again for each
    of the key and value scales in "token" mode (the value scales multiply P, which is formed
    before the V tile is waited for)."""
    tokens = [cfg.k_scales, cfg.v_scales].count("token")
    return cfg.copies_per_tile * (1 + tokens), cfg.copies_per_tile


def issue(cfg: _Config, ts: TileScales, head_base, rows, slot, which: int, k_bar) -> None:
    """ "token" mode: bulk copies of the key (``which`` 0) or value scales of a tile whose page
    copies start at pool ``rows`` (``_gpu_tile._tile_rows``), onto the K pages' barrier
    (``arrivals``)."""
    mode, ref, base, ring = (
        (cfg.k_scales, ts.k_ref, ts.k_base, ts.k_ring)
        if which == 0
        else (cfg.v_scales, ts.v_ref, ts.v_base, ts.v_ring)
    )
    if mode != "token":
        return
    r = cfg.rows_per_copy
    for j, row in enumerate(rows):
        plgpu.copy_gmem_to_smem(
            ref.at[pl.ds(base + row - head_base, r)], ring.at[slot, pl.ds(j * r, r)], k_bar.at[slot],
            oob_mode=quant.IN_BOUNDS,
        )  # fmt: skip


def page_scalars(cfg: _Config, ts: TileScales, t, bt_ref, step) -> tuple[tuple, tuple]:
    """ "page" mode: the key and value scales of K/V tile ``step``'s pages (each () otherwise)."""
    T, C, r = cfg.block_kv, cfg.page_size, cfg.rows_per_copy
    if "page" not in (cfg.k_scales, cfg.v_scales):
        return (), ()
    pages = []
    for j in range(cfg.copies_per_tile):
        tok = (t.t_lo + step) * T + j * r
        page = bt_ref[t.seq, jnp.minimum(tok // C, t.last_page)]
        pages.append(jnp.clip(page, 0, cfg.num_pages - 1))
    k = tuple(ts.k_ref[ts.k_base + p] for p in pages) if cfg.k_scales == "page" else ()
    v = tuple(ts.v_ref[ts.v_base + p] for p in pages) if cfg.v_scales == "page" else ()
    return k, v


def scale_scores(cfg: _Config, ts: TileScales, scalars, slot, sc):
    """[64, T] scores times their keys' scales."""
    f = quant.factor(
        cfg.k_scales, ts.k_head, ts.k_ring, slot, scalars[0], cfg.page_size, _KEYS, cfg.block_kv
    )
    return quant.times(sc, f, 1)


def scale_probabilities(cfg: _Config, ts: TileScales, scalars, slot, p, keys_hi):
    """[64, T] probabilities times their keys' value scales (per page or token; per head the
    output is scaled instead); per token, keys from ``keys_hi`` on get 0."""
    if cfg.v_scales == "head":
        return p
    f = quant.factor(
        cfg.v_scales, ts.v_head, ts.v_ring, slot, scalars[1], cfg.page_size, _KEYS, cfg.block_kv
    )
    if cfg.v_scales == "token":
        f = quant.masked_factor(f, keys_hi, _KEYS, cfg.block_kv)
    return quant.times(p, f, 1)


def dequantize(cfg: _Config, src, dst, valid_rows=None) -> None:
    """The ring slot ``src`` into this warpgroup's bf16 tile ``dst`` (after a warpgroup barrier:
    its last product may still read the tile); rows from ``valid_rows`` on as zeros."""
    quant.dequantize_tile(src, dst, cfg.kv_dtype, valid_rows, barrier_first=not cfg.interpret)


def output_scale(cfg: _Config, ts: TileScales | None):
    """The factor on the output: the per-head value scale, else None."""
    return None if ts is None or cfg.v_scales != "head" else ts.v_head
