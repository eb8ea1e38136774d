"""In-engine beam search with Hugging Face transformers' ``num_beams`` semantics.

Beams are ordinary sequences of the engine, so they share pages: when a beam is kept by
several candidates it is forked (every page shared, refcount + 1), when it is dropped its
pages are freed, and the first write to a shared last page copies it (copy-on-write, done
by the allocator). Only the selection below runs on the host, on the top ``2 * W``
log-probabilities of each beam that the jitted step returns.

The selection follows transformers' vectorised ``_beam_search`` (v4.50+, v5): per step the
top ``2W`` candidates over all beams by accumulated log-probability; candidates that hit a
stopping criterion (EOS/stop token, or the length limit) cannot continue; the top ``W`` of
the rest are the next running beams; finished candidates among the first ``W`` are scored
``sum_logprobs / generated_len ** length_penalty`` and merged into the ``W`` best finished
hypotheses; the search ends when no running beam can improve on them (``early_stopping``),
every candidate finished, or all ``W`` hypotheses are done with ``early_stopping=True``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jpaged.engine.sampling import BeamSearchParams

_NEG = -1.0e9


@dataclasses.dataclass
class Hypothesis:
    tokens: list[int]  # generated tokens only
    score: float  # length-penalised


@dataclasses.dataclass
class BeamState:
    """Finished hypotheses and stopping flags of one beam-search request."""

    params: BeamSearchParams
    prompt_len: int
    stop_ids: frozenset[int]
    finished: list[Hypothesis] = dataclasses.field(default_factory=list)
    improvable: bool = True
    done: bool = False

    @property
    def width(self) -> int:
        return self.params.beam_width

    def _worst_finished(self) -> float:
        return min(h.score for h in self.finished) if len(self.finished) == self.width else _NEG


@dataclasses.dataclass
class Choice:
    parent: int  # index into the running beams of this step
    token: int
    score: float  # accumulated log-probability


def select(
    state: BeamState,
    beam_tokens: list[list[int]],
    beam_scores: np.ndarray,
    top_logprobs_BK: np.ndarray,
    top_ids_BK: np.ndarray,
) -> list[Choice]:
    """One beam-search step: updates ``state.finished`` and returns the next running beams.

    Args:
      state: the request's ``BeamState`` (updated in place; ``state.done`` when it ends).
      beam_tokens: generated tokens of each running beam (B beams, B <= W).
      beam_scores: f64[B] accumulated log-probabilities of the running beams.
      top_logprobs_BK: [B, K] each beam's K >= 2W best next-token log-probabilities.
      top_ids_BK: [B, K] their token ids.

    Returns:
      The W next running beams (parent index, token, accumulated score), best first; empty
      when the search is done.
    """
    W = state.width
    K = 2 * W
    cur_gen = len(beam_tokens[0])  # generated tokens so far (equal for all beams)
    cand = beam_scores[:, None] + top_logprobs_BK[:, :K].astype(np.float64)
    flat = cand.reshape(-1)
    order = np.argsort(-flat, kind="stable")[:K]
    parents = order // cand.shape[1]
    tokens = top_ids_BK[:, :K].reshape(-1)[order]
    scores = flat[order]
    at_limit = cur_gen + 1 >= state.params.max_tokens
    hits = np.array([at_limit or int(t) in state.stop_ids for t in tokens])
    # e. running beams: the best W candidates that did not finish.
    run_scores = scores + hits * _NEG
    run_order = np.argsort(-run_scores, kind="stable")[:W]
    # f. finished hypotheses: candidates among the first W that finished, if still allowed.
    lp = state.params.length_penalty
    full = len(state.finished) == W
    if state.improvable and not (full and state.params.early_stopping is True):
        for r in range(min(W, len(order))):
            if hits[r]:
                toks = [*beam_tokens[parents[r]], int(tokens[r])]
                state.finished.append(Hypothesis(toks, float(scores[r] / (cur_gen + 1) ** lp)))
        state.finished.sort(key=lambda h: -h.score)
        del state.finished[W:]
    running = [Choice(int(parents[r]), int(tokens[r]), float(run_scores[r])) for r in run_order]
    # g. stopping condition with the new length.
    new_gen = cur_gen + 1
    if state.params.early_stopping == "never" and lp > 0.0:
        best_len = state.params.max_tokens
    else:
        best_len = new_gen
    best_running = running[0].score / (best_len**lp) if running else _NEG
    state.improvable = state.improvable and best_running > state._worst_finished()
    all_done = len(state.finished) == W and state.params.early_stopping is True
    if not state.improvable or all_done or hits.all():
        state.done = True
        return []
    return running


def results(state: BeamState) -> list[Hypothesis]:
    """The finished hypotheses, best first."""
    return sorted(state.finished, key=lambda h: -h.score)
