"""The engine's parts, built from a model and `EngineOptions`: the model and tokenizer, the
device pool and host allocator (`KVManager`), the `Scheduler`, the `Runner` of the step
programs, and the parts that run a step (`TokenAppender`, `StepExecutor`, `DecodeChain`)."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jpaged.engine.appender import TokenAppender
from jpaged.engine.buckets import BucketGrid
from jpaged.engine.chain_join import ChainJoin
from jpaged.engine.chat import load_chat_template
from jpaged.engine.compile_cache import configure as configure_compilation_cache
from jpaged.engine.counters import Counters
from jpaged.engine.decode_chain import DecodeChain
from jpaged.engine.kv_manager import KVManager
from jpaged.engine.model_setup import default_kv_bytes, model_dtype, read_eos, with_params
from jpaged.engine.options import EngineOptions, resolve_cache_dtype
from jpaged.engine.runner import Runner, default_compiler_options
from jpaged.engine.scheduler import Scheduler
from jpaged.engine.step import StepExecutor
from jpaged.engine.tokenizer_adapter import as_engine_tokenizer
from jpaged.kv.allocator import BlockAllocator
from jpaged.kv.cache import PagedKVCache, pages_for_budget
from jpaged.kv.layer_groups import local_window, pool_layers
from jpaged.kv.page_groups import PageGroups, default_local_pages
from jpaged.parallel.mesh import DATA_AXIS
from jpaged.parallel.tp import TensorParallelModel, create_cache, data_replicas, shard_model

__all__ = ["EngineParts", "assemble", "grouped_pool_layers", "load_replicas"]


@dataclasses.dataclass
class EngineParts:
    """Everything `jpaged.LLM` drives; sizes resolved from the options and the model.

    Attributes:
      model: the model served.
      tokenizer: the tokenizer (None: token ids only).
      eos_token_ids: the end-of-sequence ids.
      max_model_len: longest sequence, prompt and generated tokens.
      width: W, block-table entries per sequence (``ceil(max_model_len / page_size)``).
      max_num_batched_tokens: the token budget of one step.
      alloc: the host allocator: a `BlockAllocator`, or `PageGroups` for a model mixing
        sliding-window and full-attention layers (`grouped_pool_layers`).
      chat_template: the `ChatTemplate` of the tokenizer or checkpoint, or None.
      grid: the step programs' shape buckets.
      cache_dir: the persistent compilation cache in use (None: none).
    """

    model: Any
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    width: int
    max_num_batched_tokens: int
    alloc: BlockAllocator | PageGroups
    kv: KVManager
    scheduler: Scheduler
    runner: Runner
    counters: Counters
    appender: TokenAppender
    executor: StepExecutor
    chain: DecodeChain
    grid: BucketGrid
    cache_dir: str | None
    chat_template: Any = None


def load_model(
    model: Any, params: Any, tokenizer: Any, eos_token_id: Any, dtype: Any, mesh: Any = None
):  # fmt: skip
    """``(model, tokenizer, eos_token_ids, chat_template)``: a checkpoint directory loaded
    (its tokenizer and end-of-sequence ids unless given), or a model object with ``params``
    applied; the tokenizer as the engine uses it (`as_engine_tokenizer`); with a ``mesh``,
    split over its ``"model"`` axis (copies along ``"data"``)."""
    tokenizer = as_engine_tokenizer(tokenizer)
    path = None
    if isinstance(model, str | pathlib.Path):
        from jpaged.models import from_pretrained, load_tokenizer

        path = pathlib.Path(model)
        model = from_pretrained(path, dtype=dtype, mesh=mesh)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        if eos_token_id is None:
            eos_token_id = read_eos(path)
    else:
        model = with_params(model, params)
        if mesh is not None:
            model = shard_model(model, mesh)
    eos = [] if eos_token_id is None else np.atleast_1d(eos_token_id).tolist()
    chat_template = load_chat_template(path, tokenizer)
    return model, tokenizer, frozenset(int(e) for e in eos), chat_template


def release_window(config: Any) -> int | None:
    """The window outside which a sequence's pages can go back to the pool: the largest of the
    layers' windows when every layer has one (Mistral), else None (a global layer reads the
    whole history; models without a ``ModelConfig`` keep every page)."""
    windows = getattr(config, "layer_windows", None)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def grouped_pool_layers(config: Any, num_local_pages: int | None, model: Any) -> int | None:
    """The layer slices of a pool of two page groups (`jpaged.kv.page_groups`) for ``model``
    of ``config``, or None: one group. A model mixing sliding-window and full-attention
    layers, as many of each in every period of its layers (Gemma 2), gets two groups unless
    ``num_local_pages`` is 0, if it reads the local group's metadata
    (``supports_page_groups``, `jpaged.models.PagedModel`); any other keeps one group.

    Raises:
      ValueError: ``num_local_pages`` > 0 for a model that cannot have two groups.
    """
    windows = getattr(config, "layer_windows", None)
    layers = pool_layers(windows) if windows else None
    if num_local_pages and layers is None:
        raise ValueError(
            f"num_local_pages={num_local_pages} needs a model mixing sliding-window and "
            f"full-attention layers, as many of each per period of its layers (Gemma 2); "
            f"this model's layer windows are {windows}"
        )
    if num_local_pages and not getattr(model, "supports_page_groups", False):
        raise ValueError(
            f"num_local_pages={num_local_pages} needs a model that reads the local page "
            f"group's metadata (supports_page_groups=True, as jpaged.models.LlamaForCausalLM); "
            f"{type(model).__name__} has none: pass num_local_pages=0 or None"
        )
    if num_local_pages == 0 or not getattr(model, "supports_page_groups", False):
        return None
    return layers


def _pool(opts: EngineOptions, cfg: Any, *, grouped: bool, budget_layers: int, K: int, H: int,
          dtype: Any, width: int, lookahead: int) -> tuple[int, int]:  # fmt: skip
    """``(global pages, local pages)`` of the pool (local 0: one group) from the options:
    ``num_pages`` is the global group's; a budget is split. By default the local group takes
    what its sequences' windows need (`default_local_pages`), at most ``num_pages`` or half
    the budget, at least one sequence of ``max_model_len`` (``width`` pages).

    Raises:
      ValueError: ``num_local_pages`` below ``width``, or a budget that leaves the global
        group nothing.
    """
    C, S = opts.page_size, opts.max_num_seqs
    total = opts.num_pages
    if total is None:  # the budget is per device: each holds its own KV heads
        budget = opts.kv_cache_memory if opts.kv_cache_memory is not None else default_kv_bytes()
        total = pages_for_budget(budget, budget_layers, K, C, H, dtype)
    if not grouped:
        return (total if opts.num_pages is not None else min(total, S * width)), 0
    local = opts.num_local_pages
    if local is None:
        auto = default_local_pages(S, width, local_window(cfg.layer_windows), C, lookahead)
        local = max(width, min(auto, total if opts.num_pages is not None else total // 2))
    if local < width and opts.num_local_pages is None:
        raise ValueError(
            f"the KV budget holds {total} pages: too few for two page groups of at least one "
            f"sequence of max_model_len each ({width} pages); raise kv_cache_memory or "
            f"num_pages, lower max_model_len, or pass num_local_pages=0 (one group)"
        )
    if local < width:
        raise ValueError(
            f"num_local_pages={local}: the local page group must hold one sequence of "
            f"max_model_len, {width} pages (or num_local_pages=0: one group, nothing released)"
        )
    if opts.num_pages is not None:
        return total, local
    if total - local < 1:
        raise ValueError(f"num_local_pages={local} leaves no global pages of the {total} the "
                         f"KV budget holds")  # fmt: skip
    return min(total - local, S * width), local


def assemble(
    model: Any,
    opts: EngineOptions,
    *,
    params: Any = None,
    tokenizer: Any = None,
    eos_token_id: int | Sequence[int] | None = None,
) -> EngineParts:
    """Builds the engine's parts (arguments as ``jpaged.LLM``'s; one replica: a mesh's
    ``"data"`` axis must be 1, see `load_replicas`).

    Raises:
      ValueError: ``max_model_len`` beyond the model's ``max_position_embeddings``; a mesh
        with a ``"data"`` axis above 1.
    """
    mesh = opts.engine_mesh()
    if mesh is not None and mesh.shape[DATA_AXIS] > 1:
        raise ValueError(f"one engine replica runs on a mesh of data size 1, got {mesh.shape}")
    cache_dir = configure_compilation_cache(opts.compilation_cache)  # before any compile
    model, tokenizer, eos_ids, chat_template = load_model(
        model, params, tokenizer, eos_token_id, opts.dtype, mesh=mesh
    )
    cfg = getattr(model, "config", None)
    max_model_len = opts.max_model_len
    max_positions = getattr(cfg, "max_position_embeddings", None)
    if max_model_len is None:
        max_model_len = int(max_positions if max_positions is not None else 2048)
    max_model_len = int(max_model_len)
    if max_positions is not None and max_model_len > max_positions:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{max_positions} (the longest sequence it was built for)"
        )
    C = opts.page_size
    W = math.ceil(max_model_len / C)
    cache_dtype = resolve_cache_dtype(opts.cache_dtype)  # "fp8" -> float8_e4m3fn
    if cache_dtype is None:
        cache_dtype = model_dtype(model)
    L, K, H = model.num_layers, model.num_kv_heads, model.head_dim
    split = isinstance(model, TensorParallelModel)
    k = opts.num_decode_steps
    grouped_layers = grouped_pool_layers(cfg, opts.num_local_pages, model)
    L_pool = grouped_layers or L
    global_pages, local_pages = _pool(
        opts, cfg, grouped=grouped_layers is not None, budget_layers=L_pool, K=model.layout.kv_heads_per_device if split else K,
        H=H, dtype=cache_dtype, width=W, lookahead=2 * k if opts.chain_decode else 0,
    )  # fmt: skip
    num_pages = int(global_pages + local_pages)
    if split:
        cache = create_cache(model, num_pages, C, cache_dtype, num_layers=L_pool)
    else:
        cache = PagedKVCache.create(L_pool, K, num_pages, C, H, cache_dtype)
    bpp = cache.bytes_per_page
    host_pages = int(opts.swap_space // bpp)
    if local_pages:
        # Host slots in proportion to the groups' pages, the local group's at most what its
        # swapped sequences can hold: their windows (swap moves held pages only), as sized by
        # default_local_pages; the rest swaps whole histories out of the global group.
        window = local_window(cfg.layer_windows)
        need = default_local_pages(
            opts.max_num_seqs, W, window, C, 2 * k if opts.chain_decode else 0
        )
        local_host = min(host_pages * local_pages // num_pages, need)
        alloc = PageGroups(
            int(global_pages), int(local_pages), C, watermark=opts.watermark,
            num_host_pages=host_pages - local_host, num_local_host_pages=local_host,
            bytes_per_page=bpp, window=window,
        )  # fmt: skip
    else:
        alloc = BlockAllocator(
            num_pages, C, watermark=opts.watermark, num_host_pages=host_pages,
            bytes_per_page=bpp,
        )  # fmt: skip
    kv = KVManager(alloc, cache)
    max_tokens = opts.max_num_batched_tokens
    if max_tokens is None:
        max_tokens = max(256, min(2048, max_model_len))
    max_tokens = int(max_tokens)
    scheduler = Scheduler(
        alloc,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=max_tokens,
        preemption_mode=opts.preemption_mode,
        enable_prefix_caching=opts.enable_prefix_caching,
        swap_bytes_per_s=opts.swap_bytes_per_s,
        recompute_tokens_per_s=opts.recompute_tokens_per_s,
        swap_space_bytes=opts.swap_space,
        # A decode loop reserves k positions ahead (a chain, 2k: the loop in flight and the
        # next one; `DecodeChain`); admission keeps the pages of one loop free.
        lookahead_tokens=k if opts.chain_decode else 0,
    )
    compiler_options = opts.compiler_options
    if compiler_options is None:
        compiler_options = default_compiler_options()
    runner = Runner(model, compiler_options=compiler_options)
    kv.cache = runner.place_cache(kv.cache)  # committed, as every program's output pool is
    counters = Counters()
    appender = TokenAppender(
        alloc, scheduler, counters,
        max_model_len=max_model_len, enable_prefix_caching=opts.enable_prefix_caching,
        tokenizer=tokenizer,
        sliding_window=release_window(cfg) or (local_window(cfg.layer_windows) if local_pages
                                               else None),
    )  # fmt: skip
    executor = StepExecutor(
        kv, runner, appender, counters, width=W,
        max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=max_tokens,
    )  # fmt: skip
    joins = None
    if opts.join_running and opts.chain_decode:
        joins = ChainJoin(kv, runner, scheduler, appender, counters, grid=executor.grid,
                          num_decode_steps=k, max_model_len=max_model_len, width=W)  # fmt: skip
    chain = DecodeChain(
        kv, runner, scheduler, appender, counters, joins=joins,
        num_decode_steps=k, enabled=opts.chain_decode, max_model_len=max_model_len, width=W,
        seq_bucket=executor.seq_bucket,
        # On GPU a loop's dispatching call can last until the loop has run: it is made from
        # a worker thread (elsewhere dispatch is asynchronous already, and thread-local JAX
        # settings would not follow the call).
        threaded_dispatch=jax.default_backend() == "gpu",
    )  # fmt: skip
    return EngineParts(
        model=model, tokenizer=tokenizer, eos_token_ids=eos_ids, max_model_len=max_model_len,
        width=W, max_num_batched_tokens=max_tokens, alloc=alloc, kv=kv, scheduler=scheduler,
        runner=runner, counters=counters, appender=appender, executor=executor, chain=chain,
        grid=executor.grid, cache_dir=cache_dir, chat_template=chat_template,
    )  # fmt: skip


def load_replicas(
    model: Any, opts: EngineOptions, *, params: Any = None, tokenizer: Any = None,
    eos_token_id: int | Sequence[int] | None = None,
) -> tuple[list[TensorParallelModel], Any, frozenset[int], Any]:  # fmt: skip
    """``(models, tokenizer, eos_token_ids, chat_template)`` of a data-parallel engine: the
    model loaded once over the whole mesh, then one model per ``"data"`` index on its own
    devices (sharing the loaded buffers)."""
    whole, tokenizer, eos_ids, chat_template = load_model(
        model, params, tokenizer, eos_token_id, opts.dtype, mesh=opts.engine_mesh()
    )
    return data_replicas(whole, DATA_AXIS), tokenizer, eos_ids, chat_template
