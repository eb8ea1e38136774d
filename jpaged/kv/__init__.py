"""KV state: the device pool and block tables (frozen pytrees) and the host allocator.

Internal modules; the public names are re-exported from `jpaged`:

- `cache`: `PagedKVCache` (the K/V pool, ``[L, K, P, C, H]``, fp8 / int8 with per-token
  scales or floating) and its donated updates; `cache_checks` their argument checks.
- `quantize`: the quantizing of K/V for an fp8 / int8 pool (scales from the values).
- `block_table`: `BlockTable` on device and its host mirror `HostBlockTable`.
- `allocator`: `BlockAllocator`, the single authority over which page holds what; it is
  composed of a `page_pool.PagePool` (device page ids, refcounts, free list, prefix cache),
  a `swap_space.HostSwapSpace` (host slots) and per-sequence `seq_record.SeqRecord`s.
- `prefix_cache`: the hash chain and the LRU of evictable cached pages.
- `prefix_plan`: which cached pages a new sequence reuses (under a sliding window, only those
  its queries see).
- `allocator_stats`: the allocator's stats snapshot and invariant checker.
- `window`: sliding-window page release (which pages no later query sees; the device table).
- `page_groups`: `PageGroups`, the global and the local page group of one pool for models that
  mix sliding-window and full-attention layers (the local group releases outside the window).
- `layer_groups`: which layers go to which group (the model's scan and the pool's sizing).
"""
