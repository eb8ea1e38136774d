"""The one tolerance table of the suite, keyed by dtype.

Comparisons are made in f32 with both ``atol`` and ``rtol``. A test that needs a
looser bound multiplies these and says why in a comment at the call site.
"""

import jax.numpy as jnp
import numpy as np

# (atol, rtol) for an attention output computed from inputs of this dtype
# against the f32 reference on the same (dtype-rounded) inputs.
TOLERANCES = {
    jnp.dtype(jnp.float32): (2e-5, 2e-5),
    jnp.dtype(jnp.bfloat16): (2e-2, 2e-2),
    jnp.dtype(jnp.float16): (3e-3, 3e-3),
}


def tol(dtype) -> dict[str, float]:
    atol, rtol = TOLERANCES[jnp.dtype(dtype)]
    return {"atol": atol, "rtol": rtol}


def assert_close(actual, expected, dtype, *, scale: float = 1.0, err_msg: str = "") -> None:
    """Asserts ``actual ≈ expected`` in f32 with the table's tolerance for ``dtype``."""
    t = tol(dtype)
    # Converted on the host (a JAX conversion compiles a program for every shape and dtype).
    a = np.asarray(actual, np.float32)
    e = np.asarray(expected, np.float32)
    assert np.all(np.isfinite(a)), f"non-finite values in output: {err_msg}"
    np.testing.assert_allclose(
        a, e, atol=t["atol"] * scale, rtol=t["rtol"] * scale, err_msg=err_msg
    )
