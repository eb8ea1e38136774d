"""A faster, result-identical operand transfer for JAX's ``io_callback`` (tests only).

The Pallas interpreters (Mosaic GPU's and Mosaic TPU's, jax 0.11.2) run a kernel as an XLA
program that calls back into Python for its memory accesses, barriers and copies: one decode
case makes some 15,000 calls of about 11 operands each. Before each call
``callback.io_callback_impl`` puts the NumPy operands on the CPU device with
``jax.device_put``, whose general path (tree flattening, checks, a batched dispatch, a result
handler per array) costs up to a third of an interpreted case's time.

``install`` replaces ``io_callback_impl`` with a copy whose transfer puts each NumPy operand
with ``pxla.batched_device_put`` (what ``device_put`` runs for a JAX array on one device):
the same committed single-device arrays (aval, sharding, values, and the same aliasing of an
aligned host buffer). Operands of any other kind, or of a dtype JAX would canonicalize, go
through ``jax.device_put``, as in the original. ``tests/test_fast_callbacks.py`` checks the arrays
against ``device_put``'s and interpreted kernels' outputs against the original's. Nothing in
the library uses this: it only makes CPU CI's interpreted kernel cases cheaper.
"""

from __future__ import annotations

import numpy as np

_original = None


_AVALS: dict = {}  # (shape, dtype, x64) -> the aval device_put gives a NumPy array of them


def _aval(x: np.ndarray):
    """``core.shaped_abstractify(x)``, remembered by shape, dtype and the x64 setting (what
    it depends on for a NumPy array)."""
    from jax._src import config, core

    key = (x.shape, x.dtype, config.enable_x64.value)
    aval = _AVALS.get(key)
    if aval is None:
        aval = _AVALS[key] = core.shaped_abstractify(x)
    return aval


def put_on_cpu(args, cpu_device):
    """``jax.device_put(args, cpu_device)`` for a tuple of operands, NumPy arrays put one by
    one as ``device_put`` puts a JAX array on one device."""
    from jax._src import api, core, dtypes
    from jax._src.interpreters import pxla
    from jax._src.sharding_impls import make_single_device_sharding

    if not core.trace_state_clean():
        return api.device_put(args, cpu_device)
    sharding = make_single_device_sharding(cpu_device)
    out = []
    for x in args:
        if type(x) is not np.ndarray or x.dtype == dtypes.float0:
            return api.device_put(args, cpu_device)
        aval = _aval(x)
        if aval.dtype != x.dtype:  # canonicalized (64-bit types without x64): device_put's
            return api.device_put(args, cpu_device)
        out.append(pxla.batched_device_put(aval, sharding, [x], [cpu_device]))
    return tuple(out)


def fast_io_callback_impl(*args, result_avals, callback, sharding, ordered):
    """``callback.io_callback_impl`` (jax 0.11.2) with ``put_on_cpu`` for its transfer."""
    from jax._src import callback as jax_callback
    from jax._src import config, tree_util
    from jax._src import xla_bridge as xb

    del result_avals, sharding, ordered
    try:
        cpu_device, *_ = xb.local_devices(backend="cpu")
    except RuntimeError as e:
        raise RuntimeError(
            "jax.io_callback failed to find a local CPU device to place the"
            ' inputs on. Make sure "cpu" is listed in --jax_platforms or the'
            " JAX_PLATFORMS environment variable."
        ) from e
    args = put_on_cpu(args, cpu_device)
    with config.default_device(cpu_device):
        try:
            return tree_util.tree_map(np.asarray, callback(*args))
        except BaseException:
            jax_callback.logger.exception("jax.io_callback failed")
            raise


def original_io_callback_impl():
    """The original ``io_callback_impl`` (whether or not ``install`` has run)."""
    from jax._src import callback

    return _original or callback.io_callback_impl


def install() -> bool:
    """Patches ``io_callback_impl`` where the jax in hand has the 0.11.2 form it replaces;
    returns whether it did (elsewhere everything runs unpatched, only slower)."""
    global _original
    import inspect

    import jax

    if jax.__version__ != "0.11.2":
        return False
    from jax._src import callback

    impl = getattr(callback, "io_callback_impl", None)
    if impl is None or "api.device_put(args, cpu_device)" not in inspect.getsource(impl):
        return False
    if _original is None:
        _original = impl
        callback.io_callback_impl = fast_io_callback_impl
    return True
