"""``tools/lowered_ir.py``: fingerprints of the GPU kernels' device code, lowered on CPU."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import _fast_lowering
import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels" / "paged_attention"))
import lowered_ir
import pytest
from _decode_gpu_cases import variant_call

from pallas_kernels.paged_attention import kernel_gpu

# A jax 0.11.2 tool (private context set-up); its variants include swap_ab's, which newer JAX
# does not lower (``swap_ab_lowers``).
pytestmark = pytest.mark.skipif(
    not kernel_gpu.swap_ab_lowers(), reason="tools/lowered_ir.py is for jax 0.11.2"
)


def _texts(**kw):
    f, args = variant_call(kw)[:2]
    return lowered_ir._kernel_texts(jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)))


def test_fingerprints_are_stable_and_tell_kernels_apart():
    program, kernels = _texts(num_splits=1)
    again = _texts(num_splits=1)  # a second lowering: the dump name's counter moved on
    assert (program, kernels) == again
    assert len(kernels) == 1 and "loc(" not in kernels[0] and "dump_basename =" not in kernels[0]
    _, other = _texts(num_splits=1, num_stages=1)
    digest = lambda s: hashlib.sha256(s.encode()).hexdigest()  # noqa: E731
    assert digest(other[0]) != digest(kernels[0])


def test_fast_layout_names_match_the_original(monkeypatch):
    """``_fast_lowering``'s variable names are the original's, call by call, and the lowered
    kernels are the same with it and without it (a variant with splits, a window and a soft
    cap: loops and branches whose regions the original printed)."""
    from jax.experimental.mosaic.gpu import layout_inference as li

    variant = dict(num_splits=3, logits_soft_cap=30.0, sliding_window=100, C=8)
    names = []

    def checked(site):
        fast, original = _fast_lowering.fast_str(site), _fast_lowering.original_str(site)
        assert fast == original
        names.append(fast)
        return fast

    monkeypatch.setattr(li.ValueSite, "__str__", checked)
    patched = _texts(**variant)
    # ... among them results of loops and branches (ops with regions)
    assert len(names) > 100 and any(" = scf." in n for n in names), names
    monkeypatch.setattr(li.ValueSite, "__str__", _fast_lowering.original_str)
    assert _texts(**variant) == patched


def test_ragged_fingerprints_are_stable_and_tell_defaults_apart():
    """The ragged kernel's default lowering prints the same twice, and its decode-heavy shape
    (paired warpgroups) lowers to another kernel than the prefill-heavy one."""
    texts = []
    for variant in (lowered_ir.RAGGED_DEFAULTS[0], lowered_ir.RAGGED_DEFAULTS[0], {"T": 8}):
        f, args = lowered_ir.ragged_call(variant)
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        texts.append(lowered_ir._kernel_texts(lowered)[1])
    assert texts[0] == texts[1] and len(texts[0]) == 1
    assert texts[2] != texts[0]
