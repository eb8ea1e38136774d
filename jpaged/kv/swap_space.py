"""Host swap slots of the block allocator, and the moves of sequences to them and back.

`HostSwapSpace` owns the host slots (refcounts, free list, counters of pages moved). A group
of sequences moves together, and a page shared inside the group moves once, so sharing
survives a round trip. It changes the `SeqRecord`s it is given and returns or takes device
pages through the `PagePool` it is given; `jpaged.BlockAllocator` validates the request and
holds both. The device side is `jpaged.gather_pages` / `jpaged.scatter_pages`. Pages released
outside a sliding window (`jpaged.kv.window`) stay released: only held pages move.
"""

from __future__ import annotations

from jpaged.kv.page_pool import PagePool, out_of_pages
from jpaged.kv.seq_record import RELEASED, SeqRecord, pages_for

__all__ = ["HostSwapSpace", "group_pages"]


def group_pages(seqs: list[SeqRecord], page_size: int) -> list[int]:
    """Distinct held pages (or host slots) holding tokens of ``seqs``, in first-seen order."""
    pages: dict[int, None] = {}
    for seq in seqs:
        pages.update(dict.fromkeys(seq.pages[seq.released : pages_for(seq.num_tokens, page_size)]))
    return list(pages)


class HostSwapSpace:
    """Host slots holding swapped-out pages.

    Args:
      num_slots: capacity in pages (0: no swapping).

    Attributes:
      refcount: per slot, the number of swapped-out sequences holding it.
      free: free slots, a stack.
      swapped_out_pages, swapped_in_pages: pages moved so far each way.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.refcount = [0] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.swapped_out_pages = self.swapped_in_pages = 0

    def release(self, slot: int) -> None:
        """Drops one reference to ``slot``; frees it at zero."""
        self.refcount[slot] -= 1
        if self.refcount[slot] == 0:
            self.free.append(slot)

    def swap_out(
        self, seqs: list[SeqRecord], pool: PagePool, page_size: int, op: str
    ) -> list[tuple[int, int]]:
        """Moves ``seqs`` (not swapped) to host slots; returns ``(device_page, host_slot)``.

        Reserved lookahead pages are released, not moved.

        Raises:
          OutOfPagesError: too few free host slots (nothing changes).
        """
        pages = group_pages(seqs, page_size)
        if len(pages) > len(self.free):
            raise out_of_pages(op, len(pages), len(self.free), self.num_slots)
        mapping = {page: self.free.pop() for page in pages}
        for seq in seqs:
            keep = pages_for(seq.num_tokens, page_size)
            for page in reversed(seq.pages[keep:]):
                pool.release(page)
            for page in reversed(seq.pages[seq.released : keep]):
                pool.release(page)
                self.refcount[mapping[page]] += 1
            seq.pages = [RELEASED] * seq.released + [
                mapping[p] for p in seq.pages[seq.released : keep]
            ]
            seq.swapped = True
        self.swapped_out_pages += len(mapping)
        return list(mapping.items())

    def swap_in(
        self, seqs: list[SeqRecord], pool: PagePool, page_size: int, op: str
    ) -> list[tuple[int, int]]:
        """Moves swapped-out ``seqs`` back to device pages; returns ``(host_slot,
        device_page)``. Cached hashes are registered again where not taken meanwhile.

        Raises:
          OutOfPagesError: too few device pages (nothing changes).
        """
        slots = group_pages(seqs, page_size)
        pool.ensure_available(len(slots), op)
        mapping = {slot: pool.take(refcount=0) for slot in slots}
        for seq in seqs:
            for slot in seq.held:
                pool.refcount[mapping[slot]] += 1
                self.release(slot)
            seq.pages = [RELEASED] * seq.released + [mapping[s] for s in seq.held]
            seq.swapped = False
            for i in range(seq.released, min(len(seq.pages), len(seq.hashes))):
                pool.cache.register(seq.pages[i], seq.hashes[i])  # where not taken meanwhile
        self.swapped_in_pages += len(mapping)
        return list(mapping.items())
