"""Bad input to ``jpaged.paged_attention`` and ``jpaged.ragged_paged_attention``, in every
implementation (the reference, "xla", and both Pallas kernels in their interpreters):

* NaN or inf in ``q``, in a visible key or value, or ``sm_scale=nan`` reach the output as
  NaN (inf) in exactly the heads that read them, while never read slots stay harmless: the
  pools' free pages and the tails of last pages are NaN-filled (``_paged_inputs``);
* invalid metadata (page ids, lengths, ``layer``, ragged ``cu_q_lens`` / ``kv_lens`` /
  ``num_seqs``) raises naming the offending index when the values are concrete (the default
  check), raises through ``checkify`` with ``check=True`` under ``jit``, and otherwise gives
  the one documented result (``pallas_kernels/*/sanitize.py``): zeros for a bad decode
  sequence, zeros everywhere for a bad layer or any bad ragged value;
* a block table of width 0 and a non-bool ``causal`` are clear errors.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import make_paged_kv
from _ragged_inputs import make_ragged_case
from jax.experimental import checkify

import jpaged
from pallas_kernels.paged_attention.reference import paged_attention_reference
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

IMPLS = ["reference", "xla", "pallas_gpu", "pallas_tpu", "pallas_triton"]

# Interpreted kernel cases ``make test`` leaves out (``make test-all`` runs them): each kernel
# keeps a NaN query, key or value case of each op and every invalid-metadata case in CI.
SLOW_CASES = {
    *(f"test_decode_non_finite_inputs_propagate[pallas_gpu-{n}]"
      for n in ("q-inf", "v-nan", "v-inf", "sm_scale-nan")),
    *(f"test_decode_non_finite_inputs_propagate[pallas_tpu-{n}]"
      for n in ("q-inf", "k-nan", "sm_scale-nan")),
    *(f"test_ragged_non_finite_inputs_propagate[{impl}-{n}]"
      for impl in ("pallas_gpu", "pallas_tpu") for n in ("q-nan-padding", "sm_scale-nan")),
}  # fmt: skip
# The Mosaic GPU interpreter's NumPy matmul warns on inf * 0 (the inputs here are meant so).
_NUMPY_NAN_WARNING = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
K, G, H, C = 2, 2, 64, 16
N = K * G
DT = jnp.bfloat16


def decode_op(impl):
    if impl == "reference":
        return paged_attention_reference
    return functools.partial(jpaged.paged_attention, implementation=impl, interpret=impl != "xla")


def ragged_op(impl):
    if impl == "reference":
        return ragged_paged_attention_reference
    return functools.partial(
        jpaged.ragged_paged_attention, implementation=impl, interpret=impl != "xla"
    )


def f32(x):
    return np.asarray(x, np.float32)  # on the host: no conversion program per shape


@functools.cache
def decode_case():
    """Lengths 40, 17, 5, 0 (the last sequence empty), two layers, NaN-filled free pages."""
    rng = np.random.default_rng(350)
    kv = make_paged_kv(rng, [40, 17, 5, 0], num_kv_heads=K, head_dim=H, page_size=C, dtype=DT,
                       num_layers=2)  # fmt: skip
    q = np.asarray(jnp.asarray(rng.standard_normal((4, N, H)), DT))
    return q, kv


@functools.cache
def ragged_case():
    """Three live sequences (kv 20, 9, 33; q 5, 1, 12), three padding rows, a dead sequence."""
    rng = np.random.default_rng(351)
    return make_ragged_case(rng, [20, 9, 33], [5, 1, 12], num_q_heads=N, num_kv_heads=K,
                            head_dim=H, page_size=C, dtype=DT, num_layers=2)  # fmt: skip


def _page_and_offset(tables, b, pos):
    return int(tables[b, pos // C]), pos % C


# ----------------------------------------------------------------------------- non-finite


DECODE_POISON = {  # name: what is poisoned
    "q-nan": "q[0, 1, 3] = NaN; q[3] = NaN (length 0: stays zero)",
    "q-inf": "q[0, 1] = +inf",
    "k-nan": "a key sequence 1 sees, KV head 0",
    "v-nan": "a value sequence 1 sees, KV head 1",
    "v-inf": "a value sequence 2 sees, KV head 0",
    "sm_scale-nan": "sm_scale=nan",
}


def _decode_poisoned(name):
    q, kv = decode_case()
    q, kp, vp = q.copy(), kv.k_pages.copy(), kv.v_pages.copy()
    bad = np.zeros((4, N, H), bool)  # the output elements that must not be finite
    sm_scale = None
    if name == "q-nan":
        q[0, 1, 3] = np.nan
        q[3] = np.nan
        bad[0, 1] = True
    elif name == "q-inf":
        q[0, 1] = np.inf
        bad[0, 1] = True
    elif name in ("k-nan", "v-nan", "v-inf"):
        b, kh, pages = {"k-nan": (1, 0, kp), "v-nan": (1, 1, vp), "v-inf": (2, 0, vp)}[name]
        page, off = _page_and_offset(kv.block_tables, b, 3)
        pages[1, kh, page, off, 5] = np.inf if name == "v-inf" else np.nan
        # A bad key spoils every output element of its heads; a bad value one element each.
        bad[b, kh * G : (kh + 1) * G, slice(None) if name == "k-nan" else 5] = True
    else:
        sm_scale = float("nan")
        bad[:3] = True
    return (q, kp, vp, kv.block_tables, kv.lengths), sm_scale, bad


@functools.cache
def _decode_clean(impl):
    """The clean case's output (once per implementation: every poisoned case compares to it)."""
    q, kv = decode_case()
    return f32(decode_op(impl)(q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, layer=1))


@_NUMPY_NAN_WARNING
@pytest.mark.parametrize("name", list(DECODE_POISON))
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_non_finite_inputs_propagate(impl, name):
    args, sm_scale, bad = _decode_poisoned(name)
    op = decode_op(impl)
    clean = _decode_clean(impl)
    assert np.isfinite(clean).all()  # NaN-filled free pages and tails are never read
    out = f32(op(*args, layer=1, sm_scale=sm_scale))
    if name == "v-inf":  # an infinite value: that output element is infinite
        assert np.isinf(out[bad]).all()
    else:
        assert np.isnan(out[bad]).all(), name
    np.testing.assert_array_equal(out[~bad], clean[~bad] if sm_scale is None else 0.0)
    assert (out[3] == 0).all()  # length 0: zeros whatever q holds


RAGGED_POISON = ["q-nan", "q-nan-padding", "k-nan", "sm_scale-nan"]


def _ragged_poisoned(name):
    case = ragged_case()
    q, kp, vp, tables, kv_lens, cu, ns = (np.array(a) for a in case.args)
    T = q.shape[0]
    bad = np.zeros((T, N, H), bool)  # the output elements that must be NaN
    sm_scale = None
    if name == "q-nan":
        q[2, 1, 0] = np.nan
        bad[2, 1] = True
    elif name == "q-nan-padding":
        q[T - 1] = np.nan  # a padding row: zeros whatever it holds
    elif name == "k-nan":  # position 3 of sequence 2: every one of its 12 rows sees it
        page, off = _page_and_offset(tables, 2, 3)
        kp[1, 0, page, off, 7] = np.nan
        bad[6:18, :G] = True
    else:
        sm_scale = float("nan")
        bad[:18] = True
    return (q, kp, vp, tables, kv_lens, cu, ns), sm_scale, bad


@functools.cache
def _ragged_clean(impl):
    """The clean case's output (once per implementation: every poisoned case compares to it)."""
    return f32(ragged_op(impl)(*ragged_case().args, layer=1))


@_NUMPY_NAN_WARNING
@pytest.mark.parametrize("name", RAGGED_POISON)
@pytest.mark.parametrize("impl", IMPLS)
def test_ragged_non_finite_inputs_propagate(impl, name):
    args, sm_scale, bad = _ragged_poisoned(name)
    op = ragged_op(impl)
    clean = _ragged_clean(impl)
    assert np.isfinite(clean).all()
    out = f32(op(*args, layer=1, sm_scale=sm_scale))
    assert np.isnan(out[bad]).all(), name
    np.testing.assert_array_equal(out[~bad], clean[~bad] if sm_scale is None else 0.0)
    assert (out[18:] == 0).all()  # padding rows


# ----------------------------------------------------------------------------- invalid metadata


def _decode_bad_metadata():
    """Sequences 0-3 invalid (a used page id >= P, a used id < 0, length > W * C, length < 0),
    sequence 4 valid; returns (args, mask of the invalid sequences)."""
    rng = np.random.default_rng(352)
    kv = make_paged_kv(rng, [40, 17, 33, 9, 23], num_kv_heads=K, head_dim=H, page_size=C,
                       dtype=DT, num_layers=2)  # fmt: skip
    q = np.asarray(jnp.asarray(rng.standard_normal((5, N, H)), DT))
    tables, lengths = kv.block_tables.copy(), kv.lengths.copy()
    P, W = kv.k_pages.shape[2], tables.shape[1]
    tables[0, 1] = P + 3
    tables[1, 0] = -1
    lengths[2] = W * C + 5
    lengths[3] = -3
    good = (q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
    return good, (q, kv.k_pages, kv.v_pages, tables, lengths)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_invalid_metadata_gives_zeros_for_those_sequences_under_jit(impl):
    good, bad = _decode_bad_metadata()
    q, kp, vp = good[:3]
    call = jax.jit(lambda t, n, layer: decode_op(impl)(q, kp, vp, t, n, layer=layer))
    want = f32(call(*good[3:], jnp.int32(1)))
    out = f32(call(*bad[3:], jnp.int32(1)))
    assert (out[:4] == 0).all()  # invalid sequences read as length 0
    np.testing.assert_array_equal(out[4], want[4])
    for layer in (2, -1, 99):  # a traced layer outside [0, L): zeros everywhere
        assert (f32(call(*good[3:], jnp.int32(layer))) == 0).all()


def _ragged_bad_metadata():
    """Each invalid ragged metadata case: name -> (tables, kv_lens, cu_q_lens, num_seqs)."""
    case = ragged_case()
    q, kp, _, tables, kv_lens, cu, ns = (np.array(a) for a in case.args)
    T, (B, W), P = q.shape[0], tables.shape, kp.shape[2]

    def edit(name, value, at=None):
        arrays = dict(tables=tables.copy(), kv_lens=kv_lens.copy(), cu=cu.copy(), ns=ns.copy())
        if at is None:
            arrays[name] = np.asarray(value, np.int32)
        else:
            arrays[name][at] = value
        return tuple(arrays.values())

    return {
        "cu_q_lens decreasing": edit("cu", 3, 2),
        "cu_q_lens[0] != 0": edit("cu", 1, 0),
        "cu_q_lens[num_seqs] > T": edit("cu", T + 4, slice(3, None)),
        "kv_lens < q_len": edit("kv_lens", 5, 2),
        "kv_lens > W * C": edit("kv_lens", W * C + 1, 1),
        "kv_lens < 0": edit("kv_lens", -1, 0),
        "num_seqs > B": edit("ns", B + 2),
        "num_seqs < 0": edit("ns", -1),
        "page id >= P": edit("tables", P, (2, 1)),
        "page id < 0": edit("tables", -5, (0, 0)),
    }


@pytest.mark.parametrize("impl", IMPLS)
def test_ragged_invalid_metadata_gives_zeros_under_jit(impl):
    q, kp, vp, *metadata = ragged_case().args
    kp, vp = jnp.asarray(kp), jnp.asarray(vp)  # the reference indexes them with tracers
    call = jax.jit(lambda t, n, cu, ns, layer: ragged_op(impl)(q, kp, vp, t, n, cu, ns,
                                                               layer=layer))  # fmt: skip
    assert np.abs(f32(call(*metadata, jnp.int32(1)))[:18]).sum(axis=(1, 2)).min() > 0
    for name, bad in _ragged_bad_metadata().items():
        assert (f32(call(*bad, jnp.int32(1))) == 0).all(), name
    assert (f32(call(*metadata, jnp.int32(2))) == 0).all()  # layer outside [0, L)


DECODE_MESSAGES = [
    r"block_tables\[0, 1\] = \d+",
    r"block_tables\[1, 0\] = -1",
    r"lengths\[\[2, 3\]\] = \[53, -3\]",
]


def test_decode_invalid_metadata_raises_when_concrete_naming_the_index():
    _, bad = _decode_bad_metadata()
    for impl in ("xla", "pallas_gpu"):  # checked before dispatch, whatever the implementation
        with pytest.raises(ValueError, match="invalid paged attention values") as e:
            decode_op(impl)(*bad, layer=1)
        for pattern in DECODE_MESSAGES:
            assert re.search(pattern, str(e.value)), (pattern, str(e.value))
    good, _ = _decode_bad_metadata()
    with pytest.raises(ValueError, match=r"layer=2 must be in \[0, num_layers=2\)"):
        jpaged.paged_attention(*good, layer=jnp.int32(2))


RAGGED_MESSAGES = {
    "cu_q_lens decreasing": r"cu_q_lens\[1\]=5 > cu_q_lens\[2\]=3",
    "cu_q_lens[0] != 0": r"cu_q_lens\[0\] must be 0, got 1",
    "cu_q_lens[num_seqs] > T": r"cu_q_lens\[num_seqs=3\]=25 must be <= T=21",
    "kv_lens < q_len": r"sequence 2 .* must be <= kv_lens\[2\]=5",
    "kv_lens > W * C": r"kv_lens\[1\]=\d+ must be in \[0, W\*C=\d+\]",
    "kv_lens < 0": r"kv_lens\[0\]=-1 must be in \[0, W\*C=\d+\]",
    "num_seqs > B": r"num_seqs=6 must be in \[0, B=4\]",
    "num_seqs < 0": r"num_seqs=-1 must be in \[0, B=4\]",
    "page id >= P": r"block_tables\[2, 1\]=\d+ must be a page id in \[0, P=\d+\)",
    "page id < 0": r"block_tables\[0, 0\]=-5 must be a page id",
}


@pytest.mark.parametrize("name", list(RAGGED_MESSAGES))
def test_ragged_invalid_metadata_raises_when_concrete_naming_the_index(name):
    q, kp, vp, *_ = ragged_case().args
    bad = _ragged_bad_metadata()[name]
    with pytest.raises(ValueError, match=RAGGED_MESSAGES[name]):
        jpaged.ragged_paged_attention(q, kp, vp, *bad, layer=1, implementation="xla")
    out = jpaged.ragged_paged_attention(q, kp, vp, *bad, layer=1, check=False)
    assert (f32(out) == 0).all()  # unchecked: the documented result


def test_check_true_under_jit_raises_through_checkify_naming_the_index():
    good, bad = _decode_bad_metadata()
    q, kp, vp = good[:3]

    def decode(t, n, layer):
        return jpaged.paged_attention(q, kp, vp, t, n, layer=layer, check=True)

    err, _ = checkify.checkify(jax.jit(decode))(*good[3:], jnp.int32(1))
    err.throw()  # valid: nothing raised
    err, out = checkify.checkify(jax.jit(decode))(*bad[3:], jnp.int32(1))
    with pytest.raises(checkify.JaxRuntimeError, match=r"lengths\[2\]=53 must be in \[0, W \* C"):
        err.throw()
    assert (f32(out)[:4] == 0).all()  # the output is still the documented one
    t = np.array(good[3])
    t[1, 0] = -7
    err, _ = checkify.checkify(jax.jit(decode))(t, good[4], jnp.int32(1))
    with pytest.raises(checkify.JaxRuntimeError, match=r"block_tables\[1, 0\]=-7 \(a used page"):
        err.throw()
    err, _ = checkify.checkify(jax.jit(decode))(*good[3:], jnp.int32(5))
    with pytest.raises(checkify.JaxRuntimeError, match=r"layer=5 must be in \[0, L = 2\)"):
        err.throw()
    with pytest.raises(ValueError, match="checkify"):  # check=True under jit needs checkify
        jax.jit(decode)(*good[3:], jnp.int32(1))
    # Traced tables beside NumPy lengths (closed over): the check indexes both by a traced row.
    lengths = np.asarray(bad[4])
    err, _ = checkify.checkify(
        jax.jit(lambda t: jpaged.paged_attention(q, kp, vp, t, lengths, layer=1, check=True))
    )(bad[3])
    with pytest.raises(checkify.JaxRuntimeError, match=r"lengths\[2\]=53 must be in"):
        err.throw()

    q, kp, vp, *metadata = ragged_case().args

    def ragged(*m):
        return jpaged.ragged_paged_attention(q, kp, vp, *m, layer=1, check=True)

    checkify.checkify(jax.jit(ragged))(*metadata)[0].throw()
    table, *rest = metadata  # NumPy lengths and offsets beside a traced table
    closed = [np.asarray(m) for m in rest]
    checkify.checkify(jax.jit(lambda t: ragged(t, *closed)))(table)[0].throw()
    expected = {
        "cu_q_lens decreasing": r"cu_q_lens\[1\]=5 > cu_q_lens\[2\]=3",
        "kv_lens < q_len": r"kv_lens\[2\]=5 must be in \[q_len = 12",
        "num_seqs > B": r"num_seqs=6 must be in \[0, B = 4\]",
        "page id < 0": r"block_tables\[0, 0\]=-5 \(a used page\)",
    }
    bad_cases = _ragged_bad_metadata()
    for name, pattern in expected.items():
        err, out = checkify.checkify(jax.jit(ragged))(*bad_cases[name])
        with pytest.raises(checkify.JaxRuntimeError, match=pattern):
            err.throw()
        assert (f32(out) == 0).all()


# ----------------------------------------------------------------------------- static errors


def test_width_0_tables_causal_and_check_of_the_wrong_kind_raise():
    q, kv = decode_case()
    empty = np.zeros((4, 0), np.int32)
    with pytest.raises(ValueError, match=r"block_tables.shape=\(4, 0\) must have W >= 1"):
        jpaged.paged_attention(q, kv.k_pages, kv.v_pages, empty, kv.lengths, layer=1)
    with pytest.raises(ValueError, match=r"block_tables.shape=\(4, 0\) must have W >= 1"):
        paged_attention_reference(q, kv.k_pages, kv.v_pages, empty, kv.lengths, layer=1)
    with pytest.raises(ValueError, match=r"check='yes' must be None"):
        jpaged.paged_attention(q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, layer=1,
                               check="yes")  # fmt: skip
    q, kp, vp, tables, *rest = ragged_case().args
    with pytest.raises(ValueError, match=r"W >= 1"):
        jpaged.ragged_paged_attention(q, kp, vp, tables[:, :0], *rest, layer=1)
    for causal in ("no", 1, None, np.int32(0)):
        message = re.escape(f"causal={causal!r} must be a bool")
        with pytest.raises(ValueError, match=message):
            jpaged.ragged_paged_attention(q, kp, vp, tables, *rest, layer=1, causal=causal)
        with pytest.raises(ValueError, match=message):
            ragged_paged_attention_reference(q, kp, vp, tables, *rest, layer=1, causal=causal)
    out = jpaged.ragged_paged_attention(q, kp, vp, tables, *rest, layer=1, causal=np.bool_(False))
    assert np.isfinite(f32(out)).all()
