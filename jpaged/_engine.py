"""``jpaged.LLM``: the serving engine's user API (vLLM-shaped) and its step loop.

>>> import jpaged
>>> llm = jpaged.LLM("tests/checkpoints/llama2", page_size=8, num_pages=64, max_num_seqs=8,
...                  max_model_len=64)
>>> out = llm.generate([[5, 6, 7]], jpaged.SamplingParams(max_tokens=4, temperature=0.0))
>>> len(out[0].outputs[0].token_ids)
4

Errors: invalid ``SamplingParams``/``BeamSearchParams`` raise ``ValueError`` when built. A
request the engine cannot serve (empty prompt, a prompt of ``max_model_len`` tokens or
more, token ids outside the vocabulary, a request that cannot fit in the pool even alone)
does not raise: its output has ``finish_reason == "error"`` and ``error`` says why, and the
engine keeps serving the other requests.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged import _beam
from jpaged._allocator import BlockAllocator
from jpaged._cache import PagedKVCache, copy_pages, gather_pages, pages_for_budget, scatter_pages
from jpaged._errors import OutOfPagesError
from jpaged._sampling import BeamSearchParams, SamplingParams
from jpaged._scheduler import Request, Scheduler, Status
from jpaged._scheduler import Sequence as Seq
from jpaged._step import LoopBatch, Runner, SamplingArrays, bucket, build_step_batch, pad_to

Prompt = Sequence[int] | str


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


class LLM:
    """A paged-KV-cache LLM engine: continuous batching, sharing, prefix cache, preemption.

    Args:
      model: a local Hugging Face checkpoint directory, a jpaged model (a Flax NNX module
        following ``jpaged.models.PagedModel``, e.g. ``jpaged.models.LlamaForCausalLM``), or
        a ``jpaged.models.ModelConfig`` (with ``params``).
      params: with a ``ModelConfig``: the parameter arrays by name
        (``jpaged.models.param_shapes``); with a module: an ``nnx.State`` to load into it.
      page_size: C, tokens per page.
      num_pages: P, pages in the pool; default from ``kv_cache_memory``.
      kv_cache_memory: bytes for the pool (K and V); default 60% of the device memory left
        after loading the model (512 MiB where the backend reports none, e.g. CPU), capped at
        what ``max_num_seqs`` sequences of ``max_model_len`` tokens need.
      max_num_seqs: most sequences in one step.
      max_model_len: longest sequence (prompt + generated); default the model's
        ``max_position_embeddings``.
      max_num_batched_tokens: token budget per step (prompts beyond it are prefilled in
        chunks); default ``max(256, min(2048, max_model_len))``.
      enable_prefix_caching: reuse the cached pages of equal prompt prefixes.
      preemption_mode: "auto" (per request, cheaper of recompute and swap), "recompute"
        or "swap".
      swap_space: bytes of host memory for swapped-out pages.
      num_decode_steps: k, decode steps per device call when every scheduled sequence is
        decoding (a ``lax.while_loop`` over pages reserved ahead); 1 disables it.
      dtype: parameter dtype when loading a checkpoint (None: as stored).
      cache_dtype: K/V dtype (default: the model's embedding dtype).
      tokenizer: a ``tokenizers.Tokenizer`` (loaded from the checkpoint when None).
      eos_token_id: end-of-sequence id(s) (read from the checkpoint when None).
      watermark: fraction of the pool kept free at admission.
      seed: seeds requests that give no seed.
      debug: check the allocator's invariants after every step.
      swap_bytes_per_s, recompute_tokens_per_s: the cost model of preemption ("auto").
    """

    def __init__(
        self,
        model: Any,
        *,
        params: Any = None,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "auto",
        swap_space: int = 1 << 30,
        num_decode_steps: int = 8,
        dtype: Any = None,
        cache_dtype: Any = None,
        tokenizer: Any = None,
        eos_token_id: int | Sequence[int] | None = None,
        watermark: float = 0.01,
        seed: int = 0,
        debug: bool = False,
        swap_bytes_per_s: float = 16e9,
        recompute_tokens_per_s: float = 20e3,
    ):
        if isinstance(model, str | pathlib.Path):
            from jpaged.models import from_pretrained, load_tokenizer

            path = pathlib.Path(model)
            self.model = from_pretrained(path, dtype=dtype)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
            if eos_token_id is None:
                eos_token_id = _read_eos(path)
        else:
            self.model = _with_params(model, params)
        for name, v in (("page_size", page_size), ("max_num_seqs", max_num_seqs)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if not isinstance(num_decode_steps, int) or num_decode_steps < 1:
            raise ValueError(f"{num_decode_steps=} must be an int >= 1")
        self.tokenizer = tokenizer
        eos = [] if eos_token_id is None else np.atleast_1d(eos_token_id).tolist()
        self.eos_token_ids = frozenset(int(e) for e in eos)
        m = self.model
        cfg = getattr(m, "config", None)
        if max_model_len is None:
            max_model_len = int(getattr(cfg, "max_position_embeddings", 2048))
        self.max_model_len = int(max_model_len)
        self.page_size = C = page_size
        self.width = W = math.ceil(self.max_model_len / C)
        if cache_dtype is None:
            cache_dtype = _model_dtype(m)
        L, K, H = m.num_layers, m.num_kv_heads, m.head_dim
        if num_pages is None:
            budget = kv_cache_memory if kv_cache_memory is not None else _default_kv_bytes()
            num_pages = min(pages_for_budget(budget, L, K, C, H, cache_dtype), max_num_seqs * W)
        self.cache = PagedKVCache.create(L, K, int(num_pages), C, H, cache_dtype)
        bpp = self.cache.bytes_per_page
        self.alloc = BlockAllocator(
            int(num_pages), C, watermark=watermark,
            num_host_pages=int(swap_space // bpp), bytes_per_page=bpp,
        )  # fmt: skip
        self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(256, min(2048, self.max_model_len))
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.enable_prefix_caching = enable_prefix_caching
        self.num_decode_steps = num_decode_steps
        self.debug = debug
        self._swap_bps, self._recompute_tps = swap_bytes_per_s, recompute_tokens_per_s
        self._host_pages: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.scheduler = Scheduler(
            self.alloc,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            preemption_mode=preemption_mode,
            swap_out=self._swap_out,
            swap_in=self._swap_in,
            swap_cost=self._swap_cost,
            recompute_cost=self._recompute_cost,
            on_copies=self._apply_copies,
            on_admit=self._on_admit,
            swap_space_bytes=swap_space,
        )
        self.runner = Runner(m)
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._steps = self._device_calls = self._tokens_generated = 0
        self._failed_at_add: set[str] = set()
        self._loop_steps = 0  # decode steps run inside decode loops (they stop early)
        self._chain = None  # (scheduled rows, outputs) of a decode loop in flight
        self._timing = dict.fromkeys(("schedule_s", "step_s", "device_wait_s"), 0.0)

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for every prompt; returns one output per prompt, in order.

        Args:
          prompts: a prompt or a list of prompts (token-id lists, or strings with a tokenizer).
          sampling_params: one for all prompts or one per prompt (default ``SamplingParams()``).
          progress: show a progress bar (tqdm) over finished requests.
          cache_salt: prefix-cache salt of these requests (pages are shared only within a salt).
        """
        prompts = _as_prompt_list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = [params] * len(prompts) if not isinstance(params, Sequence) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = [
            self.add_request(p, sp, cache_salt=cache_salt)
            for p, sp in zip(prompts, params, strict=False)
        ]
        return self._run_to_completion(ids, progress)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        *,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Beam search (transformers' ``num_beams`` semantics); beams best first per prompt."""
        prompts = _as_prompt_list(prompts)
        ids = [self.add_request(p, params) for p in prompts]
        return self._run_to_completion(ids, progress)

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields a ``RequestOutput`` snapshot each time one of these requests progresses."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        ids = {self.add_request(p, params) for p in prompts}
        pending = set(ids)
        for rid in list(ids):
            if self._requests[rid].finished:
                pending.discard(rid)
                yield self._output(self._requests[rid])
        while pending:
            for out in self.step():
                if out.request_id in pending:
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queues a request and returns its id.

        A request that cannot be served is finished at once with finish reason "error"
        (see the module docstring); its output is available from ``step``/``generate``.

        Raises:
          ValueError: ``params`` is not a ``SamplingParams``/``BeamSearchParams``, a string
            prompt without a tokenizer, or a duplicate ``request_id``.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise ValueError(f"params must be SamplingParams or BeamSearchParams, got {params!r}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"{request_id=} is already in use")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a string prompt needs a tokenizer; pass token ids instead")
            text, prompt = prompt, self.tokenizer.encode(prompt).ids
        tokens = [int(t) for t in prompt]
        req = Request(request_id, tokens, params, arrival=len(self._requests), prompt_text=text)
        req.salt = cache_salt
        self._requests[request_id] = req
        if isinstance(params, BeamSearchParams):
            if 0 < self.max_model_len - len(tokens) < params.max_tokens:
                params = dataclasses.replace(params, max_tokens=self.max_model_len - len(tokens))
                req.params = params
            stops = set(params.stop_token_ids) | (
                set() if params.ignore_eos else self.eos_token_ids
            )
            req.beam = _beam.BeamState(params, len(tokens), frozenset(stops))
        seed = params.seed if isinstance(params, SamplingParams) else None
        if seed is None:
            seed = int(self._rng.integers(0, 2**31 - params.n if hasattr(params, "n") else 2**31))
        req.seqs = [Seq(next(self._seq_ids), 0, list(tokens), len(tokens), seed)]
        error = self._validate(req)
        if error is not None:
            req.error = error
            req.seqs[0].finish_reason = "error"
            req.status = Status.FINISHED
            self._failed_at_add.add(request_id)
        else:
            self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stops a request and frees everything it holds (finish reason "abort")."""
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown {request_id=}")
        if not req.finished:
            self.scheduler.abort(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_output(self, request_id: str) -> RequestOutput:
        return self._output(self._requests[request_id])

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step (one device call); returns the requests that progressed."""
        touched = self._step()
        return [self._output(self._requests[rid]) for rid in sorted(touched, key=_id_order)]

    def _step(self) -> set[str]:
        """One step; returns the ids of the requests it touched (progressed, preempted, done)."""
        if self._chain is not None:  # a decode loop is in flight: no scheduling, just advance
            t1 = time.perf_counter()
            touched = {it.request.request_id for it in self._chain[0]}
            self._steps += 1
            self._advance_chain()
            self._timing["step_s"] += time.perf_counter() - t1
            return self._after_step(touched)
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        self._timing["schedule_s"] += t1 - t0
        touched = {s.request.request_id for s in sched.scheduled}
        touched |= {rid for rid, _ in sched.preempted}
        if sched.scheduled:
            self._steps += 1
            if self._can_loop(sched):
                self._run_loop(sched)
            else:
                self._run_step(sched)
        self._timing["step_s"] += time.perf_counter() - t1
        return self._after_step(touched)

    def _after_step(self, touched: set[str]) -> set[str]:
        if self.debug:
            self.alloc.check_invariants()
        # Requests that finished or failed this step, scheduled or not (errors, aborts).
        touched |= {r.request_id for r in self.scheduler.take_finished()}
        touched |= self._failed_at_add
        self._failed_at_add = set()
        return touched

    def warmup(self, *, progress: bool = False) -> int:
        """Compiles every step program this engine can meet, on inputs that write nothing.

        Covers the decode step and the decode loop for every sequence bucket and the ragged
        step for every (sequence, token) bucket pair; beam search's top-k variant compiles on
        first use. After this, serving compiles nothing (``stats()["recompiles"]`` is fixed).

        Returns:
          The number of program shapes run.
        """
        W = self.width
        top = max(self.max_num_batched_tokens, 16)
        seq_buckets = sorted({self._seq_bucket(n) for n in range(1, self.max_num_seqs + 1)})
        tok_buckets = sorted({bucket(t, 16, top) for t in range(1, top + 1)})
        shapes = [("decode", B, B) for B in seq_buckets]
        if self.num_decode_steps > 1:
            shapes += [("loop", B, 0) for B in seq_buckets]
        shapes += [("ragged", B, T) for B in seq_buckets for T in tok_buckets]
        if progress:
            from tqdm.auto import tqdm

            shapes_iter = tqdm(shapes, desc="warmup", unit="program")
        else:
            shapes_iter = shapes
        for kind, B, T in shapes_iter:
            zeros = np.zeros((B, 5))
            if kind == "loop":
                batch = LoopBatch(
                    tokens=np.zeros(B, np.int32), lens=np.zeros(B, np.int32),
                    block_tables=np.zeros((B, W), np.int32), active=np.zeros(B, bool),
                    max_steps=np.zeros(B, np.int32), min_steps=np.zeros(B, np.int32),
                    stop_ids=np.full((B, 4), -1, np.int32), sampling=_sampling_arrays(zeros, B),
                )  # fmt: skip
                self.cache = self.runner.decode_loop(
                    self.cache, batch, num_steps=self.num_decode_steps
                )[0]
                continue
            batch = build_step_batch(
                [], [np.zeros(0, np.int32)], [], [], _sampling_arrays(zeros, B),
                width=W, num_rows=B, num_tokens=T,
            )  # fmt: skip
            self.cache = self.runner.step(self.cache, batch, decode=kind == "decode")[0]
        jax.block_until_ready(self.cache)
        return len(shapes)

    def stats(self) -> dict[str, Any]:
        """Pool, sharing, prefix-cache, preemption and compile counters."""
        s = self.alloc.stats()
        c = self.scheduler.counters
        return {
            "pages_total": s.total_pages,
            "pages_free": s.free_pages,
            "pages_used": s.used_pages,
            "pages_shared": s.shared_pages,
            "pages_cached": s.cached_pages,
            "pages_evictable": s.evictable_pages,
            "kv_utilisation": s.utilisation,
            "live_tokens": s.live_tokens,
            "logical_tokens": s.logical_tokens,
            "prefix_queries": s.prefix_queries,
            "prefix_hit_tokens": s.prefix_hit_tokens,
            "prefix_hit_rate": s.prefix_hit_tokens / max(s.prefix_query_tokens, 1),
            "preemptions_recompute": c["preemptions_recompute"],
            "preemptions_swap": c["preemptions_swap"],
            "cow_copies": s.cow_copies,
            "swapped_out_bytes": s.swapped_out_bytes,
            "swapped_in_bytes": s.swapped_in_bytes,
            "recompiles": self.runner.num_compiles,
            "steps": self._steps,
            "device_calls": self._device_calls,
            "loop_decode_steps": self._loop_steps,
            "tokens_generated": self._tokens_generated,
            # Host time scheduling, host + device time in steps, and of that the time spent
            # waiting for device results (so host work per step = step_s - device_wait_s).
            **{f"time_{k}": v for k, v in self._timing.items()},
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }

    @property
    def preemption_events(self):
        return list(self.scheduler.events)

    # ------------------------------------------------------------------ requests

    def _validate(self, req: Request) -> str | None:
        n = len(req.prompt)
        V = self.model.vocab_size
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
        C = self.page_size
        gen = min(req.params.max_tokens, self.max_model_len - n)
        # Full prompt pages are shared; each sequence owns the rest of its pages.
        need = n // C + req.fan_out * (math.ceil((n + gen) / C) - n // C)
        usable = self.alloc.num_pages - self.alloc.watermark_pages
        if need > usable:
            return (
                f"cannot fit even alone: {n} prompt tokens + {gen} new tokens x {req.fan_out} "
                f"sequence(s) need up to {need} pages of {C} tokens; the pool has {usable} "
                f"(num_pages={self.alloc.num_pages} minus the watermark)"
            )
        return None

    def _run_to_completion(self, ids: list[str], progress: bool) -> list[RequestOutput]:
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        pending = {rid for rid in ids if not self._requests[rid].finished}
        if bar is not None:
            bar.update(len(ids) - len(pending))
        while pending:
            if not self.scheduler.has_unfinished():
                raise RuntimeError("engine idle with unfinished requests (scheduler bug)")
            for rid in self._step() & pending:
                if self._requests[rid].finished:
                    pending.discard(rid)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [self._output(self._requests[rid]) for rid in ids]

    def _output(self, req: Request) -> RequestOutput:
        if req.is_beam and req.beam is not None and req.beam.done:
            outs = [
                CompletionOutput(i, h.tokens, self._decode(h.tokens), "stop" if (
                    h.tokens and h.tokens[-1] in req.beam.stop_ids) else "length",
                    float("nan"), score=h.score)
                for i, h in enumerate(_beam.results(req.beam))
            ]  # fmt: skip
        else:
            outs = [
                CompletionOutput(s.index, s.output_ids, self._decode(s.output_ids),
                                 s.finish_reason, s.cumulative_logprob)
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

    def _decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    # ------------------------------------------------------------------ pages (callbacks)

    def _on_admit(self, req: Request) -> None:
        """Creates the request's sequences in the allocator (all or nothing)."""
        done = []
        # After a recompute a forked group allocates its first sequence for the prompt only;
        # the others are forked from it once the prompt is computed (`_refork`).
        seqs = req.live_seqs()[:1] if req.refork else req.live_seqs()
        try:
            for seq in seqs:
                tokens = req.prompt if req.refork else seq.tokens
                seq.num_committed = 0
                if self.enable_prefix_caching:
                    cached = self.alloc.allocate_with_prefix(seq.seq_id, tokens, req.salt)
                    seq.num_computed = cached
                    if req.num_cached_tokens is None:
                        req.num_cached_tokens = cached
                else:
                    self.alloc.allocate(seq.seq_id, len(tokens))
                    seq.num_computed = 0
                done.append(seq)
        except OutOfPagesError:
            for seq in done:
                self.alloc.free(seq.seq_id)
                seq.num_computed = 0
            raise

    def _apply_copies(self, pairs: list[tuple[int, int]]) -> None:
        M = bucket(len(pairs), 8, 1 << 30)
        arr = pad_to(np.asarray(pairs, np.int32).reshape(-1, 2), M, -1)
        self.cache = copy_pages(self.cache, arr, validate=False)

    def _group_ids(self, req: Request) -> list[int]:
        return [s.seq_id for s in req.live_seqs()]

    def _swap_cost(self, req: Request) -> tuple[int, float]:
        ids = self._group_ids(req)
        if not ids or self.alloc.num_host_pages == 0 or not self.alloc.can_swap_out(ids):
            return 1 << 62, float("inf")
        pages = {p for i in ids for p in self.alloc.block_table(i)[: self._held_pages(i)]}
        nbytes = len(pages) * self.cache.bytes_per_page
        return nbytes, 2 * nbytes / self._swap_bps

    def _held_pages(self, seq_id: int) -> int:
        return math.ceil(self.alloc.num_tokens(seq_id) / self.page_size)

    def _recompute_cost(self, req: Request) -> tuple[int, float]:
        tokens = sum(s.num_computed for s in req.live_seqs())
        return tokens, tokens / self._recompute_tps

    def _swap_out(self, req: Request) -> int:
        pairs = self.alloc.swap_out(self._group_ids(req))
        if pairs:
            dev = np.asarray([p for p, _ in pairs], np.int32)
            M = bucket(len(dev), 8, 1 << 30)
            k, v = gather_pages(self.cache, pad_to(dev, M, -1), validate=False)
            k, v = np.asarray(k), np.asarray(v)
            for i, (_, slot) in enumerate(pairs):
                self._host_pages[slot] = (k[:, :, i], v[:, :, i])
        req.swapped = {"bytes": 0}
        return len(pairs) * self.cache.bytes_per_page

    def _swap_in(self, req: Request) -> None:
        ids = self._group_ids(req)
        pages = req.swapped["bytes"] // self.cache.bytes_per_page
        running = self.scheduler.running
        # Headroom of one page per sequence that will run, so the next decode step does not
        # preempt it right back (swap ping-pong when the pool is nearly full).
        headroom = sum(len(r.live_seqs()) for r in running) + len(ids) if running else 0
        if not self.alloc.can_swap_in(ids) or self.alloc.num_free_pages - pages < headroom:
            raise OutOfPagesError(f"swap_in of request {req.request_id!r} does not fit yet")
        pairs = self.alloc.swap_in(ids)
        if pairs:
            M = bucket(len(pairs), 8, 1 << 30)
            dst = pad_to(np.asarray([d for _, d in pairs], np.int32), M, -1)
            k = np.stack([self._host_pages[s][0] for s, _ in pairs], axis=2)
            v = np.stack([self._host_pages[s][1] for s, _ in pairs], axis=2)
            pad = [(0, 0), (0, 0), (0, M - len(pairs)), (0, 0), (0, 0)]
            k, v = np.pad(k, pad), np.pad(v, pad)
            self.cache = scatter_pages(self.cache, dst, k, v, validate=False)
            for s, _ in pairs:
                del self._host_pages[s]

    # ------------------------------------------------------------------ the step

    def _seq_bucket(self, n: int) -> int:
        return bucket(n, 8, self.max_num_seqs)

    def _sampling_row(self, req: Request, seq: Seq, seed: int) -> tuple:
        p = req.params
        if req.is_beam:
            return (0.0, 0, 1.0, 0, seq.num_tokens)
        return (p.temperature, p.top_k, p.top_p, seed, seq.num_tokens)

    def _run_step(self, sched) -> None:
        items = sched.scheduled
        rows = []  # (item index, completion index) of each sampled row
        for b, it in enumerate(items):
            if it.samples:
                req = it.request
                fan = 1 if (req.forked or req.is_beam) else req.fan_out
                rows.extend((b, i) for i in range(fan))
        samp = [self._sampling_row(items[b].request, items[b].seq, items[b].seq.seed + i)
                for b, i in rows]  # fmt: skip
        decode = sched.decode_only
        Bp = self._seq_bucket(max(len(items), len(rows)))
        batch = build_step_batch(
            [(it.seq.tokens, it.seq.num_computed, it.num_new) for it in items],
            [self.alloc.slots(it.seq.seq_id, it.seq.num_computed, it.num_new) for it in items],
            [self.alloc.block_table(it.seq.seq_id) for it in items],
            [b for b, _ in rows],
            _sampling_arrays(np.asarray(samp, np.float64), Bp),
            width=self.width,
            num_rows=Bp,
            num_tokens=Bp if decode else bucket(sched.num_tokens, 16,
                                                max(self.max_num_batched_tokens, 16)),
        )  # fmt: skip
        num_top = 0
        if any(it.request.is_beam for it in items):
            num_top = bucket(2 * max(it.request.fan_out for it in items if it.request.is_beam),
                             8, 1 << 30)  # fmt: skip
        self.cache, tok_R, lp_R, top = self.runner.step(
            self.cache, batch, decode=decode, num_top=num_top
        )
        self._device_calls += 1
        for x in (tok_R, lp_R) if top is None else (tok_R, lp_R, *top):
            x.copy_to_host_async()
        # While the device runs: book-keeping that needs no sampled token (prefix-cache
        # hashing, re-forks). K/V of the scheduled tokens are in the cache once it finishes,
        # and every later device call is ordered after this one.
        for it in items:
            it.seq.num_computed += it.num_new
            self._commit_pages(it.request, it.seq)
            if it.request.refork and it.seq.num_computed == len(it.request.prompt):
                self._refork(it.request, it.seq)
        t = time.perf_counter()
        tok_R, lp_R = np.asarray(tok_R), np.asarray(lp_R)
        top = None if top is None else (np.asarray(top[0]), np.asarray(top[1]))
        self._timing["device_wait_s"] += time.perf_counter() - t
        by_item: dict[int, list[int]] = {}
        for r, (b, _) in enumerate(rows):
            by_item.setdefault(b, []).append(r)
        beams: dict[str, list[tuple[Seq, int]]] = {}
        for b, rs in by_item.items():
            it = items[b]
            req = it.request
            if req.finished:
                continue
            if req.is_beam:
                beams.setdefault(req.request_id, []).append((it.seq, rs[0]))
                continue
            targets = [it.seq]
            if len(rs) > 1:  # n > 1: the prompt is done; fork it into the n completions
                targets += [self._fork(req, it.seq, i, it.seq.seed + i) for i in range(1, len(rs))]
                req.forked = True
            for seq, r in zip(targets, rs, strict=True):
                self._append(req, seq, int(tok_R[r]), float(lp_R[r]))
        for rid, entries in beams.items():
            self._beam_step(self._requests[rid], entries, top)

    def _refork(self, req: Request, seq0: Seq) -> None:
        """The recomputed prompt is in ``seq0``'s pages: the group's other sequences share them
        again (each then recomputes its own generated tokens)."""
        for seq in req.live_seqs()[1:]:
            self.alloc.fork(seq0.seq_id, seq.seq_id)
            seq.num_computed, seq.num_committed = seq0.num_computed, seq0.num_committed
        req.refork = False

    def _fork(self, req: Request, parent: Seq, index: int, seed: int) -> Seq:
        """A new sequence sharing every page of ``parent`` (refcounts + 1, no copy)."""
        child = Seq(next(self._seq_ids), index, list(parent.tokens), parent.num_prompt, seed,
                    parent.num_computed, cumulative_logprob=parent.cumulative_logprob,
                    num_committed=parent.num_committed)  # fmt: skip
        self.alloc.fork(parent.seq_id, child.seq_id)
        req.seqs.append(child)
        return child

    def _append(self, req: Request, seq: Seq, token: int, lp: float) -> None:
        seq.tokens.append(token)
        seq.cumulative_logprob += lp
        self._tokens_generated += 1
        p = req.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        reason = None
        if token in stops and seq.num_generated >= p.min_tokens:
            reason = "stop"
        elif seq.num_generated >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish_seq(req, seq, reason)

    def _commit_pages(self, req: Request, seq: Seq) -> None:
        """Registers newly computed full pages in the prefix cache (only on a page boundary)."""
        full = seq.num_computed // self.page_size * self.page_size
        if not self.enable_prefix_caching or full <= seq.num_committed or seq.finished:
            return
        self.alloc.commit_full_pages(seq.seq_id, seq.tokens[:full], req.salt)
        seq.num_committed = full

    def _beam_step(self, req: Request, entries: list[tuple[Seq, int]], top) -> None:
        lp_RK, ids_RK = top
        seqs = [s for s, _ in entries]
        rows = [r for _, r in entries]
        choices = _beam.select(
            req.beam,
            [s.output_ids for s in seqs],
            np.asarray([s.cumulative_logprob for s in seqs], np.float64),
            lp_RK[rows],
            ids_RK[rows],
        )
        req.forked = True
        if not choices:
            for s in list(req.seqs):
                self.scheduler.finish_seq(req, s, "stop")
            return
        used: set[int] = set()
        new_seqs = []
        for j, ch in enumerate(choices):
            parent = seqs[ch.parent]
            if ch.parent not in used:
                used.add(ch.parent)
                child = parent
            else:
                child = self._fork(req, parent, j, parent.seed)
            new_seqs.append((child, ch))
        for k, s in enumerate(seqs):
            if k not in used:
                self.scheduler.drop_seq(req, s)
        req.seqs = []
        for j, (child, ch) in enumerate(new_seqs):
            child.index = j
            child.tokens.append(ch.token)
            child.cumulative_logprob = ch.score
            req.seqs.append(child)
            self._tokens_generated += 1

    # ------------------------------------------------------------------ multi-step decode

    def _can_loop(self, sched) -> bool:
        # Waiting requests that were not admitted this step (no pages or seats) wait for the
        # loop to end: at most k - 1 steps later than with single steps.
        if self.num_decode_steps <= 1 or not sched.decode_only:
            return False
        return all(
            it.samples and not it.request.is_beam and (it.request.forked or it.request.fan_out == 1)
            for it in sched.scheduled
        )

    def _loop_limits(self, items) -> list[int]:
        """Tokens each row may still generate (``max_tokens`` and ``max_model_len``)."""
        return [
            max(1, min(it.request.params.max_tokens - it.seq.num_generated,
                       self.max_model_len - it.seq.num_tokens))
            for it in items
        ]  # fmt: skip

    def _reserve(self, items, ahead: list[int]) -> bool:
        """Makes positions ``[num_computed, num_computed + ahead)`` of each row exist and be
        private (lookahead); False if the pool is short (the reservations made stay, and are
        released by the truncate at the end of the loop chain)."""
        try:
            for it, n in zip(items, ahead, strict=True):
                seq = it.seq
                if seq.finished:
                    continue
                extra = seq.num_computed + n - self.alloc.num_tokens(seq.seq_id)
                copies = self.alloc.reserve(seq.seq_id, max(extra, 0))
                if copies:
                    self._apply_copies(copies)
        except OutOfPagesError:
            return False
        return True

    def _tables(self, items, Bp: int) -> np.ndarray:
        table_BW = np.zeros((Bp, self.width), np.int32)
        for b, it in enumerate(items):
            if not it.seq.finished:
                table = self.alloc.block_table(it.seq.seq_id)[: self.width]
                table_BW[b, : len(table)] = table
        return table_BW

    def _run_loop(self, sched) -> None:
        """Starts a chain of decode loops (each up to k steps on device) over ``sched``."""
        items = sched.scheduled
        k = self.num_decode_steps
        limits = self._loop_limits(items)
        if not self._reserve(items, [min(k, lim) for lim in limits]):
            for it in items:
                self.alloc.truncate(it.seq.seq_id, self.alloc.num_tokens(it.seq.seq_id))
            return self._run_step(sched)
        B = len(items)
        Bp = self._seq_bucket(B)
        stop_lists = []
        for it in items:
            p = it.request.params
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            stop_lists.append(sorted(stops))
        S = bucket(max(1, max(len(s) for s in stop_lists)), 4, 1 << 20)
        stop_ids = np.full((Bp, S), -1, np.int32)
        for b, s in enumerate(stop_lists):
            stop_ids[b, : len(s)] = s
        samp = np.asarray([self._sampling_row(it.request, it.seq, it.seq.seed) for it in items])
        min_steps = [max(it.request.params.min_tokens - it.seq.num_generated, 0) for it in items]
        batch = LoopBatch(
            tokens=pad_to(np.asarray([it.seq.tokens[-1] for it in items], np.int32), Bp, 0),
            lens=pad_to(np.asarray([it.seq.num_computed for it in items], np.int32), Bp, 0),
            block_tables=self._tables(items, Bp),
            active=pad_to(np.ones(B, bool), Bp, False),
            max_steps=pad_to(np.asarray(limits, np.int32), Bp, 0),
            min_steps=pad_to(np.asarray(min_steps, np.int32), Bp, 0),
            stop_ids=stop_ids,
            sampling=_sampling_arrays(samp, Bp),
        )
        # Processed by the next `step()`, which first dispatches the loop after it: every
        # step makes at most one device call, and host work overlaps the loop in flight.
        self._chain = (items, self._dispatch_loop(batch))

    def _dispatch_loop(self, batch: LoopBatch):
        self.cache, out_KB, lp_KB, ran, carry = self.runner.decode_loop(
            self.cache, batch, num_steps=self.num_decode_steps
        )
        self._device_calls += 1
        for x in (out_KB, lp_KB, ran):
            x.copy_to_host_async()
        return out_KB, lp_KB, ran, carry

    def _may_chain(self, items) -> bool:
        live = sum(not it.seq.finished for it in items)
        return not self.scheduler.waiting and 2 * live >= len(items)

    def _advance_chain(self) -> None:
        """Processes the loop in flight; first, when nothing waits, dispatches the next loop
        from its device-side carry, so the host work below overlaps the device."""
        items, (out_KB, lp_KB, ran, carry) = self._chain
        k = self.num_decode_steps
        nxt = None
        limits = self._loop_limits(items)  # before this loop's tokens: upper bounds
        # Chain only if some row may still be running after this loop (else the next loop
        # would run zero steps). The loop in flight writes at most k positions per row, the
        # next one k more.
        if (
            any(lim > k for it, lim in zip(items, limits, strict=True) if not it.seq.finished)
            and self._may_chain(items)
            and self._reserve(items, [min(2 * k, lim) for lim in limits])
        ):
            tables = self._tables(items, carry.block_tables.shape[0])
            nxt = self._dispatch_loop(dataclasses.replace(carry, block_tables=tables))
        t = time.perf_counter()
        out_KB, lp_KB = np.asarray(out_KB), np.asarray(lp_KB)
        self._loop_steps += int(ran)
        self._timing["device_wait_s"] += time.perf_counter() - t
        for b, it in enumerate(items):
            seq, req = it.seq, it.request
            for step in range(k):
                tok = int(out_KB[step, b])
                if tok < 0 or seq.finished:
                    break
                seq.num_computed += 1
                self._append(req, seq, tok, float(lp_KB[step, b]))
        # The allocator's lengths catch up with the cache (inside the reservation: nothing is
        # allocated), so stats and the prefix cache are current even mid-chain.
        chained = nxt is not None and any(not it.seq.finished for it in items)
        for it in items:
            seq = it.seq
            if not seq.finished:
                held = self.alloc.num_tokens(seq.seq_id)
                if seq.num_computed > held:
                    copies = self.alloc.append_slots(seq.seq_id, seq.num_computed - held)
                    if copies:  # never within a reservation, unless forked since: not here
                        raise AssertionError(
                            f"unexpected copy-on-write in a decode chain: {copies}"
                        )
                if not chained:  # end of the chain: release the unused reservation
                    self.alloc.truncate(seq.seq_id, seq.num_computed)
                self._commit_pages(it.request, seq)
        self._chain = (items, nxt) if chained else None


def _with_params(model: Any, params: Any) -> Any:
    from flax import nnx

    from jpaged.models import LlamaForCausalLM, ModelConfig

    if isinstance(model, ModelConfig):
        if params is None:
            raise ValueError("a ModelConfig needs params= (parameter arrays by name)")
        return LlamaForCausalLM(model, params=params)
    if params is not None:
        if not isinstance(model, nnx.Module):
            raise ValueError(f"params= needs an nnx.Module model, got {type(model).__name__}")
        nnx.update(model, params)
    return model


def _default_kv_bytes() -> int:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # backends without memory stats
        stats = {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    if not limit:
        return 512 << 20
    return max(int(0.6 * (limit - used)), 1 << 20)


def _id_order(request_id: str):
    return (0, int(request_id)) if request_id.isdigit() else (1, request_id)


def _sampling_arrays(samp: np.ndarray, R: int) -> SamplingArrays:
    samp = np.asarray(samp, np.float64).reshape(-1, 5)
    return SamplingArrays(
        temperature=pad_to(samp[:, 0].astype(np.float32), R, 0.0),
        top_k=pad_to(samp[:, 1].astype(np.int32), R, 0),
        top_p=pad_to(samp[:, 2].astype(np.float32), R, 1.0),
        seed=pad_to(samp[:, 3].astype(np.int32), R, 0),
        position=pad_to(samp[:, 4].astype(np.int32), R, 0),
    )


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int | np.integer):
        return [prompts]
    return prompts


def _model_dtype(model) -> Any:
    leaves = jax.tree.leaves(getattr(model, "embed_VD", None) or model)
    for leaf in leaves:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.dtype
    return jnp.float32


def _read_eos(path: pathlib.Path) -> list[int] | None:
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return list(np.atleast_1d(eos).astype(int))
    return None
