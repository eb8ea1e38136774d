"""The split-KV log-sum-exp merge (``pallas_kernels._merge``) against an f64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._merge import merge_lse_partials


def _reference(o, lse):
    lse = lse.astype(np.float64)
    mx = np.max(lse, axis=0)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    w = np.exp2(lse - mx)
    den = w.sum(axis=0)
    return (w[..., None] * o).sum(axis=0) / np.where(den > 0, den, 1.0)[..., None]


@pytest.mark.parametrize("shape", [(1, 5, 8), (2, 3, 16), (32, 32, 128), (7, 4, 3, 64)])
def test_matches_reference(shape):
    rng = np.random.default_rng(sum(shape))
    lse = (rng.standard_normal(shape[:-1]) * 8).astype(np.float32)
    lse[rng.random(shape[:-1]) < 0.25] = -np.inf  # empty splits
    lse[:, 0] = -np.inf  # a row no split saw
    lse[:, -1] = 3.0  # equal weights
    o = rng.standard_normal(shape).astype(np.float32)
    o[np.isinf(lse)] = 0.0  # as the kernels write an empty split
    out = jax.jit(lambda a, b: merge_lse_partials(a, b, jnp.float32))(o, lse)
    out = np.asarray(out)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, _reference(o, lse), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[0], 0.0)


def test_extreme_lse_and_dtypes():
    # lse far apart: the small split's weight underflows to exactly 0, no inf or NaN.
    lse = np.array([[1e4], [-1e4], [-np.inf]], np.float32)
    o = np.array([[[1.0, 2.0]], [[5.0, 6.0]], [[0.0, 0.0]]], np.float32)
    out = merge_lse_partials(jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse), jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[1.0, 2.0]])


def test_bad_shapes():
    with pytest.raises(ValueError, match="lse shape"):
        merge_lse_partials(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4)), jnp.float32)
