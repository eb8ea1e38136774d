"""``jpaged.models.batch_metadata``: the metadata of a ragged batch built by hand."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

from jpaged.models import batch_metadata


def test_slots_follow_permuted_block_tables():
    rng = np.random.default_rng(0)
    C, W, P = 4, 5, 40
    tables = rng.permutation(P)[: 3 * W].reshape(3, W)
    cached, query = [0, 7, 12], [5, 1, 4]  # 12 + 4 = 16 = C * 4: ends on a page boundary
    pos, meta = batch_metadata(tables, cached, query, C, num_tokens=13)
    rows = [(b, p) for b in range(3) for p in range(cached[b], cached[b] + query[b])]
    assert pos.tolist() == [p for _, p in rows] + [0, 0, 0]
    want = [tables[b, p // C] * C + p % C for b, p in rows] + [-1, -1, -1]
    assert meta.slot_mapping.tolist() == want
    assert meta.kv_lens.tolist() == [5, 8, 16]
    assert meta.cu_q_lens.tolist() == [0, 5, 6, 10]
    assert meta.logits_indices.tolist() == [4, 5, 9]
    assert int(meta.num_seqs) == 3
    assert meta.slot_mapping.dtype == np.int32 and pos.dtype == np.int32


def test_default_rows_are_the_new_tokens():
    pos, meta = batch_metadata([[2, 0]], [3], [1], 4)
    assert pos.tolist() == [3] and meta.slot_mapping.tolist() == [11]


@pytest.mark.parametrize(
    "args, match",
    [
        (([[0, 1]], [0, 0], [1, 1], 4), "agree on B"),
        (([[0, 1]], [0], [0], 4), "query_lens must be >= 1"),
        (([[0, 1]], [-1], [1], 4), "cached_lens >= 0"),
        (([[0, 1]], [8], [1], 4), "exceeds its block table's 8 token slots"),
    ],
)
def test_bad_input_names_the_problem(args, match):
    with pytest.raises(ValueError, match=match):
        batch_metadata(*args)


def test_num_tokens_below_new_tokens_raises():
    with pytest.raises(ValueError, match="num_tokens=2 is below the 3 new tokens"):
        batch_metadata([[0, 1]], [0], [3], 4, num_tokens=2)


def test_fixed_num_tokens_keeps_one_compiled_shape():
    """Steps of different lengths padded to one T: a jitted consumer traces once."""

    @jax.jit
    @chex.assert_max_traces(n=1)
    def consume(positions_T, metadata):
        chex.assert_shape(positions_T, (8,))
        return positions_T.sum() + metadata.slot_mapping.sum() + metadata.kv_lens.sum()

    tables = np.arange(8).reshape(2, 4)
    for cached, query in (([0, 0], [5, 3]), ([5, 3], [1, 1]), ([6, 4], [2, 1])):
        pos, meta = batch_metadata(tables, cached, query, 4, num_tokens=8)
        want = pos.sum() + meta.slot_mapping.sum() + meta.kv_lens.sum()
        assert int(consume(pos, meta)) == want
