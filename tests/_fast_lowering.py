"""A faster, output-identical ``str`` for Mosaic GPU's layout-inference variables (tests only).

Mosaic GPU's layout inference (jax 0.11.2, ``layout_inference.ValueSite.__str__``) names each
variable by the leading ``%N = op.name`` of ``str(operation)``, and sorts every variable of a
kernel by that name (``constraints.compute_transitively_equal_vars``). ``str(operation)``
verifies the operation and prints it whole, regions included: for an ``scf.for`` or
``scf.if`` that is most of the kernel, once per variable. Lowering the decode kernel's larger
variants for CUDA spent about half its time there (the staging variant at T=128: 22 s of 29).

``install`` replaces it with a print that skips the regions and the verifier, which yields the
same leading ``%N = op.name`` (the SSA numbering does not depend on either), hence the same
names, the same order and the same lowered module: ``tests/test_lowered_ir.py`` checks the
names call by call against the original and compares the lowered kernels' fingerprints.
Nothing in the library uses this: it only makes CPU CI's cross-lowering tests cheaper.
"""

from __future__ import annotations

_original = None


def _kind(site) -> str:
    from jax.experimental.mosaic.gpu import layout_inference as li

    return {li.VariableType.OPERAND: "o", li.VariableType.RESULT: "r"}.get(site.type, "a")


def fast_str(site) -> str:
    """``ValueSite.__str__`` without printing the operation's regions or verifying it."""
    from jax.experimental.mosaic.gpu import layout_inference as li

    text = site.operation.operation.get_asm(assume_verified=True, skip_regions=True)
    match = li._op_name_regex.match(text)
    assert match is not None, text[:200]
    return f"{match.group(0)}:{_kind(site)}-{site.index}"


def original_str(site) -> str:
    """The original ``ValueSite.__str__`` (whether or not ``install`` has run)."""
    from jax.experimental.mosaic.gpu import layout_inference as li

    return (_original or li.ValueSite.__str__)(site)


def install() -> bool:
    """Patches ``ValueSite.__str__`` where the jax in hand has the 0.11.2 form it replaces;
    returns whether it did (elsewhere everything runs unpatched, only slower)."""
    global _original
    try:
        from jax.experimental.mosaic.gpu import layout_inference as li
    except ImportError:
        return False
    site = getattr(li, "ValueSite", None)
    if site is None or not hasattr(li, "_op_name_regex") or not hasattr(li, "VariableType"):
        return False
    if _original is None:
        _original = site.__str__
        site.__str__ = fast_str
    return True
