"""Prefix-cache bookkeeping for the block allocator: a SHA-256 hash chain over full pages
and an LRU of evictable cached pages (vLLM v1's scheme, over jpaged's ref-counted pool).

A full page's hash is ``SHA-256(parent_hash || token ids of the page)``; the first page's
parent is a root derived from the request's salt, so requests with different salts never
share pages (tenant isolation). Only full pages are hashed. A hashed page whose refcount
drops to zero is not freed but parked, keeping its contents, in the evictable LRU; a later
prefix hit takes it back, and the allocator evicts the least recently used one (dropping
its hash) only when no free page is left. The allocator releases a sequence's pages tail
first, so the tail pages of a request (longer prefixes, less reusable) are evicted before
its head pages.

This module holds the data structures only; `jpaged.BlockAllocator` owns the refcounts and
decides when pages are registered, parked, taken back and evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

__all__ = ["PrefixCache", "first_mismatch", "hash_chain", "hash_page", "root_hash"]

_ROOT = b"jpaged.prefix.v1"


def root_hash(salt: bytes | str | None = None) -> bytes:
    """The parent hash of a sequence's first page; differs per ``salt``."""
    if isinstance(salt, str):
        salt = salt.encode()
    return hashlib.sha256(_ROOT + b"\x00" + (b"" if salt is None else b"\x01" + salt)).digest()


def hash_page(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chain hash of one full page: SHA-256 of the parent hash and the page's token ids.

    >>> h = hash_page(root_hash(), [1, 2, 3, 4])
    >>> len(h), h == hash_page(root_hash("tenant-a"), [1, 2, 3, 4])
    (32, False)
    """
    tokens = np.asarray(token_ids, dtype="<i8")
    return hashlib.sha256(parent + tokens.tobytes()).digest()


def hash_chain(
    token_ids: Sequence[int],
    page_size: int,
    num_pages: int,
    salt: bytes | str | None = None,
    parents: Sequence[bytes] = (),
) -> list[bytes]:
    """Hashes of the first ``num_pages`` full pages of ``token_ids``, reusing ``parents``.

    ``parents`` are already known hashes of the first pages (they are kept, not recomputed).
    """
    hashes = list(parents[:num_pages])
    parent = hashes[-1] if hashes else root_hash(salt)
    for i in range(len(hashes), num_pages):
        parent = hash_page(parent, token_ids[i * page_size : (i + 1) * page_size])
        hashes.append(parent)
    return hashes


def first_mismatch(
    token_ids: Sequence[int],
    page_size: int,
    hashes: Sequence[bytes],
    salt: bytes | str | None = None,
) -> int | None:
    """The first page whose chain hash over ``token_ids`` differs from ``hashes`` (None if
    every one of the ``len(hashes)`` pages agrees).

    >>> h = hash_chain([1, 2, 3, 4], 2, 2)
    >>> first_mismatch([1, 2, 3, 4], 2, h), first_mismatch([1, 2, 3, 5], 2, h)
    (None, 1)
    """
    again = hash_chain(token_ids, page_size, len(hashes), salt)
    return next((i for i, (a, b) in enumerate(zip(again, hashes, strict=True)) if a != b), None)


class PrefixCache:
    """Hash <-> page maps and the LRU of evictable (refcount 0) cached pages.

    Attributes:
      page_hash: page id -> hash of each registered (cached) page.
      hash_page: hash -> page id (the inverse of ``page_hash``).
      evictable: cached pages with refcount 0, least recently released first.
      evictions: pages evicted so far (hash dropped to reuse the page).
    """

    def __init__(self) -> None:
        self.page_hash: dict[int, bytes] = {}
        self.hash_page: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.page_hash)

    def is_cached(self, page: int) -> bool:
        return page in self.page_hash

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest prefix of ``hashes`` that is cached (no state change)."""
        pages = []
        for h in hashes:
            page = self.hash_page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, page: int, h: bytes) -> bool:
        """Caches ``page`` under ``h``; False (nothing done) if ``h`` or ``page`` is taken."""
        if h in self.hash_page or page in self.page_hash:
            return False
        self.hash_page[h] = page
        self.page_hash[page] = h
        return True

    def uncache(self, page: int) -> None:
        """Drops the hash of ``page`` (it is about to be written or reused)."""
        h = self.page_hash.pop(page)
        del self.hash_page[h]
        self.evictable.pop(page, None)

    def park(self, page: int) -> None:
        """Puts a cached page whose refcount reached 0 at the most-recent end of the LRU."""
        self.evictable[page] = None

    def take_back(self, page: int) -> None:
        """Removes a parked page from the LRU (a prefix hit references it again)."""
        del self.evictable[page]

    def evict(self) -> int:
        """Evicts the least recently released cached page and returns it (hash dropped)."""
        page, _ = self.evictable.popitem(last=False)
        h = self.page_hash.pop(page)
        del self.hash_page[h]
        self.evictions += 1
        return page
