"""Tests of the on-device ragged tile schedule (``pallas_kernels/ragged_paged_attention/schedule.py``).

The GPU and TPU kernels trust it for which rows each query tile computes and stores; the
in-place (``direct_io``) GPU kernel also trusts its empty tiles to cover the padding rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import schedule

# Under jit, as the kernels call it: one program a case instead of one per operation.
_tile_schedule = jax.jit(
    schedule.tile_schedule, static_argnames=("num_tokens", "block_q", "extra_tiles")
)


def _batch(rng, B, T):
    """Random live sequences (some with no query rows), then dead entries holding garbage."""
    ns = int(rng.integers(0, B + 1))
    q_lens = rng.integers(0, 40, size=ns)
    q_lens = np.minimum(q_lens, np.maximum(T - np.concatenate([[0], np.cumsum(q_lens)])[:-1], 0))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu = np.concatenate([cu, rng.integers(-5, 3 * T, size=B - ns)]).astype(np.int32)
    kv_lens = np.concatenate([q_lens + rng.integers(0, 50, size=ns), rng.integers(-5, 99, B - ns)])
    return kv_lens.astype(np.int32), cu, np.int32(ns), q_lens


def _worst_batch(B, T, block_q):
    """Every sequence one row past a whole tile: the most tiles (and wasted rows) per row."""
    q_lens = np.full(B, block_q + 1)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (q_lens + 7).astype(np.int32), cu, np.int32(B), q_lens


# Random batches 3-5 are left out of ``make test`` (``make test-all`` runs them): seeds 0-2 and
# the worst case stay at every block_q.
SLOW_CASES = {
    f"test_tiles_cover_every_row_once_and_padding_chunks_cover_the_rest[{seed}-{block_q}]"
    for seed in (3, 4, 5)
    for block_q in (1, 8, 16, 32)
}


@pytest.mark.parametrize("block_q", [1, 8, 16, 32])
@pytest.mark.parametrize("seed", [*range(6), "worst"])
def test_tiles_cover_every_row_once_and_padding_chunks_cover_the_rest(block_q, seed):
    if seed == "worst":
        B = 5
        T = B * (block_q + 1) + 3 * block_q - 1
        kv_lens, cu, ns, q_lens = _worst_batch(B, T, block_q)
    else:
        rng = np.random.default_rng(seed)
        B, T = int(rng.integers(1, 9)), int(rng.integers(1, 200))
        kv_lens, cu, ns, q_lens = _batch(rng, B, T)
    ts = _tile_schedule(
        jnp.asarray(kv_lens), jnp.asarray(cu), jnp.asarray(ns), num_tokens=T, block_q=block_q,
        extra_tiles=2,
    )  # fmt: skip
    seq, q_start, q_rows, pos0, kv_len, pad = (
        np.asarray(x) for x in (ts.seq, ts.q_start, ts.q_rows, ts.pos0, ts.kv_len, ts.pad_start)
    )
    total = int(cu[ns])
    covered = np.zeros(T, np.int32)
    for i in np.flatnonzero(q_rows > 0):
        b = seq[i]
        lo = q_start[i]
        assert cu[b] <= lo and lo + q_rows[i] <= cu[b + 1] and q_rows[i] <= block_q
        assert pos0[i] == kv_lens[b] - q_lens[b] + (lo - cu[b]) and kv_len[i] == kv_lens[b]
        covered[lo : lo + q_rows[i]] += 1
        assert pad[i] == T
    assert np.all(covered[:total] == 1) and np.all(covered[total:] == 0)
    assert int(ts.num_tiles) == int(np.sum(q_rows > 0))
    # The empty tiles' padding chunks cover [total, T) and start nowhere before it.
    padded = np.zeros(T, bool)
    for i in np.flatnonzero(q_rows == 0):
        assert total <= pad[i] <= T
        padded[pad[i] : pad[i] + block_q] = True
    assert np.all(padded[total:])


def test_token_rows_off_skips_the_row_maps():
    ts = schedule.tile_schedule(
        jnp.array([5, 3], jnp.int32), jnp.array([0, 2, 3], jnp.int32), jnp.int32(2),
        num_tokens=8, block_q=4, token_rows=False,
    )  # fmt: skip
    assert ts.tile_T is None and ts.row_T is None
    assert np.asarray(ts.pad_start).tolist()[int(ts.num_tiles) :][:1] == [3]
