"""Device page ids of the KV pool: refcounts, the free list and the prefix cache.

`PagePool` hands out and takes back page ids; it knows nothing of sequences (the
`jpaged.BlockAllocator` holding it does). A page is in exactly one state: free, referenced
(refcount > 0) or evictable (cached, refcount 0, parked in the prefix cache's LRU).
"""

from __future__ import annotations

from jpaged._errors import OutOfPagesError
from jpaged.kv.prefix_cache import PrefixCache

__all__ = ["PagePool", "out_of_pages"]


def out_of_pages(op: str, needed: int, free: int, total: int) -> OutOfPagesError:
    """The `OutOfPagesError` of ``op``, with ``needed``, ``free`` and ``total`` attributes."""
    err = OutOfPagesError(
        f"{op} needs {needed} pages but only {free} of {total} are available "
        f"(free plus evictable cached pages)"
    )
    err.needed, err.free, err.total = needed, free, total
    return err


class PagePool:
    """Refcounts and free list of P device pages, and the prefix cache over them.

    Args:
      num_pages: P, pages in the pool (ids ``0 .. P-1``).

    Attributes:
      refcount: per page, the number of block tables holding it.
      free: free pages, a stack (pops 0, 1, 2, ... first).
      cache: the `PrefixCache` (hashes of full pages, LRU of evictable ones).
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.free = list(range(num_pages - 1, -1, -1))
        self.cache = PrefixCache()

    @property
    def num_free(self) -> int:
        """Pages available to new allocations: free plus evictable cached ones."""
        return len(self.free) + len(self.cache.evictable)

    def ensure_available(self, needed: int, op: str) -> None:
        """Raises `OutOfPagesError` when fewer than ``needed`` pages are available."""
        if needed > self.num_free:
            raise out_of_pages(op, needed, self.num_free, self.num_pages)

    def take(self, refcount: int = 1) -> int:
        """A free page (or the least recently released evictable one), with ``refcount``."""
        page = self.free.pop() if self.free else self.cache.evict()
        self.refcount[page] = refcount
        return page

    def release(self, page: int) -> None:
        """Drops one reference; at zero the page is parked (cached) or freed."""
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if self.cache.is_cached(page):
                self.cache.park(page)
            else:
                self.free.append(page)

    def writable(self, page: int) -> bool:
        """Whether ``page`` may be written in place (one holder, not cached)."""
        return self.refcount[page] == 1 and not self.cache.is_cached(page)

    def uncache(self, pages) -> None:
        """Drops the hashes of held ``pages`` that are cached (they stay referenced)."""
        for page in pages:
            if self.cache.is_cached(page):
                self.cache.uncache(page)

    def drop_cache(self) -> None:
        """Forgets every cached page's hash: evictable pages become free."""
        for page in list(self.cache.page_hash):
            self.cache.uncache(page)
            if self.refcount[page] == 0:
                self.free.append(page)
