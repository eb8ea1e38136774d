"""Admission beside a running chain of decode loops: a request's prefill runs between two
loops of the chain, and its row joins the chain's device carry at the next loop.

While a chain runs (`jpaged.engine.decode_chain.DecodeChain`), each of its rounds may carry
a step planned beside it (`jpaged.engine.beside_plan.schedule_beside`: the next prefill
chunk, or decode token, of running requests outside the chain, and the admission of waiting
ones). The round runs, in one dispatch and in this order on the device: that step (a
ragged or decode step of the bucket grid), then, for each request whose step sampled its
first token, a small program that writes its row (that token, taken on device from the
step's output, its length, limits, stop ids and sampling settings) into the carry at a free
slot (a finished row's, or padding), after growing the carry to a larger row bucket when
none is free; then the next decode loop. Nothing waits for the host: the new rows decode in
that loop, and the host reads the step's tokens while it runs.

A request joins only where the loop computes exactly what a step would
(`jpaged.engine.beside_plan.joinable`). A waiting request that would be admitted but cannot
join, or a running one outside the chain that cannot, ends the chain (the next step
schedules everything); so does a plan beside the chain that is blocked (a running request
outside it cannot grow), after its page operations ran. The join and grow programs are in
the bucket grid (`BucketGrid.programs`), so warm-up compiles them (`lower_join_programs`).
Their inputs go through `Runner.on_device` first, so each program meets one input sharding (a
loop's carry or a grown one; a decode or a ragged step's tokens).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpaged._errors import OutOfPagesError
from jpaged.engine.batches import (
    LoopBatch,
    SamplingArrays,
    StepBatch,
    sampling_arrays,
    sampling_row,
)
from jpaged.engine.beside_plan import JoinRule, joinable, schedule_beside
from jpaged.engine.buckets import BucketGrid, ProgramKey
from jpaged.engine.runner import count_trace
from jpaged.engine.scheduler import PageOp, Scheduled, StepPlan
from jpaged.engine.step import plan_step_batch

__all__ = [
    "ChainJoin",
    "JoinRows",
    "StepBesideLoop",
    "empty_carry",
    "grow_carry",
    "join_rows",
    "lower_join_programs",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class JoinRows:
    """Rows written into a decode loop's carry (B rows, host NumPy).

    Attributes:
      mask: bool[B] the slots written.
      src: i32[B] each slot's row in the step's sampled tokens (its first token).
      lens: i32[B] tokens in the cache; the first token sits at position ``lens``.
      max_steps: i32[B] tokens the row may still generate after its first one.
      min_steps: i32[B] tokens before which stop tokens do not stop it (after the first).
      first_stops: bool[B] whether a stop token as the first token stops the row.
      stop_ids: i32[B, S] the row's stop tokens, -1 padding (S: the chain's).
      sampling: the rows' ``SamplingArrays``.
    """

    mask: np.ndarray
    src: np.ndarray
    lens: np.ndarray
    max_steps: np.ndarray
    min_steps: np.ndarray
    first_stops: np.ndarray
    stop_ids: np.ndarray
    sampling: SamplingArrays


def _join_impl(carry: LoopBatch, rows: JoinRows, tok_R):
    """Writes the rows of ``rows.mask`` into ``carry`` (every other row unchanged).

    Args:
      carry: a decode loop's `LoopBatch` of B rows (tokens i32[B], lens i32[B], active
        bool[B], max_steps i32[B], min_steps i32[B], stop_ids i32[B, S], sampling: B rows).
      rows: the `JoinRows` (B rows).
      tok_R: i32[R] the step's sampled tokens (R: its row bucket); slot b's first token is
        ``tok_R[rows.src[b]]``.

    Returns:
      The carry (same shapes); a joined row is active unless its first token stopped it
      (a stop token past ``min_tokens``) or it may generate nothing more.
    """
    count_trace()
    tok_B = tok_R[jnp.clip(rows.src, 0, tok_R.shape[0] - 1)]
    stopped_B = jnp.any(tok_B[:, None] == rows.stop_ids, axis=1) & rows.first_stops
    active_B = ~stopped_B & (rows.max_steps > 0)

    def put(new, old):
        mask = rows.mask.reshape(rows.mask.shape + (1,) * (old.ndim - 1))
        return jnp.where(mask, new.astype(old.dtype), old)

    return dataclasses.replace(
        carry, tokens=put(tok_B, carry.tokens), lens=put(rows.lens, carry.lens),
        active=put(active_B, carry.active), max_steps=put(rows.max_steps, carry.max_steps),
        min_steps=put(rows.min_steps, carry.min_steps), stop_ids=put(rows.stop_ids, carry.stop_ids),
        sampling=jax.tree.map(put, rows.sampling, carry.sampling),
    )  # fmt: skip


def _grow_impl(carry: LoopBatch, *, rows: int):
    """``carry`` (B rows: tokens i32[B], lens i32[B], block_tables i32[B, W] (and
    local_block_tables), active and live bool[B], max_steps and min_steps i32[B], stop_ids
    i32[B, S], sampling: B rows) padded to ``rows`` rows (static, > B) of inactive, non-live
    padding."""
    count_trace()

    def pad(x, fill):
        extra = jnp.full((rows - x.shape[0], *x.shape[1:]), fill, x.dtype)
        return jnp.concatenate([x, extra])

    s = carry.sampling
    local = carry.local_block_tables
    return dataclasses.replace(
        carry, tokens=pad(carry.tokens, 0), lens=pad(carry.lens, 0),
        block_tables=pad(carry.block_tables, 0),
        local_block_tables=None if local is None else pad(local, 0), active=pad(carry.active, False),
        live=pad(carry.live, False), max_steps=pad(carry.max_steps, 0),
        min_steps=pad(carry.min_steps, 0), stop_ids=pad(carry.stop_ids, -1),
        sampling=SamplingArrays(temperature=pad(s.temperature, 0.0), top_k=pad(s.top_k, 0),
                                top_p=pad(s.top_p, 1.0), seed=pad(s.seed, 0),
                                position=pad(s.position, 0)),
    )  # fmt: skip


join_rows = jax.jit(_join_impl)
grow_carry = jax.jit(_grow_impl, static_argnames=("rows",))


@dataclasses.dataclass
class StepBesideLoop:
    """A step planned beside a chain's next loop, and the rows that join that loop.

    Attributes:
      plan: the step's `StepPlan` (its page operations run before it; ``plan.blocked``:
        the chain ends after them, nothing runs).
      batch: its `StepBatch` (None: nothing to run, only page operations).
      rows: per sampled token row, the index in ``plan.scheduled``.
      items: the chain's rows for the next loop (joined rows in their slots).
      num_rows: the next loop's row bucket.
      grown: whether it is larger than the chain's (the carry grows first).
      join: the `JoinRows` (None: no row joins).
      tables, live: the next loop's table fields (`jpaged.engine.batches.loop_tables`) and
        live rows (host).
      result: the future of the step's ``(tokens, logprobs)`` (device arrays).
      starts_chain: the step starts the chain (an empty carry; `ChainJoin.round_of`).
    """

    plan: StepPlan
    batch: StepBatch | None
    rows: list[int]
    items: list[Scheduled]
    num_rows: int
    grown: bool
    join: JoinRows | None
    tables: dict[str, np.ndarray] | None = None
    live: np.ndarray | None = None
    result: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    starts_chain: bool = False

    @property
    def request_ids(self) -> list[str]:
        """The requests this round changes: those it schedules, and those its page
        operations name (swapped in, copied, admitted without tokens yet): a failure before
        the step ran fails them all (their pages may not hold their K/V)."""
        ids = dict.fromkeys(it.request.request_id for it in self.plan.scheduled)
        ids.update(dict.fromkeys(op.request_id for op in self.plan.page_ops))
        return [rid for rid in ids if rid is not None]


class ChainJoin:
    """Plans and applies the steps beside a chain of decode loops and the rows they join.

    Args:
      kv, runner, scheduler, appender, counters: the engine's parts.
      grid: the bucket grid (row and token buckets).
      num_decode_steps: k.
      max_model_len: longest sequence.
      width: W, block-table width.
    """

    def __init__(self, kv, runner, scheduler, appender, counters, *, grid: BucketGrid,
                 num_decode_steps: int, max_model_len: int, width: int):  # fmt: skip
        self.kv, self.runner, self.scheduler = kv, runner, scheduler
        self.appender, self.counters, self.grid = appender, counters, grid
        self.k, self.max_model_len, self.width = num_decode_steps, max_model_len, width

    def rule(self, mode: str, num_stops: int) -> JoinRule:
        """The `JoinRule` of a chain of sampling ``mode`` and ``num_stops`` stop-id columns."""
        return JoinRule(mode=mode, num_stops=num_stops, vocab_size=self.runner.vocab_size)

    def must_end(self, items, rule: JoinRule, ahead: int) -> bool:
        """Whether a request outside the chain needs it to end: a running one that cannot
        join, or a waiting head that would be admitted and cannot."""
        chained = {it.request.request_id for it in items}
        for req in self.scheduler.running:
            if req.request_id not in chained and not joinable(req, rule):
                return True
        waiting = self.scheduler.waiting
        return (bool(waiting) and not joinable(waiting[0], rule)
                and self.scheduler.can_admit_head(ahead))  # fmt: skip

    def wants(self, items, ahead: int) -> bool:
        """Whether something outside the chain could run beside it."""
        chained = {it.request.request_id for it in items}
        if any(r.request_id not in chained for r in self.scheduler.running):
            return True
        return self.scheduler.can_admit_head(ahead)

    def plan(self, items, rule: JoinRule) -> StepBesideLoop:
        """Plans the step beside the chain's next loop and the rows that join it (changing
        the allocator: admissions, slots, the joined rows' reservations). With
        ``plan.blocked`` the chain must end (a running request outside it cannot grow); its
        page operations still run."""
        chained = {it.request.request_id for it in items}
        plan = schedule_beside(self.scheduler, chained, rule)
        if plan.blocked:
            return StepBesideLoop(plan=plan, batch=None, rows=[], items=list(items),
                                  num_rows=self.grid.rows(len(items)), grown=False,
                                  join=None)  # fmt: skip
        return self.round_of(plan, items, rule)

    def round_of(self, plan: StepPlan, items, rule: JoinRule) -> StepBesideLoop:
        """The round of ``plan`` (a step that is not blocked) beside a chain of rows ``items``
        (empty: a chain starts from the step, `DecodeChain.start_from_step`): each of its
        sampling rows that may generate more than its first token joins the next loop, in a
        finished row's slot or a new one, once the slots of its first loop are reserved
        (their copies are appended to ``plan.page_ops``)."""
        Bp = self.grid.rows(len(items))  # the chain's row bucket
        scheduled = plan.scheduled
        rows = [b for b, it in enumerate(scheduled) if it.samples]
        new_items = list(items)
        free = [b for b, it in enumerate(items) if it.seq.finished]
        joins = []  # (slot, scheduled index, token row, limit)
        for r, b in enumerate(rows):
            it = scheduled[b]
            seq, p = it.seq, it.request.params
            n0 = seq.num_computed + it.num_new  # the first token's position
            lim = min(p.max_tokens - seq.num_generated - 1, self.max_model_len - n0 - 1)
            if lim <= 0 or not self._reserve(it, n0 + min(self.k, lim), plan):
                continue  # it finishes with its first token, or decodes beside next time
            slot = free.pop(0) if free else len(new_items)
            if slot == len(new_items):
                new_items.append(None)
            new_items[slot] = Scheduled(seq, it.request, 1)
            joins.append((slot, b, r, lim))
        new_Bp = self.grid.rows(len(new_items))
        batch = self._batch(plan, rows) if scheduled else None
        join = self._join_rows(scheduled, joins, new_Bp, rule.num_stops)
        return StepBesideLoop(plan=plan, batch=batch, rows=rows, items=new_items,
                              num_rows=new_Bp, grown=new_Bp > Bp, join=join)  # fmt: skip

    def _reserve(self, it: Scheduled, upto: int, plan: StepPlan) -> bool:
        """Slots up to position ``upto`` for a joining row (its first loop); copies go into
        the plan's page operations."""
        seq_id = it.seq.seq_id
        extra = upto - self.kv.alloc.num_tokens(seq_id)
        try:
            copies = self.kv.alloc.reserve(seq_id, max(extra, 0))
        except OutOfPagesError:
            return False
        if copies:
            plan.page_ops.append(PageOp("copy", tuple(copies), it.request.request_id))
        return True

    def _batch(self, plan: StepPlan, rows: list[int]) -> StepBatch:
        items = plan.scheduled
        samp = [sampling_row(items[b].request, items[b].seq, items[b].seq.seed) for b in rows]
        return plan_step_batch(plan, rows, samp, self.kv.alloc, self.grid, width=self.width)[0]

    def _join_rows(self, scheduled, joins, Bp: int, num_stops: int) -> JoinRows | None:
        if not joins:
            return None
        mask = np.zeros(Bp, bool)
        src, lens, max_steps, min_steps = (np.zeros(Bp, np.int32) for _ in range(4))
        first_stops = np.zeros(Bp, bool)
        stop_ids = np.full((Bp, num_stops), -1, np.int32)
        samp = np.zeros((Bp, 5))
        samp[:, 2] = 1.0
        for slot, b, r, lim in joins:
            it = scheduled[b]
            seq, p = it.seq, it.request.params
            gen = seq.num_generated + 1  # with the first token
            mask[slot], src[slot] = True, r
            lens[slot], max_steps[slot] = seq.num_computed + it.num_new, lim
            min_steps[slot] = min(max(p.min_tokens - gen, 0), lim)
            first_stops[slot] = gen >= p.min_tokens
            stops = sorted(it.request.stop_ids)
            stop_ids[slot, : len(stops)] = stops
            samp[slot] = sampling_row(it.request, seq, seq.seed)
        return JoinRows(mask=mask, src=src, lens=lens, max_steps=max_steps,
                        min_steps=min_steps, first_stops=first_stops, stop_ids=stop_ids,
                        sampling=sampling_arrays(samp, Bp))  # fmt: skip

    def run(self, cache, carry: LoopBatch, beside: StepBesideLoop):
        """Runs in the dispatch thread: the step beside, then the joins (growing the carry
        first when its bucket is too small); returns ``(cache, the next loop's batch)``.
        The carry and the step's tokens are placed (`Runner.on_device`) before the grow and
        join programs: whichever program made them, those meet the sharding warm-up gave."""
        try:
            if beside.batch is not None:
                out = self.runner.step(cache, beside.batch, decode=beside.plan.decode_only)
                cache, tok_R, lp_R = out[:3]
                tok_R.copy_to_host_async()
                lp_R.copy_to_host_async()
                beside.result.set_result((tok_R, lp_R))
            else:
                beside.result.set_result(None)
        except BaseException as e:
            if not beside.result.done():
                beside.result.set_exception(e)
            raise
        if beside.num_rows > carry.tokens.shape[0]:
            carry = grow_carry(self.runner.on_device(carry), rows=beside.num_rows)
        if beside.join is not None:
            put = self.runner.on_device
            carry = join_rows(put(carry), put(beside.join), put(tok_R))
        return cache, dataclasses.replace(carry, **beside.tables, live=beside.live)

    def count(self, beside: StepBesideLoop) -> None:
        """Adds the round's step and joins to the counters (at dispatch)."""
        c = self.counters
        if beside.batch is not None:
            c.device_calls += 1
        if beside.starts_chain:
            c.chains_from_steps += 1
            return
        if beside.batch is not None:
            c.steps_beside_chain += 1
        if beside.join is not None:
            c.chain_joins += int(beside.join.mask.sum())
        c.chain_grows += beside.grown

    def finish(self, beside: StepBesideLoop) -> set[str]:
        """After the round's dispatch: the step's book-keeping, then its sampled tokens
        (waits for the step only, not for the loop after it); returns the ids it touched."""
        items = beside.plan.scheduled
        for it in items:
            it.seq.num_computed += it.num_new
            self.appender.commit_pages(it.request, it.seq)
            self.appender.release_outside_window(it.seq)
        touched = {it.request.request_id for it in items}
        if beside.batch is None:
            return touched
        t = time.perf_counter()
        tok_R, lp_R = beside.result.result()
        tok_R, lp_R = np.asarray(tok_R).tolist(), np.asarray(lp_R).tolist()
        self.counters.timing["device_wait_s"] += time.perf_counter() - t
        for r, b in enumerate(beside.rows):
            it = items[b]
            if not it.request.finished and not it.seq.finished:
                self.appender.append(it.request, it.seq, tok_R[r], lp_R[r], None)
        return touched


def lower_join_programs(runner, keys: list[ProgramKey], *, width: int, num_stops: int,
                        grouped: bool = False):  # fmt: skip
    """Lowers the join and grow programs of ``keys`` on inputs placed as `ChainJoin.run`
    places them (a carry of each row bucket, a step's tokens of each), which write no row;
    ``grouped``: carries of a pool of two page groups (with local block tables).

    Returns:
      ``[(key, lowered, run)]``: ``run()`` runs the program once (after its compile).
    """
    out = []
    for key in keys:
        if key.kind == "grow":
            carry = empty_carry(runner, key.tokens, width, num_stops, grouped)
            fn, args, kw = grow_carry, (carry,), {"rows": key.rows}
        else:
            B = key.rows
            zeros = np.zeros(B, np.int32)
            rows = JoinRows(mask=np.zeros(B, bool), src=zeros, lens=zeros, max_steps=zeros,
                            min_steps=zeros, first_stops=np.zeros(B, bool),
                            stop_ids=np.full((B, num_stops), -1, np.int32),
                            sampling=sampling_arrays(np.zeros((B, 5)), B))  # fmt: skip
            tok_R = runner.on_device(np.zeros(key.tokens, np.int32))
            args = (empty_carry(runner, B, width, num_stops, grouped), runner.on_device(rows),
                    tok_R)  # fmt: skip
            fn, kw = join_rows, {}
        lowered = fn.trace(*args, **kw).lower()
        out.append((key, lowered, lambda fn=fn, args=args, kw=kw: fn(*args, **kw)))
    return out


def empty_carry(runner, B: int, width: int, num_stops: int, grouped: bool) -> LoopBatch:
    """A decode loop's carry of B padding rows, on the device as a loop's output is."""
    zeros = np.zeros(B, np.int32)
    table = np.zeros((B, width), np.int32)
    carry = LoopBatch(
        tokens=zeros, lens=zeros, block_tables=table,
        local_block_tables=table.copy() if grouped else None,
        active=np.zeros(B, bool), live=np.zeros(B, bool), max_steps=zeros, min_steps=zeros,
        stop_ids=np.full((B, num_stops), -1, np.int32),
        sampling=sampling_arrays(np.zeros((B, 5)), B),
    )  # fmt: skip
    return runner.on_device(carry)
