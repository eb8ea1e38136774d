"""Logits processing on device, between the model and the sampler: user logits processors,
logit bias, repetition / presence / frequency penalties, and the log-probability outputs.

Everything here is traced into the jitted step and decode-loop programs
(`jpaged.engine.runner`); the host only builds the per-row inputs (`logits_inputs`). Each
feature is present in a batch only when some row of it uses it (its inputs are None
otherwise), so a batch without them runs exactly the program it ran before, and a row that
does not use a feature gets bit-identical logits in a batch where another row does (its
neutral values: penalty 1 / 0, no bias entries, no processor).

Costs (R rows, V vocabulary, S = the engine's fixed history length, ``max_model_len``
rounded up to a page):

- penalties: the host sends each row's tokens, ``i32[R, S]``; the device builds a
  ``bool[R, V]`` seen-token mask and an ``i32[R, V]`` generated-token count by a scatter of
  that history, once per step (single step) or once per decode loop, whose steps update
  them with one scatter per token (5 bytes x R x V of device memory while the program runs);
- logit bias: ``i32[R, NB]`` ids and ``f32[R, NB]`` values (NB the largest bias of the
  batch, rounded up to a power of two >= 8), one scatter-add;
- logits processors: each distinct processor chain of the batch runs on every row (vmap)
  and is kept where the row uses it; they also receive the ``i32[R, S]`` history;
- log-probabilities: a top-k (``k = MAX_LOGPROBS``, 20) of the raw logits and a rank count
  (one compare over ``[R, V]``); prompt log-probabilities compute the logits of every token
  of the step (``f32[T, V]`` instead of ``f32[R, V]``).

Logits processors: ``f(token_ids: i32[S], logits: f32[V]) -> f32[V]``, called per row under
``jax.vmap`` with the row's prompt and generated tokens followed by -1 padding up to S (the
length is ``(token_ids >= 0).sum()``). They are traced once per engine program, so they
must be jittable (no host callbacks, no Python control flow on values) and may not change
the shape. The processor chains of a batch are a static argument of its program: the same
function objects always hit the same compiled program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.engine.params import MAX_LOGPROBS, SamplingParams

__all__ = [
    "LogitsInputs",
    "apply_processing",
    "logits_inputs",
    "penalty_state",
    "prompt_logprobs",
    "rank_of",
    "token_logprob",
    "top_logprobs",
    "update_penalty_state",
]

ProcessorChains = tuple[tuple[Callable, ...], ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitsInputs:
    """Per-row inputs of the logits processing (R rows); a field is None when no row of the
    batch needs it (the pytree structure then selects the program).

    Attributes:
      history: i32[R, S] each row's prompt and generated tokens, -1 after them (penalties
        and processors).
      num_prompt: i32[R] prompt length of each row (positions from it on are generated).
      repetition: f32[R] repetition penalty (1: off); with ``presence`` and ``frequency``
        f32[R] (0: off). All three or none.
      bias_ids: i32[R, NB] token ids of the logit bias, -1 padding; ``bias_values`` f32[R, NB].
      min_p: f32[R] (0: off).
      processor_chain: i32[R] index of the row's chain in the program's static
        ``processors`` (-1: none).
    """

    history: Any = None
    num_prompt: Any = None
    repetition: Any = None
    presence: Any = None
    frequency: Any = None
    bias_ids: Any = None
    bias_values: Any = None
    min_p: Any = None
    processor_chain: Any = None


def penalty_state(history_RS: jax.Array, num_prompt_R: jax.Array, vocab_size: int):
    """``(seen bool[R, V], generated counts i32[R, V])`` from the rows' token history:
    ``seen`` marks every prompt or generated token (repetition penalty), ``counts`` counts the
    generated ones (presence and frequency penalties)."""
    R, S = history_RS.shape
    rows_RS = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32)[:, None], (R, S))
    valid_RS = history_RS >= 0
    generated_RS = valid_RS & (jnp.arange(S, dtype=jnp.int32)[None, :] >= num_prompt_R[:, None])
    V = vocab_size
    seen_RV = (
        jnp.zeros((R, V), bool)
        .at[rows_RS, jnp.where(valid_RS, history_RS, V)]
        .set(True, mode="drop")
    )
    counts_RV = (
        jnp.zeros((R, V), jnp.int32)
        .at[rows_RS, jnp.where(generated_RS, history_RS, V)]
        .add(1, mode="drop")
    )
    return seen_RV, counts_RV


def update_penalty_state(state, tokens_R: jax.Array, active_R: jax.Array):
    """The penalty state after the active rows generated ``tokens_R`` (inactive rows keep it)."""
    seen_RV, counts_RV = state
    R, V = seen_RV.shape
    rows_R = jnp.arange(R, dtype=jnp.int32)
    ids_R = jnp.where(active_R, tokens_R, V)
    return (
        seen_RV.at[rows_R, ids_R].set(True, mode="drop"),
        counts_RV.at[rows_R, ids_R].add(1, mode="drop"),
    )


def _run_chain(chain, token_ids_S, logits_V):
    V = logits_V.shape[0]
    for f in chain:
        out = f(token_ids_S, logits_V)
        if not hasattr(out, "shape") or tuple(out.shape) != (V,):
            raise ValueError(
                f"logits processor {getattr(f, '__name__', f)!r} returned shape "
                f"{getattr(out, 'shape', type(out).__name__)}, expected ({V},): it takes "
                "(token_ids i32[S], logits f32[V]) of one row and returns f32[V]"
            )
        logits_V = jnp.asarray(out).astype(jnp.float32)
    return logits_V


def apply_processing(
    logits_RV: jax.Array,
    inputs: LogitsInputs | None,
    *,
    processors: ProcessorChains = (),
    state=None,
) -> jax.Array:
    """The logits the sampler sees: processors, then bias, then penalties (f32[R, V]).

    Args:
      logits_RV: f32[R, V] raw logits.
      inputs: the rows' `LogitsInputs` (None: returned unchanged).
      processors: static; the batch's distinct processor chains.
      state: the penalty state ``(seen, counts)`` (`penalty_state`); None builds it from
        ``inputs.history`` when penalties are on.
    """
    if inputs is None:
        return logits_RV
    logits_RV = logits_RV.astype(jnp.float32)
    R, V = logits_RV.shape
    for g, chain in enumerate(processors):
        out_RV = jax.vmap(lambda ids, lg, chain=chain: _run_chain(chain, ids, lg))(
            inputs.history, logits_RV
        )
        logits_RV = jnp.where((inputs.processor_chain == g)[:, None], out_RV, logits_RV)
    if inputs.bias_ids is not None:
        rows = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32)[:, None], inputs.bias_ids.shape)
        ids = jnp.where(inputs.bias_ids >= 0, inputs.bias_ids, V)
        logits_RV = logits_RV.at[rows, ids].add(inputs.bias_values, mode="drop")
    if inputs.repetition is not None:
        seen_RV, counts_RV = (
            state if state is not None else penalty_state(inputs.history, inputs.num_prompt, V)
        )
        # transformers' RepetitionPenaltyLogitsProcessor (over prompt and generated tokens).
        p_R1 = inputs.repetition[:, None]
        penalized_RV = jnp.where(logits_RV < 0, logits_RV * p_R1, logits_RV / p_R1)
        logits_RV = jnp.where(seen_RV, penalized_RV, logits_RV)
        # vLLM / OpenAI presence and frequency penalties (generated tokens only).
        counts_f = counts_RV.astype(jnp.float32)
        logits_RV = logits_RV - inputs.frequency[:, None] * counts_f
        logits_RV = logits_RV - inputs.presence[:, None] * (counts_RV > 0).astype(jnp.float32)
    return logits_RV


def token_logprob(raw_RV: jax.Array, tokens_R: jax.Array) -> jax.Array:
    """f32[R]: each token's log-probability under the raw logits (``log_softmax``)."""
    raw_RV = raw_RV.astype(jnp.float32)
    lse_R = jax.nn.logsumexp(raw_RV, axis=-1)
    return jnp.take_along_axis(raw_RV, tokens_R[:, None], axis=-1)[:, 0] - lse_R


def rank_of(raw_RV: jax.Array, tokens_R: jax.Array) -> jax.Array:
    """i32[R]: 1-based rank of each token in its row (tokens at least as likely counted, as
    vLLM does)."""
    raw_RV = raw_RV.astype(jnp.float32)
    chosen_R1 = jnp.take_along_axis(raw_RV, tokens_R[:, None], axis=-1)
    return jnp.sum(raw_RV >= chosen_R1, axis=-1, dtype=jnp.int32)


def top_logprobs(logits_BV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest log-probabilities of each row and their token ids (beam search,
    ``logprobs``).

    Args:
      logits_BV: [B, V] logits.
      k: static number of candidates per row (``2 * beam_width`` suffices for beam search).

    Returns:
      (logprobs f32[B, k] descending, token ids i32[B, k]).
    """
    logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logprobs_BV, min(k, logprobs_BV.shape[-1]))
    return values, ids.astype(jnp.int32)


def prompt_logprobs(logits_TV: jax.Array, targets_T: jax.Array, num_top: int):
    """Prompt log-probabilities of one step: row t's logits score the prompt token that
    follows it (``targets_T[t]``, -1: none, its values are then meaningless).

    Returns:
      ``(logprob f32[T], top logprobs f32[T, num_top], top ids i32[T, num_top],
      rank i32[T])``.
    """
    safe_T = jnp.maximum(targets_T, 0)
    vals_TN, ids_TN = top_logprobs(logits_TV, num_top)
    return token_logprob(logits_TV, safe_T), vals_TN, ids_TN, rank_of(logits_TV, safe_T)


# ------------------------------------------------------------------ host side


def _bucket8(n: int) -> int:
    b = 8
    while b < n:
        b *= 2
    return b


def uses_processing(p) -> bool:
    """Whether a request's parameters need `LogitsInputs` at all."""
    return isinstance(p, SamplingParams) and (
        p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or bool(p.logit_bias)
        or (p.min_p > 0.0 and p.temperature > 0.0)
        or bool(p.logits_processors)
    )


def logits_inputs(
    rows: list[tuple[Any, list[int], int]], num_rows: int, history_len: int
) -> tuple[LogitsInputs | None, ProcessorChains]:
    """The `LogitsInputs` of a batch's sampling rows (host NumPy) and its processor chains.

    Args:
      rows: per sampling row ``(params, tokens, num_prompt)``: the request's parameters
        (``BeamSearchParams`` rows use none of the features), its sequence's tokens so far
        and its prompt length.
      num_rows: R, the padded row count.
      history_len: S, the engine's fixed history length.

    Returns:
      ``(inputs, processors)``; ``(None, ())`` when no row uses a feature.
    """
    ps = [p if isinstance(p, SamplingParams) else None for p, _, _ in rows]
    if not any(uses_processing(p) for p in ps):
        return None, ()
    R = num_rows

    def column(get, neutral, dtype):
        col = np.full(R, neutral, dtype)
        for r, p in enumerate(ps):
            if p is not None:
                col[r] = get(p)
        return col

    fields: dict[str, Any] = {}
    penalties = any(
        p is not None and (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                           or p.frequency_penalty != 0.0)
        for p in ps
    )  # fmt: skip
    chains: list[tuple[Callable, ...]] = []
    chain_of = np.full(R, -1, np.int32)
    for r, p in enumerate(ps):
        if p is not None and p.logits_processors:
            if p.logits_processors not in chains:
                chains.append(p.logits_processors)
            chain_of[r] = chains.index(p.logits_processors)
    if penalties or chains:
        hist = np.full((R, history_len), -1, np.int32)
        num_prompt = np.zeros(R, np.int32)
        for r, (_, tokens, n_prompt) in enumerate(rows):
            hist[r, : len(tokens)] = tokens[:history_len]
            num_prompt[r] = n_prompt
        fields.update(history=hist, num_prompt=num_prompt)
    if penalties:
        fields.update(
            repetition=column(lambda p: p.repetition_penalty, 1.0, np.float32),
            presence=column(lambda p: p.presence_penalty, 0.0, np.float32),
            frequency=column(lambda p: p.frequency_penalty, 0.0, np.float32),
        )
    biases = [p.logit_bias if p is not None and p.logit_bias else {} for p in ps]
    if any(biases):
        NB = _bucket8(max(len(b) for b in biases))
        ids = np.full((R, NB), -1, np.int32)
        vals = np.zeros((R, NB), np.float32)
        for r, b in enumerate(biases):
            ids[r, : len(b)] = list(b.keys())
            vals[r, : len(b)] = list(b.values())
        fields.update(bias_ids=ids, bias_values=vals)
    if any(p is not None and p.min_p > 0.0 and p.temperature > 0.0 for p in ps):
        fields["min_p"] = column(lambda p: p.min_p, 0.0, np.float32)
    if chains:
        fields["processor_chain"] = chain_of
    return LogitsInputs(**fields), tuple(chains)


def num_top_for(params: list[Any]) -> int:
    """The static top-k size the rows' ``logprobs`` / ``prompt_logprobs`` need (0: none)."""
    want = any(
        isinstance(p, SamplingParams) and (p.logprobs is not None or p.prompt_logprobs is not None)
        for p in params
    )
    return MAX_LOGPROBS if want else 0
