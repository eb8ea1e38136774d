"""Multi-step decode: chains of on-device decode loops (up to k steps each) over pages
reserved ahead, the next loop dispatched from the previous one's device carry.

`DecodeChain` starts a chain when every scheduled sequence is decoding (`can_loop`), or
from a step with prefill whose requests can all be in a loop (`start_from_step`: the step
and the first loop in one dispatch), and each later engine step advances it (`advance`): it
reserves the next loop's pages, waits for the loop in flight, dispatches the next loop from
its carry, and only then hands the tokens to the `TokenAppender`, so the host work overlaps
the device. With ``joins`` (a `ChainJoin`), a request admitted while the chain runs has its
prefill run between two loops and its row joins the next loop (`jpaged.engine.chain_join`).
A chain ends when no row can run on (and none joins), when half its rows finished, when the
pool cannot reserve ahead, when a request outside it needs a single step (a waiting request
that would be admitted and cannot join; without ``joins``, any), or on a failure (`end`:
every row keeps exactly its computed tokens).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time

import jax
import numpy as np

from jpaged._errors import OutOfPagesError
from jpaged.engine.appender import TokenAppender
from jpaged.engine.batches import LoopBatch, loop_tables, pad_to, sampling_arrays, sampling_row
from jpaged.engine.beside_plan import JoinRule, joinable
from jpaged.engine.buckets import stop_bucket
from jpaged.engine.chain_join import ChainJoin, StepBesideLoop, empty_carry
from jpaged.engine.counters import Counters
from jpaged.engine.kv_manager import KVManager
from jpaged.engine.logits_process import logits_inputs, num_top_for
from jpaged.engine.runner import Runner
from jpaged.engine.sampling import sampling_mode
from jpaged.engine.scheduler import Scheduled, Scheduler, StepPlan
from jpaged.kv.page_groups import PageGroups

__all__ = ["DecodeChain", "NextRound"]


@dataclasses.dataclass
class NextRound:
    """What follows the loop in flight, planned while it runs.

    Attributes:
      tables: the next loop's `LoopBatch` table fields (``block_tables`` i32[B, W], with
        two page groups also ``local_block_tables``; `loop_tables`) (None: no next loop,
        the chain ends).
      live: bool[B] its live rows (None with ``tables``).
      beside: the step planned beside it (None: none); with no next loop, only its page
        operations run (a blocked plan's copies, or the admissions of a plan whose rows
        would have nothing to decode), and the next step schedules its requests.
    """

    tables: dict[str, np.ndarray] | None
    live: np.ndarray | None
    beside: StepBesideLoop | None = None


class DecodeChain:
    """Chains of decode loops of up to ``num_decode_steps`` steps on device.

    Args:
      kv: the KV manager (reservations, block tables, the pool and its hand-over).
      runner: the jitted decode loop.
      scheduler: asked whether a waiting request would be admitted (which ends a chain).
      appender: applies the loops' tokens.
      counters: device calls, loop steps and timing are added to.
      num_decode_steps: k.
      enabled: whether chains run at all (False: every plan runs as a single step).
      max_model_len: longest sequence.
      width: W, block-table width.
      seq_bucket: the sequence bucket of n rows (the single step's).
      threaded_dispatch: dispatch loops from a worker thread (GPU: see ``_dispatch``).
      joins: runs admitted requests' prefills beside the chain and joins their rows to it
        (None: a request that would be admitted ends the chain).

    Attributes:
      state: ``(scheduled rows, program, future of the loop in flight)`` while a chain runs,
        else None; ``program`` is the loop's static ``(sampling mode, num_top, processors)``.
        A row's index is its slot in the loop's carry (a joined row takes a finished one's).
    """

    def __init__(
        self,
        kv: KVManager,
        runner: Runner,
        scheduler: Scheduler,
        appender: TokenAppender,
        counters: Counters,
        *,
        num_decode_steps: int,
        enabled: bool = True,
        max_model_len: int,
        width: int,
        seq_bucket,
        threaded_dispatch: bool,
        joins: ChainJoin | None = None,
    ):
        self.kv, self.runner, self.scheduler = kv, runner, scheduler
        self.joins = joins
        self._joinable = False  # whether the running chain takes rows (no logits features)
        self._num_stops = 0  # the chain's stop-id columns
        self.beside_request_ids: list[str] = []  # requests the step beside this round changes
        self.appender, self.counters = appender, counters
        self.num_decode_steps = num_decode_steps
        self.enabled = enabled
        self.max_model_len = max_model_len
        self.width = width
        self._seq_bucket = seq_bucket
        self.threaded_dispatch = threaded_dispatch
        self.state: tuple[list[Scheduled], tuple, concurrent.futures.Future | None] | None = None
        self._dispatcher: concurrent.futures.ThreadPoolExecutor | None = None

    def can_loop(self, plan: StepPlan) -> bool:
        """Whether ``plan`` can run as a decode loop (every row decodes and samples alone)."""
        # Waiting requests that were not admitted this step (no pages or seats) are scheduled
        # again when the chain ends (or join it, once they would be admitted).
        if not (self.enabled and plan.decode_only):
            return False
        return all(
            it.samples and not it.request.is_beam and (it.request.forked or it.request.fan_out == 1)
            for it in plan.scheduled
        )

    def _loop_limits(self, items) -> list[int]:
        """Tokens each row may still generate (``max_tokens`` and ``max_model_len``)."""
        return [
            max(1, min(it.request.params.max_tokens - it.seq.num_generated,
                       self.max_model_len - it.seq.num_tokens))
            for it in items
        ]  # fmt: skip

    def _reserve(self, items, ahead: list[int]) -> bool:
        """Makes positions ``[num_computed, num_computed + ahead)`` of each row exist and be
        private (lookahead); False if the pool is short (the reservations made stay, and are
        released by the truncate at the end of the loop chain)."""
        try:
            for it, n in zip(items, ahead, strict=True):
                seq = it.seq
                if seq.finished:
                    continue
                extra = seq.num_computed + n - self.kv.alloc.num_tokens(seq.seq_id)
                copies = self.kv.alloc.reserve(seq.seq_id, max(extra, 0))
                if copies:
                    self.kv.copy(copies)
        except OutOfPagesError:
            return False
        return True

    def _tables(self, items, Bp: int) -> dict[str, np.ndarray]:
        ids = [None if it.seq.finished else it.seq.seq_id for it in items]
        return loop_tables(self.kv.alloc, ids, Bp, self.width)

    def start(self, plan: StepPlan) -> bool:
        """Starts a chain of decode loops (each up to k steps on device) over ``plan``;
        False (nothing started, reservations released) when the pool is short: run the
        plan as a single step instead."""
        items = plan.scheduled
        k = self.num_decode_steps
        limits = self._loop_limits(items)
        if not self._reserve(items, [min(k, lim) for lim in limits]):
            for it in items:
                self.kv.alloc.truncate(it.seq.seq_id, self.kv.alloc.num_tokens(it.seq.seq_id))
            return False
        B = len(items)
        Bp = self._seq_bucket(B)
        stop_lists = [sorted(it.request.stop_ids) for it in items]
        S = stop_bucket(max(len(s) for s in stop_lists))
        stop_ids = np.full((Bp, S), -1, np.int32)
        for b, s in enumerate(stop_lists):
            stop_ids[b, : len(s)] = s
        samp = np.asarray([sampling_row(it.request, it.seq, it.seq.seed) for it in items])
        inputs, processors = logits_inputs(
            [(it.request.params, it.seq.tokens, it.seq.num_prompt) for it in items], Bp,
            self.width * self.kv.alloc.page_size,
        )  # fmt: skip
        num_top = num_top_for([it.request.params for it in items])
        # At most the row's limit (a min_tokens beyond it must not overflow the int32 array).
        min_steps = [min(max(it.request.params.min_tokens - it.seq.num_generated, 0), lim)
                     for it, lim in zip(items, limits, strict=True)]  # fmt: skip
        batch = LoopBatch(
            tokens=pad_to(np.asarray([it.seq.tokens[-1] for it in items], np.int32), Bp, 0),
            lens=pad_to(np.asarray([it.seq.num_computed for it in items], np.int32), Bp, 0),
            **self._tables(items, Bp),
            active=pad_to(np.ones(B, bool), Bp, False),
            live=pad_to(np.ones(B, bool), Bp, False),
            max_steps=pad_to(np.asarray(limits, np.int32), Bp, 0),
            min_steps=pad_to(np.asarray(min_steps, np.int32), Bp, 0),
            stop_ids=stop_ids,
            sampling=sampling_arrays(samp, Bp),
            logits=inputs,
        )
        # The sampling mode is static (no device-side branch) and fixed for the whole chain:
        # its rows only ever drop out. So are the log-probability outputs and processors.
        mode = sampling_mode(samp[:, 0], samp[:, 1], samp[:, 2], self.runner.vocab_size)
        program = (mode, num_top, processors)
        self._joinable = self.joins is not None and inputs is None and not num_top
        self._num_stops = S
        self.counters.chain_starts += 1
        # Processed by the next `step()`, which first dispatches the loop after it: every
        # step makes at most one device call, and host work overlaps the loop in flight.
        try:
            self.state = (items, program, self._dispatch(batch, program))
        except Exception:
            self.end(items)
            raise
        return True

    def step_rule(self, plan: StepPlan) -> JoinRule | None:
        """The `JoinRule` of a chain that ``plan``, a step that is not decode-only, can start
        (`start_from_step`), or None: chains or joins are off, nothing samples, a request
        it schedules could not be in a decode loop (beam search, ``n > 1``, logits
        processing, log-probabilities; `jpaged.engine.beside_plan.joinable`), or the chain
        would end after its first loop for a request outside it (`ChainJoin.must_end`: a
        running one that cannot join, or a waiting one that would be admitted and cannot),
        which would wait that loop for its step."""
        if not (self.enabled and self.joins is not None) or plan.decode_only:
            return None
        sampled = [it for it in plan.scheduled if it.samples]
        if not sampled:
            return None
        samp = np.asarray([sampling_row(it.request, it.seq, it.seq.seed) for it in sampled])
        mode = sampling_mode(samp[:, 0], samp[:, 1], samp[:, 2], self.runner.vocab_size)
        num_stops = stop_bucket(max(len(it.request.stop_ids) for it in sampled))
        rule = self.joins.rule(mode, num_stops)
        if not all(joinable(it.request, rule) for it in plan.scheduled):
            return None
        if self.joins.must_end(plan.scheduled, rule, self.num_decode_steps + 1):
            return None
        return rule

    def start_from_step(self, plan: StepPlan, rule: JoinRule) -> set[str] | None:
        """Starts a chain from a step with prefill (``plan``, its page operations applied;
        ``rule`` from `step_rule`): one dispatch runs the step, writes the rows that sample
        into an empty carry (`jpaged.engine.chain_join`) and runs the first decode loop, so
        the loop is on the device before the host reads the step's tokens. Returns the ids
        of the requests the step touched (their first tokens are appended when the step is
        done, while the loop runs), or None when no row would join (every one finishes
        with its first token, or the pool cannot reserve its loop): run the plan as a
        single step instead (nothing changed)."""
        done = len(plan.page_ops)
        beside = self.joins.round_of(plan, [], rule)
        if beside.join is None:
            return None
        self.kv.apply(plan.page_ops[done:])  # the joined rows' copies-on-write
        Bp = beside.num_rows
        beside.grown, beside.starts_chain = False, True  # the carry starts at their bucket
        beside.tables = self._tables(beside.items, Bp)
        beside.live = pad_to(np.ones(len(beside.items), bool), Bp, False)
        carry = empty_carry(self.runner, Bp, self.width, rule.num_stops,
                            grouped=isinstance(self.kv.alloc, PageGroups))  # fmt: skip
        program = (rule.mode, 0, ())  # as `start` makes it: no top-k, no processors
        self._joinable, self._num_stops = True, rule.num_stops
        self.counters.chain_starts += 1
        try:
            fut = self._dispatch(carry, program, beside)
        except Exception:
            self.end(beside.items)
            raise
        self.state = (beside.items, program, fut)
        try:
            return self.joins.finish(beside)  # waits for the step, not the loop
        except Exception:  # the step failed (in the dispatch thread), or appending its
            self.end(beside.items)  # tokens did: the chain ends with it
            raise

    def _dispatch(self, batch: LoopBatch, program: tuple,
                  beside: StepBesideLoop | None = None) -> concurrent.futures.Future:  # fmt: skip
        """Starts a decode loop (after ``beside``'s step and joins, in the same call);
        returns the future of ``((cache, tokens, logprobs, steps run, carry, top), seconds
        the call took)``.

        On GPU the call that dispatches a loop can return only once the loop has run (XLA
        thunks that synchronise with the host: cuBLAS GEMMs on dynamic slices inside loops,
        measured on the H200), and it releases the GIL meanwhile: it is made from a worker
        thread (``threaded_dispatch``), so the host processes the previous loop's tokens while
        this one runs. The caller's default device and matmul precision (thread-local JAX
        settings) go with it. Reading ``kv.cache`` waits for the call.
        """
        cache = self.kv.cache  # the previous dispatch's output pool (waits for that call)
        self.counters.device_calls += 1
        settings = (getattr(jax.config, "jax_default_device", None),
                    getattr(jax.config, "jax_default_matmul_precision", None))  # fmt: skip
        if beside is not None:
            self.joins.count(beside)
        if not self.threaded_dispatch:
            fut = concurrent.futures.Future()
            fut.set_result(self._loop_call(cache, batch, program, settings, beside))
            self.kv.pending = fut  # installs its pool on the next read of kv.cache
            return fut
        if self._dispatcher is None:
            self._dispatcher = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="jpaged-dispatch"
            )
        fut = self._dispatcher.submit(self._loop_call, cache, batch, program, settings, beside)
        self.kv.pending = fut
        return fut

    def _loop_call(self, cache, batch: LoopBatch, program: tuple, settings, beside=None):
        """Runs in the dispatch thread (under the dispatching thread's JAX settings)."""
        device, precision = settings
        with contextlib.ExitStack() as stack:
            if device is not None:
                stack.enter_context(jax.default_device(device))
            if precision is not None:
                stack.enter_context(jax.default_matmul_precision(precision))
            t = time.perf_counter()
            if beside is not None:
                cache, batch = self.joins.run(cache, batch, beside)
            mode, num_top, processors = program
            out = self.runner.decode_loop(cache, batch, num_steps=self.num_decode_steps,
                                          mode=mode, num_top=num_top,
                                          processors=processors)  # fmt: skip
            dt = time.perf_counter() - t
        for x in jax.tree.leaves((out[1:4], out[5])):  # tokens, logprobs, steps run, top
            x.copy_to_host_async()
        return out, dt

    def _may_chain(self, items, mode: str) -> bool:
        # A waiting request ends the chain only if it would be admitted: with the pool full
        # (or every seat taken) it keeps waiting either way; with joins, only if it cannot
        # join (nor may a running request outside the chain that cannot). The allocator's
        # lengths are those before the loop in flight, whose k tokens (and the next step's
        # one) come before an admission.
        live = sum(not it.seq.finished for it in items)
        ahead = self.num_decode_steps + 1
        if 2 * live < len(items):
            return False
        if self._joinable:
            return not self.joins.must_end(items, self.joins.rule(mode, self._num_stops), ahead)
        return not self.scheduler.can_admit_head(ahead)

    def advance(self) -> set[str]:
        """Processes the loop in flight; first, when nothing waits, dispatches the next loop
        from its device-side carry (after a step beside it, with ``joins``), so the host
        work below overlaps the device. Returns the ids of the requests of the step beside
        (the chain's own rows are the caller's to report)."""
        items, program, fut = self.state
        self.beside_request_ids = []
        try:
            return self._advance(items, program, fut)
        except Exception:
            # A loop failed (e.g. out of memory, in the dispatch thread or here): the chain
            # ends and its reservations are released; its rows are scheduled again from what
            # the host holds (tokens of a loop not yet processed are computed again).
            self.end(items)
            raise

    def end(self, items) -> None:
        """Ends a chain after a failure: every row keeps exactly its computed tokens (the
        allocator's length catches up within the reservation, the rest is released)."""
        self.state = None
        pending = self.kv.pending
        if pending is not None:
            concurrent.futures.wait([pending])  # a next loop still running: its error, if
            try:  # any, surfaces here rather than inside a later scheduling step
                pending.result()
            except Exception:
                self.kv.pending = None  # its pool is the one it was given
        for it in items:
            seq = it.seq
            if seq.finished or seq.seq_id not in self.kv.alloc:
                continue
            try:
                self._catch_up(seq)
                self.kv.alloc.truncate(seq.seq_id, seq.num_computed)
            except Exception:  # keep releasing the others; the original error propagates
                continue

    def _catch_up(self, seq) -> None:
        """The allocator's length of ``seq`` catches up with its computed tokens, within the
        pages the chain reserved (nothing is allocated, nothing copied)."""
        held = self.kv.alloc.num_tokens(seq.seq_id)
        if seq.num_computed > held:
            copies = self.kv.alloc.append_slots(seq.seq_id, seq.num_computed - held)
            if copies:  # never within a reservation, unless forked since: not here
                raise AssertionError(f"unexpected copy-on-write in a decode chain: {copies}")

    def _plan_next(self, items, program: tuple, limits: list[int]) -> NextRound | None:
        """The next round, or None: the chain ends (nothing planned beside it)."""
        k = self.num_decode_steps
        runs_on = any(lim > k for it, lim in zip(items, limits, strict=True)
                      if not it.seq.finished)  # fmt: skip
        ahead = k + 1
        wants = self._joinable and self.joins.wants(items, ahead)
        if not (runs_on or wants) or not self._may_chain(items, program[0]):
            return None
        if runs_on and not self._reserve(items, [min(2 * k, lim) for lim in limits]):
            return None
        beside = None
        if wants:
            beside = self.joins.plan(items, self.joins.rule(program[0], self._num_stops))
            self.beside_request_ids = beside.request_ids
            # Blocked (a request outside the chain cannot grow), or nothing would decode in
            # the next loop: the chain ends once the plan's page operations ran.
            if beside.plan.blocked or (not runs_on and beside.join is None):
                return NextRound(tables=None, live=None, beside=beside)
            items = beside.items
        Bp = self._seq_bucket(len(items))  # the loop's row bucket (`start`)
        # Rows finished on the host (aborted) are still active in the device carry: their
        # pages may be freed and reused, and their table rows are now zeros (page 0 is
        # someone's page), so they must not decode (nor write K/V) in the next loop.
        live = pad_to(np.asarray([not it.seq.finished for it in items]), Bp, False)
        return NextRound(tables=self._tables(items, Bp), live=live, beside=beside)

    def _advance(self, items, program: tuple, fut) -> set[str]:
        limits = self._loop_limits(items)  # before this loop's tokens: upper bounds
        # The next loop's reservations, block tables and the step beside it need only what
        # the host knows now, so they are prepared while the loop in flight runs: once it is
        # done, dispatching the next one takes a device op and a submit. Chain only if some
        # row may still be running after this loop (else the next loop would run zero
        # steps), or a row joins. The loop in flight writes at most k positions per row,
        # the next one k more.
        plan = self._plan_next(items, program, limits)
        t = time.perf_counter()
        (_, out_KB, lp_KB, ran, carry, top), dispatch_s = fut.result()
        self.counters.timing["device_wait_s"] += time.perf_counter() - t
        self.counters.timing["dispatch_s"] += dispatch_s
        nxt = None
        beside = None if plan is None else plan.beside
        if beside is not None and plan.tables is None:  # planned, but the chain ends: the
            self.kv.apply(beside.plan.page_ops)  # next step schedules its requests again
            self.beside_request_ids, beside = [], None
        elif beside is not None:
            self.kv.apply(beside.plan.page_ops)  # before the step (swap-ins, copies)
            beside.tables, beside.live = plan.tables, plan.live
            nxt = self._dispatch(carry, program, beside)
        elif plan is not None:
            tables, live = plan.tables, plan.live
            shape = tables["block_tables"].shape
            assert shape == carry.block_tables.shape, (shape, carry.block_tables.shape)
            nxt = self._dispatch(dataclasses.replace(carry, **tables, live=live), program)
        t = time.perf_counter()
        out_KB, lp_KB = np.asarray(out_KB), np.asarray(lp_KB)
        top = None if top is None else tuple(np.asarray(x) for x in top)
        self.counters.loop_steps += int(ran)
        self.counters.timing["device_wait_s"] += time.perf_counter() - t
        # Rows' tokens as Python lists at once (not an int() per element).
        for b, (it, toks, lps) in enumerate(zip(items, out_KB.T.tolist(), lp_KB.T.tolist(),
                                                strict=False)):  # fmt: skip
            seq = it.seq
            if seq.finished or toks[0] < 0:
                continue
            n = toks.index(-1) if toks[-1] < 0 else len(toks)  # -1 once the row stopped
            tops = None if top is None else [(top[0][i, b], top[1][i, b], top[2][i, b])
                                             for i in range(n)]  # fmt: skip
            seq.num_computed += self.appender.append_many(it.request, seq, toks[:n], lps[:n],
                                                          tops)  # fmt: skip
        # The allocator's lengths catch up with the cache (inside the reservation: nothing is
        # allocated), so stats and the prefix cache are current even mid-chain.
        chained = nxt is not None and any(not it.seq.finished for it in items)
        for it in items:
            seq = it.seq
            if not seq.finished:
                self._catch_up(seq)
                if not chained:  # end of the chain: release the unused reservation
                    self.kv.alloc.truncate(seq.seq_id, seq.num_computed)
                self.appender.commit_pages(it.request, seq)
                # The next loop, dispatched above, may still read pages released here (its
                # table was built before): they are reused only by later device calls.
                self.appender.release_outside_window(seq)
        touched = set()
        if beside is not None:
            items = beside.items
            touched = self.joins.finish(beside)  # the step's tokens (not the loop's)
            chained = nxt is not None and any(not it.seq.finished for it in items)
        self.state = (items, program, nxt) if chained else None
        return touched
