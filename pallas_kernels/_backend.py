"""Backend facts used by dispatch: which platform runs, which GPU generation."""

from __future__ import annotations

import dataclasses
import functools

import jax


def default_platform() -> str:
    """Returns "cpu", "gpu" or "tpu" for the default backend."""
    return jax.default_backend()


@functools.cache
def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the first GPU, or None without one."""
    if default_platform() != "gpu":
        return None
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if cc is None:
        return None
    major, minor = (int(x) for x in str(cc).split(".")[:2])
    return major, minor


@functools.cache
def gpu_num_sms(default: int = 132) -> int:
    """Streaming multiprocessors of the first GPU (``default``, an H100/H200's 132, without
    one: cross-lowering on a CPU host sizes persistent grids for the H200)."""
    if default_platform() != "gpu":
        return default
    return int(getattr(jax.devices()[0], "core_count", None) or default)


def has_mosaic_gpu() -> bool:
    """True on NVIDIA GPUs that Mosaic GPU targets (Hopper sm90 and newer)."""
    cc = gpu_compute_capability()
    return cc is not None and cc >= (9, 0)


# Compute capabilities whose GPUs auto dispatch gives the Pallas-Triton kernels: Ampere and
# Ada (sm80 A100, sm86 A10 / RTX 30xx, sm87 Orin, sm89 L4 / RTX 40xx). Turing (sm75, T4) is
# left out: the kernels lower for it but were never compiled for it (no bf16 MMA there, and
# XLA's Triton pipeline is built for Ampere and newer; BUILD.md, dispatch matrix).
TRITON_AUTO_CAPABILITIES = ((8, 0), (9, 0))


@dataclasses.dataclass(frozen=True)
class AutoRoute:
    """The Pallas kernel auto dispatch tries on this backend, and why.

    Attributes:
      kernel: "pallas_gpu", "pallas_triton", "pallas_tpu", or None (the XLA path only).
      reason: one sentence naming the backend fact that chose it.
      fallback: the kernel tried next for a call ``kernel`` cannot run (on Hopper the
        Pallas-Triton kernels, which take f32, any page size and head dims the Mosaic GPU
        kernels refuse), before the XLA path; None where no second kernel was verified.
    """

    kernel: str | None
    reason: str
    fallback: str | None = None

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernels to try, in order (the XLA path runs when none can)."""
        return tuple(k for k in (self.kernel, self.fallback) if k is not None)


def _rocm() -> bool:
    version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
    return "rocm" in version or "hip" in version


def triton_route_reason() -> str | None:
    """None when this JAX still has Pallas's Triton backend (it is deprecated), else why not."""
    try:
        from jax.experimental.pallas import triton as plt  # noqa: F401
    except ImportError as e:
        return f"this JAX ({jax.__version__}) has no Pallas Triton backend ({e})"
    return None


def auto_route() -> AutoRoute:
    """Which Pallas kernel ``implementation=None`` tries first on the default backend, and why
    (the XLA path runs whatever that kernel cannot: its ``unsupported_reason`` says why)."""
    platform = default_platform()
    if platform == "tpu":
        return AutoRoute("pallas_tpu", "TPU backend: the Mosaic TPU kernels")
    if platform != "gpu":
        return AutoRoute(None, f"{platform} backend: no compiled kernel, the XLA path")
    if _rocm():
        return AutoRoute(None, "ROCm GPU: no kernel verified there, the XLA path")
    cc = gpu_compute_capability()
    if cc is None:
        return AutoRoute(None, "GPU of unknown compute capability: the XLA path")
    sm = f"sm{cc[0]}{cc[1]}"
    if has_mosaic_gpu():
        # Hopper's second choice: the Pallas-Triton kernels ran their GPU tests on an H100 and
        # were timed on the H200; on Blackwell they were never compiled.
        fallback = "pallas_triton" if cc[0] == 9 and triton_route_reason() is None else None
        return AutoRoute("pallas_gpu", f"{sm}: Mosaic GPU kernels (Hopper and newer)", fallback)
    lo, hi = TRITON_AUTO_CAPABILITIES
    if lo <= cc < hi:
        missing = triton_route_reason()
        if missing is not None:
            return AutoRoute(None, f"{sm}: {missing}; the XLA path")
        return AutoRoute("pallas_triton", f"{sm}: Pallas-Triton kernels (Ampere/Ada)")
    return AutoRoute(
        None,
        f"{sm}: no kernel verified below sm80 (Pallas-Triton) and sm90 (Mosaic GPU): the XLA path",
    )
