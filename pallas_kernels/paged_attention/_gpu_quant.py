"""Quantized pages in the Mosaic GPU decode kernel (``kernel_gpu``; the scheme is
``pallas_kernels._gpu.quant``'s): a unit's scales, their SMEM rings and copies, and the
per-key-row factors of a tile's scores and probabilities.

Per mode (``_Config.k_scales`` / ``v_scales``):

- ``"head"``: one scalar a unit, read at its start (keys: a factor on every score; values: on
  the output, ``_gpu_tile._finish``);
- ``"page"``: one scalar a page; a tile's are read one tile ahead (their table entries and
  scales in flight during the tile before) and carried through the loop (``page_scales``);
- ``"token"``: one f32 a key row, copied beside the tile's pages (``issue``: ``T / C`` bulk copies of
  ``C`` floats, or one of ``T``, arriving on the K pages' barrier) into an SMEM ring
  ``[stages, T]`` and loaded in the scores' row layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._gpu import quant
from pallas_kernels._gpu.config import smem_transforms
from pallas_kernels.paged_attention._gpu_config import _Config


class UnitScales(NamedTuple):
    """A unit's scale refs and indices (traced scalars)."""

    k_ref: Any  # the flattened key scales (GMEM)
    v_ref: Any
    k_base: Any  # index of the unit's KV head's first key scale
    v_base: Any
    k_head: Any  # "head" mode: the unit's key scale; else None
    v_head: Any
    k_ring: Any = None  # "token" mode: the SMEM ring [stages, T] of key scales
    v_ring: Any = None


def _per_head(cfg: _Config, mode: str) -> int:
    return {"head": 1, "page": cfg.num_pages, "token": cfg.num_pages * cfg.page_size}[mode]


def unit_scales(cfg: _Config, ks_ref, vs_ref, sbase_ref, h) -> UnitScales:
    """The scales of KV head ``h``'s units (``sbase_ref``: i32[2], the layer's base indices)."""
    k_base = sbase_ref[0] + h * _per_head(cfg, cfg.k_scales)
    v_base = sbase_ref[1] + h * _per_head(cfg, cfg.v_scales)
    return UnitScales(
        k_ref=ks_ref,
        v_ref=vs_ref,
        k_base=k_base,
        v_base=v_base,
        k_head=ks_ref[k_base] if cfg.k_scales == "head" else None,
        v_head=vs_ref[v_base] if cfg.v_scales == "head" else None,
    )


def scratch(cfg: _Config) -> tuple:
    """SMEM of a quantized kernel (nothing otherwise): the bf16 tile K and V are dequantized
    into, then an SMEM ring [stages, T] f32 for each of the key and value scales in "token"
    mode."""
    if not cfg.quantized:
        return ()
    T, stages = cfg.block_kv, cfg.num_stages
    tile = plgpu.SMEM((T, cfg.head_dim), cfg.dtype, transforms=smem_transforms())
    rings = [
        plgpu.SMEM((stages, T), jnp.float32) for m in (cfg.k_scales, cfg.v_scales) if m == "token"
    ]
    return (tile, *rings)


def with_rings(cfg: _Config, qs: UnitScales, rings) -> UnitScales:
    """``qs`` with its "token" mode rings (``scratch``'s after the tile)."""
    rings = list(rings)
    k_ring = rings.pop(0) if cfg.k_scales == "token" else None
    v_ring = rings.pop(0) if cfg.v_scales == "token" else None
    return qs._replace(k_ring=k_ring, v_ring=v_ring)


def arrivals(cfg: _Config) -> tuple[int, int]:
    """Arrivals on a slot's K and V barriers: the tile's page copies, and on K's as many copies
    again for each of the key and value scales in "token" mode. The value scales ride on the
    K barrier because they multiply P, which is formed before the V tile is waited for."""
    tokens = [cfg.k_scales, cfg.v_scales].count("token")
    return cfg.copies_per_tile * (1 + tokens), cfg.copies_per_tile


def issue(cfg: _Config, unit, qs: UnitScales, i, slot, pages, k_bar) -> None:
    """ "token" mode: the bulk copies of tile i's key (and value) scales into ring slot
    ``slot``, one per page copy (``rows_per_copy`` floats), each one arrival on the slot's K
    barrier (``arrivals``)."""
    C, r, P = cfg.page_size, cfg.rows_per_copy, cfg.num_pages
    for j, page in enumerate(pages):
        tok = (unit.start + i) * cfg.block_kv + j * r
        offset = jnp.clip(page, 0, P - 1) * C + tok % C
        for mode, ref, base, ring in (
            (cfg.k_scales, qs.k_ref, qs.k_base, qs.k_ring),
            (cfg.v_scales, qs.v_ref, qs.v_base, qs.v_ring),
        ):
            if mode == "token":
                plgpu.copy_gmem_to_smem(
                    ref.at[pl.ds(base + offset, r)], ring.at[slot, pl.ds(j * r, r)], k_bar.at[slot],
                    oob_mode=quant.IN_BOUNDS,
                )  # fmt: skip


def page_scales(cfg: _Config, qs: UnitScales, pages) -> tuple:
    """ "page" mode: the key and value scales of a tile's pages (``_gpu_tile._lookup``'s
    entries), as one flat tuple of scalars; () when neither scale is per page."""
    P = cfg.num_pages
    out = []
    for mode, ref, base in (
        (cfg.k_scales, qs.k_ref, qs.k_base),
        (cfg.v_scales, qs.v_ref, qs.v_base),
    ):
        if mode == "page":
            out += [ref[base + jnp.clip(page, 0, P - 1)] for page in pages]
    return tuple(out)


def _vector_layout(cfg: _Config, layout):
    """The layout of a vector over a tile's keys beside its scores: rows with ``swap_ab``."""
    return layout.reduce(1 if cfg.swap_ab else 0)


def _split_page_scalars(cfg: _Config, scalars: tuple) -> tuple[tuple, tuple]:
    n = cfg.copies_per_tile
    k = scalars[:n] if cfg.k_scales == "page" else ()
    return k, scalars[len(k) :]


def _factor(cfg: _Config, mode, head, ring, scalars, slot, layout):
    vec = _vector_layout(cfg, layout)
    return quant.factor(mode, head, ring, slot, scalars, cfg.page_size, vec, cfg.block_kv)


def scale_scores(cfg: _Config, qs: UnitScales, scalars: tuple, slot, sc, layout):
    """The scores of a tile times their key rows' scales."""
    k, _ = _split_page_scalars(cfg, scalars)
    factor = _factor(cfg, cfg.k_scales, qs.k_head, qs.k_ring, k, slot, layout)
    return quant.times(sc, factor, 0 if cfg.swap_ab else 1)


def scale_probabilities(cfg: _Config, qs: UnitScales, scalars: tuple, slot, p, layout, keys_hi):
    """A tile's probabilities times their key rows' value scales ("page" and "token" modes;
    ``p`` itself per head, whose scale multiplies the output). Per token, rows from
    ``keys_hi`` on (past the sequence: stale, maybe NaN, scales) get 0, not ``0 * NaN``."""
    if cfg.v_scales == "head":
        return p
    _, v = _split_page_scalars(cfg, scalars)
    factor = _factor(cfg, cfg.v_scales, qs.v_head, qs.v_ring, v, slot, layout)
    if cfg.v_scales == "token":
        factor = quant.masked_factor(factor, keys_hi, _vector_layout(cfg, layout), cfg.block_kv)
    return quant.times(p, factor, 0 if cfg.swap_ab else 1)


def dequantize(cfg: _Config, src, dst, tile_tok=None, length=None) -> None:
    """Tile ``src`` (8-bit, a ring slot) into the bf16 tile ``dst``; with ``length``, a tile
    past the sequence end writes its rows from ``length`` on as zeros (stale or NaN page tails:
    V's; K's stale rows only give scores that the mask hides)."""
    if length is None:
        quant.dequantize_tile(src, dst, cfg.kv_dtype)
        return
    past = tile_tok + cfg.block_kv > length
    pl.when(past)(lambda: quant.dequantize_tile(src, dst, cfg.kv_dtype, length - tile_tok))
    pl.when(~past)(lambda: quant.dequantize_tile(src, dst, cfg.kv_dtype))
