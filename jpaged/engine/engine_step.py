"""One engine step: schedule, run the page operations, run the device call, fail what failed.

`EngineStep.run` is the body of ``jpaged.LLM.step``: while a chain of decode loops is in
flight it advances the chain; otherwise the `Scheduler` plans (`StepPlan`), the
`KVManager` runs the plan's page operations, and the plan runs as one device call
(`StepExecutor`) or starts a chain (`DecodeChain`): a decode-only plan as the chain's first
loop, a plan with prefill as the step before it, in the same dispatch, when its rows can
join a decode loop.

A step that raises (a page operation, the device call, the token appender) fails only the
requests of that step (`EngineStep.fail`): each gets finish reason ``"error"`` with the
exception as ``RequestOutput.error``, and its pages are freed. If the device pool was lost
with the failed call (it had been donated), a zero-filled pool replaces it, the running
requests start again from their tokens (recompute) and the prefix cache is emptied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from jpaged.engine.counters import Counters
from jpaged.engine.decode_chain import DecodeChain
from jpaged.engine.kv_manager import KVManager
from jpaged.engine.scheduler import Scheduler
from jpaged.engine.step import StepExecutor
from jpaged.kv.allocator import BlockAllocator

__all__ = ["EngineStep"]

_log = logging.getLogger("jpaged")

_MAX_MESSAGE = 1000  # characters of the exception's text kept in a failed request's error


class EngineStep:
    """Runs engine steps over the parts `jpaged.engine.assembly.assemble` built.

    Args:
      request: ``request_id -> Request`` (or None), for the requests a page operation names.
      debug: check the allocator's invariants after every step.
    """

    def __init__(
        self, *, alloc: BlockAllocator, kv: KVManager, scheduler: Scheduler, chain: DecodeChain,
        executor: StepExecutor, counters: Counters, request: Callable, debug: bool = False,
    ):  # fmt: skip
        self.alloc, self.kv, self.scheduler = alloc, kv, scheduler
        self.chain, self.executor, self.counters = chain, executor, counters
        self.request, self.debug = request, debug

    def run(self) -> tuple[set[str], list[str]]:
        """One step; returns ``(touched, done)``: the ids of the requests it touched
        (progressed, preempted) and of those that finished or failed since the last step,
        scheduled or not (errors, aborts)."""
        touched = self._advance_chain() if self.chain.state is not None else self._plan_and_run()
        if self.debug:
            self.alloc.check_invariants()
        self.alloc.take_dirty()  # the engine rebuilds tables per step; keep the set bounded
        return touched, [r.request_id for r in self.scheduler.take_finished()]

    def _advance_chain(self) -> set[str]:
        """A decode loop is in flight: advance the chain."""
        t1 = time.perf_counter()
        # Rows finished in an earlier loop of the chain were reported then (and may be
        # retired); rows finishing now are reported through the scheduler's finished list.
        items = self.chain.state[0]
        touched = {it.request.request_id for it in items if not it.request.finished}
        self.counters.steps += 1
        try:
            touched |= self.chain.advance()  # on a failure it ends the chain (`DecodeChain.end`)
        except Exception as e:  # the step planned beside the loop fails with it (every
            # request it scheduled, swapped in, copied pages of, or admitted)
            beside = [self.request(rid) for rid in self.chain.beside_request_ids]
            self.fail([it.request for it in items] + beside, e)
        self.counters.timing["step_s"] += time.perf_counter() - t1
        return touched

    def _plan_and_run(self) -> set[str]:
        timing = self.counters.timing
        # A decode loop left running by the chain that ended: wait for it here, so that its
        # failure (if any) surfaces before scheduling changes the allocator (a copy-on-write
        # or swap that could then not run). Its rows have finished on the host.
        try:
            self.kv.cache  # noqa: B018
        except Exception as e:
            self.fail([], e)
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        touched = {s.request.request_id for s in plan.scheduled}
        touched |= {rid for rid, _ in plan.preempted}
        for i, op in enumerate(plan.page_ops):  # swap-outs, copies, swap-ins, in order
            try:
                self.kv.apply([op])
            except Exception as e:
                # The requests of this and the later operations fail; the others of the
                # plan run in a later step (their slots stay allocated).
                self.fail([self.request(o.request_id) for o in plan.page_ops[i:]], e)
                return touched
        t1 = time.perf_counter()
        timing["schedule_s"] += t1 - t0
        if plan.scheduled:
            self.counters.steps += 1
            try:
                if self.chain.can_loop(plan) and self.chain.start(plan):
                    # Its rows progress when the next step processes the loop.
                    touched -= {s.request.request_id for s in plan.scheduled}
                elif not self._start_chain_from_step(plan):
                    self.executor.run(plan)
            except Exception as e:
                self.fail([s.request for s in plan.scheduled], e)
        timing["step_s"] += time.perf_counter() - t1
        return touched

    def _start_chain_from_step(self, plan) -> bool:
        """Whether ``plan`` (a step with prefill) started a chain whose first decode loop
        runs right after it, in the same dispatch (`DecodeChain.start_from_step`)."""
        rule = self.chain.step_rule(plan)
        return rule is not None and self.chain.start_from_step(plan, rule) is not None

    def fail(self, requests: list, error: Exception) -> None:
        """Fails ``requests`` (None entries and finished requests are skipped) with ``error``."""
        _log.error("an engine step failed; its requests fail", exc_info=error)
        text = f"{type(error).__name__}: {error}"
        if len(text) > _MAX_MESSAGE:
            text = text[:_MAX_MESSAGE] + " ..."
        message = "the engine step running this request failed: " + text
        for req in requests:
            if req is not None and not req.finished:
                # Pages this step registered (or swapped in) may not hold their tokens' K/V.
                held = [s.seq_id for s in req.live_seqs() if s.seq_id in self.alloc]
                self.alloc.reset_prefix_cache(held)
                self.scheduler.fail(req, message)
        if self.kv.replace_lost_pool():
            self.scheduler.restart_running()
            self.alloc.reset_prefix_cache()
