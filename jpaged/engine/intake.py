"""Request intake: a prompt and its parameters become a `Request` with its first sequence,
or a request finished at once with finish reason "error" when the engine cannot serve it."""

from __future__ import annotations

import dataclasses
import itertools
import math
import reprlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from jpaged.engine import beam
from jpaged.engine.appender import TokenAppender
from jpaged.engine.requests import Request, Status
from jpaged.engine.requests import Sequence as Seq
from jpaged.engine.sampling import BeamSearchParams, SamplingParams
from jpaged.kv.allocator import BlockAllocator

__all__ = ["Prompt", "RequestIntake", "as_prompt_list", "check_cache_salt", "id_order"]

Prompt = Sequence[int] | str

_PROMPT_HELP = "a prompt is a list of token ids (int) or a string (with a tokenizer)"
_repr = reprlib.Repr(maxstring=40, maxother=40, maxlist=8, maxtuple=8, maxset=8, maxdict=4).repr


def _is_token_id(v: Any) -> bool:
    """An ``int``, a numpy integer or a 0-d integer array, never a ``bool`` (nor a float,
    str or bytes)."""
    if isinstance(v, bool | np.bool_):
        return False
    if isinstance(v, int | np.integer):
        return True
    return getattr(v, "ndim", None) == 0 and np.issubdtype(getattr(v, "dtype", None), np.integer)


def check_cache_salt(cache_salt: Any) -> None:
    """Raises ``ValueError`` unless ``cache_salt`` is a str or None."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt={cache_salt!r} must be a str or None")


class RequestIntake:
    """Builds requests: ids, arrival order, seeds, tokenization, stop ids and the limits a
    request must meet to be served.

    Args:
      alloc: the host allocator (the pool size a request must fit in).
      appender: hands out sequence ids.
      tokenizer: encodes string prompts (None: token ids only).
      eos_token_ids: stop ids added unless a request sets ``ignore_eos``.
      vocab_size: V; prompt ids must lie in [0, V).
      max_model_len, max_num_seqs, max_num_batched_tokens: the engine's limits.
      seed: seeds the requests that give no seed.
    """

    def __init__(
        self,
        alloc: BlockAllocator,
        appender: TokenAppender,
        *,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        seed: int,
    ):
        self.alloc = alloc
        self.appender = appender
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    def new_id(self, in_use) -> str:
        """The next automatic request id not in ``in_use`` (auto ids skip ids users gave)."""
        request_id = str(next(self._ids))
        while request_id in in_use:
            request_id = str(next(self._ids))
        return request_id

    def read_prompt(self, prompt: Any, name: str = "prompt") -> tuple[list[int], str | None]:
        """``(token ids, text or None)`` of a prompt: token ids as given (``int`` or numpy
        integers, or a 1-D integer array), or a string encoded by the tokenizer.

        Args:
          prompt: the prompt.
          name: how error messages name it (``"prompt"``, ``"prompts[2]"``).

        Raises:
          ValueError: naming ``name`` and the offending element: a string without a
            tokenizer, or anything but a string, a list/tuple of ids or a 1-D integer array
            (floats, bools, strings of digits, bytes and None are not token ids).
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{name} is a string, which needs a tokenizer; pass token ids instead"
                )
            return [int(t) for t in self.tokenizer.encode(prompt).ids], prompt
        if hasattr(prompt, "ndim") and hasattr(prompt, "dtype"):  # numpy / jax arrays
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise ValueError(
                    f"{name} is an array of shape {tuple(prompt.shape)} and dtype "
                    f"{prompt.dtype}: a prompt array must be 1-D of an integer dtype"
                )
            return np.asarray(prompt).astype(np.int64).tolist(), None
        if not isinstance(prompt, list | tuple | range):
            raise ValueError(f"{name}={_repr(prompt)} ({type(prompt).__name__}): {_PROMPT_HELP}")
        for i, t in enumerate(prompt):
            if not _is_token_id(t):
                raise ValueError(
                    f"{name}[{i}]={_repr(t)} ({type(t).__name__}) is not a token id: {_PROMPT_HELP}"
                )
        return [int(t) for t in prompt], None

    def make_request(
        self,
        prompt: tuple[list[int], str | None],
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        cache_salt: str | None,
    ) -> Request:
        """The request with its first sequence; finished with ``error`` set if it cannot be
        served (`unservable_reason`).

        Args:
          prompt: ``(token ids, text or None)``, as `read_prompt` returns it.
          params: the request's parameters.
          request_id: its id.
          cache_salt: its prefix-cache salt (a str or None).

        Raises:
          ValueError: a stop token id outside the vocabulary.
        """
        tokens, text = prompt
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stops:
            raise ValueError(
                f"stop_token_ids {bad_stops[:4]} must lie in [0, vocab_size={self.vocab_size}) "
                "(the model cannot emit other ids)"
            )
        req = Request(request_id, tokens, params, arrival=next(self._arrivals), prompt_text=text)
        req.salt = cache_salt
        req.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        if isinstance(params, BeamSearchParams):
            if 0 < self.max_model_len - len(tokens) < params.max_tokens:
                params = dataclasses.replace(params, max_tokens=self.max_model_len - len(tokens))
                req.params = params
            req.beam = beam.BeamState(params, len(tokens), req.stop_ids)
        seed = params.seed if isinstance(params, SamplingParams) else None
        if seed is None:
            seed = int(self._rng.integers(0, 2**31 - params.n if hasattr(params, "n") else 2**31))
        req.seqs = [Seq(self.appender.new_seq_id(), 0, list(tokens), len(tokens), seed)]
        error = self.unservable_reason(req)
        if error is not None:
            req.error = error
            req.seqs[0].finish_reason = "error"
            req.status = Status.FINISHED
        return req

    def unservable_reason(self, req: Request) -> str | None:
        """Why the engine cannot serve ``req`` (None if it can)."""
        n = len(req.prompt)
        V = self.vocab_size
        if n == 0:
            return "empty prompt: a request needs at least one prompt token"
        if n >= self.max_model_len:
            return f"prompt of {n} tokens must be shorter than max_model_len={self.max_model_len}"
        if min(req.prompt) < 0 or max(req.prompt) >= V:
            return f"prompt token ids must lie in [0, vocab_size={V})"
        if req.fan_out > self.max_num_seqs:
            return f"{req.fan_out} sequences exceed max_num_seqs={self.max_num_seqs}"
        if req.is_beam and req.fan_out > self.max_num_batched_tokens:
            return (
                f"beam_width={req.fan_out} exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens} (all beams decode in one step)"
            )
        C = self.alloc.page_size
        gen = min(req.params.max_tokens, self.max_model_len - n)
        # Full prompt pages are shared; each sequence owns the rest of its pages.
        need = n // C + req.fan_out * (math.ceil((n + gen) / C) - n // C)
        usable = self.alloc.num_pages - self.alloc.watermark_pages
        if need > usable:
            groups = getattr(self.alloc, "local_group", None)
            sizes = (
                f"num_pages={self.alloc.num_pages}" if groups is None
                else f"the tighter of two page groups: global {self.alloc.global_group.num_pages}"
                f" pages, local {groups.num_pages}"
            )  # fmt: skip
            return (
                f"cannot fit even alone: {n} prompt tokens + {gen} new tokens x {req.fan_out} "
                f"sequence(s) need up to {need} pages of {C} tokens; the pool has {usable} "
                f"({sizes}, minus the watermark)"
            )
        return None


def id_order(request_id: str):
    """Sort key: numeric ids in number order first, then the others by name."""
    return (0, int(request_id)) if request_id.isdigit() else (1, request_id)


def as_prompt_list(prompts: Any) -> list:
    """One prompt (a string, a list of ids, a 1-D array) as a list of one; a list of
    prompts (or a 2-D array, one prompt a row) as a list.

    Raises:
      ValueError: ``prompts`` is neither a prompt nor a list of prompts (e.g. ``5``,
        ``None``, bytes or a set).
    """
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "ndim") and hasattr(prompts, "dtype"):
        if prompts.ndim not in (1, 2):
            raise ValueError(
                f"prompts is an array of shape {tuple(prompts.shape)}: pass one prompt "
                "(1-D) or one prompt a row (2-D)"
            )
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if not isinstance(prompts, list | tuple | range):
        raise ValueError(
            f"prompts={_repr(prompts)} ({type(prompts).__name__}) must be a prompt or a list of "
            f"prompts: {_PROMPT_HELP}"
        )
    prompts = list(prompts)
    nested = (str, bytes, list, tuple, range, dict, set)
    if prompts and not any(isinstance(p, nested) or getattr(p, "ndim", 0) for p in prompts):
        return [prompts]  # ids (or scalars that `read_prompt` rejects): one prompt
    return prompts
