"""``jpaged.LLM``: the serving engine's user API (vLLM-shaped).

The facade builds the parts (`jpaged.engine.assembly`) and drives them one engine step at
a time (`jpaged.engine.engine_step.EngineStep`); it keeps the requests and builds their
outputs.

>>> import jpaged
>>> llm = jpaged.LLM("tests/checkpoints/llama2", page_size=8, num_pages=64, max_num_seqs=8,
...                  max_model_len=64)
>>> out = llm.generate([[5, 6, 7]], jpaged.SamplingParams(max_tokens=4, temperature=0.0))
>>> len(out[0].outputs[0].token_ids)
4

Errors: invalid ``SamplingParams``/``BeamSearchParams`` raise ``ValueError`` when built, and
so do malformed requests where they enter (``add_request``, ``generate``: a prompt that is not
token ids nor a string with a tokenizer, named with the offending element; a ``cache_salt``
that is not a str), leaving nothing queued. A request the engine cannot serve (empty prompt,
a prompt of ``max_model_len`` tokens or more, token ids outside the vocabulary, a request
that cannot fit in the pool even alone) does not raise: its output has
``finish_reason == "error"`` and ``error`` says why, and the engine keeps serving the other
requests. A step that raises (a page operation, the device call, the token appender) fails
the requests of that step the same way, with the exception as ``error``; ``step()`` itself
raises nothing and the engine serves the next call (`jpaged.engine.engine_step`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from jpaged.engine.assembly import assemble, load_replicas
from jpaged.engine.chat import render_conversations
from jpaged.engine.data_parallel import ReplicaSet, combined_stats, combined_warmup
from jpaged.engine.engine_stats import engine_stats, held_page_tables
from jpaged.engine.engine_step import EngineStep
from jpaged.engine.intake import Prompt, RequestIntake, as_prompt_list, check_cache_salt, id_order
from jpaged.engine.options import EngineOptions
from jpaged.engine.outputs import RequestOutput, request_output
from jpaged.engine.params import check_for_engine
from jpaged.engine.request_book import RequestBook
from jpaged.engine.requests import Request
from jpaged.engine.sampling import BeamSearchParams, SamplingParams
from jpaged.engine.warmup import WarmupReport, warmup_programs
from jpaged.kv.cache import PagedKVCache
from jpaged.parallel.mesh import DATA_AXIS

__all__ = ["LLM"]


def _check_params(params: Any, name: str) -> None:
    if not isinstance(params, SamplingParams | BeamSearchParams):
        raise ValueError(f"{name} must be SamplingParams or BeamSearchParams, got {params!r}")


class LLM:
    """A paged-KV-cache LLM engine: continuous batching, sharing, prefix cache, preemption.

    Args:
      model: a local Hugging Face checkpoint directory, a jpaged model (a Flax NNX module
        following ``jpaged.models.PagedModel``, e.g. ``jpaged.models.LlamaForCausalLM``), or
        a ``jpaged.models.ModelConfig`` (with ``params``).
      params: with a ``ModelConfig``: the parameter arrays by name
        (``jpaged.models.param_shapes``); with a module: an ``nnx.State`` to load into it.
      page_size: C, tokens per page.
      num_pages: P, pages in the pool (two groups: the global one's); default from ``kv_cache_memory``.
      num_local_pages: pages of the local group (`jpaged.kv.page_groups`) where a model mixing
        windowed and global layers (Gemma 2) releases out-of-window pages (None: auto; 0: off).
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
      num_decode_steps: k, decode steps per device call of a decode chain (a
        ``lax.fori_loop`` over pages reserved ahead). A request arriving while a chain runs
        waits for the call in flight and the next (the host dispatches one ahead), so k
        trades time to first token for host work per token: on an H100 with Llama-3-8B
        shapes, 1 served 128 ShareGPT-like requests at once as fast as 2 and 8 (3214, 3209
        and 3176 output tok/s), with 20 ms to the first token at 4 req/s against 29 and 91
        ms (BENCHMARKS.md). Raise it where the host cannot keep up with short steps (small
        models).
      chain_decode: when every scheduled sequence decodes, run decode chains: each call's
        successor is dispatched from its device carry before the host reads its tokens, so
        host work overlaps the device. False: one synchronous step per call, no decode loop
        programs (fewer to compile); ``num_decode_steps`` must then be 1.
      join_running: admit requests while a chain of decode loops runs: a request's prefill
        runs between two loops and its row joins the next one (`jpaged.engine.chain_join`;
        rows with beam search, ``n > 1``, logits processing or log-probabilities end the
        chain instead). False: an admission ends the chain and runs as a single step.
        Without ``chain_decode`` there is nothing to join.
      dtype: parameter dtype when loading a checkpoint (None: as stored).
      cache_dtype: K/V dtype (default: the model's); "fp8" / "fp8_e5m2" / "int8": quantized.
      tokenizer: a ``tokenizers.Tokenizer`` or a transformers tokenizer (wrapped in
        `jpaged.engine.tokenizer_adapter.TransformersTokenizer`, which ``self.tokenizer``
        then is); loaded from the checkpoint when None.
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
      tensor_parallel_size: split the model over this many devices (the first ones of
        ``jax.devices()``): heads, MLP and vocabulary (``jpaged.parallel``, docs/parallel.md).
      mesh: a ``jax.sharding.Mesh`` with axes ``"model"`` (tensor parallel: the model and
        the pool's KV heads split over it) and/or ``"data"`` (independent replicas, each
        with its own pool, allocator and scheduler, behind this one engine). Under
        ``jax.distributed`` it may span hosts (BUILD.md, "Several devices and several
        hosts"). ``kv_cache_memory`` is per device.
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
      alloc: the host `jpaged.BlockAllocator` (`jpaged.kv.page_groups.PageGroups`: two groups).
      cache: the device `jpaged.PagedKVCache` (held by ``kv``).
      kv: the `KVManager` (allocator, pool, host swap space).
      scheduler: the `Scheduler`.
      runner: the `Runner` of the jitted step programs.
      replicas: with a ``"data"`` axis, one engine per replica (then ``alloc``, ``kv``,
        ``scheduler`` and ``runner`` are None: each replica has its own); else empty.
    """

    def __init__(
        self,
        model: Any,
        *,
        params: Any = None,
        page_size: int = 16,
        num_pages: int | None = None,
        num_local_pages: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "auto",
        swap_space: int = 1 << 30,
        num_decode_steps: int = 1,
        chain_decode: bool = True,
        join_running: bool = True,
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
        tensor_parallel_size: int = 1,
        mesh: Any = None,
        compilation_cache: Any = True,
    ):
        self.options = opts = EngineOptions(
            page_size=page_size, num_pages=num_pages, num_local_pages=num_local_pages,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, preemption_mode=preemption_mode,
            swap_space=swap_space, num_decode_steps=num_decode_steps,
            chain_decode=chain_decode, join_running=join_running, dtype=dtype,
            cache_dtype=cache_dtype, watermark=watermark, seed=seed, debug=debug,
            swap_bytes_per_s=swap_bytes_per_s, recompute_tokens_per_s=recompute_tokens_per_s,
            compiler_options=compiler_options, keep_finished=keep_finished,
            tensor_parallel_size=tensor_parallel_size, mesh=mesh,
            compilation_cache=compilation_cache,
        )  # fmt: skip
        self._book = RequestBook(opts.keep_finished)
        self.replicas: list[LLM] = []
        engine_mesh = opts.engine_mesh()
        if engine_mesh is not None and engine_mesh.shape[DATA_AXIS] > 1:
            models, tokenizer, eos, chat_template = load_replicas(
                model, opts, params=params, tokenizer=tokenizer, eos_token_id=eos_token_id
            )
            self.replicas = [LLM(m, tokenizer=tokenizer, eos_token_id=sorted(eos) or None,
                                 **opts.replica_options()) for m in models]  # fmt: skip
            self._replica_set = ReplicaSet(self.replicas)
            self._init_from(self.replicas[0], opts)
            self.chat_template = chat_template
            return
        parts = assemble(model, opts, params=params, tokenizer=tokenizer, eos_token_id=eos_token_id)
        self.model, self.tokenizer = parts.model, parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.max_model_len, self.width = parts.max_model_len, parts.width
        self.page_size, self.max_num_seqs = opts.page_size, opts.max_num_seqs
        self.max_num_batched_tokens = parts.max_num_batched_tokens
        self.enable_prefix_caching = opts.enable_prefix_caching
        self.num_decode_steps, self.debug = opts.num_decode_steps, opts.debug
        self.chain_decode = opts.chain_decode
        self.alloc, self.kv, self.scheduler = parts.alloc, parts.kv, parts.scheduler
        self.runner, self.counters, self.appender = parts.runner, parts.counters, parts.appender
        self.executor, self.chain = parts.executor, parts.chain
        self.engine_step = EngineStep(
            alloc=self.alloc, kv=self.kv, scheduler=self.scheduler, chain=self.chain,
            executor=self.executor, counters=self.counters, request=self._book.get,
            debug=self.debug,
        )  # fmt: skip
        self.chat_template = parts.chat_template
        self.grid, self.compilation_cache_dir = parts.grid, parts.cache_dir
        self.intake = RequestIntake(
            self.alloc, self.appender, tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids, vocab_size=self.model.vocab_size,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, seed=opts.seed,
        )  # fmt: skip

    def _init_from(self, replica: LLM, opts: EngineOptions) -> None:
        """The data-parallel front's settings, from its first replica (no parts of its own;
        request ids come from that replica's counter)."""
        self.model, self.tokenizer = replica.model, replica.tokenizer
        self.eos_token_ids, self.max_model_len = replica.eos_token_ids, replica.max_model_len
        self.width, self.page_size = replica.width, opts.page_size
        self.max_num_seqs = opts.max_num_seqs
        self.max_num_batched_tokens = replica.max_num_batched_tokens
        self.enable_prefix_caching = opts.enable_prefix_caching
        self.num_decode_steps, self.debug = opts.num_decode_steps, opts.debug
        self.chain_decode = opts.chain_decode
        self.intake = replica.intake
        self.alloc = self.kv = self.scheduler = self.runner = self.counters = None
        self.appender = self.executor = self.chain = self.engine_step = None

    @property
    def keep_finished(self) -> int:
        """Finished requests kept for ``get_output`` (settable)."""
        return self._book.keep_finished

    @keep_finished.setter
    def keep_finished(self, value: int) -> None:
        self._book.keep_finished = value

    @property
    def cache(self) -> PagedKVCache:
        """The K/V pool (``kv.cache``: waits for a decode loop being dispatched)."""
        if self.replicas:
            raise AttributeError("each data-parallel replica has its own pool: replicas[i].cache")
        return self.kv.cache

    @cache.setter
    def cache(self, value: PagedKVCache) -> None:
        # Committed where the programs run, as their outputs are (`Runner.place_cache`).
        self.kv.cache = self.runner.place_cache(value)

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

        Raises:
          ValueError: (nothing is queued) a prompt that is not token ids nor a string with a
            tokenizer (``prompts[i]`` and the element named), parameters of the wrong type or
            count, a ``cache_salt`` that is not a str or None.
        """
        prompts = as_prompt_list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = [params] * len(prompts) if not isinstance(params, Sequence) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = self._add_all(prompts, params, cache_salt)
        return self._run_to_completion(ids, progress)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of ``{"role", "content"}`` dicts) or to
        a list of conversations, through the model's chat template (`jpaged.engine.chat`:
        rendered as transformers' ``apply_chat_template`` renders it, then tokenized without
        added special tokens); ``RequestOutput.prompt`` holds the rendered text.

        Args:
          chat_template: a Jinja template that overrides the checkpoint's.
          add_generation_prompt: end the prompt with the assistant's turn header.
          chat_template_kwargs: more variables for the template.

        Raises:
          ValueError: no tokenizer, no chat template, or malformed messages.
        """
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer: give LLM(tokenizer=...)")
        texts = render_conversations(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **(chat_template_kwargs or {}),
        )  # fmt: skip
        ids = [self.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = [params] * len(ids) if not isinstance(params, Sequence) else list(params)
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} sampling params for {len(ids)} conversations")
        rids = self._add_all(ids, params, None)
        for rid, text in zip(rids, texts, strict=True):
            self._book[rid].prompt_text = text
        return self._run_to_completion(rids, progress)

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
        ids = self._add_all(prompts, [params] * len(prompts), None)
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
        params = sampling_params if sampling_params is not None else SamplingParams()
        ids = self._add_all(prompts, [params] * len(prompts), None)
        pending = set(ids)
        try:
            for rid in ids:
                if self._book[rid].finished:
                    pending.discard(rid)
                    yield self._output(self._book[rid])
            while pending:
                for out in self.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            self._abort_all(pending)

    def _add_all(self, prompts: list, params: list, cache_salt: str | None) -> list[str]:
        """Adds one request per prompt, all or nothing: every prompt and parameter set is
        checked before the first is added, and on a later error the requests added are
        removed (the caller never got their ids, so no later step may report them).

        Raises:
          ValueError: naming the first bad prompt (``prompts[i]``) or parameter set.
        """
        check_cache_salt(cache_salt)
        for i, sp in enumerate(params):
            _check_params(sp, f"sampling_params[{i}]")
            check_for_engine(sp, vocab_size=self.model.vocab_size,
                             has_tokenizer=self.tokenizer is not None)  # fmt: skip
        read = [self.intake.read_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        ids: list[str] = []
        try:
            for prompt, sp in zip(read, params, strict=True):
                ids.append(self._add(prompt, sp, None, cache_salt))
        except BaseException:
            self._discard(ids)
            raise
        return ids

    def _discard(self, ids) -> None:
        """Aborts and forgets requests whose ids never reached the caller."""
        for rid in ids:
            req = self._book.discard(rid)
            if req is not None and not req.finished:
                self.scheduler.abort(req)

    def _abort_all(self, ids) -> None:
        for rid in ids:
            if not self._book[rid].finished:
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
          ValueError: (nothing is queued) ``params`` is not a ``SamplingParams``/
            ``BeamSearchParams``; the prompt is not a list of token ids (``int``/numpy
            integers) nor a string with a tokenizer; ``cache_salt`` is not a str or None;
            ``request_id`` is not a str, or is already in use.
        """
        params = params if params is not None else SamplingParams()
        _check_params(params, "params")
        check_for_engine(params, vocab_size=self.model.vocab_size,
                         has_tokenizer=self.tokenizer is not None)  # fmt: skip
        check_cache_salt(cache_salt)
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r} must be a str or None")
        return self._add(self.intake.read_prompt(prompt), params, request_id, cache_salt)

    def _add(self, prompt, params, request_id: str | None, cache_salt: str | None) -> str:
        """Queues a checked request (``prompt`` as `RequestIntake.read_prompt` returns it)."""
        if request_id is None:
            request_id = self.intake.new_id(self._book.by_id)
        if request_id in self._book:
            raise ValueError(f"{request_id=} is already in use")
        if self.replicas:
            replica = self._replica_set.pick(prompt[0], cache_salt)  # by its token ids
            replica._add(prompt, params, request_id, cache_salt)
            req = replica._book[request_id]
        else:
            req = self.intake.make_request(prompt, params, request_id, cache_salt)
        self._book.add(req)
        if not req.finished and not self.replicas:
            self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stops a request and frees everything it holds (finish reason "abort")."""
        req = self._book.lookup(request_id)
        if not req.finished and self.replicas:
            self._replica_set.owner(req.request_id).abort(req.request_id)
        elif not req.finished:
            self.scheduler.abort(req)

    def has_unfinished_requests(self) -> bool:
        if self.replicas:
            return any(r.has_unfinished_requests() for r in self.replicas)
        return self.scheduler.has_unfinished()

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's current output (a finished one only among the last ``keep_finished``)."""
        return self._output(self._book.lookup(request_id))

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step (one device call); returns the requests that progressed,
        and those finished since the last step (an aborted one with finish reason "abort")."""
        touched = self._step()
        return [self._output(self._book[rid]) for rid in sorted(touched, key=id_order)
                if rid in self._book]  # fmt: skip

    def _step(self) -> set[str]:
        """One step; returns the ids of the requests it touched (progressed, preempted, done)."""
        self._book.retire()  # at the start: the previous step's outputs have been built
        if self.replicas:  # every replica with work steps; the front keeps the finished ids
            touched = self._replica_set.step()
            return self._book.settle(touched, [r for r in touched if self._book[r].finished])
        return self._book.settle(*self.engine_step.run())

    def warmup(self, *, progress: bool | None = None, threads: int | None = None) -> WarmupReport:
        """Compiles every step program this engine can meet, on inputs that write nothing.

        The programs come from the engine's shape buckets (``grid``, `BucketGrid`): the
        decode step per row bucket, the decode loop per row bucket and sampling mode
        (greedy, random, truncated; none with ``chain_decode=False``), the ragged step per
        token bucket, the join and grow programs of ``join_running``; then the page programs
        of copy-on-write and swap (`KVManager.warmup_page_programs`). They are compiled by a
        thread pool, or loaded from the persistent compilation cache
        (``compilation_cache``). Beam search's top-k variant, loops whose rows have more
        than 8 stop ids, and the variants of the sampling features (logprobs, prompt
        logprobs, penalties, bias, min-p, logits processors: `jpaged.engine.logits_process`)
        compile on first use, once per combination met in a batch. After this, serving
        compiles nothing else (``stats()["recompiles"]`` is fixed).

        Args:
          progress: a progress bar over the programs (tqdm); None: where stderr is a
            terminal.
          threads: compile threads (default: one per CPU core, at most 16).

        Returns:
          A `WarmupReport` (``print`` it for a table): programs compiled, seconds each and in
          all, persistent-cache hits (with data-parallel replicas: theirs in one report).
        """
        if self.replicas:
            return combined_warmup([r.warmup(progress=progress, threads=threads)
                                    for r in self.replicas])  # fmt: skip
        return warmup_programs(
            self.kv, self.runner, self.grid, width=self.width,
            num_decode_steps=self.num_decode_steps if self.chain.enabled else None,
            join=self.chain.joins is not None,
            cache_dir=self.compilation_cache_dir, progress=progress, threads=threads,
        )  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """Pool, sharing, prefix-cache, preemption and compile counters (with data-parallel
        replicas: summed, and each replica's under ``"replicas"``)."""
        if self.replicas:
            return combined_stats([r.stats() for r in self.replicas])
        return engine_stats(self.alloc, self.scheduler, self.runner, self.counters)

    def page_tables(self) -> dict[tuple[str, int], list[int]]:
        """The device pages each sequence holds now, in order (its block table).

        Returns:
          ``{(request_id, index): page ids}`` for every unfinished request's sequences that
          hold pages (``index``: the completion or beam slot; swapped-out and waiting
          sequences hold none). Pages shared by several sequences appear in each. With
          data-parallel replicas, each page id is one of its own replica's pool.
        """
        if self.replicas:
            return {key: pages for r in self.replicas for key, pages in r.page_tables().items()}
        return held_page_tables(self.scheduler, self.alloc)

    @property
    def preemption_events(self):
        schedulers = [r.scheduler for r in self.replicas] or [self.scheduler]
        return [e for s in schedulers for e in s.events]

    def _run_to_completion(self, ids: list[str], progress: bool) -> list[RequestOutput]:
        """Steps until the requests ``ids`` finish; returns their outputs, in order. If
        anything raises meanwhile (an interrupt, a bug), the unfinished ones are aborted and
        forgotten: the caller never gets their ids, so no later step may run them."""
        try:
            return self._steps_until_done(ids, progress)
        except BaseException:
            self._discard([rid for rid in ids if rid in self._book])
            raise

    def _steps_until_done(self, ids: list[str], progress: bool) -> list[RequestOutput]:
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        reqs = {rid: self._book[rid] for rid in ids}  # kept even if retired meanwhile
        pending = {rid for rid in ids if not reqs[rid].finished}
        if bar is not None:
            bar.update(len(ids) - len(pending))
        while pending:
            if not self.has_unfinished_requests():
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
