"""Ragged paged attention: prefill, chunked prefill, multi-token decode and mixed batches.

Modules: ``reference`` (plain jnp, f32), ``validate`` (static and eager checks), ``schedule``
(on-device ragged metadata), ``xla`` (memory-lean XLA implementation), ``kernel_gpu``
(Mosaic GPU). The public entry point is ``jpaged.ragged_paged_attention``.
"""

from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference as ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention.validate import validate_dynamic as validate_dynamic
from pallas_kernels.ragged_paged_attention.validate import validate_static as validate_static
from pallas_kernels.ragged_paged_attention.xla import (
    ragged_paged_attention_xla as ragged_paged_attention_xla,
)
