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
import time
from collections.abc import Iterator, Sequence
from typing import Any

from jpaged.engine.assembly import assemble
from jpaged.engine.engine_stats import engine_stats
from jpaged.engine.intake import Prompt, RequestIntake, as_prompt_list, id_order
from jpaged.engine.options import EngineOptions
from jpaged.engine.outputs import RequestOutput, request_output
from jpaged.engine.requests import Request
from jpaged.engine.sampling import BeamSearchParams, SamplingParams
from jpaged.engine.warmup import WarmupReport, warmup_programs
from jpaged.kv.cache import PagedKVCache

__all__ = ["LLM"]


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
      compilation_cache: JAX's persistent compilation cache, so a later process loads the
        compiled step programs instead of compiling them: True (default) in
        ``~/.cache/jpaged/jax-<versions>-<device>`` (``$XDG_CACHE_HOME`` honoured; one
        directory per JAX, jaxlib and jpaged version and device, so an upgrade never loads
        a stale entry; ``JPAGED_COMPILATION_CACHE=off`` or a directory in the environment
        overrides the default), a directory, or None (no cache). A cache directory you gave
        JAX yourself (``JAX_COMPILATION_CACHE_DIR``) is kept. The cache is JAX's, for the
        whole process.

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
        compilation_cache: Any = True,
    ):
        self.options = opts = EngineOptions(
            page_size=page_size, num_pages=num_pages, kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, preemption_mode=preemption_mode,
            swap_space=swap_space, num_decode_steps=num_decode_steps, dtype=dtype,
            cache_dtype=cache_dtype, watermark=watermark, seed=seed, debug=debug,
            swap_bytes_per_s=swap_bytes_per_s, recompute_tokens_per_s=recompute_tokens_per_s,
            compiler_options=compiler_options, keep_finished=keep_finished,
            compilation_cache=compilation_cache,
        )  # fmt: skip
        parts = assemble(model, opts, params=params, tokenizer=tokenizer, eos_token_id=eos_token_id)
        self.model, self.tokenizer = parts.model, parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.max_model_len, self.width = parts.max_model_len, parts.width
        self.page_size, self.max_num_seqs = opts.page_size, opts.max_num_seqs
        self.max_num_batched_tokens = parts.max_num_batched_tokens
        self.enable_prefix_caching = opts.enable_prefix_caching
        self.num_decode_steps, self.debug = opts.num_decode_steps, opts.debug
        self.keep_finished = opts.keep_finished
        self.alloc, self.kv, self.scheduler = parts.alloc, parts.kv, parts.scheduler
        self.runner, self.counters, self.appender = parts.runner, parts.counters, parts.appender
        self.executor, self.chain = parts.executor, parts.chain
        self.grid, self.compilation_cache_dir = parts.grid, parts.cache_dir
        self.intake = RequestIntake(
            self.alloc, self.appender, tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids, vocab_size=self.model.vocab_size,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, seed=opts.seed,
        )  # fmt: skip
        self._requests: dict[str, Request] = {}
        self._finished_ids: collections.deque[str] = collections.deque()  # oldest first
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
        prompts = as_prompt_list(prompts)
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
        prompts = as_prompt_list(prompts)
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
        prompts = as_prompt_list(prompts)
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
        if request_id is None:
            request_id = self.intake.new_id(self._requests)
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"{request_id=} is already in use")
        req = self.intake.make_request(prompt, params, request_id, cache_salt)
        self._requests[request_id] = req
        if req.finished:
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
        return [self._output(self._requests[rid]) for rid in sorted(touched, key=id_order)
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

    def warmup(self, *, progress: bool | None = None, threads: int | None = None) -> WarmupReport:
        """Compiles every step program this engine can meet, on inputs that write nothing.

        The programs come from the engine's shape buckets (``grid``, `BucketGrid`): the
        decode step per row bucket, the decode loop per row bucket and sampling mode
        (greedy, random, truncated; none with ``num_decode_steps=1``), the ragged step per
        token bucket; then the page programs of copy-on-write and swap
        (`KVManager.warmup_page_programs`). They are compiled by a thread pool, or loaded
        from the persistent compilation cache (``compilation_cache``). Beam search's top-k
        variant compiles on first use. After this, serving compiles nothing
        (``stats()["recompiles"]`` is fixed).

        Args:
          progress: a progress bar over the programs (tqdm); None: where stderr is a
            terminal.
          threads: compile threads (default: one per CPU core, at most 16).

        Returns:
          A `WarmupReport` (``print`` it for a table): programs compiled, seconds each and in
          all, persistent-cache hits.
        """
        return warmup_programs(
            self.kv, self.runner, self.grid, width=self.width,
            num_decode_steps=self.num_decode_steps, cache_dir=self.compilation_cache_dir,
            progress=progress, threads=threads,
        )  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """Pool, sharing, prefix-cache, preemption and compile counters."""
        return engine_stats(self.alloc, self.scheduler, self.runner, self.counters)

    @property
    def preemption_events(self):
        return list(self.scheduler.events)

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
