"""BlockTable on device, HostBlockTable deltas, and their agreement with the allocator."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jpaged import BlockAllocator, BlockTable, HostBlockTable, apply_delta
from jpaged.kv import block_table as _block_table
from jpaged.kv.block_table import bucket_size

B, W, C = 6, 5, 4


def test_create():
    table = BlockTable.create(max_seqs=B, width=W)
    assert table.tables.shape == (B, W) and table.lengths.shape == (B,)
    assert table.tables.dtype == table.lengths.dtype == np.int32
    assert (table.max_seqs, table.width) == (B, W)
    assert not np.asarray(table.tables).any() and not np.asarray(table.lengths).any()
    with pytest.raises(ValueError, match="width=0 must be a positive int"):
        BlockTable.create(max_seqs=2, width=0)


def test_apply_delta_sets_entries_and_skips_padding():
    table = BlockTable.create(B, W)
    rows = np.array([1, -1, 1, 4], np.int32)
    cols = np.array([0, 3, 2, 4], np.int32)
    values = np.array([9, 8, 7, 6], np.int32)
    table = apply_delta(table, rows, cols, values, np.array([4, -1], np.int32), np.array([17, 3]))
    want = np.zeros((B, W), np.int32)
    want[1, 0], want[1, 2], want[4, 4] = 9, 7, 6
    np.testing.assert_array_equal(np.asarray(table.tables), want)
    np.testing.assert_array_equal(np.asarray(table.lengths), [0, 0, 0, 0, 17, 0])


def test_host_mirror_follows_the_allocator():
    """Random allocator traffic; after each step the device table equals the host mirror,
    and each row's first pages and length equal the allocator's."""
    rng = np.random.default_rng(0)
    alloc = BlockAllocator(num_pages=24, page_size=C, watermark=0.0)
    host = HostBlockTable(B, W)
    table = BlockTable.create(B, W)
    rows: dict[int, int] = {}  # seq id -> row
    next_id = 0
    for _ in range(40):
        op = rng.integers(4)
        free_rows = sorted(set(range(B)) - set(rows.values()))
        if op == 0 and free_rows and alloc.can_allocate(8):
            next_id += 1
            alloc.allocate(next_id, int(rng.integers(0, 9)))
            rows[next_id] = free_rows[0]
        elif op == 1 and rows:
            seq = int(rng.choice(list(rows)))
            if alloc.num_tokens(seq) + 2 <= W * C and alloc.can_append_slots(seq, 2):
                alloc.append_slots(seq, int(rng.integers(1, 3)))
        elif op == 2 and rows and free_rows:
            parent = int(rng.choice(list(rows)))
            next_id += 1
            alloc.fork(parent, next_id)
            rows[next_id] = free_rows[0]
        elif op == 3 and rows:
            seq = int(rng.choice(list(rows)))
            alloc.free(seq)
            host.clear_row(rows.pop(seq))
        for seq in alloc.take_dirty():
            if seq in rows:
                host.set_row(rows[seq], alloc.block_table(seq), alloc.num_tokens(seq))
        table = apply_delta(table, *host.delta())
        np.testing.assert_array_equal(np.asarray(table.tables), host.tables)
        np.testing.assert_array_equal(np.asarray(table.lengths), host.lengths)
        for seq, row in rows.items():
            pages = alloc.block_table(seq)
            assert host.tables[row, : len(pages)].tolist() == pages
            assert host.lengths[row] == alloc.num_tokens(seq)


def test_delta_sizes_are_bucketed_and_only_changes_travel():
    host = HostBlockTable(B, W)
    host.set_row(0, [3, 4], 7)
    d = host.delta()
    assert d.rows.shape == (8,) and d.length_rows.shape == (8,)
    entries = zip(d.rows[:2].tolist(), d.cols[:2].tolist(), d.values[:2].tolist(), strict=True)
    assert sorted(entries) == [(0, 0, 3), (0, 1, 4)]
    assert (d.rows[2:] == -1).all() and (d.length_rows[1:] == -1).all()
    host.set_row(0, [3, 4, 5], 9)  # only the new page and the length travel
    d = host.delta()
    assert d.rows[:2].tolist() == [0, -1] and d.cols[0] == 2 and d.values[0] == 5
    assert d.length_rows[:2].tolist() == [0, -1] and d.length_values[0] == 9
    assert (host.delta().rows == -1).all()  # nothing changed since
    host.set_row(1, list(range(W)), 1)
    host.set_row(2, list(range(10, 10 + W)), 1)
    assert host.delta().rows.shape == (16,)
    assert [bucket_size(n) for n in (0, 1, 8, 9, 17)] == [8, 8, 8, 16, 32]


def test_apply_delta_donates_and_compiles_once():
    host = HostBlockTable(B, W)
    table = BlockTable.create(B, W)
    host.set_row(0, [1, 2], 5)
    table = apply_delta(table, *host.delta())
    size = _block_table._apply_delta._cache_size()
    old = table.tables
    host.set_row(3, [7], 1)
    table = apply_delta(table, *host.delta())  # same bucket: no compile
    jax.block_until_ready(table)
    assert old.is_deleted()
    assert _block_table._apply_delta._cache_size() == size
    assert np.asarray(table.tables)[3, 0] == 7


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([0], [0, 1], [0], [0], [0]), r"rows, cols, values must be vectors of one length"),
        (([0], [0], [0], [0, 1], [0]), r"length_rows, length_values must be vectors"),
        (([0.5], [0], [0], [0], [0]), r"rows must be an integer array"),
        (([B], [0], [0], [0], [0]), r"rows must lie in \[-1, 6\) \(-1 = skip\)"),
        (([0], [W], [0], [0], [0]), r"cols of non-skipped entries must lie in \[0, 5\)"),
        (([0], [0], [0], [-2], [0]), r"length_rows must lie in \[-1, 6\)"),
    ],
)
def test_apply_delta_rejects_bad_inputs(args, match):
    table = BlockTable.create(B, W)
    with pytest.raises(ValueError, match=match):
        apply_delta(table, *[np.asarray(a) for a in args])


def test_host_mirror_rejects_bad_rows():
    host = HostBlockTable(B, W)
    with pytest.raises(ValueError, match=r"row=6 must lie in \[0, 6\)"):
        host.set_row(B, [0], 1)
    with pytest.raises(ValueError, match="row 0 has 6 pages; must be <= width=5"):
        host.set_row(0, list(range(W + 1)), 1)
    with pytest.raises(ValueError, match="length=-1 must be >= 0"):
        host.set_row(0, [], -1)
