"""The host block allocator: the single authority over which page holds what.

`BlockAllocator` is plain Python (never traced). It keeps, per sequence id (any hashable
host id), a block table (page ids) and a token count, a refcount per page, a free list, a
prefix cache of full pages (SHA-256 hash chain, LRU of evictable pages) and a host swap
pool. Every call is all-or-nothing: a call that raises leaves the allocator unchanged.

Sequences (each method's docstring has the details):

- ``allocate(seq_id, num_tokens)``; ``allocate_with_prefix(seq_id, token_ids, salt=None) ->
  num_cached_tokens`` reuses the cached full pages of the longest cached prefix (never the
  whole prompt: the last token is always computed).
- ``append_slots(seq_id, num_tokens=1) -> [(src, dst)]`` grows a sequence; a shared or cached
  last page is replaced and ``(src, dst)`` returned for the device to copy first
  (copy-on-write). ``reserve(seq_id, num_tokens)`` makes the next positions' pages exist and
  private without changing the length (lookahead for multi-step decode); ``truncate``
  shrinks.
- ``fork(parent_id, child_id)`` shares every page (refcount + 1); ``free(seq_id)`` releases
  them; ``release_outside_window`` gives back the pages a sliding window no longer sees
  (`jpaged.kv.window`); ``commit_full_pages`` registers full pages in the prefix cache.
- ``swap_out(seq_ids) -> [(device_page, host_slot)]`` / ``swap_in(seq_ids) -> [(host_slot,
  device_page)]`` move a group of sequences to the host pool and back (a page shared inside
  the group moves once); run the device gather of a swap-out (`jpaged.gather_pages`) before
  any later write to the pool, since the released pages may be handed out again.

Queries: ``block_table``, ``host_block_table``, ``num_tokens``, ``slots(seq_id, start,
count)`` (i32 ``page * C + offset``), ``can_allocate`` (honours the watermark),
``can_append_slots``, ``can_swap_in``/``can_swap_out``, ``match_prefix``,
``num_free_pages``, ``stats()``, ``take_dirty()`` and ``check_invariants()``.

Errors: `jpaged.OutOfPagesError` (with ``needed``, ``free``, ``total`` attributes) when pages
run out; `jpaged.AllocatorError` for misuse (unknown or duplicate id, double free, fork of
an unknown sequence, operations on a swapped-out sequence, bad counts);
`AllocatorInvariantError` from ``check_invariants``.

Parts: `BlockAllocator` holds a `PagePool` (device page ids, refcounts, free list and the
prefix cache of `jpaged.kv.prefix_cache`), a `HostSwapSpace` (host slots and the moves to
them) and a `SeqRecord` per sequence; the stats snapshot and the invariant checker
(`jpaged.kv.allocator_stats`) read those parts.

>>> alloc = BlockAllocator(num_pages=8, page_size=4)
>>> alloc.allocate("a", 6)
>>> alloc.block_table("a"), alloc.slots("a", 4, 2).tolist()
([0, 1], [4, 5])
>>> alloc.fork("a", "b")
>>> alloc.append_slots("b")  # "b" writes position 6 of shared page 1: copy it first
[(1, 2)]
>>> alloc.block_table("b"), alloc.stats().shared_pages
([0, 2], 1)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from jpaged._errors import AllocatorError
from jpaged.kv.allocator_stats import (
    AllocatorInvariantError,
    AllocatorStats,
    collect_stats,
    invariant_errors,
)
from jpaged.kv.copy_on_write import CopyPairs, growth_pages, make_writable
from jpaged.kv.page_pool import PagePool
from jpaged.kv.prefix_cache import first_mismatch, hash_chain
from jpaged.kv.prefix_plan import prefix_plan
from jpaged.kv.seq_record import RELEASED, SeqRecord, pages_for
from jpaged.kv.swap_space import HostSwapSpace, group_pages
from jpaged.kv.window import lookup_table, release_outside_window, touch_released

__all__ = ["AllocatorInvariantError", "AllocatorStats", "BlockAllocator"]


class BlockAllocator:
    """Pages, refcounts, block tables, copy-on-write, lookahead, prefix cache and swap.

    Args:
      num_pages: P, pages in the device pool (page ids ``0 .. P-1``, all ordinary).
      page_size: C, tokens per page.
      watermark: fraction of the pool that `can_allocate` and `can_swap_in` keep free, so
        running sequences can still grow (vLLM's 0.01).
      num_host_pages: capacity of the host swap pool, in pages (0: no swapping).
      bytes_per_page: bytes of one page (K and V, all layers), for the swap byte counters
        (`jpaged.PagedKVCache.bytes_per_page`).

    Raises:
      ValueError: a size is not a positive int, or the watermark is outside [0, 1).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        watermark: float = 0.01,
        num_host_pages: int = 0,
        bytes_per_page: int = 0,
    ):
        for name, v, lo in (
            ("num_pages", num_pages, 1),
            ("page_size", page_size, 1),
            ("num_host_pages", num_host_pages, 0),
            ("bytes_per_page", bytes_per_page, 0),
        ):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name}={v!r} must be an int >= {lo}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"{watermark=} must lie in [0, 1)")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.watermark_pages = int(watermark * num_pages)
        self.num_host_pages, self.bytes_per_page = int(num_host_pages), int(bytes_per_page)
        self._pool = PagePool(self.num_pages)
        self._host = HostSwapSpace(self.num_host_pages)
        self._seqs: dict[Hashable, SeqRecord] = {}
        self._freed_ids: OrderedDict[Hashable, None] = OrderedDict()  # for "double free"
        self._dirty: set[Hashable] = set()
        self._cow_copies = self._window_released = 0
        self._prefix_queries = self._prefix_query_tokens = self._prefix_hit_tokens = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_pages(self) -> int:
        """Pages available to new allocations: free plus evictable cached ones."""
        return self._pool.num_free

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[Hashable]:
        """The ids of the sequences held, swapped-out ones included."""
        return list(self._seqs)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The page ids of ``seq_id``, reserved lookahead pages included (a copy); entries
        released outside the sliding window hold its first held page (`jpaged.kv.window`)."""
        return lookup_table(self._get(seq_id, "block_table"))

    def num_released_pages(self, seq_id: Hashable) -> int:
        """Leading block-table entries of ``seq_id`` released outside the sliding window."""
        return self._get(seq_id, "num_released_pages", allow_swapped=True).released

    def num_tokens(self, seq_id: Hashable) -> int:
        """The length of ``seq_id`` (reserved slots not counted)."""
        return self._seqs[seq_id].num_tokens if seq_id in self._seqs else self._unknown(seq_id)

    def slots(self, seq_id: Hashable, start: int, count: int) -> np.ndarray:
        """i32[count] slot ids ``page * C + offset`` of positions ``[start, start + count)``.

        Raises:
          AllocatorError: the range is negative or past the allocated (reserved) capacity.
        """
        seq = self._get(seq_id, "slots")
        capacity = len(seq.pages) * self.page_size
        first = seq.released * self.page_size
        if start < first or count < 0 or start + count > capacity:
            raise AllocatorError(
                f"slots({seq_id!r}, {start=}, {count=}): positions must lie in [{first}, "
                f"{capacity}) (the pages allocated or reserved and not released)"
            )
        C = self.page_size
        if count == 1:  # the decode hot path
            return np.array([seq.pages[start // C] * C + start % C], np.int32)
        first = start // C
        pages = np.array(seq.pages[first : -(-(start + count) // C)], np.int32)
        pos = np.arange(start - first * C, start - first * C + count, dtype=np.int32)
        return pages[pos // C] * C + pos % C

    def can_allocate(
        self,
        num_tokens: int,
        *,
        token_ids: Sequence[int] | None = None,
        salt: bytes | str | None = None,
        keep_free: int = 0,
        max_cached_pages: int | None = None,
        window: int | None = None,
    ) -> bool:
        """Whether a new sequence of ``num_tokens`` fits while keeping the watermark (and
        ``keep_free`` more pages, e.g. running sequences' lookahead) free.

        With ``token_ids`` (the prompt), pages that `allocate_with_prefix` would take from
        the prefix cache are accounted for (``max_cached_pages``, ``window``: `allocate_with_prefix`).
        """
        needed = self._pages_for(num_tokens)
        if token_ids is not None:
            needed = prefix_plan(self._pool, token_ids, self.page_size, salt,
                                 max_pages=max_cached_pages, window=window)[3]  # fmt: skip
        return needed <= self.num_free_pages - self.watermark_pages - keep_free

    def growth_pages(self, seq_id: Hashable, num_tokens: int) -> int:
        """New pages ``reserve(seq_id, num_tokens)`` would take now (pages already reserved
        count as held; a shared page in the way counts, as it would be copied)."""
        seq = self._get(seq_id, "growth_pages")
        return growth_pages(
            seq,
            self._pool,
            self.page_size,
            seq.num_tokens + self._count(num_tokens, "growth_pages"),
        )

    def can_append_slots(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether ``append_slots(seq_id, num_tokens)`` (or ``reserve``) would succeed."""
        seq = self._get(seq_id, "can_append_slots")
        return (
            growth_pages(seq, self._pool, self.page_size, seq.num_tokens + num_tokens)
            <= self.num_free_pages
        )

    def stats(self) -> AllocatorStats:
        """A snapshot of the pool, the sharing and the counters (O(pages held))."""
        return collect_stats(
            self._seqs.values(), self._pool, self._host, self.page_size, self.bytes_per_page,
            cow_copies=self._cow_copies, window_released=self._window_released,
            prefix_queries=self._prefix_queries,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
        )  # fmt: skip

    def take_dirty(self) -> set[Hashable]:
        """Ids whose block table or length changed since the last call (freed ones too)."""
        dirty, self._dirty = self._dirty, set()
        return dirty

    # ------------------------------------------------------------------ sequences

    def allocate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Creates ``seq_id`` holding ``num_tokens`` slots on fresh private pages.

        Raises:
          AllocatorError: ``seq_id`` exists or ``num_tokens`` is negative.
          OutOfPagesError: not enough pages (the watermark is not applied here).
        """
        self._check_new(seq_id, "allocate")
        needed = self._pages_for(self._count(num_tokens, "allocate"))
        self._pool.ensure_available(needed, f"allocate({seq_id!r}, {num_tokens})")
        pages = [self._pool.take() for _ in range(needed)]
        self._add_seq(seq_id, SeqRecord(pages=pages, num_tokens=num_tokens))

    def allocate_with_prefix(
        self, seq_id: Hashable, token_ids: Sequence[int], salt: bytes | str | None = None,
        *, max_cached_pages: int | None = None, window: int | None = None,
    ) -> int:  # fmt: skip
        """Creates ``seq_id`` for the prompt ``token_ids``, reusing cached full pages.

        Args:
          seq_id: a new id.
          token_ids: the prompt (its length is the sequence's length).
          salt: isolates caches (e.g. per tenant): pages are shared only under equal salts.
          max_cached_pages: at most this many leading pages count as cached (None: no limit).
          window: the sliding window of every query of the sequence: a hit needs only the pages
            its queries see, those before start released (`jpaged.kv.prefix_plan`).

        Returns:
          The number of leading tokens whose K/V are already in the pages (a multiple of
          C, at most ``len(token_ids) - 1``); the caller computes the rest.

        Raises:
          AllocatorError: ``seq_id`` exists.
          OutOfPagesError: not enough pages for the uncached part.
        """
        self._check_new(seq_id, "allocate_with_prefix")
        hashes, released, hit_pages, needed = prefix_plan(
            self._pool, token_ids, self.page_size, salt, max_pages=max_cached_pages, window=window
        )
        self._pool.ensure_available(needed, f"allocate_with_prefix({seq_id!r}, {len(token_ids)})")
        for page in hit_pages:
            if self._pool.refcount[page] == 0:
                self._pool.cache.take_back(page)
            self._pool.refcount[page] += 1
        hit = released + len(hit_pages)
        fresh = [self._pool.take() for _ in range(self._pages_for(len(token_ids)) - hit)]
        seq = SeqRecord(pages=[RELEASED] * released + hit_pages + fresh, released=released,
                        num_tokens=len(token_ids), hashes=hashes[:hit])  # fmt: skip
        seq.salt = salt
        self._add_seq(seq_id, seq)
        cached = hit * self.page_size
        self._prefix_queries += 1
        self._prefix_query_tokens += len(token_ids)
        self._prefix_hit_tokens += cached
        return cached

    def match_prefix(
        self,
        token_ids: Sequence[int],
        salt: bytes | str | None = None,
        *,
        window: int | None = None,
    ) -> tuple[int, list[int]]:
        """The cached prefix of ``token_ids``: ``(num_cached_tokens, pages)``; changes nothing.

        At most ``len(token_ids) - 1`` tokens match (the last one must be computed). With a
        ``window`` (`allocate_with_prefix`), ``pages`` are those after the released ones.
        """
        _, released, pages, _ = prefix_plan(self._pool, token_ids, self.page_size, salt,
                                            window=window)  # fmt: skip
        return (released + len(pages)) * self.page_size, pages

    def commit_full_pages(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        salt: bytes | str | None = None,
        *,
        verify: bool = True,
    ) -> int:
        """Registers the full pages of ``seq_id`` in the prefix cache; returns how many are new.

        Args:
          seq_id: the sequence.
          token_ids: its tokens so far (at least up to its last full page); tokens past the
            sequence's length are ignored.
          salt: must equal the salt the sequence was allocated with.
          verify: also check ``token_ids`` against the pages registered before (prefix hits,
            earlier commits): O(pages) hashing per call. The engine, whose token lists only
            grow, passes False.

        A page whose hash is already cached on another page stays an uncached duplicate
        until the sequence is freed (block tables never change behind the engine's back).

        Raises:
          AllocatorError: unknown or swapped sequence, a different salt, or token ids that
            disagree with an already cached page of this sequence.
        """
        seq = self._get(seq_id, "commit_full_pages")
        if salt != seq.salt:
            raise AllocatorError(
                f"commit_full_pages({seq_id!r}): {salt=} must equal the salt the sequence "
                f"was allocated with ({seq.salt!r})"
            )
        full = min(len(token_ids), seq.num_tokens) // self.page_size
        old = len(seq.hashes)
        bad = first_mismatch(token_ids, self.page_size, seq.hashes[:full], salt) if verify else None
        if bad is not None:
            raise AllocatorError(
                f"commit_full_pages({seq_id!r}): token ids of page {bad} disagree with "
                f"the cached contents of page {seq.pages[bad]}"
            )
        hashes = hash_chain(token_ids, self.page_size, full, salt, parents=seq.hashes)
        fresh = range(max(old, seq.released), full)  # released pages are not registered
        for i in fresh:
            cached = self._pool.cache.page_hash.get(seq.pages[i])
            if cached is not None and cached != hashes[i]:
                raise AllocatorError(
                    f"commit_full_pages({seq_id!r}): token ids of page {i} disagree with "
                    f"the cached contents of page {seq.pages[i]}"
                )
        registered = sum(self._pool.cache.register(seq.pages[i], hashes[i]) for i in fresh)
        seq.hashes = hashes if full > old else seq.hashes
        return registered

    def append_slots(self, seq_id: Hashable, num_tokens: int = 1) -> CopyPairs:
        """Grows ``seq_id`` by ``num_tokens``; returns copy-on-write ``(src, dst)`` pairs.

        Raises:
          AllocatorError: unknown or swapped sequence, or a negative count.
          OutOfPagesError: not enough pages (nothing changes).
        """
        seq = self._get(seq_id, "append_slots")
        n = self._count(num_tokens, "append_slots")
        pairs = make_writable(
            seq, self._pool, self.page_size, seq.num_tokens + n, f"append_slots({seq_id!r}, {n})"
        )
        self._cow_copies += len(pairs)
        seq.num_tokens += n
        self._dirty.add(seq_id)
        return pairs

    def reserve(self, seq_id: Hashable, num_tokens: int) -> CopyPairs:
        """Makes the next ``num_tokens`` positions' pages exist and private (lookahead).

        The length does not change; `slots` then covers the reserved positions.

        Raises:
          AllocatorError: unknown or swapped sequence, or a negative count.
          OutOfPagesError: not enough pages (nothing changes).
        """
        seq = self._get(seq_id, "reserve")
        n = self._count(num_tokens, "reserve")
        pairs = make_writable(
            seq, self._pool, self.page_size, seq.num_tokens + n, f"reserve({seq_id!r}, {n})"
        )
        self._cow_copies += len(pairs)
        self._dirty.add(seq_id)
        return pairs

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Shrinks ``seq_id`` to ``num_tokens`` tokens, releasing pages past the new end.

        Raises:
          AllocatorError: unknown or swapped sequence, or ``num_tokens`` outside
            ``[0, current length]`` (with released pages: from the end of the first held one).
        """
        seq = self._get(seq_id, "truncate")
        low = (seq.released + 1) * self.page_size if seq.released else 0  # first held page full
        if not low <= num_tokens <= seq.num_tokens:
            raise AllocatorError(f"truncate({seq_id!r}, {num_tokens}): num_tokens must lie in "
                                 f"[{low}, {seq.num_tokens}]")  # fmt: skip
        keep = self._pages_for(num_tokens)
        for page in reversed(seq.pages[keep:]):
            self._pool.release(page)
        del seq.pages[keep:]
        seq.num_tokens = num_tokens
        del seq.hashes[num_tokens // self.page_size :]
        if num_tokens % self.page_size and keep:
            last = seq.pages[-1]  # now partial: it will be written again
            if self._pool.refcount[last] == 1 and self._pool.cache.is_cached(last):
                self._pool.cache.uncache(last)
        self._dirty.add(seq_id)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Creates ``child_id`` sharing every page of ``parent_id`` that holds tokens.

        Raises:
          AllocatorError: unknown or swapped parent, or ``child_id`` exists.
        """
        parent = self._get(parent_id, "fork")
        self._check_new(child_id, "fork")
        pages = parent.pages[: self._pages_for(parent.num_tokens)]
        for page in pages[parent.released :]:
            self._pool.refcount[page] += 1
        child = SeqRecord(
            pages=list(pages), num_tokens=parent.num_tokens, hashes=list(parent.hashes),
            released=parent.released,
        )  # fmt: skip
        child.salt = parent.salt
        self._add_seq(child_id, child)

    def free(self, seq_id: Hashable) -> None:
        """Releases every page of ``seq_id`` (tail first) and forgets it.

        Raises:
          AllocatorError: double free or unknown sequence.
        """
        if seq_id not in self._seqs:
            if seq_id in self._freed_ids:
                raise AllocatorError(f"free({seq_id!r}): double free (already freed)")
            self._unknown(seq_id, "free")
        seq = self._seqs.pop(seq_id)
        release = self._host.release if seq.swapped else self._pool.release
        for page in reversed(seq.held):
            release(page)
        touch_released(seq, self._pool)  # its released head pages are evicted last
        self._freed_ids[seq_id] = None
        if len(self._freed_ids) > 65536:
            self._freed_ids.popitem(last=False)
        self._dirty.add(seq_id)

    def reset_prefix_cache(self, seq_ids: Iterable[Hashable] | None = None) -> None:
        """Forgets cached hashes whose pages may not hold what they say (the device pool was
        lost, a failed step did not write them): of every page (evictable ones become free),
        or of the device pages of ``seq_ids``. Held pages stay with their sequences."""
        ids = list(self._seqs) if seq_ids is None else list(seq_ids)
        seqs = [self._get(i, "reset_prefix_cache", allow_swapped=True) for i in ids]
        if seq_ids is None:
            self._pool.drop_cache()
        self._pool.uncache(p for seq in seqs if not seq.swapped for p in seq.pages if p != RELEASED)
        for seq in seqs:
            seq.hashes = []

    def release_outside_window(self, seq_id: Hashable, num_computed: int, window: int) -> int:
        """Gives back the pages of ``seq_id`` that no query at a position >= ``num_computed``
        sees under a sliding ``window`` (keys ``j <= num_computed - window``), oldest first;
        returns how many. Shared pages lose one reference, cached ones are parked with their
        contents. Call it once those tokens are computed (`jpaged.kv.window`).

        Raises:
          AllocatorError: unknown or swapped sequence, ``num_computed`` outside
            ``[0, num_tokens]``, or ``window`` < 1.
        """
        seq = self._get(seq_id, "release_outside_window")
        op = f"release_outside_window({seq_id!r}, {num_computed}, {window})"
        count = release_outside_window(seq, self._pool, self.page_size, num_computed, window, op)
        self._window_released += count
        if count:
            self._dirty.add(seq_id)
        return count

    # ------------------------------------------------------------------ swap

    def host_block_table(self, seq_id: Hashable) -> list[int]:
        """The host swap slots holding a swapped-out ``seq_id``'s pages (a copy).

        Raises:
          AllocatorError: unknown sequence, or the sequence is not swapped out.
        """
        seq = self._get(seq_id, "host_block_table", allow_swapped=True)
        if not seq.swapped:
            raise AllocatorError(f"host_block_table({seq_id!r}): sequence is not swapped out")
        return lookup_table(seq)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._get(seq_id, "is_swapped", allow_swapped=True).swapped

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the host pool has room for the (distinct) pages of ``seq_ids``."""
        seqs = self._group(seq_ids, "can_swap_out", swapped=False)
        return len(group_pages(seqs, self.page_size)) <= len(self._host.free)

    def can_swap_in(self, seq_ids: Iterable[Hashable], *, keep_free: int = 0) -> bool:
        """Whether the device pool has room (above the watermark and ``keep_free`` more
        pages) to swap ``seq_ids`` in."""
        seqs = self._group(seq_ids, "can_swap_in", swapped=True)
        needed = len(group_pages(seqs, self.page_size))
        return needed <= self.num_free_pages - self.watermark_pages - keep_free

    def swap_out(self, seq_ids: Iterable[Hashable]) -> CopyPairs:
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
        op = f"swap_out({ids!r}) on the host pool"
        pairs = self._host.swap_out(seqs, self._pool, self.page_size, op)
        self._dirty.update(ids)
        return pairs

    def swap_in(self, seq_ids: Iterable[Hashable]) -> CopyPairs:
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
        pairs = self._host.swap_in(seqs, self._pool, self.page_size, f"swap_in({ids!r})")
        self._dirty.update(ids)
        return pairs

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Checks the bookkeeping; raises `AllocatorInvariantError` listing every problem.

        free + referenced + evictable = pool; each page's refcount equals the number of
        tables holding it; no page is both free and referenced or cached; the hash maps
        are inverse; tables cover their lengths; the same for the host pool.
        """
        errors = invariant_errors(self._seqs, self._pool, self._host, self.page_size)
        if errors:
            raise AllocatorInvariantError("; ".join(errors))

    # ------------------------------------------------------------------ internals

    def _pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def _count(self, n: int, op: str) -> int:
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise AllocatorError(f"{op}: num_tokens={n!r} must be an int >= 0")
        return int(n)

    def _unknown(self, seq_id: Hashable, op: str = "num_tokens"):
        raise AllocatorError(f"{op}({seq_id!r}): unknown sequence {seq_id!r}")

    def _get(self, seq_id: Hashable, op: str, *, allow_swapped: bool = False) -> SeqRecord:
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._unknown(seq_id, op)
        if seq.swapped and not allow_swapped:
            raise AllocatorError(f"{op}({seq_id!r}): sequence is swapped out; swap it in first")
        return seq

    def _group(self, seq_ids: Iterable[Hashable], op: str, *, swapped: bool) -> list[SeqRecord]:
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise AllocatorError(f"{op}: repeated sequence ids in {ids!r}")
        seqs = [self._get(i, op, allow_swapped=True) for i in ids]
        for seq_id, seq in zip(ids, seqs, strict=True):
            if seq.swapped != swapped:
                state = "already swapped out" if seq.swapped else "not swapped out"
                raise AllocatorError(f"{op}({seq_id!r}): sequence is {state}")
        return seqs

    def _check_new(self, seq_id: Hashable, op: str) -> None:
        if seq_id in self._seqs:
            raise AllocatorError(f"{op}: sequence {seq_id!r} already exists")

    def _add_seq(self, seq_id: Hashable, seq: SeqRecord) -> None:
        self._seqs[seq_id] = seq
        self._freed_ids.pop(seq_id, None)
        self._dirty.add(seq_id)
