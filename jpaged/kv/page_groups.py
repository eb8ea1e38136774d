"""Two page groups in one pool, for models that mix sliding-window and full-attention layers.

A global (full-attention) layer reads a sequence's whole history and a local (sliding-window)
layer only its last ``w`` keys. With one stacked pool a page spans every layer, so nothing
could be released while any layer is global. `PageGroups` splits the pool's pages into two
groups, each with its own `jpaged.BlockAllocator` (free list, refcounts, prefix cache, host
swap slots):

- the global group, pages ``0 .. P_g - 1``: the full-attention layers' K/V, whole histories;
- the local group, pages ``P_g .. P_g + P_l - 1``: the windowed layers' K/V, whose pages
  outside the window go back to the group (`jpaged.kv.window`).

The device pool is one `jpaged.PagedKVCache` ``[L / 2, K, P_g + P_l, C, H]``: its layer axis
holds one slice per global layer for a global page and one per local layer for a local
page (a model with as many local as global layers: Gemma 2), and the model indexes it by
each layer's index within its group (`jpaged.kv.layer_groups`). A page copy, swap or gather
moves a page of either group the same way, so the page operations keep one id space:
local pages and host slots are numbered after the global ones.

The local group mirrors every operation of the global one (allocate, grow, reserve,
truncate, fork, free, swap, prefix-cache commits), so a sequence has the same length and
table layout in both; it also releases pages outside the window
(`release_outside_window`). Growth, allocation and swaps are all or nothing: both groups are
checked before either changes. A prefix hit needs the chain's pages in the global group and,
in the local group, only the pages a query after the hit sees (`jpaged.kv.prefix_plan`: the
local entries before them start released); without a ``window``, the chain in both.

>>> groups = PageGroups(num_global_pages=8, num_local_pages=4, page_size=2, watermark=0.0,
...                     window=2)
>>> groups.allocate("a", 7)
>>> groups.block_table("a"), groups.local_block_table("a")
([0, 1, 2, 3], [8, 9, 10, 11])
>>> groups.release_outside_window("a", num_computed=7, window=2)
2
>>> groups.local_block_table("a"), groups.local_slots("a", 6, 1).tolist()
([10, 10, 10, 11], [22])
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from jpaged._errors import OutOfPagesError
from jpaged.kv.allocator import AllocatorInvariantError, AllocatorStats, BlockAllocator
from jpaged.kv.copy_on_write import CopyPairs

__all__ = ["PageGroups", "default_local_pages", "swap_out_pages"]


def default_local_pages(
    max_num_seqs: int, width: int, window: int, page_size: int, lookahead_tokens: int = 0
) -> int:
    """Local-group pages for ``max_num_seqs`` decoding sequences, each holding its window
    (``ceil(w / C) + 2`` pages, `jpaged.kv.window`) and a decode loop's reservation, plus
    one whole sequence of ``width`` pages (admission allocates a whole prompt).

    >>> default_local_pages(max_num_seqs=8, width=16, window=8, page_size=4, lookahead_tokens=2)
    56
    """
    per_seq = -(-window // page_size) + 2 + -(-lookahead_tokens // page_size)
    return max_num_seqs * per_seq + width


class PageGroups:
    """The global and the local page group of one pool; the `jpaged.BlockAllocator` interface
    the engine uses, over both.

    Args:
      num_global_pages: P_g, pages of the global group (ids ``0 .. P_g - 1``).
      num_local_pages: P_l, pages of the local group (ids ``P_g .. P_g + P_l - 1``).
      page_size: C, tokens per page.
      watermark: fraction of each group kept free by `can_allocate` and `can_swap_in`.
      num_host_pages: host swap slots of the global group (ids ``0 .. H_g - 1``).
      num_local_host_pages: host swap slots of the local group (ids after the global ones).
      bytes_per_page: bytes of one page of either group.
      window: the local layers' sliding window (prefix hits need only its pages in the local
        group); None: a hit needs the whole chain in both groups.

    Attributes:
      global_group: the global group's allocator (its own page ids).
      local_group: the local group's allocator (its own page ids; ``local_offset`` added
        gives the pool's).
      local_offset: P_g, the pool id of the local group's page 0.
      local_host_offset: H_g, the host slot of the local group's slot 0.

    Counts that the scheduler compares with the watermark are the tighter group's:
    ``num_free_pages - watermark_pages`` (and ``num_pages - watermark_pages``) is the smaller
    of the two groups' room above their watermarks.

    Raises:
      ValueError: a size is not a positive int, or the watermark is outside [0, 1).
    """

    def __init__(
        self,
        num_global_pages: int,
        num_local_pages: int,
        page_size: int,
        *,
        watermark: float = 0.01,
        num_host_pages: int = 0,
        num_local_host_pages: int = 0,
        bytes_per_page: int = 0,
        window: int | None = None,
    ):
        self.global_group = BlockAllocator(
            num_global_pages, page_size, watermark=watermark, num_host_pages=num_host_pages,
            bytes_per_page=bytes_per_page,
        )  # fmt: skip
        self.local_group = BlockAllocator(
            num_local_pages, page_size, watermark=watermark,
            num_host_pages=num_local_host_pages, bytes_per_page=bytes_per_page,
        )  # fmt: skip
        self.page_size = self.global_group.page_size
        self.bytes_per_page = self.global_group.bytes_per_page
        self.local_offset = self.global_group.num_pages
        self.local_host_offset = self.global_group.num_host_pages
        self.num_host_pages = self.local_host_offset + self.local_group.num_host_pages
        self.watermark_pages = self.global_group.watermark_pages
        self.window = window

    # ------------------------------------------------------------------ queries

    def _tighter(self, global_count: int, local_count: int) -> int:
        """The smaller room above the watermarks, plus the global watermark."""
        g, loc = self.global_group, self.local_group
        return min(global_count, local_count - loc.watermark_pages + g.watermark_pages)

    @property
    def num_pages(self) -> int:
        """The tighter group's pages (see the class docstring)."""
        return self._tighter(self.global_group.num_pages, self.local_group.num_pages)

    @property
    def num_free_pages(self) -> int:
        """The tighter group's free plus evictable pages (see the class docstring)."""
        return self._tighter(self.global_group.num_free_pages, self.local_group.num_free_pages)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.global_group

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The global group's page ids of ``seq_id``."""
        return self.global_group.block_table(seq_id)

    def local_block_table(self, seq_id: Hashable) -> list[int]:
        """The local group's page ids of ``seq_id`` as pool ids; entries released outside
        the window hold its first held page."""
        return [p + self.local_offset for p in self.local_group.block_table(seq_id)]

    def num_released_pages(self, seq_id: Hashable) -> int:
        """Leading local-group entries of ``seq_id`` released outside the window."""
        return self.local_group.num_released_pages(seq_id)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.global_group.num_tokens(seq_id)

    def slots(self, seq_id: Hashable, start: int, count: int) -> np.ndarray:
        """i32[count] global-group slots of positions ``[start, start + count)``."""
        return self.global_group.slots(seq_id, start, count)

    def local_slots(self, seq_id: Hashable, start: int, count: int) -> np.ndarray:
        """i32[count] local-group slots (pool ids) of positions ``[start, start + count)``."""
        return self.local_group.slots(seq_id, start, count) + self.local_offset * self.page_size

    def cached_pages(self, token_ids: Sequence[int], salt: bytes | str | None = None) -> int:
        """Leading full pages of ``token_ids`` a new sequence finds cached (a prefix hit's
        length): the global group's chain, and in the local group the pages of the window
        (without a window, the chain)."""
        hit = len(self.global_group.match_prefix(token_ids, salt)[1])
        within = token_ids[: hit * self.page_size + 1]  # at most `hit` full pages
        cached = self.local_group.match_prefix(within, salt, window=self.window)[0]
        return cached // self.page_size

    def _prefix_args(self, hit: int) -> tuple[dict, dict]:
        """Each group's keyword arguments of a prefix hit of ``hit`` pages."""
        return {"max_cached_pages": hit}, {"max_cached_pages": hit, "window": self.window}

    def match_prefix(
        self, token_ids: Sequence[int], salt: bytes | str | None = None
    ) -> tuple[int, list[int]]:
        """``(num_cached_tokens, global pages)`` of a prefix hit (`cached_pages`)."""
        hit = self.cached_pages(token_ids, salt)
        return hit * self.page_size, self.global_group.match_prefix(token_ids, salt)[1][:hit]

    def can_allocate(
        self,
        num_tokens: int,
        *,
        token_ids: Sequence[int] | None = None,
        salt: bytes | str | None = None,
        keep_free: int = 0,
    ) -> bool:
        """Whether a new sequence fits in both groups (`jpaged.BlockAllocator.can_allocate`)."""
        if token_ids is None:
            return all(a.can_allocate(num_tokens, keep_free=keep_free) for a in self._groups)
        kws = self._prefix_args(self.cached_pages(token_ids, salt))
        return all(
            a.can_allocate(num_tokens, token_ids=token_ids, salt=salt, keep_free=keep_free, **kw)
            for a, kw in zip(self._groups, kws, strict=True)
        )

    def growth_pages(self, seq_id: Hashable, num_tokens: int) -> int:
        """New pages growing ``seq_id`` by ``num_tokens`` takes in the hungrier group."""
        return max(a.growth_pages(seq_id, num_tokens) for a in self._groups)

    def can_append_slots(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        return all(a.can_append_slots(seq_id, num_tokens) for a in self._groups)

    def stats(self) -> AllocatorStats:
        """Both groups' page counts, copies, releases and swaps added up; tokens and prefix
        queries as the global group counts them (each token is in both groups)."""
        g, loc = self.global_group.stats(), self.local_group.stats()
        summed = ("total_pages", "free_pages", "used_pages", "shared_pages", "cached_pages",
                  "evictable_pages", "allocated_slots", "cow_copies", "window_released",
                  "evictions", "host_pages", "host_free_pages", "swapped_out_pages",
                  "swapped_in_pages", "swapped_out_bytes", "swapped_in_bytes")  # fmt: skip
        fields = {name: getattr(g, name) + getattr(loc, name) for name in summed}
        return AllocatorStats(**{**vars(g), **fields})

    def take_dirty(self) -> set[Hashable]:
        return self.global_group.take_dirty() | self.local_group.take_dirty()

    # ------------------------------------------------------------------ sequences

    @property
    def _groups(self) -> tuple[BlockAllocator, BlockAllocator]:
        return self.global_group, self.local_group

    def _ensure_room(self, op: str, num_tokens: int, prefix: tuple[dict, dict] = ({}, {})) -> None:
        """Raises `OutOfPagesError` unless both groups have the pages of a new sequence
        (without the watermark, as ``allocate`` itself; ``prefix``: each group's prefix-hit
        arguments of `jpaged.BlockAllocator.can_allocate`), before either changes."""
        for name, a, kw in zip(("global", "local"), self._groups, prefix, strict=True):
            if not a.can_allocate(num_tokens, keep_free=-a.watermark_pages, **kw):
                raise OutOfPagesError(
                    f"{op} ({num_tokens} tokens) needs more pages of the {name} group than "
                    f"the {a.num_free_pages} of {a.num_pages} available"
                )

    def allocate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Creates ``seq_id`` in both groups (all or nothing)."""
        if seq_id not in self:
            self._ensure_room(f"allocate({seq_id!r})", num_tokens)
        self.global_group.allocate(seq_id, num_tokens)
        self.local_group.allocate(seq_id, num_tokens)

    def allocate_with_prefix(
        self, seq_id: Hashable, token_ids: Sequence[int], salt: bytes | str | None = None
    ) -> int:
        """Creates ``seq_id`` in both groups, reusing the cached pages of a prefix hit
        (`cached_pages`); returns the number of cached tokens (all or nothing)."""
        kws = self._prefix_args(self.cached_pages(token_ids, salt))
        if seq_id not in self:
            prefix = tuple({"token_ids": token_ids, "salt": salt, **kw} for kw in kws)
            self._ensure_room(f"allocate_with_prefix({seq_id!r})", len(token_ids), prefix)
        cached = self.global_group.allocate_with_prefix(seq_id, token_ids, salt, **kws[0])
        self.local_group.allocate_with_prefix(seq_id, token_ids, salt, **kws[1])
        return cached

    def commit_full_pages(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        salt: bytes | str | None = None,
        *,
        verify: bool = True,
    ) -> int:
        """Registers the full pages of ``seq_id`` in both groups' prefix caches (released local
        pages are not registered); returns how many global pages are new."""
        self.local_group.commit_full_pages(seq_id, token_ids, salt, verify=verify)
        return self.global_group.commit_full_pages(seq_id, token_ids, salt, verify=verify)

    def _ensure_growth(self, seq_id: Hashable, num_tokens: int, op: str) -> None:
        """Raises `OutOfPagesError` unless both groups can grow ``seq_id`` by ``num_tokens``
        (checked before either changes: a group grown alone could not be rolled back without
        losing its copy-on-write pairs)."""
        for name, a in zip(("global", "local"), self._groups, strict=True):
            if not a.can_append_slots(seq_id, num_tokens):
                needed = a.growth_pages(seq_id, num_tokens)
                raise OutOfPagesError(
                    f"{op}({seq_id!r}, {num_tokens}) needs {needed} pages of the {name} group "
                    f"but only {a.num_free_pages} of {a.num_pages} are available"
                )

    def append_slots(self, seq_id: Hashable, num_tokens: int = 1) -> CopyPairs:
        """Grows ``seq_id`` in both groups; the copy-on-write pairs of both, as pool ids."""
        self._ensure_growth(seq_id, num_tokens, "append_slots")
        pairs = self.global_group.append_slots(seq_id, num_tokens)
        return pairs + self._local_pages(self.local_group.append_slots(seq_id, num_tokens))

    def reserve(self, seq_id: Hashable, num_tokens: int) -> CopyPairs:
        """Reserves the next positions' pages in both groups; copy pairs as pool ids."""
        self._ensure_growth(seq_id, num_tokens, "reserve")
        pairs = self.global_group.reserve(seq_id, num_tokens)
        return pairs + self._local_pages(self.local_group.reserve(seq_id, num_tokens))

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Shrinks ``seq_id`` in both groups (the local group's released pages bound it)."""
        self.local_group.truncate(seq_id, num_tokens)
        self.global_group.truncate(seq_id, num_tokens)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        for a in self._groups:
            a.fork(parent_id, child_id)

    def free(self, seq_id: Hashable) -> None:
        for a in self._groups:
            a.free(seq_id)

    def reset_prefix_cache(self, seq_ids: Iterable[Hashable] | None = None) -> None:
        ids = None if seq_ids is None else list(seq_ids)
        for a in self._groups:
            a.reset_prefix_cache(ids)

    def release_outside_window(self, seq_id: Hashable, num_computed: int, window: int) -> int:
        """Gives back the local-group pages of ``seq_id`` outside the ``window``
        (`jpaged.BlockAllocator.release_outside_window`); the global group keeps its pages."""
        return self.local_group.release_outside_window(seq_id, num_computed, window)

    # ------------------------------------------------------------------ swap

    def host_block_table(self, seq_id: Hashable) -> list[int]:
        return self.global_group.host_block_table(seq_id)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self.global_group.is_swapped(seq_id)

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        ids = list(seq_ids)
        return all(a.can_swap_out(ids) for a in self._groups)

    def can_swap_in(self, seq_ids: Iterable[Hashable], *, keep_free: int = 0) -> bool:
        ids = list(seq_ids)
        return all(a.can_swap_in(ids, keep_free=keep_free) for a in self._groups)

    def swap_out(self, seq_ids: Iterable[Hashable]) -> CopyPairs:
        """Moves ``seq_ids`` to the host in both groups; ``(device_page, host_slot)`` pairs
        as pool ids and host slots (all or nothing)."""
        ids = list(seq_ids)
        if not all(a.can_swap_out(ids) for a in self._groups):
            raise OutOfPagesError(f"swap_out({ids!r}): too few free host slots in a group")
        pairs = self.global_group.swap_out(ids)
        local = self.local_group.swap_out(ids)
        return pairs + [(d + self.local_offset, h + self.local_host_offset) for d, h in local]

    def swap_in(self, seq_ids: Iterable[Hashable]) -> CopyPairs:
        """Moves swapped-out ``seq_ids`` back in both groups; ``(host_slot, device_page)``
        pairs as host slots and pool ids (all or nothing; no watermark)."""
        ids = list(seq_ids)
        # keep_free=-watermark: room without the watermark, as swap_in itself needs.
        if not all(a.can_swap_in(ids, keep_free=-a.watermark_pages) for a in self._groups):
            raise OutOfPagesError(f"swap_in({ids!r}): too few free pages in a group")
        pairs = self.global_group.swap_in(ids)
        local = self.local_group.swap_in(ids)
        return pairs + [(h + self.local_host_offset, d + self.local_offset) for h, d in local]

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Checks both groups (`jpaged.BlockAllocator.check_invariants`) and that they hold
        the same sequences with the same lengths, swap states and table lengths; raises
        `jpaged.AllocatorInvariantError` listing every problem."""
        errors = []
        for name, a in zip(("global", "local"), self._groups, strict=True):
            try:
                a.check_invariants()
            except AllocatorInvariantError as e:
                errors.append(f"{name} group: {e}")
        g, loc = self._groups
        if set(g.seq_ids()) != set(loc.seq_ids()):
            errors.append(f"the groups hold different sequences: {g.seq_ids()} != {loc.seq_ids()}")
        for s in set(g.seq_ids()) & set(loc.seq_ids()):
            if g.num_tokens(s) != loc.num_tokens(s) or g.is_swapped(s) != loc.is_swapped(s):
                errors.append(f"seq {s!r}: length or swap state differs between the groups")
            elif not g.is_swapped(s) and len(g.block_table(s)) != len(loc.block_table(s)):
                errors.append(f"seq {s!r}: table lengths differ between the groups")
            if g.num_released_pages(s):
                errors.append(f"seq {s!r}: the global group released pages")
        if errors:
            raise AllocatorInvariantError("; ".join(errors))

    def _local_pages(self, pairs: CopyPairs) -> CopyPairs:
        return [(a + self.local_offset, b + self.local_offset) for a, b in pairs]


def swap_out_pages(alloc: BlockAllocator | PageGroups, seq_ids: Iterable[Hashable]) -> int:
    """Device pages a swap-out of ``seq_ids`` moves (pages they share counted once): their
    block tables' pages up to their lengths, and with two page groups also the local pages
    they still hold (those inside the window).

    >>> g = PageGroups(8, 4, 4, watermark=0.0, num_host_pages=8, num_local_host_pages=4)
    >>> g.allocate("a", 10)
    >>> g.release_outside_window("a", 10, 4)
    1
    >>> swap_out_pages(g, ["a"]), len(g.swap_out(["a"]))
    (5, 5)
    """
    C = alloc.page_size
    ids = list(seq_ids)
    held = {i: -(-alloc.num_tokens(i) // C) for i in ids}
    pages = {p for i in ids for p in alloc.block_table(i)[: held[i]]}
    if isinstance(alloc, PageGroups):
        pages |= {p for i in ids
                  for p in alloc.local_block_table(i)[alloc.num_released_pages(i) : held[i]]}  # fmt: skip
    return len(pages)
