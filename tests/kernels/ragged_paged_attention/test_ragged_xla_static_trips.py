"""The XLA ragged and decode paths' static trip counts with a sliding window: the loop covers
exactly the chunks a window can touch (causal), and every key a non-causal window sees (keys
after the query position are visible there), against the f64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
from _paged_inputs import dense_attention, make_paged_kv
from _ragged_inputs import dense_ragged_attention, make_ragged_case
from _tolerances import assert_close

from pallas_kernels.paged_attention.xla import paged_attention_xla
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window,pages_per_chunk", [(1, 1), (7, 2), (20, 1), (33, 3)])
def test_ragged_window_static_trips(causal, window, pages_per_chunk):
    rng = np.random.default_rng(window * 10 + pages_per_chunk)
    case = make_ragged_case(rng, (150, 40, 1, 97), (30, 1, 1, 97), page_size=4, num_q_heads=4)
    out = ragged_paged_attention_xla(
        *case.args, sm_scale=0.25, causal=causal, sliding_window=window, block_q=4,
        pages_per_chunk=pages_per_chunk,
    )  # fmt: skip
    ref = dense_ragged_attention(case, sm_scale=0.25, causal=causal, sliding_window=window)
    assert_close(out, ref, np.float32)


@pytest.mark.parametrize("window,pages_per_chunk", [(1, 1), (5, 1), (16, 2), (17, 3), (300, 2)])
def test_decode_window_static_trips(window, pages_per_chunk):
    rng = np.random.default_rng(window)
    lengths = [0, 1, 7, 8, 9, 200, 333]
    kv = make_paged_kv(rng, lengths, num_kv_heads=2, head_dim=16, page_size=8)
    q = rng.standard_normal((len(lengths), 4, 16)).astype(np.float32)
    out = paged_attention_xla(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=0.25,
        sliding_window=window, pages_per_chunk=pages_per_chunk,
    )  # fmt: skip
    ref = dense_attention(q, kv.k_dense, kv.v_dense, kv.lengths, sm_scale=0.25,
                          sliding_window=window)  # fmt: skip
    assert_close(out, ref, np.float32)


def _primitives(jaxpr) -> set[str]:
    """Every primitive's name in a closed jaxpr, sub-jaxprs (loop bodies, branches) included."""
    import jax.extend.core as jex

    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jex.ClosedJaxpr):
                    names |= _primitives(sub.jaxpr)
                elif isinstance(sub, jex.Jaxpr):
                    names |= _primitives(sub)
    return names


@pytest.mark.parametrize("window", [None, 20])
def test_no_loop_condition_or_branch_is_read_back(window):
    """XLA on GPU reads a ``while`` condition (and a ``cond`` predicate) back to the host each
    time: both paths' loops must be static-trip scans."""
    import jax

    rng = np.random.default_rng(1)
    case = make_ragged_case(rng, (150, 40, 1), (30, 1, 1), page_size=4, num_q_heads=4)
    ragged = jax.make_jaxpr(
        lambda *a: ragged_paged_attention_xla(*a, sm_scale=0.25, sliding_window=window)
    )(*case.args)
    kv = make_paged_kv(rng, [0, 9, 200], num_kv_heads=2, head_dim=16, page_size=8)
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    decode = jax.make_jaxpr(
        lambda *a: paged_attention_xla(*a, sm_scale=0.25, sliding_window=window)
    )(q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
    for name, closed in (("ragged", ragged), ("decode", decode)):
        found = _primitives(closed.jaxpr)
        assert "scan" in found, name  # the chunk loop is there
        assert not {"while", "cond"} & found, (name, sorted(found))
