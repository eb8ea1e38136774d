"""The runner: the jitted step programs of a model on the paged cache (cache donated).

Two jitted programs run a model on the paged cache:

- ``step``: one forward over a ragged token batch (prefill chunks and decodes mixed), then
  on-device logits processing and sampling of one token per logits row
  (`jpaged.engine.sampling.sample_rows`; for beam search and ``logprobs``, the top
  log-probabilities of each row; for ``prompt_logprobs``, those of every token row).
- ``decode_loop``: a ``lax.fori_loop`` of exactly k decode steps, each feeding the token it
  sampled into the next, writing K/V into slots the host reserved ahead (crossing page
  boundaries); a sequence that finished (stop token or length) writes nothing in the steps
  after (a fixed trip count: on GPU a ``while_loop`` condition is read back to the host every
  iteration).
  It also returns its final state as a ``LoopBatch`` (the carry), from which the engine
  dispatches the next loop before reading this one's tokens.
  Its sampling mode (greedy, random, truncated) is a static argument chosen on the host
  (``sampling_mode``): a device-side ``lax.cond`` would make XLA on GPU read the predicate
  back, so dispatching the loop would wait for the loop before it.

Their inputs are the fixed-shape batches of `jpaged.engine.batches` (every shape from a
small set of buckets), so after warm-up nothing compiles.
``Runner.num_compiles`` counts traces of the step functions (each trace is one compile).
Warm-up installs each program's executable (``Runner.install``; compiled, or loaded from
the `jpaged.engine.executable_store` without tracing); a call whose static arguments and
input shapes match one runs it, any other call goes through ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, make_single_device_sharding

from jpaged.engine.batches import LoopBatch, StepBatch
from jpaged.engine.executable_store import describe_tree
from jpaged.engine.logits_process import penalty_state, prompt_logprobs, update_penalty_state
from jpaged.engine.sampling import sample_rows, sampling_mode
from jpaged.models._protocol import AttentionMetadata
from jpaged.parallel.tp import TensorParallelModel

SAMPLING_MODES = ("greedy", "random", "truncate")  # the decode loop's static sampling modes

# XLA options of the step programs on GPU. The layers run under a scan over stacked weights;
# XLA's default Triton GEMMs copied each layer's weight slice before reading it (a memcpy of
# every weight per decode step: H200, Llama-3-8B shapes, 64 sequences, 13.1 ms per step,
# 6.6 ms of it copies); cuBLAS GEMMs with dynamic-slice fusion read the slices in place
# (6.3 ms). ``benchmarks/decode_step.py`` measures the variants.
GPU_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_enable_dynamic_slice_fusion": True,
}
# The options per NVIDIA GPU generation (compute capability major) where they were measured:
# Hopper (sm90: the H200). Every other generation (Ampere/Ada sm80-sm89, Turing sm75,
# Blackwell sm100+) keeps XLA's defaults until it is measured there.
MEASURED_GPU_OPTIONS: dict[int, dict[str, Any]] = {9: GPU_COMPILER_OPTIONS}


def _cuda_capability() -> tuple[int, int] | None:
    """The default backend's NVIDIA compute capability, None off an NVIDIA GPU."""
    if jax.default_backend() != "gpu":
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return tuple(int(x) for x in str(cc).split(".")[:2])  # type: ignore[return-value]
    except ValueError:  # ROCm names its architecture ("gfx90a")
        return None


def default_compiler_options(
    platform: str | None = None, compute_capability: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The step programs' XLA options: on a "cuda" platform those measured for the GPU's
    generation (``MEASURED_GPU_OPTIONS``: Hopper's ``GPU_COMPILER_OPTIONS``), XLA's defaults
    for unmeasured generations and anything else (CPU, TPU, ROCm). Default: the default
    backend's platform ("gpu" resolves to "cuda" or "rocm") and GPU. ``compute_capability``
    (major, minor) picks the generation; with "cuda" and none given, the local GPU's, else
    Hopper's (the measured one).

    >>> default_compiler_options("cpu"), default_compiler_options("rocm")
    ({}, {})
    >>> sorted(default_compiler_options("cuda", (9, 0)))
    ['xla_gpu_enable_dynamic_slice_fusion', 'xla_gpu_enable_triton_gemm']
    >>> default_compiler_options("cuda", (8, 9)), default_compiler_options("cuda", (10, 0))
    ({}, {})
    """
    if platform is None:
        platform = jax.default_backend()
        if platform == "gpu":
            version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
            platform = "rocm" if "rocm" in version or "hip" in version else "cuda"
    if platform != "cuda":
        return {}
    cc = compute_capability or _cuda_capability() or (9, 0)
    return dict(MEASURED_GPU_OPTIONS.get(cc[0], {}))


_TRACES = [0]  # traces (= compiles) of the step programs in this process


def count_trace() -> None:
    """Counts one trace (= compile) of an engine program in ``Runner.num_compiles`` (the
    small programs beside the step programs call it too: `jpaged.engine.chain_join`)."""
    _TRACES[0] += 1


def _step_impl(graphdef, state, cache, batch: StepBatch, *, decode: bool, num_top: int,
               processors: tuple):  # fmt: skip
    _TRACES[0] += 1  # runs once per trace, i.e. once per compile
    model = nnx.merge(graphdef, state)
    meta = batch.metadata
    every_row = batch.prompt_targets is not None  # prompt log-probabilities: all T rows
    if every_row:
        T = batch.tokens.shape[0]
        meta = dataclasses.replace(meta, logits_indices=jnp.arange(T, dtype=jnp.int32))
    logits_RV, cache = model(batch.tokens, batch.positions, cache, meta, decode=decode)
    prompt = None
    if every_row:
        prompt = prompt_logprobs(logits_RV, batch.prompt_targets, num_top)
        logits_RV = logits_RV[batch.metadata.logits_indices]
    tokens_R, logprobs_R, top = sample_rows(
        logits_RV, batch.sampling, batch.logits, processors=processors, num_top=num_top
    )
    return cache, tokens_R, logprobs_R, top, prompt


def _loop_impl(graphdef, state, cache, batch: LoopBatch, *, num_steps: int, mode: str,
               num_top: int, processors: tuple):  # fmt: skip
    _TRACES[0] += 1
    model = nnx.merge(graphdef, state)
    B, W = batch.block_tables.shape
    C = cache.page_size
    rows_B = jnp.arange(B, dtype=jnp.int32)
    cu_q_lens = jnp.arange(B + 1, dtype=jnp.int32)
    inputs = batch.logits

    def body(_, carry):
        ran, cache, tok_B, lens_B, active_B, gen_B, out_KB, lp_KB, extra = carry
        step = ran  # iterations run with an active row: they come first

        def slots(table_BW):  # each active row's slot at position lens (-1: none)
            page_B = table_BW[rows_B, jnp.minimum(lens_B // C, W - 1)]
            return jnp.where(active_B, page_B * C + lens_B % C, -1)

        local = {}
        if batch.local_block_tables is not None:  # a pool of two page groups
            local = dict(local_slot_mapping=slots(batch.local_block_tables),
                         local_block_tables=batch.local_block_tables)  # fmt: skip
        meta = AttentionMetadata(
            slot_mapping=slots(batch.block_tables),
            block_tables=batch.block_tables,
            kv_lens=jnp.where(active_B, lens_B + 1, 0),
            cu_q_lens=cu_q_lens,
            num_seqs=jnp.int32(B),
            logits_indices=rows_B,
            **local,
        )
        logits_BV, cache = model(tok_B, lens_B, cache, meta, decode=True)
        s = dataclasses.replace(batch.sampling, position=lens_B + 1)
        now = inputs
        if "history" in extra:
            now = dataclasses.replace(inputs, history=extra["history"])
        new_B, lp_B, top = sample_rows(logits_BV, s, now, mode=mode, processors=processors,
                                       num_top=num_top, state=extra.get("penalty"))  # fmt: skip
        any_B = jnp.any(active_B)
        k = jnp.minimum(step, num_steps - 1)
        out_KB = out_KB.at[k].set(jnp.where(any_B & active_B, new_B, out_KB[k]))
        lp_KB = lp_KB.at[k].set(jnp.where(any_B, lp_B, lp_KB[k]))
        extra = dict(extra)
        if "history" in extra:  # the new token sits at position lens + 1
            S = extra["history"].shape[1]
            extra["history"] = (
                extra["history"]
                .at[rows_B, jnp.where(active_B, lens_B + 1, S)]
                .set(new_B, mode="drop")
            )
        if "penalty" in extra:
            extra["penalty"] = update_penalty_state(extra["penalty"], new_B, active_B)
        if top is not None:
            for name, x in zip(("top_vals", "top_ids", "ranks"), top, strict=True):
                extra[name] = extra[name].at[k].set(jnp.where(any_B, x, extra[name][k]))
        gen_B = gen_B + active_B.astype(jnp.int32)
        stopped_B = jnp.any(new_B[:, None] == batch.stop_ids, axis=1) & (gen_B >= batch.min_steps)
        still_B = active_B & ~stopped_B & (gen_B < batch.max_steps)
        return (
            ran + any_B.astype(jnp.int32),
            cache,
            jnp.where(active_B, new_B, tok_B),
            jnp.where(active_B, lens_B + 1, lens_B),
            still_B,
            gen_B,
            out_KB,
            lp_KB,
            extra,
        )

    extra = {}
    if inputs is not None and inputs.history is not None:
        extra["history"] = jnp.asarray(inputs.history)
        if inputs.repetition is not None:
            V = model.vocab_size
            extra["penalty"] = penalty_state(extra["history"], inputs.num_prompt, V)
    if num_top:
        n = min(num_top, model.vocab_size)
        extra["top_vals"] = jnp.zeros((num_steps, B, n), jnp.float32)
        extra["top_ids"] = jnp.zeros((num_steps, B, n), jnp.int32)
        extra["ranks"] = jnp.zeros((num_steps, B), jnp.int32)
    init = (
        jnp.int32(0),
        cache,
        batch.tokens,
        batch.lens,
        batch.active & batch.live & (batch.max_steps > 0),
        jnp.zeros((B,), jnp.int32),
        jnp.full((num_steps, B), -1, jnp.int32),
        jnp.zeros((num_steps, B), jnp.float32),
        extra,
    )
    # A loop of a known trip count (num_steps; iterations after every row stopped write
    # nothing): a data-dependent while condition would make the host wait for the device on
    # every iteration on GPU (XLA reads the predicate back), so the call would not return
    # before the loop ended.
    steps, cache, tok_B, lens_B, active_B, gen_B, out_KB, lp_KB, extra = jax.lax.fori_loop(
        0, num_steps, body, init
    )
    # Where the rows stand, for a loop chained right after this one without the host.
    carry = dataclasses.replace(
        batch,
        tokens=tok_B,
        lens=lens_B,
        active=active_B,
        max_steps=batch.max_steps - gen_B,
        min_steps=jnp.maximum(batch.min_steps - gen_B, 0),
    )
    if "history" in extra:
        carry = dataclasses.replace(
            carry, logits=dataclasses.replace(inputs, history=extra["history"])
        )
    top = (extra["top_vals"], extra["top_ids"], extra["ranks"]) if num_top else None
    return cache, out_KB, lp_KB, steps, carry, top


@functools.cache
def _programs(graphdef, treedef, compiler_options: tuple = ()):
    """The jitted step programs of one model structure (shared by every engine over it).

    The model state travels as a flat list of arrays and the graphdef is closed over, so a
    call hashes nothing and flattens no module tree (host dispatch cost per step)."""

    def merge(leaves):
        return jax.tree.unflatten(treedef, leaves)

    def step(leaves, cache, batch, *, decode, num_top, processors):
        return _step_impl(graphdef, merge(leaves), cache, batch, decode=decode, num_top=num_top,
                          processors=processors)  # fmt: skip

    def loop(leaves, cache, batch, *, num_steps, mode, num_top, processors):
        return _loop_impl(graphdef, merge(leaves), cache, batch, num_steps=num_steps, mode=mode,
                          num_top=num_top, processors=processors)  # fmt: skip

    opts = dict(compiler_options) or None
    return (
        jax.jit(step, static_argnames=("decode", "num_top", "processors"),
                donate_argnames=("cache",), compiler_options=opts),
        jax.jit(loop, static_argnames=("num_steps", "mode", "num_top", "processors"),
                donate_argnames=("cache",), compiler_options=opts),
    )  # fmt: skip


# Executables installed by warm-up (loaded from the store, or compiled there), by runner
# fingerprint and call signature: shared by every runner over a model of the same structure,
# devices and compiler options, as the jitted programs are (`_programs`), so an engine rebuilt
# over the same model runs them too instead of tracing and compiling on demand. They live as
# long as the process, or until `clear_installed`.
_INSTALLED: dict[tuple[str, tuple], jax.stages.Compiled] = {}

# JAX settings that change what a traced program computes and that callers may set around a
# call (context managers) or for the process: read at every call, as jax.jit's cache key does,
# so a call under other settings than warm-up's traces its own program.
_TRACE_SETTINGS = ("jax_default_matmul_precision", "jax_enable_x64", "jax_numpy_dtype_promotion",
                   "jax_numpy_rank_promotion", "jax_default_prng_impl",
                   "jax_threefry_partitionable", "jax_softmax_custom_jvp", "jax_debug_nans",
                   "jax_debug_infs")  # fmt: skip


def clear_installed() -> None:
    """Forgets every installed executable (as ``jax.clear_caches`` does the jitted ones)."""
    _INSTALLED.clear()


def _signature(program: str, statics: dict[str, Any], cache, placed_batch) -> tuple:
    """What selects an installed executable: the program, its static arguments, the JAX
    settings of the call, and the tree structure, shapes, dtypes and shardings of the pool
    and the placed batch."""
    leaves, treedef = jax.tree.flatten((cache, placed_batch))
    settings = tuple(getattr(jax.config, name, None) for name in _TRACE_SETTINGS)
    return (program, tuple(sorted(statics.items())), settings, treedef,
            tuple((x.shape, x.dtype, x.sharding) for x in leaves))  # fmt: skip


class Runner:
    """Holds a model split into (graphdef, state) and calls the jitted step programs.

    The programs are cached per (graphdef, state structure, compiler options), so engines
    over models of the same structure share compiles.

    Args:
      model: the NNX model.
      compiler_options: XLA options the step programs compile with (``jax.jit``'s
        ``compiler_options``), e.g. ``{"xla_gpu_enable_command_buffer": "..."}``.

    Attributes:
      num_compiles: step-program compiles (traces) in this process since this runner was built.
      fingerprint: sha256 of the graphdef, the state's shapes, dtypes and shardings, the
        compiler options and the devices' ids: runners of one fingerprint share installed
        executables (`install`).
    """

    def __init__(self, model: nnx.Module, *, compiler_options: dict[str, Any] | None = None):
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        opts = tuple(sorted((compiler_options or {}).items()))
        self.compiler_options = dict(opts)
        self.vocab_size = int(model.vocab_size)
        self._step, self._loop = _programs(graphdef, treedef, opts)
        self._start = _TRACES[0]
        # Every input of a program is committed to where the programs run: the batch to every
        # device of a tensor-parallel mesh, else to the model's device. JAX compiles a program
        # once per placement of its inputs (an uncommitted array and a committed one differ,
        # and a program's outputs are committed once any input is), so host arrays, a loop's
        # carry and a pool written by a swap-in must all meet the placement warm-up compiled.
        mesh = model.mesh if isinstance(model, TensorParallelModel) else None
        if mesh is None:
            self._batch_sharding = make_single_device_sharding(next(iter(leaves[0].devices())))
            leaves = jax.device_put(leaves, self._batch_sharding)  # aliases, never copies
        else:
            self._batch_sharding = NamedSharding(mesh, PartitionSpec())
        self.leaves = leaves
        self.devices = tuple(mesh.devices.flat) if mesh is not None else tuple(leaves[0].devices())
        self.fingerprint = hashlib.sha256(repr((graphdef, describe_tree(leaves), opts,
                                                [d.id for d in self.devices]))
                                          .encode()).hexdigest()  # fmt: skip

    def on_device(self, tree):
        """``tree`` committed where the programs run (every device of a tensor-parallel mesh,
        else the model's device): arrays from any program, or the host, then have one
        sharding, and a program compiled for one of them serves them all."""
        return jax.device_put(tree, self._batch_sharding)

    def place_cache(self, cache):
        """A pool made outside the programs (created, or replaced after a loss) committed to
        the model's device, as the programs' outputs are; a tensor-parallel pool is sharded
        (committed) already and is returned as it is."""
        if isinstance(self._batch_sharding, NamedSharding):
            return cache
        return jax.device_put(cache, self._batch_sharding)

    @property
    def num_compiles(self) -> int:
        return _TRACES[0] - self._start

    def step(self, cache, batch: StepBatch, *, decode: bool, num_top: int = 0,
             processors: tuple = ()):  # fmt: skip
        """Runs one step.

        Args:
          num_top: static; > 0 also returns each row's top ``num_top`` raw log-probabilities
            (beam search, ``logprobs``) and its sampled token's rank.
          processors: static; the batch's logits-processor chains (``batch.logits``).

        Returns:
          ``(cache, tokens i32[R], logprobs f32[R], top, prompt)``: ``top`` is None or
          ``(f32[R, num_top], i32[R, num_top], rank i32[R])``; ``prompt`` (with
          ``batch.prompt_targets``) is None or ``(logprob f32[T], f32[T, num_top],
          i32[T, num_top], rank i32[T])`` of each row's target token.
        """
        statics = dict(decode=decode, num_top=num_top, processors=processors)
        return self._call("step", self._step, statics, cache, batch)

    def decode_loop(self, cache, batch: LoopBatch, *, num_steps: int, mode: str | None = None,
                    num_top: int = 0, processors: tuple = ()):  # fmt: skip
        """Runs up to ``num_steps`` decode steps.

        Args:
          mode: the static sampling mode ("greedy", "random", "truncate"); None computes it
            from ``batch.sampling`` (host arrays; a device carry keeps its first mode).
          num_top, processors: as ``step``'s.

        Returns:
          ``(cache, tokens i32[k, B] (-1 once a row stopped), logprobs f32[k, B], steps run,
          carry, top)``, where ``carry`` is the ``LoopBatch`` a next loop continues from and
          ``top`` None or ``(f32[k, B, num_top], i32[k, B, num_top], rank i32[k, B])``.
        """
        if mode is None:
            s = batch.sampling
            mode = sampling_mode(s.temperature, s.top_k, s.top_p, self.vocab_size)
        statics = dict(num_steps=num_steps, mode=mode, num_top=num_top, processors=processors)
        return self._call("loop", self._loop, statics, cache, batch)

    def _installed_key(self, program: str, statics: dict[str, Any], cache, placed_batch):
        return self.fingerprint, _signature(program, statics, cache, placed_batch)

    def _call(self, program: str, jitted, statics: dict[str, Any], cache, batch):
        """Runs the installed executable of these statics, settings and shapes, else the
        jitted ``program`` (traced and compiled on first use)."""
        batch = self.on_device(batch)
        installed = _INSTALLED.get(self._installed_key(program, statics, cache, batch))
        if installed is not None:
            return installed(self.leaves, cache, batch)
        return jitted(self.leaves, cache, batch, **statics)

    def run_compiled(self, compiled: jax.stages.Compiled, cache, batch):
        """Runs ``compiled`` (an executable of ``step``'s or ``decode_loop``'s program for
        these inputs) as `step` and `decode_loop` run an installed one; returns its outputs."""
        return compiled(self.leaves, cache, self.on_device(batch))

    def install(self, program: str, statics: dict[str, Any], cache, batch,
                compiled: jax.stages.Compiled) -> None:  # fmt: skip
        """Makes ``compiled`` (``step``'s or ``decode_loop``'s program, ``program`` "step"
        or "loop", for these static arguments and inputs' shapes, under the caller's JAX
        settings) the executable that later calls of the same static arguments, settings and
        shapes run, on this runner and on every runner of the same `fingerprint`."""
        _INSTALLED[self._installed_key(program, statics, cache, self.on_device(batch))] = compiled

    def program_parts(self, program: str, statics: dict[str, Any], cache, batch) -> tuple:
        """What decides one program's executable besides jpaged, JAX and the backend (an
        `ExecutableStore` key): the model (graphdef, state, compiler options), the program
        and its static arguments, the pool's and the placed batch's structure, shapes,
        dtypes and shardings."""
        return (self.fingerprint, program, sorted(statics.items()), describe_tree(cache),
                describe_tree(self.on_device(batch)))  # fmt: skip

    def trace_step(self, cache, batch: StepBatch, *, decode: bool, num_top: int = 0,
                   processors: tuple = ()):  # fmt: skip
        """`step`'s program traced for these inputs (a ``jax.stages.Traced``; nothing runs).
        ``.lower().compile()`` compiles it, and a later `step` on inputs of the same shapes
        and kinds (host or device arrays) runs that executable without compiling again."""
        return self._step.trace(self.leaves, cache, self.on_device(batch), decode=decode,
                                num_top=num_top, processors=processors)  # fmt: skip

    def trace_loop(self, cache, batch: LoopBatch, *, num_steps: int, mode: str,
                   num_top: int = 0, processors: tuple = ()):  # fmt: skip
        """`decode_loop`'s program traced for these inputs (see `trace_step`)."""
        return self._loop.trace(self.leaves, cache, self.on_device(batch), num_steps=num_steps,
                                mode=mode, num_top=num_top, processors=processors)  # fmt: skip
