"""Planning beside a running chain of decode loops: which requests may join the chain
(`joinable`), and the step that runs between two of its loops (`schedule_beside`).

Both work on host data only: a request, and the `JoinRule` of the chain's loop program (its
sampling mode and stop-id columns). `jpaged.engine.chain_join.ChainJoin` turns the plan into
the step and the rows that join the chain.
"""

from __future__ import annotations

import dataclasses

from jpaged.engine.logits_process import num_top_for, uses_processing
from jpaged.engine.requests import Request
from jpaged.engine.sampling import sampling_mode
from jpaged.engine.scheduler import Scheduler, StepPlan

__all__ = ["JoinRule", "joinable", "schedule_beside"]


@dataclasses.dataclass(frozen=True)
class JoinRule:
    """What a request must match to join a running chain (its loop program's static shape).

    Attributes:
      mode: the loop's sampling mode ("greedy", "random", "truncate").
      num_stops: the loop's stop-id columns (S).
      vocab_size: V (a top-k of V or more is no truncation).
    """

    mode: str
    num_stops: int
    vocab_size: int


def joinable(req: Request, rule: JoinRule) -> bool:
    """Whether ``req``'s row decodes in a loop of ``rule`` exactly as in single steps: one
    sequence (no beam search, ``n == 1``), no logits processing, no log-probability
    outputs, at most ``rule.num_stops`` stop ids, greedy or the loop's sampling mode."""
    p = req.params
    if req.is_beam or req.fan_out != 1 or req.refork or len(req.live_seqs()) != 1:
        return False
    if uses_processing(p) or num_top_for([p]) or len(req.stop_ids) > rule.num_stops:
        return False
    own = sampling_mode([p.temperature], [p.top_k], [p.top_p], rule.vocab_size)
    return own in ("greedy", rule.mode)


def _joinable_heads(sched: Scheduler, rule: JoinRule) -> int:
    """How many requests at the head of the queue may join (admission stops at the first
    that cannot; at most one per free seat is looked at)."""
    room = sched.max_num_seqs - sum(len(r.live_seqs()) for r in sched.running)
    n = 0
    for req in sched.waiting:
        if n >= room or not joinable(req, rule):
            break
        n += 1
    return n


def schedule_beside(sched: Scheduler, chained: set[str], rule: JoinRule) -> StepPlan:
    """Plans a step that runs beside a chain of decode loops, leaving the chain's requests
    (ids in ``chained``) alone: the next tokens of the other running requests (a prefill
    chunk, or one decode token), then the admission of waiting requests as
    `Scheduler.schedule` admits them, while the head is `joinable`. Never preempts.

    Returns:
      The `StepPlan`; ``blocked`` (nothing scheduled) when a running request outside the
      chain cannot grow: the engine ends the chain and schedules, after running the plan's
      page operations (the requests grown before it keep their slots, and their copies are
      emitted only once).
    """
    sched.step_index += 1
    out = StepPlan()
    budget = sched.max_num_batched_tokens
    seats = sum(len(r.live_seqs()) for r in sched.running)
    for req in list(sched.running):
        if req.request_id in chained:
            continue
        plan = sched._plan(req, budget, sched.max_num_seqs)
        if plan is None:
            continue
        if not sched._grow(req, plan, out):
            return dataclasses.replace(out, scheduled=[], num_tokens=0, blocked=True)
        out.scheduled.extend(plan)
        used = sum(p.num_new for p in plan)
        budget -= used
        out.num_tokens += used
    sched._admit(out, budget, seats=seats, max_heads=_joinable_heads(sched, rule))
    return out
