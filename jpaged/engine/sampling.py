"""Sampling parameters and on-device sampling (greedy, temperature, top-k, top-p, seeded).

Every random draw is keyed by ``fold_in(key(seed), position)``, where ``position`` is the
position of the token being sampled. A request therefore samples the same tokens whatever
else is in the batch, whichever step or bucket it lands in, and after a preemption.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Finite, so a fully masked row never turns into NaN (jax's Pallas ops use the same constant).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_SEED_MAX = 2**31 - 1


def _is_int(v) -> bool:
    return isinstance(v, int | np.integer)


def _is_real(v) -> bool:
    return isinstance(v, int | float | np.integer | np.floating)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    Invalid values raise ``ValueError`` at construction, before a request reaches the engine.

    Attributes:
      max_tokens: maximum number of generated tokens per completion (>= 1).
      temperature: 0 is greedy; > 0 divides the logits before sampling.
      top_k: keep the k most likely tokens; 0 or -1 keeps all.
      top_p: keep the smallest set of most likely tokens whose probability reaches
        ``top_p`` (0 < top_p <= 1; 1 keeps all).
      n: completions per prompt. They share the prompt's pages. Completion i uses seed
        ``seed + i``, so it equals a run of the same prompt alone with ``n=1, seed=seed+i``.
      seed: per-request seed; None draws one from the engine's generator.
      stop_token_ids: generation stops after emitting any of these (it is kept in the output).
      ignore_eos: if True, the model's EOS token does not stop generation.
      min_tokens: EOS and stop tokens do not stop generation before this many tokens.

    >>> SamplingParams(max_tokens=8, temperature=0.0).greedy
    True
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self):
        errors = []
        if not isinstance(self.max_tokens, int | np.integer) or self.max_tokens < 1:
            errors.append(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if not (
            _is_real(self.temperature) and self.temperature >= 0 and np.isfinite(self.temperature)
        ):
            errors.append(f"temperature={self.temperature!r} must be a finite float >= 0")
        if not isinstance(self.top_k, int | np.integer) or self.top_k < -1:
            errors.append(f"top_k={self.top_k!r} must be an int >= 1, or 0 / -1 (all tokens)")
        if not (_is_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            errors.append(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.n, int | np.integer) or self.n < 1:
            errors.append(f"n={self.n!r} must be an int >= 1")
        if self.seed is not None and (
            not isinstance(self.seed, int | np.integer) or not 0 <= self.seed <= _SEED_MAX
        ):
            errors.append(f"seed={self.seed!r} must be None or an int in [0, 2**31 - 1]")
        elif self.seed is not None and _is_int(self.n) and self.seed + self.n - 1 > _SEED_MAX:
            errors.append(
                f"seed={self.seed!r} with n={self.n!r}: completion i uses seed + i, so "
                f"seed + n - 1 must be <= 2**31 - 1"
            )
        if not isinstance(self.min_tokens, int | np.integer) or not (
            0 <= self.min_tokens <= max(int(self.max_tokens), 0)
        ):
            errors.append(f"min_tokens={self.min_tokens!r} must be in [0, max_tokens]")
        try:
            stops = tuple(int(t) for t in self.stop_token_ids)
        except (TypeError, ValueError):
            stops = None
            errors.append(f"stop_token_ids={self.stop_token_ids!r} must be a sequence of ints")
        if stops is not None and any(t < 0 for t in stops):
            errors.append(f"stop_token_ids={self.stop_token_ids!r} must be >= 0")
        if errors:
            raise ValueError("invalid SamplingParams: " + "; ".join(errors))
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        """True when sampling is greedy (``temperature == 0``)."""
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """Beam search, with the semantics of Hugging Face transformers' ``num_beams`` search.

    Attributes:
      beam_width: beams kept per prompt (>= 1); also the number of returned sequences.
      max_tokens: maximum new tokens per beam (>= 1).
      length_penalty: a finished beam scores ``sum_logprobs / num_generated ** length_penalty``.
      early_stopping: True stops as soon as ``beam_width`` beams finished; False stops when no
        running beam can beat the worst kept finished one at the current length; "never"
        judges that at the longest possible length (transformers' semantics).
      stop_token_ids: tokens that finish a beam besides the model's EOS.
      ignore_eos: if True, EOS does not finish a beam.
    """

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        errors = []
        if not isinstance(self.beam_width, int | np.integer) or self.beam_width < 1:
            errors.append(f"beam_width={self.beam_width!r} must be an int >= 1")
        if not isinstance(self.max_tokens, int | np.integer) or self.max_tokens < 1:
            errors.append(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if not (_is_real(self.length_penalty) and np.isfinite(self.length_penalty)):
            errors.append(f"length_penalty={self.length_penalty!r} must be finite")
        if self.early_stopping not in (True, False, "never"):
            errors.append(f"early_stopping={self.early_stopping!r} must be True, False or 'never'")
        try:
            stops = tuple(int(t) for t in self.stop_token_ids)
        except (TypeError, ValueError):
            stops = None
            errors.append(f"stop_token_ids={self.stop_token_ids!r} must be a sequence of ints")
        if errors:
            raise ValueError("invalid BeamSearchParams: " + "; ".join(errors))
        object.__setattr__(self, "stop_token_ids", stops)


def sample(
    logits_BV: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    seed_B: jax.Array,
    position_B: jax.Array,
    *,
    mode: str | None = None,
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


def top_logprobs(logits_BV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest log-probabilities of each row and their token ids (beam search).

    Args:
      logits_BV: [B, V] logits.
      k: static number of candidates per row (``2 * beam_width`` suffices for beam search).

    Returns:
      (logprobs f32[B, k] descending, token ids i32[B, k]).
    """
    logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logprobs_BV, min(k, logprobs_BV.shape[-1]))
    return values, ids.astype(jnp.int32)
