"""A quantized PagedKVCache (fp8 / int8 pages, per-token f32 scales): creation and sizing, the
quantizing writes (scales from the values, saturating, no NaN from zero tokens), copy-on-write
and swap moving scales with their pages, donation, and attention over the written pool against
an f64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import dense_attention

import jpaged
from jpaged import (
    PagedKVCache,
    copy_pages,
    gather_pages,
    pages_for_budget,
    scatter_pages,
    write_kv,
    write_kv_layer,
)
from jpaged.kv import cache as _cache
from jpaged.kv import quantize

L, K, P, C, H = 2, 2, 12, 4, 16
NAMES = ["fp8", "fp8_e5m2", "int8"]
# Worst relative error of one value after a round trip: half a step of the format's mantissa
# (e4m3: 2^-4, e5m2: 2^-3) or, for int8, half a step of amax / 127 (relative to amax).
ROUND_TRIP = {"fp8": 2.0**-4, "fp8_e5m2": 2.0**-3, "int8": 0.5 / 127}


def _dequantized(cache: PagedKVCache):
    k = quantize.dequantize(cache.k_pages, cache.k_scale)
    v = quantize.dequantize(cache.v_pages, cache.v_scale)
    return np.asarray(k, np.float64), np.asarray(v, np.float64)


@pytest.mark.parametrize("name", NAMES)
def test_create_and_budget(name):
    cache = PagedKVCache.create(L, K, P, C, H, dtype=name)
    assert cache.quantized and cache.dtype == quantize.kv_dtype(name)
    assert cache.k_scale.shape == (L, K, P, C) and cache.k_scale.dtype == jnp.float32
    assert set(cache.scales) == {"k_scale", "v_scale"}
    assert cache.bytes == 2 * L * K * P * C * (H + 4)
    assert cache.bytes_per_page == 2 * L * K * C * (H + 4)
    # The same bytes hold about twice the bf16 pages (the scales cost 4 bytes a token).
    budget = 1 << 24
    bf16 = pages_for_budget(budget, L, K, C, 128, jnp.bfloat16)
    q8 = pages_for_budget(budget, L, K, C, 128, name)
    assert q8 == budget // (2 * L * K * C * 132) and 1.9 < q8 / bf16 < 2.0
    big = PagedKVCache.create_from_budget(budget, L, K, C, 128, name)
    assert big.num_pages == q8 and big.bytes <= budget
    assert not PagedKVCache.create(L, K, P, C, H, jnp.bfloat16).scales


def test_bad_pools_raise():
    pages = jnp.zeros((L, K, P, C, H), jnp.int8)
    with pytest.raises(ValueError, match="k_scale must be given with int8 pages"):
        PagedKVCache(k_pages=pages, v_pages=pages)
    with pytest.raises(ValueError, match=r"v_scale must be float32 of shape \[L, K, P, C\]"):
        PagedKVCache(
            k_pages=pages, v_pages=pages, k_scale=jnp.ones((L, K, P, C)),
            v_scale=jnp.ones((L, K, P, 1)),
        )  # fmt: skip
    f = jnp.zeros((L, K, P, C, H))
    with pytest.raises(ValueError, match="go with quantized pages"):
        PagedKVCache(k_pages=f, v_pages=f, k_scale=jnp.ones((L, K, P, C)), v_scale=None)
    with pytest.raises(ValueError, match="must be one of"):
        PagedKVCache.create(L, K, P, C, H, dtype="fp4")


@pytest.mark.parametrize("name", NAMES)
def test_write_quantizes_per_token(name):
    rng = np.random.default_rng(0)
    cache = PagedKVCache.create(L, K, P, C, H, dtype=name)
    T = 7
    magnitudes = rng.lognormal(0.0, 2.0, size=(L, T, K, 1))
    k = (rng.standard_normal((L, T, K, H)) * magnitudes).astype(np.float32)
    k[:, 3] = 0.0  # an all-zero token: scale 1, zero codes, no 0 / 0
    v = rng.standard_normal((L, T, K, H)).astype(np.float32)
    slots = np.array([5, 0, 47, 6, -1, 13, 22], np.int32)
    cache = write_kv(cache, jnp.asarray(k), jnp.asarray(v), slots)
    kd, vd = _dequantized(cache)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        page, off = divmod(int(slot), C)
        for x, xd in ((k, kd), (v, vd)):
            got = xd[:, :, page, off]  # [L, K, H]
            want = x[:, t]
            amax = np.abs(want).max(axis=-1, keepdims=True)
            err = np.abs(got - want)
            bound = ROUND_TRIP[name] * (amax if name == "int8" else np.abs(want)) + 1e-30
            assert np.all(err <= bound * 1.0001 + 2e-38 * amax), (name, t)
    assert np.all(np.asarray(cache.k_scale)[:, :, 0, 3] == 1.0)  # the zero token (slot 6)
    assert np.all(np.asarray(cache.k_pages, np.float32)[:, :, 1, 2] == 0.0)
    assert np.all(np.isfinite(kd)) and np.all(np.isfinite(vd))


@pytest.mark.parametrize("name", NAMES)
def test_write_saturates(name):
    # A value far beyond the format's range quantizes to the largest code, never inf or NaN;
    # the token's other values keep their ratio to it.
    cache = PagedKVCache.create(1, 1, 2, C, H, dtype=name)
    k = np.ones((1, 1, 1, H), np.float32)
    k[..., 0] = 3e38
    cache = write_kv(cache, jnp.asarray(k), jnp.asarray(-k), np.array([1], np.int32))
    codes = np.asarray(cache.k_pages[0, 0, 0, 1], np.float32)
    assert np.all(np.isfinite(codes)) and codes[0] == quantize.fmax(name)
    kd, vd = _dequantized(cache)
    np.testing.assert_allclose(kd[0, 0, 0, 1, 0], 3e38, rtol=1e-6)
    np.testing.assert_allclose(vd[0, 0, 0, 1, 0], -3e38, rtol=1e-6)


def test_write_kv_layer_in_a_jitted_loop_then_attention():
    # The model's pattern: write a layer's new tokens (traced layer) inside jit, then attend
    # with the cache's scales; against f64 attention on the values written, within the
    # quantization error, and against the dequantized pool exactly (f32 rounding).
    rng = np.random.default_rng(1)
    B, N, T = 3, 4, 9
    lengths = np.array([9, 0, 5], np.int32)
    tables = np.array([[7, 2, 9], [0, 0, 0], [4, 11, 0]], np.int32)  # permuted pages
    slots = np.array([tables[0, p // C] * C + p % C for p in range(9)], np.int32)  # sequence 0
    k = rng.standard_normal((L, T, K, H)).astype(np.float32)
    v = rng.standard_normal((L, T, K, H)).astype(np.float32)

    @jax.jit
    def step(cache, k, v):
        for layer in range(L):
            cache = write_kv_layer(cache, jnp.int32(layer), k[layer], v[layer], slots)
        return cache

    cache = step(PagedKVCache.create(L, K, P, C, H, dtype="fp8"), jnp.asarray(k), jnp.asarray(v))
    # Sequence 2's five tokens, written eagerly.
    k2 = rng.standard_normal((L, 5, K, H)).astype(np.float32)
    v2 = rng.standard_normal((L, 5, K, H)).astype(np.float32)
    s2 = np.array([tables[2, p // C] * C + p % C for p in range(5)], np.int32)
    cache = write_kv(cache, jnp.asarray(k2), jnp.asarray(v2), s2)
    q = rng.standard_normal((B, N, H)).astype(np.float32)
    kd, vd = _dequantized(cache)
    for layer in range(L):
        out = jpaged.paged_attention(
            jnp.asarray(q), cache.k_pages, cache.v_pages, tables, lengths, layer=layer,
            implementation="xla", **cache.scales,
        )  # fmt: skip
        dense_k = np.zeros((B, 3 * C, K, H))
        dense_v = np.zeros((B, 3 * C, K, H))
        exact_k, exact_v = np.zeros_like(dense_k), np.zeros_like(dense_v)
        dense_k[0, :9], dense_v[0, :9] = k[layer], v[layer]
        dense_k[2, :5], dense_v[2, :5] = k2[layer], v2[layer]
        for b in (0, 2):
            for p in range(lengths[b]):
                page, off = tables[b, p // C], p % C
                exact_k[b, p] = kd[layer, :, page, off]
                exact_v[b, p] = vd[layer, :, page, off]
        ref = dense_attention(q, exact_k, exact_v, lengths)
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)
        orig = dense_attention(q, dense_k, dense_v, lengths)
        err = np.abs(np.asarray(out) - orig).max() / np.abs(orig).max()
        assert err < 0.05, err  # e4m3's 2^-4 rounding, averaged by the softmax


@pytest.mark.parametrize("name", NAMES)
def test_copy_and_swap_move_scales(name):
    rng = np.random.default_rng(2)
    cache = PagedKVCache.create(L, K, P, C, H, dtype=name)
    T = 2 * C
    k = rng.standard_normal((L, T, K, H)).astype(np.float32) * 10.0
    cache = write_kv(cache, jnp.asarray(k), jnp.asarray(-k), np.arange(T, dtype=np.int32))
    before = jax.tree.map(np.asarray, cache)
    cache = copy_pages(cache, np.array([[1, 5], [0, 7], [-1, -1]], np.int32))
    after = jax.tree.map(np.asarray, cache)
    for name_, x in (("k_pages", after.k_pages), ("k_scale", after.k_scale),
                     ("v_scale", after.v_scale)):  # fmt: skip
        ref = getattr(before, name_)
        np.testing.assert_array_equal(
            np.asarray(x[:, :, 5], np.float32), np.asarray(ref[:, :, 1], np.float32)
        )
        np.testing.assert_array_equal(
            np.asarray(x[:, :, 7], np.float32), np.asarray(ref[:, :, 0], np.float32)
        )
    # Swap out pages 5 and 0, then in at 9 and 10: codes and scales as they were.
    parts = gather_pages(cache, np.array([5, 0, -1], np.int32))
    assert len(parts) == 4 and parts[2].shape == (L, K, 3, C) and parts[0].dtype == cache.dtype
    host = [np.asarray(x) for x in parts]
    assert np.all(host[2][:, :, 2] == 0.0)  # the -1 row reads zeros
    cache = scatter_pages(cache, np.array([9, 10, -1], np.int32), *host)
    kd, vd = _dequantized(cache)
    kb, vb = _dequantized(before)
    np.testing.assert_array_equal(kd[:, :, 9], kb[:, :, 1])
    np.testing.assert_array_equal(vd[:, :, 10], vb[:, :, 0])
    # Floating pages into a quantized pool are quantized on the way in.
    f = rng.standard_normal((L, K, 1, C, H)).astype(np.float32)
    cache = scatter_pages(cache, np.array([3], np.int32), f, f)
    kd, _ = _dequantized(cache)
    assert np.abs(kd[:, :, 3] - f[:, :, 0]).max() <= ROUND_TRIP[name] * np.abs(f).max() * 1.01


def test_scatter_pages_checks_codes_and_scales():
    cache = PagedKVCache.create(L, K, P, C, H, dtype="int8")
    codes = np.zeros((L, K, 1, C, H), np.int8)
    ones = np.ones((L, K, 1, C), np.float32)
    ids = np.array([1], np.int32)
    with pytest.raises(ValueError, match="k_scale and v_scale go together"):
        scatter_pages(cache, ids, codes, codes, ones)
    with pytest.raises(ValueError, match="must hold the pool's int8 codes"):
        scatter_pages(cache, ids, codes.astype(np.float32), codes, ones, ones)
    with pytest.raises(ValueError, match=r"v_scale must be float32 \[L, K, M, C\]"):
        scatter_pages(cache, ids, codes, codes, ones, ones[..., :1])
    f32 = PagedKVCache.create(L, K, P, C, H, dtype=jnp.float32)
    with pytest.raises(ValueError, match="only with a quantized pool"):
        scatter_pages(f32, ids, codes.astype(np.float32), codes.astype(np.float32), ones, ones)


def test_writes_refuse_values_already_in_the_pool_dtype():
    # K/V cast to fp8 before the write would have lost their range: a clear error instead.
    cache = PagedKVCache.create(L, K, P, C, H, dtype="fp8")
    k = jnp.ones((3, K, H), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"k_TKH.dtype=float8_e4m3fn is the pool's own"):
        write_kv_layer(cache, 0, k, k, np.array([0, 1, 2], np.int32))
    with pytest.raises(ValueError, match=r"k_LKMCH.dtype=float8_e4m3fn is the pool's own"):
        scatter_pages(cache, np.array([1]), jnp.ones((L, K, 1, C, H), jnp.float8_e4m3fn),
                      jnp.ones((L, K, 1, C, H)))  # fmt: skip


def test_quantized_updates_donate_and_compile_once():
    cache = PagedKVCache.create(L, K, P, C, H, dtype="fp8")
    k = jnp.ones((5, K, H))
    slots = jnp.array([0, 1, 2, -1, 40], jnp.int32)
    old = jax.tree.leaves(cache)
    cache = write_kv_layer(cache, 1, k, k, slots)
    jax.block_until_ready(cache)
    assert all(x.is_deleted() for x in old)
    stats = _cache._write_kv_layer.lower(cache, 1, k, k, slots).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= cache.bytes
    size = _cache._write_kv_layer._cache_size()
    cache = write_kv_layer(cache, 0, 2 * k, k, slots)
    cache = copy_pages(cache, np.array([[0, 3]], np.int32))
    cache = copy_pages(cache, np.array([[1, 4]], np.int32))
    assert _cache._write_kv_layer._cache_size() == size
    assert float(cache.k_scale[0, 0, 3, 0]) == pytest.approx(2.0 / quantize.fmax("fp8"))


@pytest.mark.parametrize("granularity", ["tensor", "head", "page", "token"])
def test_quantize_any_granularity_feeds_attention(granularity):
    # ``quantize.quantize`` makes pools of any granularity for the attention ops.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((K, P, C, H)).astype(np.float32)
    pages, scale = quantize.quantize(jnp.asarray(x), jnp.float8_e4m3fn, granularity)
    assert scale.shape == {"tensor": (), "head": (K, 1, 1), "page": (K, P, 1),
                           "token": (K, P, C)}[granularity]  # fmt: skip
    back = np.asarray(quantize.dequantize(pages, scale))
    assert np.abs(back - x).max() <= 2.0**-4 * np.abs(x).max() * 1.01
    tables, lengths = np.array([[3, 1, 8]], np.int32), np.array([11], np.int32)
    q = rng.standard_normal((1, 4, H)).astype(np.float32)
    out = jpaged.paged_attention(q, pages, pages, tables, lengths, k_scale=scale, v_scale=scale)
    assert np.all(np.isfinite(np.asarray(out)))
    with pytest.raises(ValueError, match="granularity='row' must be one of"):
        quantize.quantize(jnp.asarray(x), jnp.int8, "row")


def test_quantize_doctests():
    import doctest

    result = doctest.testmod(quantize)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp8", jnp.float8_e4m3fn), ("fp8_e5m2", jnp.float8_e5m2), ("int8", jnp.int8)],
)
def test_quantize_takes_cache_dtype_names(name, dtype):
    # The names ``LLM(cache_dtype=...)`` takes quantize like the dtypes they stand for.
    x = jnp.asarray(np.random.default_rng(4).standard_normal((K, P, C, H)), jnp.float32)
    by_name, by_dtype = quantize.quantize(x, name, "page"), quantize.quantize(x, dtype, "page")
    assert by_name[0].dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(
        np.asarray(by_name[0], np.float32), np.asarray(by_dtype[0], np.float32)
    )
    np.testing.assert_array_equal(np.asarray(by_name[1]), np.asarray(by_dtype[1]))
    with pytest.raises(ValueError, match="must be one of"):
        quantize.quantize(x, "fp4", "page")
    with pytest.raises(ValueError, match="must be one of"):
        quantize.quantize(x, "bf16", "page")
