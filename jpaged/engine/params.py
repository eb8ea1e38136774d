"""``SamplingParams`` and ``BeamSearchParams``: what a request asks for, checked when built.

Every field is checked at construction and a bad value raises one ``ValueError`` that names
each offending field and the value expected. Integer fields take ``int`` or ``np.integer``
only (not ``bool``, ``float`` or ``str``: ``max_tokens=True`` or ``stop_token_ids="12"`` is an
error, not 1 token or ``(1, 2)``); real fields take ints and floats (not ``bool``); token ids
must fit the engine's int32 arrays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

__all__ = ["MAX_LOGPROBS", "BeamSearchParams", "SamplingParams", "check_for_engine"]

MAX_LOGPROBS = 20  # most alternatives per token (``logprobs``, ``prompt_logprobs``): vLLM's default
_SEED_MAX = 2**31 - 1
_TOKEN_MAX = 2**31 - 1  # token ids travel in int32 arrays


def _is_int(v) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def _is_real(v) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(
        v, bool | np.bool_
    )


def _is_bool(v) -> bool:
    return isinstance(v, bool | np.bool_)


def _finite(v) -> bool:
    return _is_real(v) and math.isfinite(float(v))


def _token_ids(name: str, value, errors: list[str]) -> tuple[int, ...]:
    """A sequence of token ids (not a string, not bools or floats) as a tuple of ints."""
    expected = f"{name}={value!r} must be a list of int token ids in [0, 2**31 - 1]"
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        errors.append(expected)
        return ()
    if not all(_is_int(t) and 0 <= t <= _TOKEN_MAX for t in value):
        errors.append(expected)
        return ()
    return tuple(int(t) for t in value)


def _check_int(errors, name, value, lo, hi=None, expected=None) -> None:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        errors.append(expected or f"{name}={value!r} must be an int {rng}")


def _check_real(errors, name, value, lo, hi) -> None:
    if not (_finite(value) and lo <= value <= hi):
        errors.append(f"{name}={value!r} must be a finite float in [{lo}, {hi}]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    Invalid values raise ``ValueError`` at construction, before a request reaches the engine.
    The order on device, per generated token: the raw logits, then ``logits_processors``,
    ``logit_bias``, ``repetition_penalty``, ``presence_penalty`` / ``frequency_penalty``
    (greedy takes the argmax here), then ``temperature``, ``min_p``, ``top_k`` / ``top_p``.

    Attributes:
      max_tokens: maximum number of generated tokens per completion (>= 1).
      temperature: 0 is greedy; > 0 divides the logits before sampling.
      top_k: keep the k most likely tokens; 0 or -1 keeps all.
      top_p: keep the smallest set of most likely tokens whose probability reaches
        ``top_p`` (0 < top_p <= 1; 1 keeps all).
      min_p: keep the tokens whose probability (after temperature) is at least ``min_p``
        times the most likely one's (0 keeps all; vLLM and transformers' ``min_p``).
      n: completions per prompt. They share the prompt's pages. Completion i uses seed
        ``seed + i``, so it equals a run of the same prompt alone with ``n=1, seed=seed+i``.
      seed: per-request seed; None draws one from the engine's generator.
      stop_token_ids: generation stops after emitting any of these (it is kept in the output).
      stop: strings that stop generation (needs a tokenizer): the output text ends before
        the first one (it is not included); the tokens end with the token that completed
        it. A streamed text holds back a tail that could still become a stop string.
      ignore_eos: if True, the model's EOS token does not stop generation.
      min_tokens: EOS, stop tokens and stop strings do not stop generation before this
        many tokens.
      logprobs: None, or k in [0, 20]: each generated token's log-probability (and its rank)
        plus the k most likely alternatives, in ``CompletionOutput.logprobs``. Log-
        probabilities are those of the model's raw distribution (``log_softmax`` of the
        logits, before penalties, bias, processors and temperature; vLLM's default).
      prompt_logprobs: None, or k in [0, 20]: the same for every prompt token after the
        first, in ``RequestOutput.prompt_logprobs`` (such a request does not read the prefix
        cache: every prompt position must be computed).
      repetition_penalty: > 0; transformers' rule over the prompt and generated tokens: a
        seen token's logit is divided by it when positive, multiplied when negative
        (1 is off).
      presence_penalty: in [-2, 2]; subtracted once from the logit of every token generated
        so far (vLLM / OpenAI; the prompt does not count).
      frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it was
        generated so far.
      logit_bias: ``{token_id: bias}`` added to those logits.
      logits_processors: functions ``f(token_ids, logits) -> logits`` traced into the step
        programs (jittable, no host callbacks), see `jpaged.engine.logits_process`:
        ``token_ids`` is ``i32[S]``, the sequence's prompt and generated tokens followed
        by -1 up to the engine's fixed length S (``max_model_len`` rounded up to a page),
        ``logits`` is ``f32[V]``; they are applied per row (``jax.vmap``). Pass the same
        function objects for every request: a program is compiled once per set of
        processors that meet in one batch.

    >>> SamplingParams(max_tokens=8, temperature=0.0).greedy
    True
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    stop: str | Sequence[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    logits_processors: Sequence[Callable] = ()

    def __post_init__(self):
        errors: list[str] = []
        _check_int(errors, "max_tokens", self.max_tokens, 1)
        if not (_finite(self.temperature) and self.temperature >= 0):
            errors.append(f"temperature={self.temperature!r} must be a finite float >= 0")
        _check_int(errors, "top_k", self.top_k, -1,
                   expected=f"top_k={self.top_k!r} must be an int >= 1, or 0 / -1 (all tokens)")  # fmt: skip
        if not (_is_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            errors.append(f"top_p={self.top_p!r} must be in (0, 1]")
        _check_real(errors, "min_p", self.min_p, 0.0, 1.0)
        _check_int(errors, "n", self.n, 1)
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed <= _SEED_MAX):
            errors.append(f"seed={self.seed!r} must be None or an int in [0, 2**31 - 1]")
        elif self.seed is not None and _is_int(self.n) and self.seed + self.n - 1 > _SEED_MAX:
            errors.append(
                f"seed={self.seed!r} with n={self.n!r}: completion i uses seed + i, so "
                f"seed + n - 1 must be <= 2**31 - 1"
            )
        max_tokens = int(self.max_tokens) if _is_int(self.max_tokens) else 0
        _check_int(errors, "min_tokens", self.min_tokens, 0, max(max_tokens, 0),
                   expected=f"min_tokens={self.min_tokens!r} must be an int in [0, max_tokens]")  # fmt: skip
        stops = _token_ids("stop_token_ids", self.stop_token_ids, errors)
        if not _is_bool(self.ignore_eos):
            errors.append(f"ignore_eos={self.ignore_eos!r} must be a bool")
        stop = self._stop_strings(errors)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _check_int(errors, name, v, 0, MAX_LOGPROBS,
                           expected=f"{name}={v!r} must be None or an int in [0, {MAX_LOGPROBS}]")  # fmt: skip
        if not (_finite(self.repetition_penalty) and self.repetition_penalty > 0):
            errors.append(
                f"repetition_penalty={self.repetition_penalty!r} must be a finite float > 0"
            )
        _check_real(errors, "presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real(errors, "frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        bias = self._logit_bias(errors)
        procs = self._processors(errors)
        if errors:
            raise ValueError("invalid SamplingParams: " + "; ".join(errors))
        object.__setattr__(self, "stop_token_ids", stops)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "logits_processors", procs)

    def _stop_strings(self, errors) -> tuple[str, ...]:
        stop = self.stop
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            errors.append(f"stop={self.stop!r} must be a non-empty string or a list of them")
            return ()
        return tuple(stop)

    def _logit_bias(self, errors) -> dict[int, float] | None:
        bias = self.logit_bias
        if bias is None:
            return None
        expected = (f"logit_bias={bias!r} must be a dict of int token ids in [0, 2**31 - 1] "
                    "to finite floats")  # fmt: skip
        if not isinstance(bias, Mapping):
            errors.append(expected)
            return None
        if not all(_is_int(t) and 0 <= t <= _TOKEN_MAX and _finite(b) for t, b in bias.items()):
            errors.append(expected)
            return None
        return {int(t): float(b) for t, b in bias.items()}

    def _processors(self, errors) -> tuple[Callable, ...]:
        procs = self.logits_processors
        if callable(procs):
            procs = (procs,)
        if not isinstance(procs, Sequence) or not all(callable(f) for f in procs):
            errors.append(f"logits_processors={self.logits_processors!r} must be a list of "
                          "functions (token_ids, logits) -> logits")  # fmt: skip
            return ()
        return tuple(procs)

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
        errors: list[str] = []
        _check_int(errors, "beam_width", self.beam_width, 1)
        _check_int(errors, "max_tokens", self.max_tokens, 1)
        if not _finite(self.length_penalty):
            errors.append(f"length_penalty={self.length_penalty!r} must be finite")
        if not (_is_bool(self.early_stopping) or (
                isinstance(self.early_stopping, str) and self.early_stopping == "never")):  # fmt: skip
            errors.append(f"early_stopping={self.early_stopping!r} must be True, False or 'never'")
        stops = _token_ids("stop_token_ids", self.stop_token_ids, errors)
        if not _is_bool(self.ignore_eos):
            errors.append(f"ignore_eos={self.ignore_eos!r} must be a bool")
        if errors:
            raise ValueError("invalid BeamSearchParams: " + "; ".join(errors))
        object.__setattr__(self, "stop_token_ids", stops)
        if _is_bool(self.early_stopping):
            object.__setattr__(self, "early_stopping", bool(self.early_stopping))


def check_for_engine(params, *, vocab_size: int, has_tokenizer: bool) -> None:
    """What a request's parameters need from the engine that serves it.

    Raises:
      ValueError: stop strings without a tokenizer, or ``logit_bias`` ids outside
        ``[0, vocab_size)``.
    """
    if not isinstance(params, SamplingParams):
        return
    if params.stop and not has_tokenizer:
        raise ValueError(f"stop={params.stop!r} needs a tokenizer (the engine has none): "
                         "use stop_token_ids, or give LLM(tokenizer=...)")  # fmt: skip
    bad = sorted(t for t in (params.logit_bias or {}) if t >= vocab_size)
    if bad:
        raise ValueError(f"logit_bias token ids {bad} must be < vocab_size={vocab_size}")
