"""The planted-key attention check (``tests/_attention_checks.py``) has teeth; the kernels pass it.

Meta-tests (CPU): broken attentions (one 64-token tile of one sequence dropped, every logit
scaled by 1.01, each sequence's last page ignored) fail ``assert_rows_close`` by several times
its tolerance for several seeds and lengths >= 4k, while the f64 oracle rounded to bf16, the
jnp f32 decode reference and the XLA implementations pass it. Kernels: the Mosaic GPU and
Mosaic TPU kernels through ``jpaged.paged_attention`` / ``jpaged.ragged_paged_attention`` with
default tuning, in their interpreters on CPU (short lengths around page and tile boundaries;
one longer case each, three of them slow), and compiled on a Hopper GPU at 4k-32k tokens
(``pytest -m gpu``: decode, and ragged batches that pick the paired FA3 body or two compute
warpgroups).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
import pytest
from _attention_checks import (
    ROW_TOLERANCES,
    TILE,
    assert_rows_close,
    planted_decode_case,
    planted_ragged_case,
    reference,
    row_errors,
)

import jpaged
from pallas_kernels.paged_attention.reference import paged_attention_reference

BF16 = jnp.bfloat16
TOL = ROW_TOLERANCES[jnp.dtype(BF16)]

# Cases ``make test`` (CPU CI) leaves out and ``make test-all`` runs (``tests/conftest.py``):
# the longer interpreter cases beyond the decode GPU kernel's (each 7-10 s interpreted).
SLOW_CASES = {
    "test_interpret_long[ragged-pallas_gpu]",
    "test_interpret_long[decode-pallas_tpu]",
    "test_interpret_long[ragged-pallas_tpu]",
}


def _op(kind):
    return jpaged.paged_attention if kind == "decode" else jpaged.ragged_paged_attention


def _bf16(x) -> np.ndarray:
    """An output as a bf16 kernel would return it."""
    return np.asarray(x, jnp.dtype(BF16)).astype(np.float32)  # rounded on the host


# ---------------------------------------------------------------- meta-tests: the check has teeth

C_META, H_META = 16, 64
# (seed, length of the longest sequence): several seeds and lengths >= 4k.
META = [(0, 4096), (1, 4096), (2, 8192), (3, 12288)]
BUGS = ["tile_first", "tile_middle", "tile_last", "logits_x1.01", "last_page"]


@functools.cache
def _meta_case(kind, seed, length, dtype=BF16):
    """A long case (K = 2, G = 2, H = 64, C = 16) and its f64 oracle, shared by the tests."""
    rng = np.random.default_rng(seed)
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=H_META, page_size=C_META, dtype=dtype)
    if kind == "decode":
        case = planted_decode_case(rng, (length, length // 2 + 7, C_META + 1, 1, 0), **shape)
    else:
        # A decode row, a 48-row chunk at the end of a long sequence, a whole prefill, a
        # one-token sequence.
        kv, q = (length, length // 2 + 7, C_META + 1, 1), (1, 48, C_META + 1, 1)
        case = planted_ragged_case(rng, kv, q, **shape)
    return case, reference(case)


def _broken(case, bug: str, seed: int) -> np.ndarray:
    """The f64 oracle of a kernel with ``bug``, rounded to bf16 as that kernel would return it.

    The tile bugs drop one 64-token tile of one sequence (sequence ``seed % 2``: a decode row,
    or for ragged the 48-row chunk, whose rows see the tile or not by causality); "last_page"
    drops the last page of every sequence (1 to C keys); "logits_x1.01" scales every logit.
    """
    lens = case.kv_lens
    S = case.k_dense.shape[-3]
    drop = np.zeros((len(lens), S), bool)
    b = seed % 2
    tiles = int(lens[b]) // TILE  # whole tiles of sequence b
    if bug == "logits_x1.01":
        return _bf16(reference(case, sm_scale=1.01 / math.sqrt(H_META)))
    if bug == "last_page":
        for i, n in enumerate(lens[: len(case.q_lens)]):
            if n:
                drop[i, (-(-int(n) // C_META) - 1) * C_META : n] = True
    else:
        t = {"tile_first": 0, "tile_last": tiles - 1}.get(bug)
        t = int(np.random.default_rng(seed).integers(1, tiles - 1)) if t is None else t
        drop[b, t * TILE : (t + 1) * TILE] = True
    return _bf16(reference(case, drop=drop))


@pytest.mark.parametrize("bug", BUGS)
@pytest.mark.parametrize(("seed", "length"), META)
@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_broken_attention_fails_the_check(kind, seed, length, bug):
    case, ref = _meta_case(kind, seed, length)
    broken = _broken(case, bug, seed)
    with pytest.raises(AssertionError, match="worst row"):
        assert_rows_close(broken, ref, BF16, err_msg=bug)
    # Not a near miss: the bug's worst row is several tolerances off (the correct kernels'
    # worst rows stay under a third of it: test_correct_attention_passes_the_check).
    assert row_errors(broken, ref).max() > 3 * TOL


@pytest.mark.parametrize(("seed", "length"), META)
@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_correct_attention_passes_the_check(kind, seed, length):
    case, ref = _meta_case(kind, seed, length)
    assert_rows_close(_bf16(ref), ref, BF16, err_msg="the f64 oracle rounded to bf16")
    xla = _op(kind)(*case.args, implementation="xla")
    assert xla.dtype == jnp.dtype(BF16)
    assert_rows_close(xla, ref, BF16, err_msg="xla")
    if kind == "decode":  # (the ragged jnp reference holds [T, S, K, H]: 6 s at 4k on CPU)
        assert_rows_close(paged_attention_reference(*case.args), ref, BF16, err_msg="jnp f32")


@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_xla_passes_the_check_in_f16(kind):
    case, _ = _meta_case(kind, 0, 4096, dtype=jnp.float16)
    out = _op(kind)(*case.args, implementation="xla")
    assert_rows_close(out, reference(case), jnp.float16, err_msg="xla f16")


def test_every_tile_and_page_matters():
    # Dropping any one of a 4k sequence's 64 tiles, or any one of its 16-token pages, or
    # scaling the logits by 0.99 or 1.01, fails the check by more than 3x its tolerance.
    rng = np.random.default_rng(11)
    case = planted_decode_case(rng, (4096,), num_q_heads=8, num_kv_heads=1, head_dim=64,
                               page_size=C_META)  # fmt: skip
    ref = reference(case)
    worst = {}
    for size in (TILE, C_META):
        for t in range(4096 // size):
            drop = np.zeros((1, 4096), bool)
            drop[0, t * size : (t + 1) * size] = True
            worst[(size, t)] = row_errors(_bf16(reference(case, drop=drop)), ref).max()
    for f in (0.99, 1.01):
        worst[f] = row_errors(_bf16(reference(case, sm_scale=f / 8.0)), ref).max()
    weakest = min(worst, key=worst.get)
    assert worst[weakest] > 3 * TOL, (weakest, worst[weakest])


def test_the_check_names_the_worst_row():
    ref = np.ones((3, 4, 8))
    out = ref.copy()
    out[2, 1, 5] = 1.05
    with pytest.raises(AssertionError, match=r"worst row \(2, 1\) has error 0.05 .* 1 of 12"):
        assert_rows_close(out, ref, BF16, err_msg="x")
    out[2, 1, 5] = 1.001
    assert assert_rows_close(out, ref, BF16) == pytest.approx(1e-3, rel=1e-3)


def test_the_check_fails_nan_and_nonzero_empty_rows():
    ref = np.ones((2, 3, 4))
    ref[1, 2] = 0.0  # a length-0 sequence's row
    out = ref.copy()
    out[1, 2, 0] = 1e-6
    with pytest.raises(AssertionError, match=r"worst row \(1, 2\)"):
        assert_rows_close(out, ref, BF16)
    out = ref.copy()
    out[0, 1, 3] = np.nan
    with pytest.raises(AssertionError, match=r"worst row \(0, 1\) has error inf"):
        assert_rows_close(out, ref, BF16)


def test_planted_inputs_keep_the_poisoned_layout():
    # The planted values replace the live slots only: free pages and each last page's tail
    # stay NaN, and the pages hold exactly the oracle's dense values.
    rng = np.random.default_rng(5)
    case = planted_decode_case(rng, (40, 0, 17), num_q_heads=4, num_kv_heads=2, head_dim=64,
                               page_size=16, num_layers=2)  # fmt: skip
    q, k_pages, v_pages, tables, lens = case.args
    assert q.dtype == k_pages.dtype == v_pages.dtype == jnp.dtype(BF16) and k_pages.ndim == 5
    for pages, dense in ((k_pages, case.k_dense), (v_pages, case.v_dense)):
        x = np.asarray(pages.astype(np.float32))
        used = set()
        for b, n in enumerate(lens):
            for j in range(n):
                page, slot = tables[b, j // 16], j % 16
                used.add((page, slot))
                np.testing.assert_array_equal(x[:, :, page, slot], dense[:, b, j])
        unused = [(p, s) for p in range(x.shape[2]) for s in range(16) if (p, s) not in used]
        assert unused and all(np.isnan(x[:, :, p, s]).all() for p, s in unused)


# --------------------------------------------------------------- kernels in their interpreters

# Page size 16, tile 64 (128 for the decode GPU kernel at H = 64): lengths on both sides of
# the page and tile boundaries.
C_INT = 16
DECODE_LENGTHS = (0, 1, C_INT - 1, C_INT, C_INT + 1, 63, 64, 65, 130)
RAGGED_KV, RAGGED_Q = (1, C_INT - 1, C_INT + 1, 65, 130), (1, 3, C_INT + 1, 20, 40)


def _check_kernel(kind, case, implementation, *, interpret, err_msg, **kw):
    out = _op(kind)(*case.args, implementation=implementation, interpret=interpret, **kw)
    assert out.shape == case.args[0].shape and out.dtype == case.args[0].dtype
    layer = kw.get("layer")
    ref = reference(case, layer=None if layer is None else int(layer))
    assert_rows_close(out, ref, case.args[0].dtype, err_msg=err_msg)


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_interpret_boundaries(kind, implementation):
    rng = np.random.default_rng(21)
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=C_INT)
    if kind == "decode":
        case = planted_decode_case(rng, DECODE_LENGTHS, **shape)
    else:
        case = planted_ragged_case(rng, RAGGED_KV, RAGGED_Q, **shape)
    _check_kernel(kind, case, implementation, interpret=True, err_msg=f"{implementation}")


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_interpret_long(kind, implementation):
    # About 1k tokens of 64-token pages (17+ tiles), G = 8 (decode) or 1 (ragged), H = 128.
    rng = np.random.default_rng(22)
    if kind == "decode":
        case = planted_decode_case(rng, (1100, 64, 65), num_q_heads=8, num_kv_heads=1,
                                   head_dim=128, page_size=64)  # fmt: skip
    else:
        case = planted_ragged_case(rng, (1100, 65), (24, 65), num_q_heads=2, num_kv_heads=2,
                                   head_dim=128, page_size=64)  # fmt: skip
    _check_kernel(kind, case, implementation, interpret=True, err_msg=f"{implementation}")


# ------------------------------------------------------------------------ GPU: compiled kernels

# Every (G, H) pair once; the long length and the page size cycle so that each long length
# meets each G, H and page size.
LONG = (4096, 16384, 32768)
PAGES = (16, 64, 128)
GPU_CASES = [
    pytest.param(G, H, LONG[(i + j) % 3], PAGES[(i + 2 * j) % 3], id=f"G{G}-H{H}")
    for i, G in enumerate((1, 4, 8))
    for j, H in enumerate((64, 128, 256))
]


def _gpu_decode_case(rng, G, H, long, C, **kw):
    lengths = (0, 1, C - 1, C, C + 1, long, long // 2 + 3)
    return planted_decode_case(rng, lengths, num_q_heads=2 * G, num_kv_heads=2, head_dim=H,
                               page_size=C, **kw)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("G", "H", "long", "C"), GPU_CASES)
def test_gpu_decode(G, H, long, C):
    case = _gpu_decode_case(np.random.default_rng(G * H + long), G, H, long, C)
    _check_kernel("decode", case, "pallas_gpu", interpret=False, err_msg=f"{long=} {C=}")


# Ragged batch shapes that pick different default bodies: decode-heavy (T <= 2 B: the paired
# FA3 body at H <= 128, split over K/V at long context) and prefill-heavy (a 96-row chunk at
# the end of the long sequence: two compute warpgroups).
def _gpu_ragged_case(rng, G, H, long, C, shape, **kw):
    kv = (1, C - 1, C, C + 1, long, long // 2 + 3)
    q = (1, 1, 1, 1, 96, 1) if shape == "prefill_heavy" else (1, 1, 2, 1, 1, 2)
    return planted_ragged_case(rng, kv, q, num_q_heads=2 * G, num_kv_heads=2, head_dim=H,
                               page_size=C, **kw)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["decode_heavy", "prefill_heavy"])
@pytest.mark.parametrize(("G", "H", "long", "C"), GPU_CASES)
def test_gpu_ragged(G, H, long, C, shape):
    case = _gpu_ragged_case(np.random.default_rng(G * H + long + 1), G, H, long, C, shape)
    _check_kernel("ragged", case, "pallas_gpu", interpret=False, err_msg=f"{long=} {C=} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_gpu_stacked_pool_long(kind):
    # A 5-D pool read at a traced layer index, 32k tokens.
    rng = np.random.default_rng(31)
    if kind == "decode":
        case = _gpu_decode_case(rng, 4, 128, 32768, 64, num_layers=2)
    else:
        case = _gpu_ragged_case(rng, 4, 128, 32768, 64, "prefill_heavy", num_layers=2)
    _check_kernel(kind, case, "pallas_gpu", interpret=False, err_msg="layer 1",
                  layer=jnp.int32(1))  # fmt: skip
