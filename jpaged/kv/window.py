"""Sliding-window page release: giving back the pages no later query of a sequence can see.

With a sliding window w on every layer (Mistral), a query at position p sees the keys
``p - w < j <= p``. Once a sequence has computed its first n tokens, every later query sits at
a position >= n (decode, the rest of a chunked prefill, a recompute starts over), so keys
``j <= n - w`` are never seen again and a page whose positions all lie there can go back to
the pool: its reference is dropped (a page shared by a fork or a prefix hit stays with its
other holders; a cached page is parked in the prefix cache's LRU with its contents, so later
prefix hits on it stay valid). Its block-table entry becomes `RELEASED`; released entries are
always a prefix of the table, so positions keep their page index (``pos // C``).

The table the device reads (`lookup_table`) points released entries at the sequence's first
held page, which is always full of computed tokens (``releasable_pages`` keeps one full page
before the one holding position n - 1 when w <= C). The kernels never need those entries: the
XLA decode path starts at the window's first page, the Mosaic kernels skip whole tiles before
the window; a tile or chunk that straddles the window start, or the XLA ragged path's chunks
(which start at the batch's earliest window), may read a released entry and mask its scores,
so the page it reads must hold finite values, which a full page of the sequence does (a
freed page may hold anything, NaN included).
"""

from __future__ import annotations

import numbers

from jpaged._errors import AllocatorError
from jpaged.kv.page_pool import PagePool
from jpaged.kv.seq_record import RELEASED, SeqRecord

__all__ = ["lookup_table", "releasable_pages", "release_outside_window", "touch_released"]


def releasable_pages(num_computed: int, window: int, page_size: int) -> int:
    """Leading pages of a sequence of ``num_computed`` computed tokens that no query at a
    position >= ``num_computed`` sees under ``window``, keeping the first held page full.

    Page i holds positions ``[i * C, (i + 1) * C)``; it is unseen iff ``(i + 1) * C - 1 <=
    num_computed - window``. At most ``num_computed // C - 1`` pages go, so page
    ``num_computed // C - 1`` (full) stays to stand in for them on the device.

    >>> releasable_pages(19, 8, 4), releasable_pages(32, 8, 4), releasable_pages(9, 2, 4)
    (3, 6, 1)
    """
    C = page_size
    return max(0, min((num_computed - window + 1) // C, num_computed // C - 1))


def release_outside_window(
    seq: SeqRecord, pool: PagePool, page_size: int, num_computed: int, window: int, op: str
) -> int:
    """Releases ``seq``'s pages outside the window (oldest first); returns how many.

    Raises:
      AllocatorError: (naming ``op``) ``num_computed`` outside ``[0, seq.num_tokens]`` or
        ``window`` not an int >= 1.
    """
    if not 0 <= num_computed <= seq.num_tokens:
        raise AllocatorError(f"{op}: num_computed must lie in [0, {seq.num_tokens}]")
    if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1:
        raise AllocatorError(f"{op}: window must be an int >= 1")
    end = releasable_pages(num_computed, window, page_size)
    if end <= seq.released:
        return 0
    for page in seq.pages[seq.released : end]:
        pool.release(page)
    count = end - seq.released
    seq.pages[seq.released : end] = [RELEASED] * count
    seq.released = end
    return count


def touch_released(seq: SeqRecord, pool: PagePool) -> None:
    """Moves ``seq``'s released pages still parked in the prefix cache to the most-recent end of
    its LRU, head page last: call it when the sequence is freed. Released first, they would
    be evicted first, and a prefix chain without its head page is never hit again; this keeps
    the allocator's order (a request's tail pages are evicted before its head pages)."""
    cache = pool.cache
    for h in reversed(seq.hashes[: seq.released]):
        page = cache.hash_page.get(h)
        if page is not None:
            cache.touch(page)


def lookup_table(seq: SeqRecord) -> list[int]:
    """``seq``'s pages (or host slots) by page index; released entries hold its first held one.

    >>> lookup_table(SeqRecord(pages=[RELEASED, RELEASED, 5, 2], num_tokens=14, released=2))
    [5, 5, 5, 2]
    """
    if not seq.released:
        return list(seq.pages)
    return [seq.pages[seq.released]] * seq.released + seq.pages[seq.released :]
