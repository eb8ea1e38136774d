"""Requests and their sequences: what the engine serves, as host records.

One scheduling unit is a *request* (a prompt with its ``n`` completions or its beams); its
*sequences* are the token streams that own pages in the allocator. Each sequence carries
``tokens`` (prompt + generated) and ``num_computed`` (tokens whose K/V are in the cache); a
step computes some more of them, so prefill, chunked prefill, decode and recomputation
after preemption are one mechanism (vLLM v1's). A sequence samples a token in the step where
its ``num_computed`` reaches ``len(tokens)``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jpaged.engine.sampling import BeamSearchParams, SamplingParams

__all__ = ["Request", "Sequence", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One token stream with pages in the allocator.

    Attributes:
      seq_id: the allocator's id.
      index: completion index within its request (n > 1), or beam slot.
      tokens: prompt + generated token ids.
      num_prompt: prompt length.
      seed: sampling seed.
      num_computed: tokens whose K/V are in the cache.
      finish_reason: None while running; "stop", "length", "abort" or "error".
      cumulative_logprob: sum of the log-probabilities of the generated tokens.
      logprobs: per generated token ``{token_id: Logprob}`` (``SamplingParams.logprobs``),
        else None.
      stop_reason: the stop string or stop token id that finished it.
      text_end: with a stop string: the length of the output text before it.
    """

    seq_id: int
    index: int
    tokens: list[int]
    num_prompt: int
    seed: int
    num_computed: int = 0
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    num_committed: int = 0  # tokens of full pages registered in the prefix cache
    detokenizer: Any = None  # the engine's incremental ``Detokenizer`` of the output text
    logprobs: list | None = None
    stop_reason: int | str | None = None
    text_end: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and its completions (or beams).

    Attributes:
      request_id: caller's id.
      prompt: prompt token ids.
      params: ``SamplingParams`` or ``BeamSearchParams``.
      arrival: admission order key (monotone).
      seqs: live and finished sequences (for beam search: the live beams).
      status: see ``Status``.
      error: the message when the request failed.
      num_preemptions: how often it was preempted.
      swapped_pages: pages it holds in the host swap space while swapped out.
      beam: the beam-search state (``jpaged.engine.beam.BeamState``) or None.
      prompt_text: the prompt string, when given as text.
      salt: prefix-cache salt.
      stop_ids: the token ids that stop a sequence (its stop tokens, and the engine's EOS
        unless ``ignore_eos``), set by the engine at admission.
      prompt_logprobs: per prompt token ``{token_id: Logprob}`` or None
        (``SamplingParams.prompt_logprobs``), else None.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams | BeamSearchParams
    arrival: int
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    error: str | None = None
    num_preemptions: int = 0
    swapped_pages: int = 0
    beam: Any = None
    prompt_text: str | None = None
    salt: str | None = None
    forked: bool = False
    refork: bool = False
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache
    stop_ids: frozenset[int] = frozenset()  # tokens that stop it (EOS unless ignored)
    prompt_logprobs: list | None = None

    def __post_init__(self):
        self.is_beam = isinstance(self.params, BeamSearchParams)

    @property
    def fan_out(self) -> int:
        """Sequences the prompt forks into once prefilled (n, or the beam width)."""
        return self.params.beam_width if self.is_beam else self.params.n

    @property
    def reads_prefix_cache(self) -> bool:
        """False for a request that wants prompt log-probabilities: every prompt position
        must be computed, none served from cached pages (vLLM does the same)."""
        return self.is_beam or self.params.prompt_logprobs is None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None if self.is_beam else self.params.prompt_logprobs

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED
