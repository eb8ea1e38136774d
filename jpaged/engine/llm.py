"""``jpaged.LLM``: the serving engine's user API (vLLM-shaped) and its step loop.

The facade builds the parts and drives them, one engine step at a time: the `Scheduler`
plans (`StepPlan`), the `KVManager` runs the plan's page operations, and the plan runs as
one device call (`StepExecutor`) or starts a chain of decode loops (`DecodeChain`); the
`TokenAppender` applies the sampled tokens.

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

import collections
import dataclasses
import itertools
import math
import pathlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jpaged.engine import beam
from jpaged.engine.appender import TokenAppender
from jpaged.engine.counters import Counters
from jpaged.engine.decode_chain import DecodeChain
from jpaged.engine.kv_manager import KVManager
from jpaged.engine.model_setup import default_kv_bytes, model_dtype, read_eos, with_params
from jpaged.engine.outputs import RequestOutput, request_output
from jpaged.engine.requests import Request, Status
from jpaged.engine.requests import Sequence as Seq
from jpaged.engine.runner import Runner, default_compiler_options
from jpaged.engine.sampling import BeamSearchParams, SamplingParams
from jpaged.engine.scheduler import Scheduler
from jpaged.engine.step import StepExecutor
from jpaged.engine.warmup import warmup_programs
from jpaged.kv.allocator import BlockAllocator
from jpaged.kv.cache import PagedKVCache, pages_for_budget

__all__ = ["LLM"]

Prompt = Sequence[int] | str


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
        decoding (a ``lax.fori_loop`` over pages reserved ahead); 1 disables it.
      dtype: parameter dtype when loading a checkpoint (None: as stored).
      cache_dtype: K/V dtype (default: the model's embedding dtype).
      tokenizer: a ``tokenizers.Tokenizer`` (loaded from the checkpoint when None).
      eos_token_id: end-of-sequence id(s) (read from the checkpoint when None).
      watermark: fraction of the pool kept free at admission.
      seed: seeds requests that give no seed.
      debug: check the allocator's invariants after every step.
      swap_bytes_per_s, recompute_tokens_per_s: the cost model of preemption ("auto").
      compiler_options: XLA options of the step programs (``jax.jit``'s ``compiler_options``);
        None: ``default_compiler_options()`` for the default backend.
      keep_finished: finished requests whose outputs ``get_output`` still returns; older
        ones are dropped (a long-running server's memory stays bounded). Unfinished requests
        are always kept, and ``generate``/``stream`` return every output they started.

    Attributes:
      model: the model served.
      alloc: the host `jpaged.BlockAllocator`.
      cache: the device `jpaged.PagedKVCache` (held by ``kv``).
      kv: the `KVManager` (allocator, pool, host swap space).
      scheduler: the `Scheduler`.
      runner: the `Runner` of the jitted step programs.
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
        compiler_options: dict[str, Any] | None = None,
        keep_finished: int = 4096,
    ):
        if isinstance(model, str | pathlib.Path):
            from jpaged.models import from_pretrained, load_tokenizer

            path = pathlib.Path(model)
            self.model = from_pretrained(path, dtype=dtype)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
            if eos_token_id is None:
                eos_token_id = read_eos(path)
        else:
            self.model = with_params(model, params)
        for name, v in (("page_size", page_size), ("max_num_seqs", max_num_seqs)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if not isinstance(num_decode_steps, int) or num_decode_steps < 1:
            raise ValueError(f"{num_decode_steps=} must be an int >= 1")
        if not isinstance(keep_finished, int) or keep_finished < 0:
            raise ValueError(f"{keep_finished=} must be an int >= 0")
        for name, v in (
            ("max_model_len", max_model_len),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if v is not None and (not isinstance(v, int | np.integer) or v < 1):
                raise ValueError(f"{name}={v!r} must be None or an int >= 1")
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
            cache_dtype = model_dtype(m)
        L, K, H = m.num_layers, m.num_kv_heads, m.head_dim
        if num_pages is None:
            budget = kv_cache_memory if kv_cache_memory is not None else default_kv_bytes()
            num_pages = min(pages_for_budget(budget, L, K, C, H, cache_dtype), max_num_seqs * W)
        cache = PagedKVCache.create(L, K, int(num_pages), C, H, cache_dtype)
        bpp = cache.bytes_per_page
        self.alloc = BlockAllocator(
            int(num_pages), C, watermark=watermark,
            num_host_pages=int(swap_space // bpp), bytes_per_page=bpp,
        )  # fmt: skip
        self.kv = KVManager(self.alloc, cache)
        self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(256, min(2048, self.max_model_len))
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.enable_prefix_caching = enable_prefix_caching
        self.num_decode_steps = num_decode_steps
        self.debug = debug
        self.scheduler = Scheduler(
            self.alloc,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            preemption_mode=preemption_mode,
            enable_prefix_caching=enable_prefix_caching,
            swap_bytes_per_s=swap_bytes_per_s,
            recompute_tokens_per_s=recompute_tokens_per_s,
            swap_space_bytes=swap_space,
            # A decode loop reserves k positions ahead (a chain, 2k: the loop in flight and
            # the next one; `DecodeChain`); admission keeps the pages of one loop free.
            lookahead_tokens=self.num_decode_steps if self.num_decode_steps > 1 else 0,
        )
        if compiler_options is None:
            compiler_options = default_compiler_options()
        self.runner = Runner(m, compiler_options=compiler_options)
        self.counters = Counters()
        self.appender = TokenAppender(
            self.alloc, self.scheduler, self.counters,
            max_model_len=self.max_model_len, enable_prefix_caching=enable_prefix_caching,
        )  # fmt: skip
        self.executor = StepExecutor(
            self.kv, self.runner, self.appender, self.counters, width=W,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
        )  # fmt: skip
        self.chain = DecodeChain(
            self.kv, self.runner, self.scheduler, self.appender, self.counters,
            num_decode_steps=num_decode_steps, max_model_len=self.max_model_len, width=W,
            seq_bucket=self.executor.seq_bucket,
            # On GPU a loop's dispatching call can last until the loop has run: it is made
            # from a worker thread (elsewhere dispatch is asynchronous already, and
            # thread-local JAX settings would not follow the call).
            threaded_dispatch=jax.default_backend() == "gpu",
        )  # fmt: skip
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self.keep_finished = keep_finished
        self._finished_ids: collections.deque[str] = collections.deque()  # oldest first
        self._arrivals = itertools.count()
        self._failed_at_add: set[str] = set()

    @property
    def cache(self) -> PagedKVCache:
        """The K/V pool (``kv.cache``: waits for a decode loop being dispatched)."""
        return self.kv.cache

    @cache.setter
    def cache(self, value: PagedKVCache) -> None:
        self.kv.cache = value

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
        ids = self._add_all((p, sp, cache_salt) for p, sp in zip(prompts, params, strict=False))
        return self._run_to_completion(ids, progress)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        *,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Beam search (transformers' ``num_beams`` semantics); beams best first per prompt.

        Raises:
          ValueError: ``params`` is not a ``BeamSearchParams``.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {params!r}")
        prompts = _as_prompt_list(prompts)
        ids = self._add_all((p, params, None) for p in prompts)
        return self._run_to_completion(ids, progress)

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields a ``RequestOutput`` snapshot each time one of these requests progresses.

        Closing the generator early (``break``, ``close()``) aborts its unfinished requests.
        """
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        ids = self._add_all((p, params, None) for p in prompts)
        pending = set(ids)
        try:
            for rid in ids:
                if self._requests[rid].finished:
                    pending.discard(rid)
                    yield self._output(self._requests[rid])
            while pending:
                for out in self.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            self._abort_all(pending)

    def _add_all(self, requests) -> list[str]:
        """Adds ``(prompt, params, cache_salt)`` requests; on an error aborts those added."""
        ids: list[str] = []
        try:
            for prompt, params, salt in requests:
                ids.append(self.add_request(prompt, params, cache_salt=salt))
        except BaseException:
            self._abort_all(ids)
            raise
        return ids

    def _abort_all(self, ids) -> None:
        for rid in ids:
            if not self._requests[rid].finished:
                self.abort(rid)

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
        if request_id is None:  # auto ids skip ids users gave
            request_id = str(next(self._ids))
            while request_id in self._requests:
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"{request_id=} is already in use")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a string prompt needs a tokenizer; pass token ids instead")
            text, prompt = prompt, self.tokenizer.encode(prompt).ids
        tokens = [int(t) for t in prompt]
        req = Request(request_id, tokens, params, arrival=next(self._arrivals), prompt_text=text)
        req.salt = cache_salt
        req.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        self._requests[request_id] = req
        if isinstance(params, BeamSearchParams):
            if 0 < self.max_model_len - len(tokens) < params.max_tokens:
                params = dataclasses.replace(params, max_tokens=self.max_model_len - len(tokens))
                req.params = params
            req.beam = beam.BeamState(params, len(tokens), req.stop_ids)
        seed = params.seed if isinstance(params, SamplingParams) else None
        if seed is None:
            seed = int(self._rng.integers(0, 2**31 - params.n if hasattr(params, "n") else 2**31))
        req.seqs = [Seq(self.appender.new_seq_id(), 0, list(tokens), len(tokens), seed)]
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
            raise ValueError(f"unknown {request_id=}{self._dropped_hint()}")
        if not req.finished:
            self.scheduler.abort(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's current output (a finished one only among the last ``keep_finished``)."""
        req = self._requests.get(str(request_id))
        if req is None:
            raise ValueError(f"unknown {request_id=}{self._dropped_hint()}")
        return self._output(req)

    def _dropped_hint(self) -> str:
        return (f" (finished requests are kept for the last keep_finished={self.keep_finished} "
                "only)")  # fmt: skip

    def _retire(self) -> None:
        """Drops the oldest finished requests beyond ``keep_finished``."""
        while len(self._finished_ids) > self.keep_finished:
            rid = self._finished_ids.popleft()
            req = self._requests.get(rid)
            if req is not None and req.finished:
                del self._requests[rid]

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step (one device call); returns the requests that progressed."""
        touched = self._step()
        return [self._output(self._requests[rid]) for rid in sorted(touched, key=_id_order)
                if rid in self._requests]  # fmt: skip

    def _step(self) -> set[str]:
        """One step; returns the ids of the requests it touched (progressed, preempted, done)."""
        self._retire()  # at the start: the previous step's outputs have been built
        timing = self.counters.timing
        if self.chain.state is not None:  # a decode loop is in flight: just advance the chain
            t1 = time.perf_counter()
            # Rows finished in an earlier loop of the chain were reported then (and may be
            # retired); rows finishing now are reported through the scheduler's finished list.
            touched = {it.request.request_id for it in self.chain.state[0]
                       if not it.request.finished}  # fmt: skip
            self.counters.steps += 1
            self.chain.advance()
            timing["step_s"] += time.perf_counter() - t1
            return self._after_step(touched)
        # A decode loop left running by the chain that ended: wait for it here, so that its
        # failure (if any) surfaces before scheduling changes the allocator (a copy-on-write
        # or swap that could then not run).
        self.kv.cache  # noqa: B018
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self.kv.apply(plan.page_ops)  # swap-outs, copies, swap-ins, in the planned order
        t1 = time.perf_counter()
        timing["schedule_s"] += t1 - t0
        touched = {s.request.request_id for s in plan.scheduled}
        touched |= {rid for rid, _ in plan.preempted}
        if plan.scheduled:
            self.counters.steps += 1
            if not (self.chain.can_loop(plan) and self.chain.start(plan)):
                self.executor.run(plan)
        timing["step_s"] += time.perf_counter() - t1
        return self._after_step(touched)

    def _after_step(self, touched: set[str]) -> set[str]:
        if self.debug:
            self.alloc.check_invariants()
        self.alloc.take_dirty()  # the engine rebuilds tables per step; keep the set bounded
        # Requests that finished or failed this step, scheduled or not (errors, aborts).
        done = [r.request_id for r in self.scheduler.take_finished()]
        self._finished_ids.extend(done)
        self._finished_ids.extend(self._failed_at_add)
        touched |= set(done)
        touched |= self._failed_at_add
        self._failed_at_add = set()
        return touched

    def warmup(self, *, progress: bool = False) -> int:
        """Compiles every step program this engine can meet, on inputs that write nothing.

        Covers the decode step for every sequence bucket, the decode loop for every sequence
        bucket and sampling mode (greedy, random, truncated), the ragged step for every
        (sequence, token) bucket pair and the page programs of copy-on-write and swap
        (`KVManager.warmup_page_programs`); beam search's top-k variant compiles on first
        use. After this, serving compiles nothing (``stats()["recompiles"]`` is fixed).

        Returns:
          The number of program shapes run.
        """
        return warmup_programs(
            self.kv, self.runner, width=self.width, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_decode_steps=self.num_decode_steps, progress=progress,
        )  # fmt: skip

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
            "steps": self.counters.steps,
            "device_calls": self.counters.device_calls,
            "loop_decode_steps": self.counters.loop_steps,
            "tokens_generated": self.counters.tokens_generated,
            # Host time scheduling, host + device time in steps, and of that the time spent
            # waiting for device results (so host work per step = step_s - device_wait_s)
            # and the time the calls that start device work took to return (dispatch_s; a
            # decode loop's call runs in the dispatch thread on GPU, where it can last until
            # the loop has run: the main thread's wait for it is in device_wait_s).
            **{f"time_{k}": v for k, v in self.counters.timing.items()},
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
        reqs = {rid: self._requests[rid] for rid in ids}  # kept even if retired meanwhile
        pending = {rid for rid in ids if not reqs[rid].finished}
        if bar is not None:
            bar.update(len(ids) - len(pending))
        while pending:
            if not self.scheduler.has_unfinished():
                raise RuntimeError("engine idle with unfinished requests (scheduler bug)")
            for rid in self._step() & pending:
                if reqs[rid].finished:
                    pending.discard(rid)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [self._output(reqs[rid]) for rid in ids]

    def _output(self, req: Request) -> RequestOutput:
        return request_output(req, self.tokenizer)


def _id_order(request_id: str):
    return (0, int(request_id)) if request_id.isdigit() else (1, request_id)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int | np.integer):
        return [prompts]
    return prompts
