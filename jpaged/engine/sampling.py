"""On-device sampling (greedy, temperature, min-p, top-k, top-p, seeded) after the logits
processing of `jpaged.engine.logits_process`; the parameter classes live in
`jpaged.engine.params` (re-exported here).

Every random draw is keyed by ``fold_in(key(seed), position)``, where ``position`` is the
position of the token being sampled. A request therefore samples the same tokens whatever
else is in the batch, whichever step or bucket it lands in, and after a preemption.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.engine.logits_process import (
    LogitsInputs,
    apply_processing,
    rank_of,
    token_logprob,
    top_logprobs,
)
from jpaged.engine.params import BeamSearchParams, SamplingParams

__all__ = [
    "BeamSearchParams",
    "SamplingParams",
    "sample",
    "sample_rows",
    "sampling_mode",
    "top_logprobs",
    "truncating",
]

# Finite, so a fully masked row never turns into NaN (jax's Pallas ops use the same constant).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def sample(
    logits_BV: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    seed_B: jax.Array,
    position_B: jax.Array,
    *,
    mode: str | None = None,
    min_p_B: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row, on device; traceable (call it inside the jitted step).

    Row b is greedy when ``temperature_B[b] == 0``; otherwise its logits are divided by the
    temperature, restricted to the ``top_k_B[b]`` most likely tokens (0 or less: all) and to the
    top-p nucleus, and sampled with the key ``fold_in(PRNGKey(seed_B[b]), position_B[b])``
    (Gumbel-max), so each row's draw depends only on its own seed and position.

    Args:
      logits_BV: [B, V] logits (any float dtype; computed in f32).
      temperature_B: f32[B].
      top_k_B: i32[B].
      top_p_B: f32[B].
      seed_B: i32[B] per-row seeds.
      position_B: i32[B] position of the token being sampled.
      mode: static, what the rows need (``sampling_mode`` computes it on the host):
        "greedy" (every row greedy: no noise is drawn), "random" (no row truncates: no sort)
        or "truncate" (some row top-k/top-p truncates: a full-vocabulary sort). None decides
        between "random" and "truncate" on device (a ``lax.cond``, which on GPU makes the host
        wait for the device before it goes on: callers that know the rows pass the mode).
      min_p_B: f32[B] or None; after temperature, tokens less likely than ``min_p`` times
        the most likely one are dropped (0 keeps all; greedy rows ignore it). No sort: it
        needs no "truncate" mode.

    Returns:
      (tokens i32[B], logprobs f32[B]): the tokens and their log-probability under the
      unmodified model distribution (``log_softmax(logits)``).

    >>> logits = jnp.array([[0.0, 3.0, 1.0]])
    >>> tok, _ = sample(logits, jnp.zeros(1), jnp.zeros(1, jnp.int32), jnp.ones(1),
    ...                 jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    >>> int(tok[0])
    1
    """
    if mode not in (None, "greedy", "random", "truncate"):
        raise ValueError(f"{mode=} must be None, 'greedy', 'random' or 'truncate'")
    logits_BV = logits_BV.astype(jnp.float32)
    V = logits_BV.shape[-1]
    # log p(token) = logit - logsumexp(logits): no [B, V] log-softmax is materialised.
    lse_B = jax.nn.logsumexp(logits_BV, axis=-1)

    def logprob(tok_B):
        return jnp.take_along_axis(logits_BV, tok_B[:, None], axis=-1)[:, 0] - lse_B

    greedy_tok_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy_tok_B, logprob(greedy_tok_B)
    greedy_B = temperature_B <= 0.0
    safe_t_B = jnp.where(greedy_B, 1.0, temperature_B).astype(jnp.float32)
    scaled_BV = logits_BV / safe_t_B[:, None]
    if min_p_B is not None:
        # p_i >= min_p * p_max  <=>  s_i >= s_max + log(min_p)  (log 0 = -inf keeps all).
        floor_B1 = jnp.max(scaled_BV, axis=-1, keepdims=True) + jnp.log(min_p_B)[:, None]
        scaled_BV = jnp.where(scaled_BV < floor_B1, _MASK_VALUE, scaled_BV)

    def gumbel(seed, position):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), position)
        return jax.random.gumbel(key, (V,), jnp.float32)

    # Noise indexed by token id, so a row draws the same token with or without truncation.
    g_BV = jax.vmap(gumbel)(seed_B.astype(jnp.uint32), position_B.astype(jnp.uint32))

    def plain():
        return jnp.argmax(scaled_BV + g_BV, axis=-1)

    def truncated():
        # Sorted descending; ties keep the lower token id first (stable sort of the negation).
        order_BV = jnp.argsort(-scaled_BV, axis=-1, stable=True)
        sorted_BV = jnp.take_along_axis(scaled_BV, order_BV, axis=-1)
        rank_V = jnp.arange(V, dtype=jnp.int32)
        k_B = jnp.where(top_k_B <= 0, V, jnp.minimum(top_k_B, V))
        keep_BV = rank_V[None, :] < k_B[:, None]
        probs_BV = jax.nn.softmax(jnp.where(keep_BV, sorted_BV, _MASK_VALUE), axis=-1)
        # Keep rank r while the mass before it is < top_p (so at least one token is kept).
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        keep_BV = keep_BV & (mass_before_BV < top_p_B[:, None])
        noisy_BV = sorted_BV + jnp.take_along_axis(g_BV, order_BV, axis=-1)
        pick_B = jnp.argmax(jnp.where(keep_BV, noisy_BV, -jnp.inf), axis=-1)
        return jnp.take_along_axis(order_BV, pick_B[:, None], axis=-1)[:, 0]

    # The full-vocabulary sort runs only when some sampling row truncates.
    if mode is None:
        any_truncating = jnp.any(truncating(temperature_B, top_k_B, top_p_B, V))
        sampled_B = jax.lax.cond(any_truncating, truncated, plain)
    else:
        sampled_B = truncated() if mode == "truncate" else plain()
    tokens_B = jnp.where(greedy_B, greedy_tok_B, sampled_B).astype(jnp.int32)
    logprob_B = logprob(tokens_B)
    return tokens_B, logprob_B


def sample_rows(
    logits_RV: jax.Array,
    s: Any,
    inputs: LogitsInputs | None,
    *,
    mode: str | None = None,
    processors: tuple = (),
    num_top: int = 0,
    state=None,
):
    """Processes the logits (`jpaged.engine.logits_process`), samples, and computes the
    log-probability outputs; traceable.

    Args:
      logits_RV: f32[R, V] raw logits.
      s: the rows' ``SamplingArrays`` (temperature, top_k, top_p, seed, position: [R]).
      inputs: the rows' ``LogitsInputs``, or None (the plain ``sample`` path, unchanged).
      mode: static sampling mode (``sample``).
      processors: static processor chains of the batch.
      num_top: static; > 0 also returns the top ``num_top`` alternatives and the rank.
      state: the decode loop's penalty state (None: built from ``inputs.history``).

    Returns:
      ``(tokens i32[R], logprobs f32[R], top)``: log-probabilities under the raw logits;
      ``top`` is None or ``(logprobs f32[R, num_top], ids i32[R, num_top], rank i32[R])``.
    """
    if inputs is None:
        tokens_R, lp_R = sample(logits_RV, s.temperature, s.top_k, s.top_p, s.seed,
                                s.position, mode=mode)  # fmt: skip
    else:
        processed_RV = apply_processing(logits_RV, inputs, processors=processors, state=state)
        tokens_R, _ = sample(processed_RV, s.temperature, s.top_k, s.top_p, s.seed, s.position,
                             mode=mode, min_p_B=inputs.min_p)  # fmt: skip
        lp_R = token_logprob(logits_RV, tokens_R)
    top = None
    if num_top:
        vals_RN, ids_RN = top_logprobs(logits_RV, num_top)
        top = (vals_RN, ids_RN, rank_of(logits_RV, tokens_R))
    return tokens_R, lp_R, top


def truncating(
    temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array, vocab_size: int
) -> jax.Array:
    """bool[B]: rows that sample from a top-k / top-p truncated distribution."""
    return ~(temperature_B <= 0.0) & (((top_k_B > 0) & (top_k_B < vocab_size)) | (top_p_B < 1.0))


def sampling_mode(temperature, top_k, top_p, vocab_size: int) -> str:
    """The static ``sample`` mode rows need, from host (NumPy) sampling parameters.

    >>> sampling_mode([0.0, 0.0], [0, 0], [1.0, 1.0], 100)
    'greedy'
    >>> sampling_mode([0.0, 0.7], [0, 0], [1.0, 1.0], 100), sampling_mode([1.0], [5], [1.0], 100)
    ('random', 'truncate')
    """
    t = np.asarray(temperature, np.float64)
    k = np.asarray(top_k, np.int64)
    p = np.asarray(top_p, np.float64)
    if not np.any(t > 0.0):
        return "greedy"
    if np.any((t > 0.0) & (((k > 0) & (k < vocab_size)) | (p < 1.0))):
        return "truncate"
    return "random"
