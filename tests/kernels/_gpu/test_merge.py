"""The shared split-KV merge (``pallas_kernels._gpu.merge``) against an f64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._gpu.merge import merge_splits


@pytest.mark.parametrize("S,R,H", [(1, 5, 8), (2, 3, 16), (32, 32, 128), (8, 257, 64)])
def test_merge_matches_f64_reference(S, R, H):
    rng = np.random.default_rng(S * 1000 + R)
    lse = (rng.standard_normal((S, R)) * 8).astype(np.float32)
    lse[rng.random((S, R)) < 0.25] = -np.inf  # empty splits
    lse[:, 0] = -np.inf  # a row no split saw
    lse[:, -1] = 3.0  # equal weights
    o = rng.standard_normal((S, R, H)).astype(np.float32)
    o[np.isinf(lse)] = 0.0  # as the kernels write an empty split
    out = np.asarray(jax.jit(lambda a, b: merge_splits(a, b, jnp.float32))(o, lse))
    l64 = lse.astype(np.float64)
    mx = np.max(l64, axis=0)
    w = np.exp2(l64 - np.where(np.isfinite(mx), mx, 0.0))
    den = w.sum(axis=0)
    ref = (w[..., None] * o).sum(axis=0) / np.where(den > 0, den, 1.0)[:, None]
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[0], 0.0)


def test_merge_far_apart_and_dtype():
    lse = np.array([[1e4], [-1e4], [-np.inf]], np.float32)
    o = np.array([[[1.0, 2.0]], [[5.0, 6.0]], [[0.0, 0.0]]], np.float32)
    out = merge_splits(jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse), jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[1.0, 2.0]])


def test_merge_bad_shapes():
    with pytest.raises(ValueError, match="lse shape"):
        merge_splits(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4)), jnp.float32)
