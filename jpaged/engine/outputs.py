"""The engine's results: ``jpaged.RequestOutput``, ``jpaged.CompletionOutput`` and their
``Logprob`` entries (vLLM's shapes), and ``request_output``, which builds one from a
request (texts decoded incrementally, cut before a stop string)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jpaged.engine import beam
from jpaged.engine.detokenize import Detokenizer
from jpaged.engine.requests import Request, Sequence
from jpaged.engine.stop_strings import held_back

__all__ = ["CompletionOutput", "Logprob", "RequestOutput", "logprob_entry", "request_output"]


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``).

    Attributes:
      logprob: log-probability under the model's raw distribution (``log_softmax`` of the
        logits, before penalties, bias, processors and temperature).
      rank: 1-based rank in that distribution (tokens at least as likely counted).
      decoded_token: the token decoded alone, when the engine has a tokenizer.
    """

    logprob: float
    rank: int
    decoded_token: str | None = None


def logprob_entry(token: int, logprob: float, top, k: int, tokenizer: Any) -> dict[int, Logprob]:
    """``{token_id: Logprob}`` of one position: the chosen (or prompt) token first, then the
    ``k`` most likely tokens (one entry fewer when the chosen token is among them).

    Args:
      top: ``(logprobs f32[N], ids i32[N], rank of the chosen token)`` from the device,
        N >= k, descending.
    """
    vals, ids, rank = top

    def piece(t: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([t])

    entry = {int(token): Logprob(float(logprob), int(rank), piece(int(token)))}
    for i in range(min(k, len(ids))):
        t = int(ids[i])
        if t not in entry:
            entry[t] = Logprob(float(vals[i]), i + 1, piece(t))
    return entry


def top_row(top, r: int):
    """Row ``r`` of a device ``top`` triple (``None`` stays ``None``)."""
    return None if top is None else (top[0][r], top[1][r], top[2][r])


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
      logprobs: with ``SamplingParams(logprobs=k)``: per generated token, ``{token_id:
        Logprob}`` of the chosen token and the k most likely ones; else None.
      stop_reason: the stop string or stop token id that finished it (None for EOS,
        a length limit, or while running).
    """

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    cumulative_logprob: float
    score: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None


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
      prompt_logprobs: with ``SamplingParams(prompt_logprobs=k)``: per prompt token,
        ``{token_id: Logprob}`` of it and the k most likely ones given the tokens before it
        (None for the first token, and for tokens not computed yet); else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


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
        stops = getattr(req.params, "stop", ())
        outs = [
            CompletionOutput(s.index, s.output_ids, _text(tokenizer, s, stops), s.finish_reason,
                             s.cumulative_logprob, logprobs=_copy(s.logprobs),
                             stop_reason=s.stop_reason)
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
        prompt_logprobs=_copy(req.prompt_logprobs),
    )


def _copy(entries: list | None) -> list | None:
    return None if entries is None else list(entries)


def _decode(tokenizer: Any, ids: list[int]) -> str | None:
    return None if tokenizer is None else tokenizer.decode(ids)


def _text(tokenizer: Any, seq: Sequence, stops: tuple[str, ...] = ()) -> str | None:
    """The sequence's output text, decoded incrementally (a full decode once finished); cut
    before the stop string that finished it; while running, without a tail that could
    still become a stop string."""
    if tokenizer is None:
        return None
    if seq.detokenizer is None:
        seq.detokenizer = Detokenizer()
    if seq.text_end is not None:
        return seq.detokenizer.text[: seq.text_end]
    text = seq.detokenizer.update(tokenizer, seq.output_ids, finished=seq.finished)
    return held_back(text, stops) if stops and not seq.finished else text
