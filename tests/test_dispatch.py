"""``jpaged.paged_attention`` dispatch: implementation choice, validation, no recompiles."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import make_paged_kv
from _tolerances import assert_close

import jpaged
import jpaged._attention
import pallas_kernels.paged_attention.reference
import pallas_kernels.paged_attention.validate
import pallas_kernels.paged_attention.xla
from jpaged import _attention
from pallas_kernels import _backend
from pallas_kernels.paged_attention import (
    dispatch,
    paged_attention_reference,
    validate_dynamic,
    validate_static,
)


def _valid(B=2, N=8, K=2, P=5, C=4, H=16, W=3, L=None, dtype=np.float32):
    """Valid numpy arguments: lengths [5, 0] over a table of W entries."""
    rng = np.random.default_rng(0)
    pool = (K, P, C, H) if L is None else (L, K, P, C, H)
    return dict(
        q=rng.standard_normal((B, N, H)).astype(dtype),
        k_pages=rng.standard_normal(pool).astype(dtype),
        v_pages=rng.standard_normal(pool).astype(dtype),
        block_tables=rng.integers(0, P, (B, W)).astype(np.int32),
        lengths=np.array([5, 0] + [1] * (B - 2), np.int32),
    )


def _call(args, **kw):
    return jpaged.paged_attention(
        args["q"], args["k_pages"], args["v_pages"], args["block_tables"], args["lengths"], **kw
    )


# --- choosing an implementation ---------------------------------------------------------


def test_auto_picks_xla_on_cpu(monkeypatch):
    if jax.default_backend() != "cpu":
        pytest.skip("auto dispatch picks a Pallas kernel on GPU/TPU")
    calls = []
    real = pallas_kernels.paged_attention.xla.paged_attention_xla

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "xla", spy)
    args = _valid()
    out = _call(args)
    assert len(calls) == 1
    assert calls[0]["sm_scale"] == pytest.approx(1 / 4)  # default 1/sqrt(H), resolved
    assert_close(out, paged_attention_reference(*args.values()), jnp.float32)


def test_dispatch_tables_name_every_implementation():
    import pallas_kernels.ragged_paged_attention.dispatch as ragged

    for table in (dispatch, ragged):
        assert set(table.IMPLEMENTATIONS) == set(_attention.IMPLEMENTATIONS)
        assert set(table.UNSUPPORTED_REASONS) == set(_attention.IMPLEMENTATIONS)
    assert dispatch.IMPLEMENTATIONS["xla"] is pallas_kernels.paged_attention.xla.paged_attention_xla


def _fake_kernel(reason, monkeypatch, impl="pallas_tpu"):
    """Replace ``impl`` in the decode table by a kernel that must not run and rejects every
    call with ``reason``."""

    def kernel(*args, interpret=False, **kwargs):
        raise AssertionError("the fake kernel must not be called")

    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, impl, kernel)
    monkeypatch.setitem(dispatch.UNSUPPORTED_REASONS, impl, lambda *a, **k: reason)


def test_auto_falls_back_to_xla_when_kernel_unsupported(monkeypatch):
    # Pretend to be on a TPU whose kernel rejects the shapes: auto must pick "xla".
    _fake_kernel("head dim 16 is not a multiple of 128", monkeypatch)
    monkeypatch.setattr(_backend, "default_platform", lambda: "tpu")
    args = _valid()
    resolved = _attention._resolve(
        "paged_attention", dispatch, None, None, tuple(args.values()), {}
    )
    assert resolved == "xla"
    assert_close(_call(args), paged_attention_reference(*args.values()), jnp.float32)


def test_explicit_unsupported_implementation_raises(monkeypatch):
    _fake_kernel("needs a TPU", monkeypatch)
    with pytest.raises(ValueError, match=r"implementation='pallas_tpu' cannot run .*needs a TPU"):
        _call(_valid(), implementation="pallas_tpu")


def test_explicit_implementation_not_shipped_raises(monkeypatch):
    monkeypatch.delitem(dispatch.IMPLEMENTATIONS, "pallas_tpu")
    with pytest.raises(ValueError, match=r"implementation='pallas_tpu' is not available"):
        _call(_valid(), implementation="pallas_tpu")
    # and auto dispatch on a TPU skips it
    monkeypatch.setattr(_backend, "default_platform", lambda: "tpu")
    assert _attention._resolve("paged_attention", dispatch, None, None, (), {}) == "xla"


@pytest.mark.parametrize("name", ["cuda", "XLA", "triton", ""])
def test_bad_implementation_name(name):
    with pytest.raises(ValueError, match=r"implementation=.* must be None \(auto\) or one of"):
        _call(_valid(), implementation=name)


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_interpret_needs_a_pallas_implementation(implementation):
    with pytest.raises(ValueError, match=r"interpret=True runs a Pallas kernel"):
        _call(_valid(), implementation=implementation, interpret=True)


def test_tuning_knobs_need_an_explicit_implementation():
    # Auto dispatch picks a different implementation per machine; a knob meant for one of them
    # must not turn into a TypeError elsewhere.
    with pytest.raises(
        ValueError, match=r"tuning knobs \['num_splits'\] are implementation-specific"
    ):
        _call(_valid(), num_splits=2)
    with pytest.raises(ValueError, match=r"tuning knobs \['block_q'\] are implementation-specific"):
        jpaged.ragged_paged_attention(
            np.zeros((4, 8, 16), np.float32), *(_valid()[k] for k in ("k_pages", "v_pages")),
            np.zeros((2, 3), np.int32), np.array([4, 0], np.int32), np.array([0, 4, 4], np.int32),
            np.array(2, np.int32), block_q=8,
        )  # fmt: skip
    out = _call(_valid(), implementation="xla", pages_per_chunk=2)  # explicit: accepted
    assert out.shape == (2, 8, 16)


# --- static validation -------------------------------------------------------------------


def _bad(**changes):
    def make():
        rest = dict(changes)
        args = _valid(L=rest.pop("L", None))
        layer = rest.pop("layer", None)
        args.update({k: v(args) if callable(v) else v for k, v in rest.items()})
        return args, layer

    return make


BAD_INPUTS = [
    (_bad(q=lambda a: a["q"][0]), r"q\.ndim=2 must be 3 \(\[B, N, H\]\)"),
    (_bad(k_pages=lambda a: a["k_pages"][0]), r"k_pages\.ndim=3 must be 4 \(\[K, P, C, H\]\)"),
    (_bad(q=lambda a: a["q"][:, :7]), r"num_q_heads=7 must be divisible by num_kv_heads=2"),
    (_bad(q=lambda a: a["q"][:, :, :8]), r"k_pages head dim 16 must equal q head dim 8"),
    (_bad(v_pages=lambda a: a["v_pages"][:, :4]), r"v_pages\.shape=\(2, 4, 4, 16\) must equal"),
    (
        _bad(v_pages=lambda a: jnp.asarray(a["v_pages"], jnp.bfloat16)),
        r"v_pages\.dtype=bfloat16 must equal k_pages\.dtype=float32",
    ),
    (_bad(q=lambda a: a["q"].astype(np.int32)), r"q\.dtype=int32 must be a floating dtype"),
    (
        _bad(k_pages=lambda a: a["k_pages"].astype(np.int16), v_pages=lambda a: a["v_pages"]),
        r"k_pages\.dtype=int16 must be a floating dtype or int8",
    ),
    (
        _bad(block_tables=lambda a: a["block_tables"].astype(np.int16)),
        r"block_tables\.dtype=int16 must be int32",
    ),
    (
        _bad(block_tables=lambda a: a["block_tables"].astype(np.float32)),
        r"block_tables\.dtype=float32 must be int32",
    ),
    (_bad(lengths=lambda a: a["lengths"].astype(np.int64)), r"lengths\.dtype=int64 must be int32"),
    (
        _bad(lengths=np.zeros(3, np.int32)),
        r"lengths\.shape\[0\]=3 must equal batch size B=2",
    ),
    (
        _bad(block_tables=lambda a: a["block_tables"][:1]),
        r"block_tables\.shape\[0\]=1 must equal batch size B=2",
    ),
    (_bad(block_tables=lambda a: a["block_tables"][0]), r"block_tables\.ndim=1 must be 2"),
    (_bad(lengths=[5, 0]), r"lengths must be an array with \.shape and \.dtype, got list"),
    (_bad(L=2), r"layer must be given \(int or i32\[\]\) for a 5-D pool"),
    (_bad(layer=1), r"layer=1 must be None for a 4-D pool"),
    (_bad(L=2, layer=2), r"layer=2 must be in \[0, num_layers=2\)"),
    (_bad(L=2, layer=-1), r"layer=-1 must be in \[0, num_layers=2\)"),
    (_bad(L=2, layer=np.float32(1)), r"layer must be an int or an integer scalar array"),
    (_bad(L=2, layer=np.zeros(1, np.int32)), r"layer must be an int .* got shape=\(1,\)"),
]


@pytest.mark.parametrize("make, match", BAD_INPUTS)
def test_bad_inputs_raise(make, match):
    args, layer = make()
    with pytest.raises(ValueError, match=match):
        _call(args, layer=layer)
    # The reference runs the same checks.
    with pytest.raises(ValueError, match=match):
        paged_attention_reference(*args.values(), layer=layer)


@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"logits_soft_cap": 0.0}, r"logits_soft_cap=0\.0 must be None or a Python number > 0"),
        ({"logits_soft_cap": -3}, r"logits_soft_cap=-3 must be None or a Python number > 0"),
        ({"sliding_window": 0}, r"sliding_window=0 must be None or a Python int >= 1"),
        ({"sliding_window": 2.5}, r"sliding_window=2\.5 must be None or a Python int >= 1"),
    ],
)
def test_bad_knobs_raise(knobs, match):
    with pytest.raises(ValueError, match=match):
        _call(_valid(), **knobs)


@pytest.mark.parametrize("sm_scale", [jnp.float32(0.5), np.ones(1), "0.5", True])
def test_sm_scale_must_be_a_python_number(sm_scale):
    with pytest.raises(ValueError, match=r"sm_scale must be None or a Python number"):
        _call(_valid(), sm_scale=sm_scale)


def test_explicit_sm_scale_is_used():
    args = _valid()
    out = _call(args, sm_scale=0.7)
    assert_close(out, paged_attention_reference(*args.values(), sm_scale=0.7), jnp.float32)
    assert not np.allclose(np.asarray(out), np.asarray(_call(args)))


def test_all_mismatches_reported_at_once():
    args = _valid()
    args["q"] = args["q"][:, :7]
    args["block_tables"] = args["block_tables"].astype(np.int16)
    with pytest.raises(ValueError) as info:
        _call(args, sliding_window=0)
    message = str(info.value)
    assert "num_q_heads=7 must be divisible by num_kv_heads=2" in message
    assert "block_tables.dtype=int16 must be int32" in message
    assert "sliding_window=0 must be" in message


def test_validate_static_accepts_valid_and_traced_inputs():
    args = _valid(L=3)
    validate_static(*args.values(), logits_soft_cap=None, sliding_window=None, layer=2)

    @jax.jit
    def traced(q, k, v, t, n, layer):
        validate_static(q, k, v, t, n, logits_soft_cap=30.0, sliding_window=4, layer=layer)
        return q

    traced(*args.values(), jnp.int32(1))


# --- dynamic validation ------------------------------------------------------------------


def test_validate_dynamic_accepts_garbage_in_unused_entries():
    args = _valid()  # C = 4, W = 3: length 5 uses table entries 0 and 1 of sequence 0.
    args["block_tables"][0, 2] = -7
    args["block_tables"][1, :] = 1000  # length 0: no entry is used
    validate_dynamic(*args.values())


@pytest.mark.parametrize(
    "lengths, match",
    [
        ([13, 0], r"lengths must be in \[0, W \* C = 12\]; lengths\[\[0\]\] = \[13\]"),
        ([5, -1], r"lengths must be in \[0, W \* C = 12\]; lengths\[\[1\]\] = \[-1\]"),
    ],
)
def test_validate_dynamic_bad_lengths(lengths, match):
    args = _valid()
    args["lengths"] = np.array(lengths, np.int32)
    with pytest.raises(ValueError, match=match):
        validate_dynamic(*args.values())


def test_validate_dynamic_bad_page_id_of_used_page():
    args = _valid()  # P = 5
    args["block_tables"][0, 1] = 5
    with pytest.raises(ValueError, match=r"must be in \[0, P = 5\): block_tables\[0, 1\] = 5"):
        validate_dynamic(*args.values())


def test_validate_dynamic_bad_layer_and_traced_values():
    args = _valid(L=2)
    with pytest.raises(ValueError, match=r"layer=2 must be in \[0, num_layers=2\)"):
        validate_dynamic(*args.values(), layer=jnp.int32(2))

    @jax.jit
    def traced(t, n):
        validate_dynamic(args["q"], args["k_pages"], args["v_pages"], t, n)
        return n

    with pytest.raises(ValueError, match=r"validate_dynamic reads the values of block_tables"):
        traced(args["block_tables"], args["lengths"])


# --- compilation ---------------------------------------------------------------------------


@pytest.fixture
def compile_events():
    """Records JAX tracing and compilation events while the test runs."""
    events: list[str] = []

    def listener(name, *args, **kwargs):
        if name.startswith("/jax/core/compile/"):
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _random_case(seed, lengths, **kw):
    rng = np.random.default_rng(seed)
    kv = make_paged_kv(rng, lengths, num_kv_heads=2, head_dim=32, page_size=8, width=4)
    q = rng.standard_normal((len(lengths), 4, 32)).astype(np.float32)
    return [jnp.asarray(x) for x in (q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)]


@pytest.mark.parametrize("knobs", [{}, {"sliding_window": 5, "logits_soft_cap": 20.0}])
def test_second_call_with_same_shapes_compiles_nothing(compile_events, knobs):
    first = _random_case(1, [3, 17, 0])
    jpaged.paged_attention(*first, implementation="xla", **knobs).block_until_ready()
    assert compile_events, "the listener saw no compilation of a first call"
    # New values (lengths, tables, pages) with the same shapes: no trace, no compile.
    # Built before clearing: moving NumPy arrays to the device compiles nothing anyway.
    second = _random_case(2, [0, 1, 24])  # 4 pages in use, like the first: same P
    compile_events.clear()
    out = jpaged.paged_attention(*second, implementation="xla", **knobs)
    out.block_until_ready()
    assert compile_events == []
    # Auto dispatch reaches the same compiled function.
    if jax.default_backend() == "cpu":
        jpaged.paged_attention(*second, **knobs).block_until_ready()
        assert compile_events == []
    assert_close(out, paged_attention_reference(*second, **knobs), jnp.float32)


def test_traced_layer_values_share_one_compile(compile_events):
    rng = np.random.default_rng(3)
    kv = make_paged_kv(rng, [4, 9], num_kv_heads=1, head_dim=16, page_size=4, num_layers=3)
    q = jnp.asarray(rng.standard_normal((2, 2, 16)).astype(np.float32))
    args = [q, *(jnp.asarray(x) for x in (kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths))]
    jpaged.paged_attention(*args, layer=0).block_until_ready()
    compile_events.clear()
    for layer in (1, 2):  # a Python int layer is passed as data, not baked into the program
        jpaged.paged_attention(*args, layer=layer).block_until_ready()
    assert compile_events == []


# --- docstring examples ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [
        jpaged._attention,
        pallas_kernels.paged_attention.reference,
        pallas_kernels.paged_attention.validate,
        pallas_kernels.paged_attention.xla,
    ],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
