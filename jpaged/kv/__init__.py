"""KV state: the device pool and block tables (frozen pytrees) and the host allocator.

Internal modules; the public names are re-exported from `jpaged`:

- `cache`: `PagedKVCache` (the K/V pool, ``[L, K, P, C, H]``) and its donated updates.
- `block_table`: `BlockTable` on device and its host mirror `HostBlockTable`.
- `allocator`: `BlockAllocator`, the single authority over which page holds what; it is
  composed of a `page_pool.PagePool` (device page ids, refcounts, free list, prefix cache),
  a `swap_space.HostSwapSpace` (host slots) and per-sequence `seq_record.SeqRecord`s.
- `prefix_cache`: the hash chain and the LRU of evictable cached pages.
- `allocator_stats`: the allocator's stats snapshot and invariant checker.
- `window`: sliding-window page release (which pages no later query sees; the device table).
"""
