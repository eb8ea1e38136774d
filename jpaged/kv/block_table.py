"""Block tables as device state, and the host mirror that ships them as small deltas.

`BlockTable` holds ``tables: i32[B, W]`` (page ids of each sequence row) and ``lengths:
i32[B]`` on the device. The host allocator (`jpaged.BlockAllocator`) decides what they hold;
`HostBlockTable` mirrors them in NumPy, records which entries changed, and emits a
fixed-size, padded `BlockTableDelta` (sizes bucketed to powers of two, so the jitted
`apply_delta` compiles once per bucket) that `apply_delta` applies on device with the table
donated.

>>> table = BlockTable.create(max_seqs=4, width=8)
>>> host = HostBlockTable(max_seqs=4, width=8)
>>> host.set_row(2, pages=[5, 1], length=10)
>>> table = apply_delta(table, *host.delta())
>>> table.tables[2, :2].tolist(), int(table.lengths[2])
([5, 1], 10)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BlockTable", "BlockTableDelta", "HostBlockTable", "apply_delta", "bucket_size"]


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["tables", "lengths"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockTable:
    """Per-row page tables and lengths on the device.

    Attributes:
      tables: i32[B, W]; row b's page j holds its tokens ``[j * C, (j + 1) * C)``. Entries
        past ``ceil(lengths[b] / C)`` are unused and may hold anything.
      lengths: i32[B] tokens per row (0 for an empty row).
    """

    tables: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, max_seqs: int, width: int) -> BlockTable:
        """An empty table: ``B = max_seqs`` rows of ``W = width`` entries, all zero.

        Raises:
          ValueError: ``max_seqs`` or ``width`` is not a positive int.
        """
        for name, v in (("max_seqs", max_seqs), ("width", width)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        return cls(
            tables=jnp.zeros((max_seqs, width), jnp.int32),
            lengths=jnp.zeros((max_seqs,), jnp.int32),
        )

    @property
    def max_seqs(self) -> int:
        return self.tables.shape[0]

    @property
    def width(self) -> int:
        return self.tables.shape[1]


class BlockTableDelta(NamedTuple):
    """A padded set of table and length updates (NumPy, host side). Rows of -1 are padding.

    Attributes:
      rows: i32[E] row of each table entry to set.
      cols: i32[E] column of each entry.
      values: i32[E] page id to store.
      length_rows: i32[R] row of each length to set.
      length_values: i32[R] new length.
    """

    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray
    length_rows: np.ndarray
    length_values: np.ndarray


@functools.partial(jax.jit, donate_argnums=0)
def _apply_delta(table: BlockTable, rows, cols, values, length_rows, length_values):
    B, W = table.tables.shape
    ok = (rows >= 0) & (rows < B) & (cols >= 0) & (cols < W)
    rows = jnp.where(ok, rows, B)
    length_rows = jnp.where((length_rows >= 0) & (length_rows < B), length_rows, B)
    return BlockTable(
        tables=table.tables.at[rows, cols].set(values.astype(jnp.int32), mode="drop"),
        lengths=table.lengths.at[length_rows].set(length_values.astype(jnp.int32), mode="drop"),
    )


def apply_delta(
    table: BlockTable,
    rows: jax.Array,
    cols: jax.Array,
    values: jax.Array,
    length_rows: jax.Array,
    length_values: jax.Array,
    *,
    validate: bool = True,
) -> BlockTable:
    """Applies a host-computed delta to the device table (in place; ``table`` is donated).

    Args:
      table: the device table, [B, W].
      rows, cols, values: i32[E] table entries ``tables[rows[e], cols[e]] = values[e]``;
        a row of ``-1`` skips the entry. Rows must not repeat an ``(row, col)`` pair.
      length_rows, length_values: i32[R] ``lengths[length_rows[r]] = length_values[r]``;
        a row of ``-1`` is skipped.
      validate: check concrete values eagerly.

    Returns:
      The updated table.

    Raises:
      ValueError: mismatched shapes, non-integer arrays, or (concrete) a row outside
        ``[-1, B)`` or a column of a non-skipped entry outside ``[0, W)``.
    """
    rows, cols, values, length_rows, length_values = (
        x if hasattr(x, "dtype") else np.asarray(x)
        for x in (rows, cols, values, length_rows, length_values)
    )
    arrays = {"rows": rows, "cols": cols, "values": values}
    lengths = {"length_rows": length_rows, "length_values": length_values}
    for group in (arrays, lengths):
        shapes = {k: np.shape(v) for k, v in group.items()}
        if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
            raise ValueError(f"{', '.join(group)} must be vectors of one length, got {shapes}")
        for k, v in group.items():
            if not jnp.issubdtype(v.dtype, jnp.integer):
                raise ValueError(f"{k} must be an integer array, got {v.dtype}")
    if validate:
        _validate_delta(table, rows, cols, length_rows)
    return _apply_delta(table, rows, cols, values, length_rows, length_values)


def _validate_delta(table: BlockTable, rows, cols, length_rows) -> None:
    B, W = table.tables.shape
    try:
        rows_np, cols_np, lrows_np = np.asarray(rows), np.asarray(cols), np.asarray(length_rows)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    for name, r in (("rows", rows_np), ("length_rows", lrows_np)):
        if r.size and (r.min() < -1 or r.max() >= B):
            raise ValueError(f"{name} must lie in [-1, {B}) (-1 = skip), got {r.tolist()}")
    used = cols_np[rows_np >= 0]
    if used.size and (used.min() < 0 or used.max() >= W):
        raise ValueError(f"cols of non-skipped entries must lie in [0, {W}), got {used.tolist()}")


def bucket_size(n: int, minimum: int = 8) -> int:
    """The padded size for ``n`` items: the next power of two, at least ``minimum``.

    >>> [bucket_size(n) for n in (0, 8, 9, 100)]
    [8, 8, 16, 128]
    """
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


class HostBlockTable:
    """NumPy mirror of a device `BlockTable` that emits padded deltas of what changed.

    Starts equal to `BlockTable.create(max_seqs, width)` (all zero). Set rows from the
    allocator (``host.set_row(row, allocator.block_table(seq_id),
    allocator.num_tokens(seq_id))``), then ship ``apply_delta(table, *host.delta())`` once
    per step. Entries past a row's pages are left as they were (unused entries may hold
    anything), so only new or changed pages travel.

    Args:
      max_seqs: B rows.
      width: W entries per row.
      min_bucket: smallest padded delta size.
    """

    def __init__(self, max_seqs: int, width: int, *, min_bucket: int = 8):
        if max_seqs < 1 or width < 1:
            raise ValueError(f"{max_seqs=} and {width=} must be positive")
        self.max_seqs, self.width, self.min_bucket = max_seqs, width, min_bucket
        self.tables = np.zeros((max_seqs, width), np.int32)  # what the device will hold
        self.lengths = np.zeros((max_seqs,), np.int32)
        self._entries: dict[tuple[int, int], int] = {}
        self._lengths: dict[int, int] = {}

    def set_row(self, row: int, pages: Sequence[int], length: int) -> None:
        """Sets row ``row`` to hold ``pages`` (its first ``len(pages)`` entries) and ``length``.

        Raises:
          ValueError: ``row`` out of range, more than W pages, or a negative length.
        """
        if not 0 <= row < self.max_seqs:
            raise ValueError(f"{row=} must lie in [0, {self.max_seqs})")
        if len(pages) > self.width:
            raise ValueError(f"row {row} has {len(pages)} pages; must be <= width={self.width}")
        if length < 0:
            raise ValueError(f"{length=} must be >= 0")
        new = np.asarray(pages, np.int32)
        old = self.tables[row, : len(new)]
        for col in np.flatnonzero(old != new).tolist():
            self._entries[(row, col)] = int(new[col])
        self.tables[row, : len(new)] = new
        if self.lengths[row] != length:
            self._lengths[row] = int(length)
            self.lengths[row] = length

    def clear_row(self, row: int) -> None:
        """Marks row ``row`` empty (length 0)."""
        self.set_row(row, [], 0)

    def delta(self) -> BlockTableDelta:
        """The padded updates since the last call (and forgets them).

        Sizes are `bucket_size` of the number of changes, so `apply_delta` compiles once
        per bucket.
        """
        E = bucket_size(len(self._entries), self.min_bucket)
        R = bucket_size(len(self._lengths), self.min_bucket)
        rows = np.full(E, -1, np.int32)
        cols = np.zeros(E, np.int32)
        values = np.zeros(E, np.int32)
        if self._entries:
            keys = np.array(list(self._entries), np.int32)
            n = len(keys)
            rows[:n], cols[:n] = keys[:, 0], keys[:, 1]
            values[:n] = np.fromiter(self._entries.values(), np.int32, n)
        length_rows = np.full(R, -1, np.int32)
        length_values = np.zeros(R, np.int32)
        n = len(self._lengths)
        length_rows[:n] = np.fromiter(self._lengths.keys(), np.int32, n)
        length_values[:n] = np.fromiter(self._lengths.values(), np.int32, n)
        self._entries.clear()
        self._lengths.clear()
        return BlockTableDelta(rows, cols, values, length_rows, length_values)
