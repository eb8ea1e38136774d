"""What the engine reports about itself: ``LLM.stats()`` (the pool, sharing, prefix-cache,
preemption, compile and timing figures) and ``LLM.page_tables()``."""

from __future__ import annotations

from typing import Any

from jpaged.engine.counters import Counters
from jpaged.engine.runner import Runner
from jpaged.engine.scheduler import Scheduler
from jpaged.kv.allocator import BlockAllocator

__all__ = ["engine_stats", "held_page_tables"]


def engine_stats(
    alloc: BlockAllocator, scheduler: Scheduler, runner: Runner, counters: Counters
) -> dict[str, Any]:
    """The figures of ``LLM.stats()`` by name."""
    s = alloc.stats()
    c = scheduler.counters
    return {
        "pages_total": s.total_pages,
        "pages_free": s.free_pages,
        "pages_used": s.used_pages,
        "pages_shared": s.shared_pages,
        "pages_cached": s.cached_pages,
        "pages_evictable": s.evictable_pages,
        "kv_utilisation": s.used_pages / s.total_pages if s.total_pages else 0.0,
        "kv_page_fill": s.page_fill,
        "live_tokens": s.live_tokens,
        "logical_tokens": s.logical_tokens,
        "prefix_queries": s.prefix_queries,
        "prefix_hit_tokens": s.prefix_hit_tokens,
        "prefix_hit_rate": s.prefix_hit_tokens / max(s.prefix_query_tokens, 1),
        "preemptions_recompute": c["preemptions_recompute"],
        "preemptions_swap": c["preemptions_swap"],
        "cow_copies": s.cow_copies,
        "pages_released_by_window": s.window_released,
        "swapped_out_bytes": s.swapped_out_bytes,
        "swapped_in_bytes": s.swapped_in_bytes,
        "recompiles": runner.num_compiles,
        "steps": counters.steps,
        "device_calls": counters.device_calls,
        "single_steps": counters.single_steps,
        "loop_decode_steps": counters.loop_steps,
        # Chains of decode loops started; steps run between two of a chain's loops, rows
        # that joined a running chain, carries grown for them (`jpaged.engine.chain_join`).
        "chain_starts": counters.chain_starts,
        "chains_from_steps": counters.chains_from_steps,
        "steps_beside_chain": counters.steps_beside_chain,
        "chain_joins": counters.chain_joins,
        "chain_grows": counters.chain_grows,
        "tokens_generated": counters.tokens_generated,
        # Host time scheduling, host + device time in steps, and of that the time spent
        # waiting for device results (so host work per step = step_s - device_wait_s) and
        # the time the calls that start device work took to return (dispatch_s; a decode
        # loop's call runs in the dispatch thread on GPU, where it can last until the loop
        # has run: the main thread's wait for it is in device_wait_s).
        **{f"time_{k}": v for k, v in counters.timing.items()},
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
    }


def held_page_tables(
    scheduler: Scheduler, alloc: BlockAllocator
) -> dict[tuple[str, int], list[int]]:
    """``{(request_id, index): page ids}``: the device pages each running sequence holds,
    in block-table order (swapped-out, waiting and finished sequences hold none)."""
    tables = {}
    for req in scheduler.running:
        for seq in req.seqs:
            alive = seq.finish_reason is None and seq.seq_id in alloc
            if alive and not alloc.is_swapped(seq.seq_id):
                pages = alloc.block_table(seq.seq_id)
                if pages:
                    tables[(req.request_id, seq.index)] = list(pages)
    return tables
