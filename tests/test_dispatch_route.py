"""Which kernel ``implementation=None`` tries per backend and GPU generation
(``pallas_kernels._backend.auto_route``), and that a call records and logs its choice with the
reason (``jpaged._attention.last_auto_choice``, the ``jpaged.dispatch`` logger)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import jpaged
import jpaged._backend
from jpaged import _attention
from pallas_kernels import _backend
from pallas_kernels.paged_attention import dispatch
from pallas_kernels.ragged_paged_attention import dispatch as ragged_dispatch


def _gpu(monkeypatch, cc, rocm=False):
    monkeypatch.setattr(_backend, "default_platform", lambda: "gpu")
    monkeypatch.setattr(_backend, "gpu_compute_capability", lambda: cc)
    monkeypatch.setattr(_backend, "_rocm", lambda: rocm)


@pytest.mark.parametrize(
    "cc,kernel,says",
    [
        ((8, 0), "pallas_triton", "sm80: Pallas-Triton"),
        ((8, 6), "pallas_triton", "sm86"),
        ((8, 9), "pallas_triton", "sm89"),
        ((7, 5), None, "sm75: no kernel verified below sm80"),
        ((9, 0), "pallas_gpu", "sm90: Mosaic GPU"),
        ((10, 0), "pallas_gpu", "sm100"),
    ],
)
def test_auto_route_per_generation(monkeypatch, cc, kernel, says):
    _gpu(monkeypatch, cc)
    route = jpaged._backend.auto_route()
    assert route.kernel == kernel
    assert says in route.reason


@pytest.mark.parametrize(
    "cc,fallback", [((9, 0), "pallas_triton"), ((10, 0), None), ((8, 9), None), ((7, 5), None)]
)
def test_only_hopper_has_a_second_kernel(monkeypatch, cc, fallback):
    _gpu(monkeypatch, cc)
    route = _backend.auto_route()
    assert route.fallback == fallback
    assert route.kernels == tuple(k for k in (route.kernel, fallback) if k is not None)
    monkeypatch.setattr(_backend, "triton_route_reason", lambda: "this JAX has none")
    assert _backend.auto_route().fallback is None


@pytest.mark.parametrize("triton_refuses", [False, True])
def test_a_call_the_mosaic_kernel_refuses_tries_triton_before_xla(monkeypatch, triton_refuses):
    """On Hopper, a call the Mosaic GPU kernel cannot run (f32, an odd page size, ...) runs the
    Pallas-Triton kernel if that one can, else the XLA path; the reason names both refusals."""
    _gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(dispatch.UNSUPPORTED_REASONS, "pallas_gpu", lambda *a, **k: "f32")
    monkeypatch.setitem(
        dispatch.UNSUPPORTED_REASONS, "pallas_triton",
        lambda *a, **k: "head dim 96" if triton_refuses else None,
    )  # fmt: skip
    calls = []
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "pallas_triton", _xla_standing_in(calls))
    jpaged.paged_attention(*_args())
    impl, why = _attention.last_auto_choice("paged_attention")
    assert "pallas_gpu cannot run this call (f32)" in why
    if triton_refuses:
        assert impl == "xla" and calls == []
        assert why.endswith("pallas_triton cannot run this call (head dim 96): the XLA path")
    else:
        assert impl == "pallas_triton" and len(calls) == 1
        assert why.endswith(": pallas_triton")


def test_auto_route_other_backends(monkeypatch):
    assert _backend.auto_route().kernel in (None, "pallas_gpu", "pallas_triton", "pallas_tpu")
    monkeypatch.setattr(_backend, "default_platform", lambda: "cpu")
    assert _backend.auto_route() == _backend.AutoRoute(
        None, "cpu backend: no compiled kernel, the XLA path"
    )
    monkeypatch.setattr(_backend, "default_platform", lambda: "tpu")
    assert _backend.auto_route().kernel == "pallas_tpu"
    _gpu(monkeypatch, (8, 0), rocm=True)
    assert _backend.auto_route().kernel is None
    assert "ROCm" in _backend.auto_route().reason


def test_auto_route_without_the_triton_backend(monkeypatch):
    """A JAX that dropped Pallas's Triton backend: sm80-sm89 get the XLA path, and why."""
    _gpu(monkeypatch, (8, 9))
    monkeypatch.setattr(_backend, "triton_route_reason", lambda: "this JAX has none")
    route = _backend.auto_route()
    assert route.kernel is None and "this JAX has none" in route.reason


def _xla_standing_in(calls: list):
    """A kernel entry that records its keyword arguments in ``calls`` and runs the XLA path
    (without ``interpret``, which only kernels take)."""
    xla = dispatch.IMPLEMENTATIONS["xla"]

    def fn(*a, **k):
        calls.append(k)
        return xla(*a, **{x: y for x, y in k.items() if x != "interpret"})

    return fn


def _args(B=2, N=8, K=2, P=6, C=4, H=16, W=3):
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((K, P, C, H)).astype(np.float32)
    return (
        rng.standard_normal((B, N, H)).astype(np.float32), kv, kv,
        rng.integers(0, P, (B, W)).astype(np.int32), np.array([5, 1], np.int32),
    )  # fmt: skip


def test_a_call_records_and_logs_its_choice(monkeypatch, caplog):
    _gpu(monkeypatch, (8, 0))
    args = _args()
    # On this CPU the kernel's own check says it needs a GPU: the XLA path runs, and says so.
    monkeypatch.setattr(_backend, "default_platform", lambda: "gpu")
    monkeypatch.setitem(dispatch.UNSUPPORTED_REASONS, "pallas_triton", lambda *a, **k: "no GPU")
    with caplog.at_level(logging.DEBUG, logger="jpaged.dispatch"):
        jpaged.paged_attention(*args)
    impl, why = _attention.last_auto_choice("paged_attention")
    assert impl == "xla"
    assert "sm80" in why and "pallas_triton cannot run this call (no GPU)" in why
    assert any("picked 'xla'" in r.getMessage() for r in caplog.records)

    calls = []
    monkeypatch.setitem(dispatch.UNSUPPORTED_REASONS, "pallas_triton", lambda *a, **k: None)
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "pallas_triton", _xla_standing_in(calls))
    jpaged.paged_attention(*args)
    assert len(calls) == 1 and calls[0]["interpret"] is False
    assert _attention.last_auto_choice("paged_attention")[0] == "pallas_triton"


def test_ragged_auto_choice_is_recorded(monkeypatch):
    monkeypatch.setattr(_backend, "default_platform", lambda: "cpu")
    q, kv, _, tables, _ = _args()
    jpaged.ragged_paged_attention(
        q[:2], kv, kv, tables, np.array([5, 1], np.int32), np.array([0, 1, 2], np.int32),
        np.int32(2),
    )  # fmt: skip
    impl, why = _attention.last_auto_choice("ragged_paged_attention")
    assert impl == "xla" and why.startswith("cpu backend")
    assert set(ragged_dispatch.IMPLEMENTATIONS) == set(_attention.IMPLEMENTATIONS)


def test_interpret_runs_the_triton_kernel_through_the_public_op():
    args = _args()
    out = jpaged.paged_attention(*args, implementation="pallas_triton", interpret=True)
    ref = jpaged.paged_attention(*args, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
