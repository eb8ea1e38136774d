"""Swapping sequences between the device pool and a host pool: `BlockAllocator`'s swap half.

`SwapMixin` holds the swap operations of `jpaged.BlockAllocator` (which owns all the state);
see `jpaged._allocator` for the whole API. A group of sequences moves together, and a page
shared inside the group moves once, so sharing survives a round trip. The device side is
`jpaged.gather_pages` / `jpaged.scatter_pages`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from jpaged._errors import AllocatorError

if TYPE_CHECKING:
    from jpaged._allocator import _Seq

__all__ = ["SwapMixin"]


class SwapMixin:
    """Swap operations over `BlockAllocator` state (host slots, host refcounts, counters)."""

    def host_block_table(self, seq_id: Hashable) -> list[int]:
        """The host swap slots holding a swapped-out ``seq_id``'s pages (a copy).

        Raises:
          AllocatorError: unknown sequence, or the sequence is not swapped out.
        """
        seq = self._get(seq_id, "host_block_table", allow_swapped=True)
        if not seq.swapped:
            raise AllocatorError(f"host_block_table({seq_id!r}): sequence is not swapped out")
        return list(seq.pages)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._get(seq_id, "is_swapped", allow_swapped=True).swapped

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the host pool has room for the (distinct) pages of ``seq_ids``."""
        seqs = self._group(seq_ids, "can_swap_out", swapped=False)
        return len(self._group_pages(seqs)) <= len(self._host_free)

    def can_swap_in(self, seq_ids: Iterable[Hashable], *, keep_free: int = 0) -> bool:
        """Whether the device pool has room (above the watermark and ``keep_free`` more
        pages) to swap ``seq_ids`` in."""
        seqs = self._group(seq_ids, "can_swap_in", swapped=True)
        needed = len(self._group_pages(seqs))
        return needed <= self.num_free_pages - self.watermark_pages - keep_free

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Moves the sequences ``seq_ids`` to the host pool.

        Pages shared inside the group move once; reserved lookahead pages are released.

        Returns:
          ``(device_page, host_slot)`` pairs: gather these pages (`jpaged.gather_pages`) into
          the host slots before anything else writes to the pool.

        Raises:
          AllocatorError: unknown, repeated or already swapped sequences.
          OutOfPagesError: the host pool has too few free slots (nothing changes).
        """
        ids = list(seq_ids)
        seqs = self._group(ids, "swap_out", swapped=False)
        pages = self._group_pages(seqs)
        if len(pages) > len(self._host_free):
            op = f"swap_out({ids!r}) on the host pool"
            raise self._out_of_pages(op, len(pages), len(self._host_free), self.num_host_pages)
        mapping = {page: self._host_free.pop() for page in pages}
        for seq_id, seq in zip(ids, seqs, strict=True):
            keep = self._pages_for(seq.num_tokens)
            for page in reversed(seq.pages[keep:]):
                self._release(page)
            for page in reversed(seq.pages[:keep]):
                self._release(page)
                self._host_refcount[mapping[page]] += 1
            seq.pages = [mapping[p] for p in seq.pages[:keep]]
            seq.swapped = True
            self._dirty.add(seq_id)
        self._swapped_out_pages += len(mapping)
        return list(mapping.items())

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Moves swapped-out sequences back to device pages (the watermark is not applied).

        Returns:
          ``(host_slot, device_page)`` pairs to copy to the device (`jpaged.scatter_pages`)
          before the sequences run.

        Raises:
          AllocatorError: unknown, repeated or not swapped sequences.
          OutOfPagesError: the device pool has too few pages (nothing changes).
        """
        ids = list(seq_ids)
        seqs = self._group(ids, "swap_in", swapped=True)
        slots = self._group_pages(seqs)
        self._ensure_available(len(slots), f"swap_in({ids!r})")
        mapping = {slot: self._take_page(refcount=0) for slot in slots}
        for seq_id, seq in zip(ids, seqs, strict=True):
            for slot in seq.pages:
                self._refcount[mapping[slot]] += 1
                self._release_host(slot)
            seq.pages = [mapping[s] for s in seq.pages]
            seq.swapped = False
            for page, h in zip(seq.pages, seq.hashes, strict=False):
                self._cache.register(page, h)  # restores the prefix cache where not taken
            self._dirty.add(seq_id)
        self._swapped_in_pages += len(mapping)
        return list(mapping.items())

    def _group(self, seq_ids: Iterable[Hashable], op: str, *, swapped: bool) -> list[_Seq]:
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise AllocatorError(f"{op}: repeated sequence ids in {ids!r}")
        seqs = [self._get(i, op, allow_swapped=True) for i in ids]
        for seq_id, seq in zip(ids, seqs, strict=True):
            if seq.swapped != swapped:
                state = "already swapped out" if seq.swapped else "not swapped out"
                raise AllocatorError(f"{op}({seq_id!r}): sequence is {state}")
        return seqs

    def _group_pages(self, seqs: list[_Seq]) -> list[int]:
        """Distinct pages (or host slots) holding tokens of ``seqs``, in first-seen order."""
        pages: dict[int, None] = {}
        for seq in seqs:
            pages.update(dict.fromkeys(seq.pages[: self._pages_for(seq.num_tokens)]))
        return list(pages)

    def _release_host(self, slot: int) -> None:
        self._host_refcount[slot] -= 1
        if self._host_refcount[slot] == 0:
            self._host_free.append(slot)
