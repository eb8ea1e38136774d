"""Tests of the Mosaic GPU ragged kernel's persistent grid (``persistent=True``: one CTA per SM
running many (tile, KV head) work items, ``_gpu_bodies._kernel_body_fa3``).

CPU CI: the dealing of work items to CTAs (every item exactly once), the argument checks and
cross-lowering for CUDA (the FA3-style body has no interpreter). GPU (``pytest -m gpu``): the
compiled kernel against the f64 dense oracle, with more work items than CTAs (several rounds,
a partial last one), permuted tables and NaN-poisoned pages.
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ragged_inputs import dense_ragged_attention, make_ragged_case
from _tolerances import assert_close

from pallas_kernels import _backend
from pallas_kernels.ragged_paged_attention import kernel_gpu
from pallas_kernels.ragged_paged_attention._gpu_order import pair_long_with_short
from pallas_kernels.ragged_paged_attention._gpu_tile import _persistent_items


@pytest.mark.parametrize(
    ("ctas", "kv_heads", "units", "splits"),
    [(132, 8, 1026, 1), (132, 8, 3, 1), (5, 1, 7, 1), (132, 4, 33, 1), (7, 3, 14, 1),
     (4, 2, 2, 1), (5, 3, 21, 3), (132, 8, 513, 1)],
)  # fmt: skip
def test_persistent_ctas_deal_every_item_once(ctas, kv_heads, units, splits):
    cfg = types.SimpleNamespace(persistent=ctas, num_kv_heads=kv_heads, kv_splits=splits)
    seen = []
    counts = []
    for cta in range(ctas):
        count, item = _persistent_items(cfg, units, cta=cta)
        counts.append(int(count))
        for j in range(int(count)):
            unit, head = item(jnp.int32(j))
            assert 0 <= int(head) < kv_heads
            assert 0 <= int(unit) < units
            seen.append(int(head) * units + int(unit))
    assert sorted(seen) == list(range(units * kv_heads))
    assert max(counts) - min(counts) <= 2 * splits  # a block of two tiles at most apart


def test_persistent_ctas_take_consecutive_pairs():
    # Blocks of two consecutive units (a long tile and a short one after the pairing), block b
    # to CTA b mod P: CTA 1 of 4 runs units 2, 3, then 10, 11.
    cfg = types.SimpleNamespace(persistent=4, num_kv_heads=1, kv_splits=1)
    count, item = _persistent_items(cfg, 12, cta=1)
    assert int(count) == 4
    assert [int(item(jnp.int32(j))[0]) for j in range(4)] == [2, 3, 10, 11]


def test_persistent_ctas_running_at_once_share_one_kv_head():
    # Head-major items: what the 132 CTAs run first is units 0..263 of head 0, as the one-item
    # grid launches them, so their K/V stays in L2.
    cfg = types.SimpleNamespace(persistent=132, num_kv_heads=8, kv_splits=1)
    heads = {int(_persistent_items(cfg, 1026, cta=c)[1](jnp.int32(0))[1]) for c in range(132)}
    units = {int(_persistent_items(cfg, 1026, cta=c)[1](jnp.int32(0))[0]) for c in range(132)}
    assert heads == {0} and units == set(range(0, 264, 2))


@pytest.mark.parametrize("num_real", [0, 1, 2, 5, 8])
def test_pair_long_with_short_interleaves_the_real_tiles(num_real):
    order = jnp.arange(100, 108, dtype=jnp.int32)
    paired = np.asarray(pair_long_with_short(order, jnp.int32(num_real)))
    expected = {
        0: [100, 101, 102, 103, 104, 105, 106, 107],
        1: [100, 101, 102, 103, 104, 105, 106, 107],
        2: [100, 101, 102, 103, 104, 105, 106, 107],
        5: [100, 104, 101, 103, 102, 105, 106, 107],
        8: [100, 107, 101, 106, 102, 105, 103, 104],
    }[num_real]
    assert paired.tolist() == expected


@pytest.mark.parametrize(
    ("T", "B", "block_kv"), [(16384, 2, 128), (16384, 2, 64), (4096, 8, 128), (512, 64, 64)]
)
def test_persistent_deal_balances_causal_prompts(T, B, block_kv):
    # Work of a tile = the K/V tiles it visits (causal, 64-token tiles), + 2 for its start. The
    # CTA with the most work has at most 7% over the mean (the 132 CTAs' share of 4,096 items
    # is 31.03, so one more pair is 6.4% over): dealt round by round without the pairing, a
    # 16k-token prompt's CTAs reached 1.5x the mean.
    P, K, tile = 132, 8, 64
    cfg = types.SimpleNamespace(persistent=P, num_kv_heads=K, kv_splits=1)
    tiles = [(b, ((t + 1) * tile + block_kv - 1) // block_kv + 2) for b in range(B)
             for t in range(T // tile)]  # fmt: skip
    seq, work = np.asarray(tiles).T
    by_sequence = np.lexsort((-work, seq)).astype(np.int32)  # the kernel's prefill order
    order = np.asarray(pair_long_with_short(jnp.asarray(by_sequence), jnp.int32(len(work))))
    loads = []
    for cta in range(P):
        count, item = _persistent_items(cfg, len(work), cta=cta)
        loads.append(sum(work[order[int(item(jnp.int32(j))[0])]] for j in range(int(count))))
    assert max(loads) <= 1.07 * np.mean(loads)


def _sds_args(T, N, K, H, C, B=4, W=8):
    sds = jax.ShapeDtypeStruct
    pool = (K, 40, C, H)
    return (
        sds((T, N, H), jnp.bfloat16), sds(pool, jnp.bfloat16), sds(pool, jnp.bfloat16),
        sds((B, W), jnp.int32), sds((B,), jnp.int32), sds((B + 1,), jnp.int32), sds((), jnp.int32),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fa3": False}, "persistent=True needs the FA3-style body"),
        ({"paired": True}, "persistent=True needs the FA3-style body"),
        ({"direct_io": False}, "persistent=True needs the FA3-style body's in-place Q/O"),
        # a second staging tile and the LSE tiles beside 128-key rings
        ({"kv_splits": 3, "block_kv": 128}, "bytes of SMEM.*or pass persistent=False"),
    ],
    ids=str,
)
def test_persistent_rejects_what_it_cannot_run(options, message):
    args = _sds_args(T=100, N=32, K=8, H=128, C=16)
    with pytest.raises(ValueError, match=message):
        kernel_gpu.make_config(*args, sm_scale=0.1, persistent=True, **options)


def test_persistent_grid_is_capped_by_the_work_items():
    # 100 tokens of 32-token tiles over 4 sequences: at most 7 tiles + 2 padding, x 8 KV heads.
    cfg, _ = kernel_gpu.make_config(*_sds_args(100, 32, 8, 128, 16), sm_scale=0.1, persistent=True)
    assert cfg.persistent == 72
    big, _ = kernel_gpu.make_config(*_sds_args(8192, 32, 8, 128, 16), sm_scale=0.1, persistent=True)
    assert big.persistent == _backend.gpu_num_sms()  # one CTA per SM (132 without a GPU)
    # Asked for, it takes the 64-key tiles and 3-deep ring measured for it, and a decode-heavy
    # batch runs it unpaired instead of refusing.
    assert (big.block_kv, big.num_stages) == (64, 3)
    decode, _ = kernel_gpu.make_config(*_sds_args(8, 32, 8, 128, 16), sm_scale=0.1, persistent=True)
    assert decode.persistent > 0 and not decode.paired
    chosen, _ = kernel_gpu.make_config(
        *_sds_args(8192, 32, 8, 128, 16), sm_scale=0.1, persistent=True, block_kv=128
    )
    assert (chosen.block_kv, chosen.num_stages) == (128, 2)


@pytest.mark.parametrize(
    ("shape", "options", "expected"),
    [
        # prefill-heavy, tables of at most 1,024 keys (64 pages of 16), items enough: on, with
        # 64-key tiles and a 3-deep ring
        ({"T": 8192, "W": 64}, {}, (132, 64, 3)),
        ({"T": 8192, "W": 16, "C": 64}, {}, (132, 64, 3)),
        # a table that may hold 1,040 keys: off (an engine's tables span the whole context)
        ({"T": 8192, "W": 65}, {}, (0, 128, 2)),
        # decode-heavy (T <= 2 B): paired instead (two rings of 64-key tiles)
        ({"T": 8, "W": 8}, {}, (0, 64, 2)),
        # too few items to fill the CTAs three times without splits
        ({"T": 1000, "W": 8}, {}, (0, 128, 2)),
        # a knob the default would set, or one it cannot take, was chosen: off
        ({"T": 8192, "W": 64}, {"block_kv": 128}, (0, 128, 2)),
        ({"T": 8192, "W": 64}, {"num_stages": 2}, (0, 128, 2)),
        ({"T": 8192, "W": 64}, {"direct_io": False}, (0, 128, 2)),
        ({"T": 8192, "W": 64}, {"persistent": False}, (0, 128, 2)),
        # G = 16 (no Q/O in place) or head dim 256: off
        ({"T": 8192, "W": 64, "N": 64, "K": 4}, {}, (0, 128, 2)),
        ({"T": 8192, "W": 64, "H": 256, "C": 256}, {}, (0, 64, 2)),
    ],
    ids=str,
)
def test_persistent_default(shape, options, expected):
    args = _sds_args(
        shape["T"], shape.get("N", 32), shape.get("K", 8), shape.get("H", 128),
        shape.get("C", 16), W=shape["W"],
    )  # fmt: skip
    cfg, _ = kernel_gpu.make_config(*args, sm_scale=0.1, fa3=True, **options)
    assert (cfg.persistent, cfg.block_kv, cfg.num_stages) == expected


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"num_wgs": 1, "causal": False},
        {"sliding_window": 50, "logits_soft_cap": 30.0, "kv_splits": 3, "block_kv": 64},
        {"H": 64, "C": 8, "K": 4, "L": 3},
        {"block_kv": 128, "num_stages": 2},
    ],
    ids=str,
)
def test_persistent_cross_lowers_for_cuda(variant):
    v = dict(variant)
    N, K, H, C, L = v.pop("N", 32), v.pop("K", 8), v.pop("H", 128), v.pop("C", 16), v.pop("L", None)
    args = list(_sds_args(100, N, K, H, C))
    if L is not None:
        args[1] = args[2] = jax.ShapeDtypeStruct((L, K, 40, C, H), jnp.bfloat16)

    def f(*a):
        return kernel_gpu.ragged_paged_attention_pallas_gpu(
            *a, sm_scale=0.125, layer=None if L is None else 1, fa3=True, persistent=True, **v
        )

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text.lower() and "_pers_" in text


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"num_wgs": 1},
        {"sliding_window": 300, "logits_soft_cap": 30.0},
        {"causal": False, "num_layers": 2, "layer": jnp.int32(1)},
        {"num_q_heads": 24},  # G = 6: 8 tokens per warpgroup in place
        {"page_size": 8, "sm_scale": -0.2},
        {"page_size": 128, "tile_order": "index"},
        {"kv_splits": 2, "block_kv": 64},
        {"dtype": jnp.float16, "head_dim": 64},
        {"block_kv": 128, "num_stages": 2},
    ],
    ids=str,
)
def test_gpu_persistent_matches_the_oracle(extra):
    extra = dict(extra)
    rng = np.random.default_rng(21)
    dtype = extra.pop("dtype", jnp.bfloat16)
    H = extra.pop("head_dim", 128)
    # 0-, 1- and page-boundary lengths beside long prompts: ~150 tiles x 4 KV heads, more work
    # items than CTAs, with a partial last round.
    case = make_ragged_case(
        rng, (0, 1, 15, 16, 17, 99, 1000, 2500, 3100), (0, 1, 1, 16, 5, 99, 1, 1200, 3100),
        num_q_heads=extra.pop("num_q_heads", 16), num_kv_heads=4, head_dim=H, dtype=dtype,
        page_size=extra.pop("page_size", 16), num_layers=extra.pop("num_layers", None),
    )  # fmt: skip
    scale = extra.pop("sm_scale", 1.0 / math.sqrt(H))
    layer = extra.pop("layer", None)
    opts = {k: extra.pop(k) for k in ("sliding_window", "logits_soft_cap", "causal") if k in extra}
    cfg, _ = kernel_gpu.make_config(
        *case.args, sm_scale=scale, layer=layer, persistent=True, **opts, **extra
    )
    assert cfg.persistent > 0
    out = kernel_gpu.ragged_paged_attention_pallas_gpu(
        *case.args, sm_scale=scale, layer=layer, persistent=True, **opts, **extra
    )
    ref = dense_ragged_attention(
        case, sm_scale=scale, layer=None if layer is None else int(layer), **opts
    )
    assert_close(out, ref, dtype, err_msg=str(extra))
    # The same call on the one-item-per-CTA grid with the same tiles and ring (persistent=True
    # alone takes its own): the persistent grid changes nothing.
    same_tiles = {"block_kv": cfg.block_kv, "num_stages": cfg.num_stages}
    plain = kernel_gpu.ragged_paged_attention_pallas_gpu(
        *case.args, sm_scale=scale, layer=layer, persistent=False, **opts, **{**extra, **same_tiles}
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))


def _short_prompts_case(page_size):
    """Prompts of at most 1,024 keys in a table of 1,024 keys (and a 1-token decode, a
    17-key one): the default picks the persistent grid, its 3-deep ring wrapping across items."""
    rng = np.random.default_rng(22 + page_size)
    kv_lens = (1024, 1, 1000, 17, 640, 1023, 512, 900, 64, 700)
    q_lens = (1024, 1, 1000, 1, 600, 1023, 512, 300, 64, 700)
    return make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
        dtype=jnp.bfloat16, page_size=page_size, width=1024 // page_size,
    )  # fmt: skip


@pytest.mark.parametrize("page_size", [16, 64])
def test_short_prompts_take_the_persistent_default(page_size):
    cfg, _ = kernel_gpu.make_config(*_short_prompts_case(page_size).args, sm_scale=0.1, fa3=True)
    assert (cfg.persistent > 0, cfg.block_kv, cfg.num_stages) == (True, 64, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_persistent_default_matches_the_oracle(page_size):
    case = _short_prompts_case(page_size)
    assert kernel_gpu.make_config(*case.args, sm_scale=0.1)[0].persistent > 0
    out = kernel_gpu.ragged_paged_attention_pallas_gpu(*case.args, sm_scale=0.1)
    assert_close(out, dense_ragged_attention(case, sm_scale=0.1), jnp.bfloat16)
