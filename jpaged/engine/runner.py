"""The runner: the jitted step programs of a model on the paged cache (cache donated).

Two jitted programs run a model on the paged cache:

- ``step``: one forward over a ragged token batch (prefill chunks and decodes mixed), then
  on-device sampling of one token per logits row (and, for beam search, the top
  log-probabilities of each row).
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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.engine.batches import LoopBatch, SamplingArrays, StepBatch
from jpaged.engine.sampling import sample, sampling_mode, top_logprobs
from jpaged.models._protocol import AttentionMetadata

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


def default_compiler_options(platform: str | None = None) -> dict[str, Any]:
    """The step programs' XLA options for ``platform``: "cuda" gets ``GPU_COMPILER_OPTIONS``
    (measured on an H200), anything else (CPU, TPU, ROCm: not measured) XLA's defaults.
    Default: the default backend's platform ("gpu" resolves to "cuda" or "rocm").

    >>> default_compiler_options("cpu"), default_compiler_options("rocm")
    ({}, {})
    >>> sorted(default_compiler_options("cuda"))
    ['xla_gpu_enable_dynamic_slice_fusion', 'xla_gpu_enable_triton_gemm']
    """
    if platform is None:
        platform = jax.default_backend()
        if platform == "gpu":
            version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
            platform = "rocm" if "rocm" in version or "hip" in version else "cuda"
    return dict(GPU_COMPILER_OPTIONS) if platform == "cuda" else {}


def _sampled(logits_RV, s: SamplingArrays, mode: str | None = None):
    return sample(logits_RV, s.temperature, s.top_k, s.top_p, s.seed, s.position, mode=mode)


_TRACES = [0]  # traces (= compiles) of the step programs in this process


def _step_impl(graphdef, state, cache, batch: StepBatch, *, decode: bool, num_top: int):
    _TRACES[0] += 1  # runs once per trace, i.e. once per compile
    model = nnx.merge(graphdef, state)
    logits_RV, cache = model(batch.tokens, batch.positions, cache, batch.metadata, decode=decode)
    tokens_R, logprobs_R = _sampled(logits_RV, batch.sampling)
    top = top_logprobs(logits_RV, num_top) if num_top else None
    return cache, tokens_R, logprobs_R, top


def _loop_impl(graphdef, state, cache, batch: LoopBatch, *, num_steps: int, mode: str):
    _TRACES[0] += 1
    model = nnx.merge(graphdef, state)
    B, W = batch.block_tables.shape
    C = cache.page_size
    rows_B = jnp.arange(B, dtype=jnp.int32)
    cu_q_lens = jnp.arange(B + 1, dtype=jnp.int32)

    def body(_, carry):
        ran, cache, tok_B, lens_B, active_B, gen_B, out_KB, lp_KB = carry
        step = ran  # iterations run with an active row: they come first
        page_B = batch.block_tables[rows_B, jnp.minimum(lens_B // C, W - 1)]
        slot_B = jnp.where(active_B, page_B * C + lens_B % C, -1)
        meta = AttentionMetadata(
            slot_mapping=slot_B,
            block_tables=batch.block_tables,
            kv_lens=jnp.where(active_B, lens_B + 1, 0),
            cu_q_lens=cu_q_lens,
            num_seqs=jnp.int32(B),
            logits_indices=rows_B,
        )
        logits_BV, cache = model(tok_B, lens_B, cache, meta, decode=True)
        s = dataclasses.replace(batch.sampling, position=lens_B + 1)
        new_B, lp_B = _sampled(logits_BV, s, mode)
        any_B = jnp.any(active_B)
        k = jnp.minimum(step, num_steps - 1)
        out_KB = out_KB.at[k].set(jnp.where(any_B & active_B, new_B, out_KB[k]))
        lp_KB = lp_KB.at[k].set(jnp.where(any_B, lp_B, lp_KB[k]))
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
        )

    init = (
        jnp.int32(0),
        cache,
        batch.tokens,
        batch.lens,
        batch.active & batch.live & (batch.max_steps > 0),
        jnp.zeros((B,), jnp.int32),
        jnp.full((num_steps, B), -1, jnp.int32),
        jnp.zeros((num_steps, B), jnp.float32),
    )
    # A loop of a known trip count (num_steps; iterations after every row stopped write
    # nothing): a data-dependent while condition would make the host wait for the device on
    # every iteration on GPU (XLA reads the predicate back), so the call would not return
    # before the loop ended.
    steps, cache, tok_B, lens_B, active_B, gen_B, out_KB, lp_KB = jax.lax.fori_loop(
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
    return cache, out_KB, lp_KB, steps, carry


@functools.cache
def _programs(graphdef, treedef, compiler_options: tuple = ()):
    """The jitted step programs of one model structure (shared by every engine over it).

    The model state travels as a flat list of arrays and the graphdef is closed over, so a
    call hashes nothing and flattens no module tree (host dispatch cost per step)."""

    def merge(leaves):
        return jax.tree.unflatten(treedef, leaves)

    def step(leaves, cache, batch, *, decode, num_top):
        return _step_impl(graphdef, merge(leaves), cache, batch, decode=decode, num_top=num_top)

    def loop(leaves, cache, batch, *, num_steps, mode):
        return _loop_impl(graphdef, merge(leaves), cache, batch, num_steps=num_steps, mode=mode)

    opts = dict(compiler_options) or None
    return (
        jax.jit(step, static_argnames=("decode", "num_top"), donate_argnames=("cache",),
                compiler_options=opts),
        jax.jit(loop, static_argnames=("num_steps", "mode"), donate_argnames=("cache",),
                compiler_options=opts),
    )  # fmt: skip


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
    """

    def __init__(self, model: nnx.Module, *, compiler_options: dict[str, Any] | None = None):
        graphdef, state = nnx.split(model)
        self.leaves, treedef = jax.tree.flatten(state)
        opts = tuple(sorted((compiler_options or {}).items()))
        self.compiler_options = dict(opts)
        self.vocab_size = int(model.vocab_size)
        self._step, self._loop = _programs(graphdef, treedef, opts)
        self._start = _TRACES[0]

    @property
    def num_compiles(self) -> int:
        return _TRACES[0] - self._start

    def step(self, cache, batch: StepBatch, *, decode: bool, num_top: int = 0):
        """Runs one step; returns (cache, tokens i32[R], logprobs f32[R], top or None)."""
        return self._step(self.leaves, cache, batch, decode=decode, num_top=num_top)

    def decode_loop(self, cache, batch: LoopBatch, *, num_steps: int, mode: str | None = None):
        """Runs up to ``num_steps`` decode steps.

        Args:
          mode: the static sampling mode ("greedy", "random", "truncate"); None computes it
            from ``batch.sampling`` (host arrays; a device carry keeps its first mode).

        Returns:
          ``(cache, tokens i32[k, B] (-1 once a row stopped), logprobs f32[k, B], steps run,
          carry)``, where ``carry`` is the ``LoopBatch`` a next loop continues from.
        """
        if mode is None:
            s = batch.sampling
            mode = sampling_mode(s.temperature, s.top_k, s.top_p, self.vocab_size)
        return self._loop(self.leaves, cache, batch, num_steps=num_steps, mode=mode)

    def trace_step(self, cache, batch: StepBatch, *, decode: bool, num_top: int = 0):
        """`step`'s program traced for these inputs (a ``jax.stages.Traced``; nothing runs).
        ``.lower().compile()`` compiles it, and a later `step` on inputs of the same shapes
        and kinds (host or device arrays) runs that executable without compiling again."""
        return self._step.trace(self.leaves, cache, batch, decode=decode, num_top=num_top)

    def trace_loop(self, cache, batch: LoopBatch, *, num_steps: int, mode: str):
        """`decode_loop`'s program traced for these inputs (see `trace_step`)."""
        return self._loop.trace(self.leaves, cache, batch, num_steps=num_steps, mode=mode)
