"""Ragged paged attention's implementations by name, for ``jpaged.ragged_paged_attention``.

``IMPLEMENTATIONS[name]`` is the function (arguments as in ``reference``, plus ``sm_scale``
resolved, ``interpret=`` for the Pallas kernels, and that implementation's tuning knobs);
``UNSUPPORTED_REASONS[name]`` says why it cannot run a call's shapes and dtypes (None if it
can).
"""

from __future__ import annotations

from collections.abc import Callable

from pallas_kernels.ragged_paged_attention import kernel_gpu, kernel_tpu, kernel_triton, xla

IMPLEMENTATIONS: dict[str, Callable] = {
    "xla": xla.ragged_paged_attention_xla,
    "pallas_gpu": kernel_gpu.ragged_paged_attention_pallas_gpu,
    "pallas_tpu": kernel_tpu.ragged_paged_attention_pallas_tpu,
    "pallas_triton": kernel_triton.ragged_paged_attention_pallas_triton,
}
UNSUPPORTED_REASONS: dict[str, Callable] = {
    "xla": xla.unsupported_reason,
    "pallas_gpu": kernel_gpu.unsupported_reason,
    "pallas_tpu": kernel_tpu.unsupported_reason,
    "pallas_triton": kernel_triton.unsupported_reason,
}
