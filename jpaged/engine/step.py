"""One engine step as one device call: a planned ragged (or decode) batch, run and sampled.

`StepExecutor.run` packs a `StepPlan`'s scheduled sequences into a bucketed `StepBatch`,
runs the jitted step (`jpaged.engine.runner.Runner.step`), and while the device runs does
the bookkeeping that needs no sampled token (computed counts, prefix-cache commits,
re-forks after a recompute); then it reads the sampled tokens back and hands them to the
`TokenAppender` (n > 1 completions fork here; beams go through one beam step per request).
"""

from __future__ import annotations

import time

import numpy as np

from jpaged.engine.appender import TokenAppender
from jpaged.engine.batches import bucket, build_step_batch, sampling_arrays, sampling_row
from jpaged.engine.counters import Counters
from jpaged.engine.kv_manager import KVManager
from jpaged.engine.requests import Request, Sequence
from jpaged.engine.runner import Runner
from jpaged.engine.scheduler import StepPlan

__all__ = ["StepExecutor"]


class StepExecutor:
    """Runs planned steps one device call each.

    Args:
      kv: the KV manager (slots, block tables, the pool).
      runner: the jitted step programs.
      appender: applies the sampled tokens.
      counters: device calls and timing are added to.
      width: W, block-table width.
      max_num_seqs: the largest sequence bucket.
      max_num_batched_tokens: the largest token bucket (at least 16).
    """

    def __init__(
        self,
        kv: KVManager,
        runner: Runner,
        appender: TokenAppender,
        counters: Counters,
        *,
        width: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ):
        self.kv, self.runner, self.appender, self.counters = kv, runner, appender, counters
        self.width = width
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    def seq_bucket(self, n: int) -> int:
        """The sequence (and logits row) bucket of ``n`` rows."""
        return bucket(n, 8, self.max_num_seqs)

    def run(self, plan: StepPlan) -> None:
        """Runs ``plan.scheduled`` in one device call and applies the sampled tokens."""
        alloc = self.kv.alloc
        items = plan.scheduled
        rows = []  # (item index, completion index) of each sampled row
        for b, it in enumerate(items):
            if it.samples:
                req = it.request
                fan = 1 if (req.forked or req.is_beam) else req.fan_out
                rows.extend((b, i) for i in range(fan))
        samp = [sampling_row(items[b].request, items[b].seq, items[b].seq.seed + i)
                for b, i in rows]  # fmt: skip
        decode = plan.decode_only
        Bp = self.seq_bucket(max(len(items), len(rows)))
        batch = build_step_batch(
            [(it.seq.tokens, it.seq.num_computed, it.num_new) for it in items],
            [alloc.slots(it.seq.seq_id, it.seq.num_computed, it.num_new) for it in items],
            [alloc.block_table(it.seq.seq_id) for it in items],
            [b for b, _ in rows],
            sampling_arrays(np.asarray(samp, np.float64), Bp),
            width=self.width,
            num_rows=Bp,
            num_tokens=Bp if decode else bucket(plan.num_tokens, 16,
                                                max(self.max_num_batched_tokens, 16)),
        )  # fmt: skip
        num_top = 0
        if any(it.request.is_beam for it in items):
            num_top = bucket(2 * max(it.request.fan_out for it in items if it.request.is_beam),
                             8, 1 << 30)  # fmt: skip
        timing = self.counters.timing
        t = time.perf_counter()
        self.kv.cache, tok_R, lp_R, top = self.runner.step(
            self.kv.cache, batch, decode=decode, num_top=num_top
        )
        timing["dispatch_s"] += time.perf_counter() - t
        self.counters.device_calls += 1
        for x in (tok_R, lp_R) if top is None else (tok_R, lp_R, *top):
            x.copy_to_host_async()
        # While the device runs: book-keeping that needs no sampled token (prefix-cache
        # hashing, re-forks). K/V of the scheduled tokens are in the cache once it finishes,
        # and every later device call is ordered after this one.
        for it in items:
            it.seq.num_computed += it.num_new
            self.appender.commit_pages(it.request, it.seq)
            if it.request.refork and it.seq.num_computed == len(it.request.prompt):
                self.appender.refork(it.request, it.seq)
            self.appender.release_outside_window(it.seq)
        t = time.perf_counter()
        tok_R, lp_R = np.asarray(tok_R), np.asarray(lp_R)
        top = None if top is None else (np.asarray(top[0]), np.asarray(top[1]))
        timing["device_wait_s"] += time.perf_counter() - t
        by_item: dict[int, list[int]] = {}
        for r, (b, _) in enumerate(rows):
            by_item.setdefault(b, []).append(r)
        beams: dict[str, tuple[Request, list[tuple[Sequence, int]]]] = {}
        for b, rs in by_item.items():
            it = items[b]
            req = it.request
            if req.finished:
                continue
            if req.is_beam:
                beams.setdefault(req.request_id, (req, []))[1].append((it.seq, rs[0]))
                continue
            targets = [it.seq]
            if len(rs) > 1:  # n > 1: the prompt is done; fork it into the n completions
                targets += [self.appender.fork(req, it.seq, i, it.seq.seed + i)
                            for i in range(1, len(rs))]  # fmt: skip
                req.forked = True
            for seq, r in zip(targets, rs, strict=True):
                self.appender.append(req, seq, int(tok_R[r]), float(lp_R[r]))
        for req, entries in beams.values():
            self.appender.beam_step(req, entries, top)
