"""The engine's results: ``jpaged.RequestOutput`` and ``jpaged.CompletionOutput``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One completion (or beam) of a request.

    Attributes:
      index: completion index (``0 .. n-1``) or rank of the beam (best first).
      token_ids: generated token ids.
      text: their decoded text when the engine has a tokenizer, else None.
      finish_reason: "stop", "length", "abort", "error" or None while running.
      cumulative_logprob: sum of the generated tokens' log-probabilities.
      score: beam search only: the length-penalised score.
    """

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    cumulative_logprob: float
    score: float | None = None


@dataclasses.dataclass
class RequestOutput:
    """The state of one request.

    Attributes:
      request_id: the id given to or returned by ``add_request``.
      prompt_token_ids: the prompt.
      prompt: the prompt text when given as text.
      outputs: its completions (``n`` of them, or the beams best first).
      finished: True once every completion finished.
      error: why the request failed (finish reason "error"), else None.
      num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0
