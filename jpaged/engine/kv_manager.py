"""The KV manager: the host allocator, the device pool and the host swap space, together.

`KVManager` holds the three (composed: each is its own object) and runs the device side of
the page operations the scheduler plans (`jpaged.engine.scheduler.PageOp`): copy-on-write
copies (`jpaged.copy_pages`), swap-outs (`jpaged.gather_pages` into host arrays) and
swap-ins (`jpaged.scatter_pages` back), each padded to a page-count bucket so nothing
compiles after warm-up. It also owns the pool's hand-over from a decode loop dispatched in
another thread (``pending``): reading ``cache`` waits for that call.

Swapped-out pages are kept as this process's blocks of the pool's KV-head axis (the whole
pool on one device; each device's heads of a tensor-parallel pool), so under
``jax.distributed`` each host keeps the heads of its own devices.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.engine.batches import bucket, pad_to
from jpaged.engine.scheduler import PageOp
from jpaged.kv.allocator import BlockAllocator
from jpaged.kv.cache import PagedKVCache, copy_pages, gather_pages, scatter_pages

__all__ = ["KVManager"]


class KVManager:
    """The allocator, the device pool and the host copies of swapped-out pages.

    Args:
      alloc: the host `jpaged.BlockAllocator` (the authority over pages).
      cache: the device `jpaged.PagedKVCache`.

    Attributes:
      alloc: the allocator.
      pending: a future of a decode-loop call whose output holds the current pool, or None.
      host_pages: host slot -> ``(k, v)`` of a swapped-out page, each ``{first KV head:
        f[L, K_block, C, H]}``: this process's blocks of the page; a quantized pool's
        ``(k, v, k_scale, v_scale)``, the codes as stored and f32 ``[L, K_block, C]`` scales.
    """

    def __init__(self, alloc: BlockAllocator, cache: PagedKVCache):
        self.alloc = alloc
        self._cache = cache
        self.pending: concurrent.futures.Future | None = None
        self.host_pages: dict[int, tuple[dict[int, np.ndarray], dict[int, np.ndarray]]] = {}

    @property
    def cache(self) -> PagedKVCache:
        """The K/V pool. While a decode loop is being dispatched (in the dispatch thread,
        `jpaged.engine.decode_chain`), reading it waits for that call: its output is the
        current pool.

        Raises:
          RuntimeError: the pool was donated to a device call that failed.
        """
        fut = self.pending
        if fut is not None:
            try:
                out = fut.result()
            except Exception:
                # The call failed in the dispatch thread; the pool is the one it was given
                # (valid when it failed before donating it). An interrupted wait (Ctrl-C)
                # leaves the dispatch pending, to be waited for again.
                self.pending = None
                raise
            self.pending, self._cache = None, out[0][0]
        if self._cache.k_pages.is_deleted():
            raise RuntimeError(
                "the K/V pool was lost: a device call that had taken it (donated) failed; "
                "replace_lost_pool() puts a fresh one in its place"
            )
        return self._cache

    @cache.setter
    def cache(self, value: PagedKVCache) -> None:
        if self.pending is not None:
            raise AssertionError("the cache was replaced while a decode loop was dispatching")
        self._cache = value

    def replace_lost_pool(self) -> bool:
        """After a failed device call: if the pool was lost (donated to the call, or the
        output of a call that failed on the device), puts a zero-filled pool of the same
        shapes and dtypes in its place and returns True (every K/V it held is gone: the
        caller recomputes or fails what lived there)."""
        fut = self.pending
        if fut is not None:
            if not fut.done() or fut.exception() is None:
                return False  # a loop still owns (or has returned) the pool
            self.pending = None
        leaves = jax.tree.leaves(self._cache)
        lost = any(x.is_deleted() for x in leaves)
        if not lost:
            try:  # the output of a call that failed on the device holds its error
                jax.block_until_ready(leaves)
            except Exception:
                lost = True
        if lost:
            # Zeros placed as the lost pool was (committed: the placement programs compiled for).
            self._cache = jax.tree.map(
                lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), self._cache
            )
        return lost

    def apply(self, ops: Iterable[PageOp]) -> None:
        """Runs a plan's page operations on the device, in order."""
        for op in ops:
            if op.kind == "copy":
                self.copy(op.pairs)
            elif op.kind == "swap_out":
                self.swap_out(op.pairs)
            elif op.kind == "swap_in":
                self.swap_in(op.pairs)
            else:
                raise ValueError(f"unknown page operation {op.kind!r}")

    def copy(self, pairs) -> None:
        """Copies pages ``(src, dst)`` (copy-on-write), padded to a bucket of pairs."""
        M = bucket(len(pairs), 8, 1 << 30)
        arr = pad_to(np.asarray(pairs, np.int32).reshape(-1, 2), M, -1)
        self.cache = copy_pages(self.cache, arr, validate=False)

    def swap_out(self, pairs) -> None:
        """Reads device pages ``(device_page, host_slot)`` into host memory (a quantized
        pool's codes and their scales)."""
        if not pairs:
            return
        dev = np.asarray([p for p, _ in pairs], np.int32)
        M = bucket(len(dev), 8, 1 << 30)
        parts = gather_pages(self.cache, pad_to(dev, M, -1), validate=False)
        blocks = [_local_blocks(x) for x in parts]
        for i, (_, slot) in enumerate(pairs):
            self.host_pages[slot] = tuple({h: x[:, :, i] for h, x in b.items()} for b in blocks)

    def swap_in(self, pairs) -> None:
        """Writes host pages ``(host_slot, device_page)`` back into the pool."""
        if not pairs:
            return
        M = bucket(len(pairs), 8, 1 << 30)
        dst = pad_to(np.asarray([d for _, d in pairs], np.int32), M, -1)
        parts = []
        for which in range(len(self.host_pages[pairs[0][0]])):
            first = self.host_pages[pairs[0][0]][which]
            blocks = {}
            for h in first:
                x = np.stack([self.host_pages[s][which][h] for s, _ in pairs], 2)
                pad = [(0, 0)] * x.ndim
                pad[2] = (0, M - len(pairs))
                blocks[h] = np.pad(x, pad)
            parts.append(_from_local_blocks(blocks, self.cache.k_pages))
        self.cache = scatter_pages(self.cache, dst, *parts, validate=False)
        for s, _ in pairs:
            del self.host_pages[s]

    def warmup_page_programs(self, width: int) -> int:
        """Compiles the page programs of copy-on-write and swap (`copy_pages`, and with swap
        space `gather_pages` / `scatter_pages`) for every page-count bucket up to ``width``
        pages (one sequence of ``max_model_len``), on ids that touch nothing; returns how
        many. Swapping a group of more pages compiles its bucket on first use."""
        num = 0
        for M in (8 << i for i in range(bucket(width, 8, 1 << 30).bit_length() - 3)):
            ids = np.full(M, -1, np.int32)
            self.cache = copy_pages(self.cache, np.full((M, 2), -1, np.int32), validate=False)
            num += 1
            if self.alloc.num_host_pages:
                parts = gather_pages(self.cache, ids, validate=False)
                self.cache = scatter_pages(self.cache, ids, *parts, validate=False)
                num += 2
        return num


def _local_blocks(x: jax.Array) -> dict[int, np.ndarray]:
    """This process's blocks of ``x`` [L, K, M, C, H] (or scales [L, K, M, C]) along the
    KV-head axis, by first head."""
    return {(s.index[1].start or 0): np.asarray(s.data) for s in x.addressable_shards}


def _from_local_blocks(blocks: dict[int, np.ndarray], like: jax.Array) -> jax.Array:
    """The array [L, K, M, C, H] (or scales [L, K, M, C]) laid out as ``like`` (the pool: split
    on the KV-head axis, axis 1) from this process's blocks."""
    block = next(iter(blocks.values()))
    shape = (block.shape[0], like.shape[1], *block.shape[2:])

    def heads(index):
        lo, hi, _ = index[1].indices(shape[1])
        start = max(h for h in blocks if h <= lo)
        return blocks[start][:, lo - start : hi - start]

    return jax.make_array_from_callback(shape, like.sharding, heads, dtype=block.dtype)
