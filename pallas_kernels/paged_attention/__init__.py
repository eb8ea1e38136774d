"""Decode attention over a paged KV cache: one query token per sequence.

Modules: ``reference`` (plain jnp, f32: the oracle), ``validate`` (checks shared by
every implementation), ``xla`` (chunked online-softmax XLA path), the Pallas kernels
(``kernel_gpu``, ``kernel_tpu``), and ``dispatch``: the implementations by name, which
``jpaged.paged_attention`` picks from.
"""

from pallas_kernels.paged_attention.reference import (
    paged_attention_reference as paged_attention_reference,
)
from pallas_kernels.paged_attention.validate import validate_dynamic as validate_dynamic
from pallas_kernels.paged_attention.validate import validate_static as validate_static
from pallas_kernels.paged_attention.xla import paged_attention_xla as paged_attention_xla
