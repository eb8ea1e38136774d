"""``tools/lowered_ir.py``: fingerprints of the decode kernel's device code, lowered on CPU."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import lowered_ir
import test_paged_attention_gpu


def _texts(**kw):
    f, args = test_paged_attention_gpu.variant_call(kw)[:2]
    return lowered_ir._kernel_texts(jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)))


def test_fingerprints_are_stable_and_tell_kernels_apart():
    program, kernels = _texts(num_splits=1)
    again = _texts(num_splits=1)  # a second lowering: the dump name's counter moved on
    assert (program, kernels) == again
    assert len(kernels) == 1 and "loc(" not in kernels[0] and "dump_basename =" not in kernels[0]
    _, other = _texts(num_splits=1, num_stages=1)
    digest = lambda s: hashlib.sha256(s.encode()).hexdigest()  # noqa: E731
    assert digest(other[0]) != digest(kernels[0])
