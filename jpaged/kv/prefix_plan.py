"""Which cached pages a new sequence reuses: the prefix-cache hit of a prompt.

A prompt's full pages hash to a chain (`jpaged.kv.prefix_cache.hash_chain`); the pages
registered under the chain's leading hashes already hold its K/V. Without a window the hit
is the longest cached prefix of the chain. For layers that see only a sliding window w, a
query at position p sees keys ``p - w < j <= p``, so a hit of m pages needs only the pages
after ``r = releasable_pages(m * C, w, C)`` (`jpaged.kv.window`): those queries sit at
positions >= m * C. The first r entries start released, as if the sequence had released
them itself (vLLM's hybrid KV-cache manager looks up sliding-window groups the same way).
"""

from __future__ import annotations

from collections.abc import Sequence

from jpaged.kv.page_pool import PagePool
from jpaged.kv.prefix_cache import hash_chain
from jpaged.kv.seq_record import pages_for
from jpaged.kv.window import releasable_pages

__all__ = ["prefix_plan", "window_prefix_hit"]


def prefix_plan(
    pool: PagePool,
    token_ids: Sequence[int],
    page_size: int,
    salt: bytes | str | None,
    *,
    max_pages: int | None = None,
    window: int | None = None,
) -> tuple[list[bytes], int, list[int], int]:
    """The hit of a prompt (never the whole prompt: its last token is always computed).

    Args:
      pool: the pool whose prefix cache is looked up (nothing changes).
      token_ids: the prompt.
      page_size: C.
      salt: the prefix cache's salt.
      max_pages: at most this many leading pages hit (None: no limit).
      window: a sliding window every query of the sequence sees only (None: none).

    Returns:
      ``(hashes, r, pages, needed)``: the chain's hashes up to the hit's end or further, the
      leading entries that start released, the cached pages of the hit after them, and the
      pages the prompt needs from the pool (a hit page held by nobody counts as taken).
    """
    full = max(len(token_ids) - 1, 0) // page_size
    full = full if max_pages is None else min(full, max_pages)
    hashes = hash_chain(token_ids, page_size, full, salt)
    needed = pages_for(len(token_ids), page_size)
    if window is None:
        return hashes, 0, *pool.prefix_hit(hashes, needed)
    return hashes, *window_prefix_hit(pool, hashes, window, page_size, needed)


def window_prefix_hit(
    pool: PagePool, hashes: list[bytes], window: int, page_size: int, pages_needed: int
) -> tuple[int, list[int], int]:
    """``(r, cached pages, pages needed)`` of the longest hit under a sliding ``window``: the
    first m pages of ``hashes`` count as cached when the pages of hashes ``[r, m)`` are,
    ``r = releasable_pages(m * C, window, C)``.

    >>> pool = PagePool(4)
    >>> for page, h in enumerate([b"h1", b"h2", b"h3"], start=1):
    ...     pool.cache.register(page, h)
    ...     pool.cache.park(page)
    True
    True
    True
    >>> pool.cache.uncache(1)  # the chain's head is gone: only a window can hit
    >>> window_prefix_hit(pool, [b"h0", b"h1", b"h2", b"h3"], window=6, page_size=4,
    ...                   pages_needed=5)
    (2, [2, 3], 3)
    """
    for m in range(len(hashes), 0, -1):
        released = releasable_pages(m * page_size, window, page_size)
        pages = [pool.cache.hash_page.get(h) for h in hashes[released:m]]
        if None not in pages:
            revived = sum(1 for p in pages if pool.refcount[p] == 0)
            return released, pages, pages_needed - released - len(pages) + revived
    return 0, [], pages_needed
