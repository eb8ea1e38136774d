"""Copy-on-write: making the pages a sequence is about to write private.

A page may be written in place only when one sequence holds it and the prefix cache does not
(`PagePool.writable`). Before a sequence writes positions ``[num_tokens, end)``, every page
holding them that is shared (refcount > 1, after a fork or a prefix hit) or cached is
replaced in its table by a fresh page; if the old page holds tokens the sequence keeps (the
last partial page), the device copies it first (``(src, dst)`` pairs). Pages past the table
are appended.
"""

from __future__ import annotations

from jpaged.kv.page_pool import PagePool
from jpaged.kv.seq_record import SeqRecord, pages_for

__all__ = ["CopyPairs", "growth_pages", "make_writable"]

CopyPairs = list[tuple[int, int]]  # (source page, destination page) for the device to copy


def growth_pages(seq: SeqRecord, pool: PagePool, page_size: int, end: int) -> int:
    """New pages needed so positions ``[num_tokens, end)`` of ``seq`` are on private pages."""
    if end <= seq.num_tokens:
        return 0
    first, last = seq.num_tokens // page_size, pages_for(end, page_size)
    needed = max(0, last - len(seq.pages))
    for i in range(first, min(len(seq.pages), last)):
        needed += not pool.writable(seq.pages[i])
    return needed


def make_writable(seq: SeqRecord, pool: PagePool, page_size: int, end: int, op: str) -> CopyPairs:
    """Makes positions ``[num_tokens, end)`` of ``seq`` private pages; returns the copies the
    device must run first.

    Raises:
      OutOfPagesError: (naming ``op``) too few pages; nothing changes.
    """
    if end <= seq.num_tokens:
        return []
    first, last = seq.num_tokens // page_size, pages_for(end, page_size)
    if last <= len(seq.pages) and all(pool.writable(seq.pages[i]) for i in range(first, last)):
        return []  # within pages already held and private (e.g. a reservation)
    pool.ensure_available(growth_pages(seq, pool, page_size, end), op)
    pairs: CopyPairs = []
    for i in range(first, min(len(seq.pages), last)):
        old = seq.pages[i]
        if pool.writable(old):
            continue
        new = pool.take()
        if i * page_size < seq.num_tokens:  # holds tokens this sequence keeps
            pairs.append((old, new))
        pool.release(old)
        seq.pages[i] = new
    seq.pages.extend(pool.take() for _ in range(last - len(seq.pages)))
    return pairs
