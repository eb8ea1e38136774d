"""Diagnostics of the block allocator: its stats snapshot and its invariant checker.

Both functions read the allocator's parts (its `SeqRecord`s, `PagePool` and
`HostSwapSpace`) and change nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping

from jpaged.kv.page_pool import PagePool
from jpaged.kv.seq_record import SeqRecord, pages_for
from jpaged.kv.swap_space import HostSwapSpace

__all__ = ["AllocatorInvariantError", "AllocatorStats", "collect_stats", "invariant_errors"]


class AllocatorInvariantError(RuntimeError):
    """`BlockAllocator.check_invariants` found inconsistent state; the message lists it."""


@dataclasses.dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of the allocator.

    Attributes:
      total_pages: pages in the device pool.
      free_pages: pages on the free list (no content worth keeping).
      used_pages: pages referenced by at least one sequence.
      shared_pages: pages referenced by more than one sequence.
      cached_pages: pages registered in the prefix cache (referenced or evictable).
      evictable_pages: cached pages with no reference (reusable on a hit, evicted on demand).
      num_seqs: sequences known (swapped ones included).
      live_tokens: distinct device slots holding a token of some sequence.
      logical_tokens: sum of the sequences' lengths (shared tokens counted per sequence).
      allocated_slots: ``used_pages * page_size``.
      page_fill: ``live_tokens / allocated_slots``, how full the held pages are (0.0 when
        nothing is allocated).
      cow_copies: copy-on-write page copies emitted so far.
      prefix_queries: prefix-cache lookups made by ``allocate_with_prefix``.
      prefix_query_tokens: prompt tokens of those lookups.
      prefix_hit_tokens: tokens served from the cache.
      evictions: cached pages evicted so far.
      host_pages: capacity of the host swap pool.
      host_free_pages: free host slots.
      swapped_seqs: sequences now swapped out.
      swapped_out_pages, swapped_in_pages: pages moved so far each way.
      swapped_out_bytes, swapped_in_bytes: the same times ``bytes_per_page``.
    """

    total_pages: int
    free_pages: int
    used_pages: int
    shared_pages: int
    cached_pages: int
    evictable_pages: int
    num_seqs: int
    live_tokens: int
    logical_tokens: int
    allocated_slots: int
    page_fill: float
    cow_copies: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    host_pages: int
    host_free_pages: int
    swapped_seqs: int
    swapped_out_pages: int
    swapped_in_pages: int
    swapped_out_bytes: int
    swapped_in_bytes: int


def collect_stats(
    seqs: Iterable[SeqRecord],
    pool: PagePool,
    host: HostSwapSpace,
    page_size: int,
    bytes_per_page: int,
    *,
    cow_copies: int,
    prefix_queries: int,
    prefix_query_tokens: int,
    prefix_hit_tokens: int,
) -> AllocatorStats:
    """A snapshot of an allocator's parts and counters (O(pages held))."""
    seqs = list(seqs)
    occupancy: dict[int, int] = {}
    logical = 0
    for seq in seqs:
        if seq.swapped:
            continue
        logical += seq.num_tokens
        for i, page in enumerate(seq.pages):
            held = min(max(seq.num_tokens - i * page_size, 0), page_size)
            occupancy[page] = max(occupancy.get(page, 0), held)
    used = sum(1 for r in pool.refcount if r > 0)
    live = sum(occupancy.values())
    allocated = used * page_size
    return AllocatorStats(
        total_pages=pool.num_pages,
        free_pages=len(pool.free),
        used_pages=used,
        shared_pages=sum(1 for r in pool.refcount if r > 1),
        cached_pages=len(pool.cache),
        evictable_pages=len(pool.cache.evictable),
        num_seqs=len(seqs),
        live_tokens=live,
        logical_tokens=logical,
        allocated_slots=allocated,
        page_fill=live / allocated if allocated else 0.0,
        cow_copies=cow_copies,
        prefix_queries=prefix_queries,
        prefix_query_tokens=prefix_query_tokens,
        prefix_hit_tokens=prefix_hit_tokens,
        evictions=pool.cache.evictions,
        host_pages=host.num_slots,
        host_free_pages=len(host.free),
        swapped_seqs=sum(1 for s in seqs if s.swapped),
        swapped_out_pages=host.swapped_out_pages,
        swapped_in_pages=host.swapped_in_pages,
        swapped_out_bytes=host.swapped_out_pages * bytes_per_page,
        swapped_in_bytes=host.swapped_in_pages * bytes_per_page,
    )


def invariant_errors(
    seqs: Mapping[Hashable, SeqRecord], pool: PagePool, host: HostSwapSpace, page_size: int
) -> list[str]:
    """Every inconsistency in an allocator's bookkeeping, as messages (empty when sound)."""

    errors: list[str] = []
    C = page_size
    holders = [0] * pool.num_pages
    host_holders = [0] * host.num_slots
    for seq_id, seq in seqs.items():
        if len(seq.pages) < pages_for(seq.num_tokens, C):
            errors.append(f"seq {seq_id!r}: {len(seq.pages)} pages < {seq.num_tokens} tokens")
        if len(set(seq.pages)) != len(seq.pages):
            errors.append(f"seq {seq_id!r}: repeated page in {seq.pages}")
        if len(seq.hashes) > seq.num_tokens // C:
            errors.append(f"seq {seq_id!r}: {len(seq.hashes)} hashes > full pages")
        counts = host_holders if seq.swapped else holders
        for page in seq.pages:
            if 0 <= page < len(counts):
                counts[page] += 1
            else:
                errors.append(f"seq {seq_id!r}: page {page} out of range")
        if seq.swapped and len(seq.pages) != pages_for(seq.num_tokens, C):
            errors.append(f"swapped seq {seq_id!r} holds reserved slots")
    free, evictable = set(pool.free), set(pool.cache.evictable)
    if len(free) != len(pool.free):
        errors.append("free list has duplicates")
    referenced = {p for p in range(pool.num_pages) if pool.refcount[p] > 0}
    for page in range(pool.num_pages):
        if pool.refcount[page] != holders[page]:
            errors.append(f"page {page}: refcount {pool.refcount[page]} != {holders[page]}")
    if free & referenced or free & evictable or evictable & referenced:
        errors.append(
            f"pages in two states: free&referenced={sorted(free & referenced)}, "
            f"free&evictable={sorted(free & evictable)}, "
            f"evictable&referenced={sorted(evictable & referenced)}"
        )
    if len(free) + len(referenced) + len(evictable) != pool.num_pages:
        errors.append(
            f"free {len(free)} + referenced {len(referenced)} + evictable "
            f"{len(evictable)} != pool {pool.num_pages}"
        )
    if any(p not in pool.cache.page_hash for p in evictable):
        errors.append("an evictable page is not cached")
    if free & set(pool.cache.page_hash):
        errors.append(f"free pages still cached: {sorted(free & set(pool.cache.page_hash))}")
    if {h: p for p, h in pool.cache.page_hash.items()} != pool.cache.hash_page:
        errors.append("prefix cache hash maps are not inverse")
    host_free = set(host.free)
    if len(host_free) != len(host.free):
        errors.append("host free list has duplicates")
    for slot in range(host.num_slots):
        if host.refcount[slot] != host_holders[slot]:
            errors.append(
                f"host slot {slot}: refcount {host.refcount[slot]} != {host_holders[slot]}"
            )
        if (slot in host_free) == (host_holders[slot] > 0):
            errors.append(f"host slot {slot}: free={slot in host_free}, holders>0 disagree")
    return errors
