"""The engine's running counters (steps, device calls, tokens, host and device time)."""

from __future__ import annotations

import dataclasses

__all__ = ["Counters"]

TIMERS = ("schedule_s", "step_s", "device_wait_s", "dispatch_s")


@dataclasses.dataclass
class Counters:
    """Counters the engine's parts add to; ``jpaged.LLM.stats`` reports them.

    Attributes:
      steps: engine steps that ran something.
      device_calls: step programs dispatched (single steps and decode loops).
      single_steps: single steps run (one model forward each; a decode loop's forwards are
        ``loop_steps``).
      tokens_generated: tokens appended to sequences.
      loop_steps: decode steps run inside decode loops (they stop early).
      chain_starts: chains of decode loops started (from a decode-only plan, or from a
        step with prefill: ``chains_from_steps``).
      chains_from_steps: chains started from a step with prefill, the step and the first
        loop in one dispatch (`jpaged.engine.decode_chain.DecodeChain.start_from_step`).
      steps_beside_chain: steps run between two loops of a chain (prefill chunks of
        admitted requests, decode tokens of requests outside it; `jpaged.engine.chain_join`).
      chain_joins: rows that joined a running chain.
      chain_grows: chains whose carry grew to a larger row bucket for rows to join.
      timing: seconds per timer: host time scheduling (``schedule_s``), host + device time
        in steps (``step_s``), of that the time waiting for device results
        (``device_wait_s``), and the time the calls starting device work took to return
        (``dispatch_s``).
    """

    steps: int = 0
    device_calls: int = 0
    single_steps: int = 0
    tokens_generated: int = 0
    loop_steps: int = 0
    chain_starts: int = 0
    chains_from_steps: int = 0
    steps_beside_chain: int = 0
    chain_joins: int = 0
    chain_grows: int = 0
    timing: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(TIMERS, 0.0))
