"""The engine's results: ``jpaged.RequestOutput`` and ``jpaged.CompletionOutput``, and
``request_output``, which builds one from a request (texts decoded incrementally)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jpaged.engine import beam
from jpaged.engine.detokenize import Detokenizer
from jpaged.engine.requests import Request, Sequence

__all__ = ["CompletionOutput", "RequestOutput", "request_output"]


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


def request_output(req: Request, tokenizer: Any) -> RequestOutput:
    """A snapshot of ``req``: its completions in index order, or its beams best first once
    the search is done; texts when there is a ``tokenizer``."""
    if req.is_beam and req.beam is not None and req.beam.done:
        outs = [
            CompletionOutput(i, h.tokens, _decode(tokenizer, h.tokens), "stop" if (
                h.tokens and h.tokens[-1] in req.beam.stop_ids) else "length",
                float("nan"), score=h.score)
            for i, h in enumerate(beam.results(req.beam))
        ]  # fmt: skip
    else:
        outs = [
            CompletionOutput(s.index, s.output_ids, _text(tokenizer, s), s.finish_reason,
                             s.cumulative_logprob)
            for s in sorted(req.seqs, key=lambda s: s.index)
        ]  # fmt: skip
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt,
        prompt=req.prompt_text,
        outputs=outs,
        finished=req.finished,
        error=req.error,
        num_cached_tokens=req.num_cached_tokens or 0,
    )


def _decode(tokenizer: Any, ids: list[int]) -> str | None:
    return None if tokenizer is None else tokenizer.decode(ids)


def _text(tokenizer: Any, seq: Sequence) -> str | None:
    """The sequence's output text, decoded incrementally (a full decode once finished)."""
    if tokenizer is None:
        return None
    if seq.detokenizer is None:
        seq.detokenizer = Detokenizer()
    return seq.detokenizer.update(tokenizer, seq.output_ids, finished=seq.finished)
