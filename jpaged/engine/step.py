"""One engine step as one device call: a planned ragged (or decode) batch, run and sampled.

`StepExecutor.run` packs a `StepPlan`'s scheduled sequences into a bucketed `StepBatch`,
runs the jitted step (`jpaged.engine.runner.Runner.step`), and while the device runs does
the bookkeeping that needs no sampled token (computed counts, prefix-cache commits,
re-forks after a recompute); then it reads the sampled tokens back and hands them to the
`TokenAppender` (n > 1 completions fork here; beams go through one beam step per request).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jpaged.engine.appender import TokenAppender
from jpaged.engine.batches import (
    StepBatch,
    bucket,
    build_step_batch,
    group_step_inputs,
    sampling_arrays,
    sampling_row,
)
from jpaged.engine.buckets import BucketGrid
from jpaged.engine.counters import Counters
from jpaged.engine.kv_manager import KVManager
from jpaged.engine.logits_process import logits_inputs, num_top_for
from jpaged.engine.outputs import top_row
from jpaged.engine.requests import Request, Sequence
from jpaged.engine.runner import Runner
from jpaged.engine.scheduler import StepPlan

__all__ = ["StepExecutor", "plan_step_batch"]


def plan_step_batch(plan: StepPlan, rows: list[int], samp: list, alloc, grid: BucketGrid, *,
                    width: int) -> tuple[StepBatch, int]:  # fmt: skip
    """The `StepBatch` of ``plan.scheduled``, in the grid's buckets: the decode step's (T == B
    rows) when every item decodes one token, else a ragged step's.

    Args:
      plan: the step's plan.
      rows: per sampled row, its item's index in ``plan.scheduled``.
      samp: per sampled row, its ``sampling_row``.
      alloc: the block allocator (slots and block tables).
      grid: the bucket grid.
      width: W, block-table width.

    Returns:
      ``(batch, Bp)``: Bp is the row bucket (the sampled rows' padded count).
    """
    items = plan.scheduled
    n = max(len(items), len(rows))
    if plan.decode_only:
        Bp = Tp = grid.rows(n)
    else:
        Bp, Tp = grid.ragged_shape(num_tokens=plan.num_tokens, num_rows=n)
    runs = [(it.seq.seq_id, it.seq.num_computed, it.num_new) for it in items]
    batch = build_step_batch(
        [(it.seq.tokens, it.seq.num_computed, it.num_new) for it in items],
        [alloc.slots(*run) for run in runs],
        [alloc.block_table(it.seq.seq_id) for it in items], rows,
        sampling_arrays(np.asarray(samp, np.float64), Bp),
        width=width, num_rows=Bp, num_tokens=Tp, **group_step_inputs(alloc, runs),
    )  # fmt: skip
    return batch, Bp


class StepExecutor:
    """Runs planned steps one device call each.

    Args:
      kv: the KV manager (slots, block tables, the pool).
      runner: the jitted step programs.
      appender: applies the sampled tokens.
      counters: device calls and timing are added to.
      width: W, block-table width.
      max_num_seqs: the largest sequence bucket.
      max_num_batched_tokens: the token budget of a step (`BucketGrid`).
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
        self.grid = BucketGrid(max_num_seqs, max_num_batched_tokens)

    def seq_bucket(self, n: int) -> int:
        """The sequence (and logits row) bucket of ``n`` rows."""
        return self.grid.rows(n)

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
        batch, Bp = plan_step_batch(plan, [b for b, _ in rows], samp, alloc, self.grid,
                                    width=self.width)  # fmt: skip
        num_top = 0
        if any(it.request.is_beam for it in items):
            num_top = bucket(2 * max(it.request.fan_out for it in items if it.request.is_beam),
                             8, 1 << 30)  # fmt: skip
        inputs, processors = logits_inputs(
            [(items[b].request.params, items[b].seq.tokens, items[b].seq.num_prompt)
             for b, _ in rows], Bp, self.width * self.kv.alloc.page_size,
        )  # fmt: skip
        prompt_rows = self._prompt_rows(items)
        prompt_targets = None
        if prompt_rows:
            prompt_targets = np.full(batch.tokens.shape[0], -1, np.int32)
            for _, _, tok, r in prompt_rows:
                prompt_targets[r] = tok
        num_top = max(num_top, num_top_for(
            [items[b].request.params for b, _ in rows] + [p[0].params for p in prompt_rows]))  # fmt: skip
        if inputs is not None or prompt_targets is not None:
            batch = dataclasses.replace(batch, logits=inputs, prompt_targets=prompt_targets)
        timing = self.counters.timing
        t = time.perf_counter()
        self.kv.cache, tok_R, lp_R, top, prompt = self.runner.step(
            self.kv.cache, batch, decode=decode, num_top=num_top, processors=processors
        )
        timing["dispatch_s"] += time.perf_counter() - t
        self.counters.device_calls += 1
        self.counters.single_steps += 1
        for x in jax.tree.leaves((tok_R, lp_R, top, prompt)):
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
        top = None if top is None else tuple(np.asarray(x) for x in top)
        prompt = None if prompt is None else tuple(np.asarray(x) for x in prompt)
        timing["device_wait_s"] += time.perf_counter() - t
        by_req: dict[str, list] = {}
        for entry in prompt_rows:
            by_req.setdefault(entry[0].request_id, []).append(entry)
        for entries in by_req.values():
            self.appender.record_prompt_logprobs(
                entries[0][0], [e[1] for e in entries], [e[2] for e in entries], prompt,
                [e[3] for e in entries],
            )  # fmt: skip
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
                self.appender.append(req, seq, int(tok_R[r]), float(lp_R[r]), top_row(top, r))
        for req, entries in beams.values():
            self.appender.beam_step(req, entries, top[:2])

    @staticmethod
    def _prompt_rows(items) -> list[tuple[Request, int, int, int]]:
        """``(request, prompt position, prompt token, token row)`` of every prompt
        log-probability this step computes: token row t (position p of a request with
        ``prompt_logprobs``) scores prompt token p + 1."""
        out = []
        row = 0
        for it in items:
            req, seq = it.request, it.seq
            if req.num_prompt_logprobs is not None:
                done = req.prompt_logprobs
                for i in range(it.num_new):
                    pos = seq.num_computed + i + 1
                    if pos < len(req.prompt) and (done is None or done[pos] is None):
                        out.append((req, pos, req.prompt[pos], row + i))
            row += it.num_new
        return out
