"""Contiguous-KV-cache baselines, the same model and KV budget as jpaged (vLLM paper, 6.1).

- `StaticBatching` (FasterTransformer-style, the common Flax/HF ``generate`` loop): when
  idle, take up to B of the earliest arrived requests, prefill them as one padded batch and
  decode the whole batch until its longest request finishes. The cache is a contiguous
  ``[B, max_len]`` per layer, ``B = budget_tokens // max_len``.
- `Orca` (continuous batching, iteration-level scheduling) with a contiguous per-request
  reservation: ``"max"`` reserves ``max_len`` tokens (Orca-Max), ``"pow2"`` the prompt plus
  the output length rounded up to a power of two (Orca-Pow2), ``"oracle"`` exactly prompt +
  true output length (Orca-Oracle). A request is admitted (FCFS) when a slot is free and
  the reserved tokens of all running requests stay within ``budget_tokens``. Each step
  prefills the newly admitted requests (one padded batch) and decodes every request that was
  already running.

Device side (`ContiguousLM`): the model's own weights, split per layer once, run by an
unrolled layer loop over per-layer caches ``k, v: [num_slots, max_len, K, H]`` (donated, so
the K/V writes are in place: no cache copy per step), with attention by
``jax.nn.dot_product_attention`` (cuDNN on GPU; ``key_value_seq_lengths`` masks the unused
tail). Decode computes the projections and the MLP for the first ``nb`` slots only (``nb``
a power-of-two bucket covering the highest busy slot; slots are handed out lowest first) and
attends (cuDNN) over all slots with the idle ones at length 1, or (XLA) over the first ``nb``
slots (XLA on CPU copies that slice: temporaries of the busy rows' K/V of one layer, not the
whole cache). ``jax.nn.dot_product_attention``
defaults to its XLA path everywhere, so the cuDNN kernel is asked for explicitly on GPU.
Orca-Oracle and Orca-Pow2 hold ``max_num_seqs`` slots of ``max_len`` on device, more than the
budget: their admission obeys the budget, the larger buffer only spares them an allocator
(it favours the baseline).

Tokens are greedy (argmax); output lengths are enforced as in the paper (EOS ignored).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from jpaged import default_compiler_options
from jpaged.models._llama import layer_out_mlp, layer_qkv
from jpaged.models._rope import inverse_frequencies

__all__ = ["ContiguousLM", "KVUsage", "Orca", "StaticBatching", "bucket", "reservation"]


def bucket(n: int, minimum: int, maximum: int) -> int:
    """The smallest power-of-two multiple of ``minimum`` >= n, capped at ``maximum``.

    >>> bucket(5, 8, 64), bucket(100, 8, 64)
    (8, 64)
    """
    b = minimum
    while b < n:
        b *= 2
    return min(b, maximum)


def compile_parallel(lowered: list, threads: int | None = None) -> None:
    """Compiles ``jax.jit(...).lower(...)`` results in a thread pool (XLA releases the GIL);
    a later call of the jitted function with the same shapes reuses the executable."""
    threads = threads or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(low.compile) for low in lowered]:
            f.result()


def reservation(policy: str, prompt_len: int, max_tokens: int, max_len: int) -> int:
    """Token slots a request reserves under ``policy``: "max" ``max_len``, "pow2" the prompt
    plus the output rounded up to a power of two (within ``max_len``), "oracle" prompt +
    output.

    >>> [reservation(p, 100, 30, 2048) for p in ("max", "pow2", "oracle")]
    [2048, 132, 130]
    """
    if policy == "max":
        return max_len
    if policy == "pow2":
        return prompt_len + min(1 << math.ceil(math.log2(max_tokens)), max_len - prompt_len)
    return prompt_len + max_tokens


@dataclasses.dataclass(frozen=True)
class KVUsage:
    """KV memory accounting at one instant, in token slots.

    Attributes:
      pool_slots: the KV budget (the same for every system).
      allocated_slots: slots reserved by running requests (pages held, for jpaged).
      live_tokens: slots holding a token that a running request will read again.
      num_seqs: sequences holding KV memory.
    """

    pool_slots: int
    allocated_slots: int
    live_tokens: int
    num_seqs: int = 0


def _rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def _qkv(cfg, p, x, positions):
    """q [..., N, H], k and v [..., K, H] of one layer (RoPE applied): the model's own code."""
    inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return layer_qkv(cfg, p, x, positions, inv_freq)


def _out_and_mlp(cfg, p, x, o):
    return layer_out_mlp(cfg, p, x, o)


def _next_tokens(cfg, w, x_BD):
    x_BD = _rms_norm(x_BD, w["norm"], cfg.rms_norm_eps)
    head = w["embed"].T if w["lm_head"] is None else w["lm_head"]
    logits_BV = jnp.einsum("bd,dv->bv", x_BD, head, preferred_element_type=jnp.float32)
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


# The contiguous systems compile with the engine's XLA options (on GPU: cuBLAS GEMMs), so
# their matmuls are the same as jpaged's.
_jit = functools.partial(jax.jit, compiler_options=default_compiler_options() or None)


@functools.partial(_jit, static_argnums=(0, 1, 2))
def _prefill(cfg, impl, dtype, w, tokens_BS, lens_B):
    """The prompts' K/V per layer ([B, S, K, H] each) and next tokens; the cache is untouched,
    so one compile per (B, S) serves every system whatever its slot count."""
    B, S = tokens_BS.shape
    x = w["embed"][tokens_BS]
    positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    ks, vs = [], []
    for p in w["layers"]:
        q, k, v = _qkv(cfg, p, x, positions_BS)
        k, v = k.astype(dtype), v.astype(dtype)
        o = jax.nn.dot_product_attention(
            q.astype(dtype), k, v, is_causal=True, query_seq_lengths=lens_B,
            key_value_seq_lengths=lens_B, implementation=impl,
        )  # fmt: skip
        x = _out_and_mlp(cfg, p, x, o)
        ks.append(k)
        vs.append(v)
    last_BD = x[jnp.arange(B), lens_B - 1]
    return tuple(ks), tuple(vs), _next_tokens(cfg, w, last_BD)


@functools.partial(_jit, donate_argnums=0)
def _write_prefill(cache, ks, vs, slots_B):
    """Writes prompt K/V into rows ``slots_B`` (out of range: skipped) of every layer, in place."""
    S = ks[0].shape[1]
    return tuple(
        (kc.at[slots_B, :S].set(k, mode="drop"), vc.at[slots_B, :S].set(v, mode="drop"))
        for (kc, vc), k, v in zip(cache, ks, vs, strict=True)
    )


@functools.partial(_jit, static_argnums=(0, 1), donate_argnums=3)
def _decode(cfg, impl, w, cache, tokens_b, pos_b, active_b):
    nb = tokens_b.shape[0]
    num_slots, max_len = cache[0][0].shape[:2]
    x = w["embed"][tokens_b][:, None]  # [nb, 1, D]
    rows_b = jnp.arange(nb)
    write_b = jnp.where(active_b, pos_b, max_len)  # out of range: dropped
    kv_lens = jnp.ones(num_slots, jnp.int32).at[:nb].set(jnp.where(active_b, pos_b + 1, 1))
    new_cache = []
    for p, (kc, vc) in zip(w["layers"], cache, strict=True):
        q, k, v = _qkv(cfg, p, x, pos_b[:, None])
        kc = kc.at[rows_b, write_b].set(k[:, 0].astype(kc.dtype), mode="drop")
        vc = vc.at[rows_b, write_b].set(v[:, 0].astype(vc.dtype), mode="drop")
        q = q.astype(kc.dtype)
        if impl == "xla":  # attend over the busy slots' rows only
            o = jax.nn.dot_product_attention(q, kc[:nb], vc[:nb],
                                             key_value_seq_lengths=kv_lens[:nb])  # fmt: skip
        else:  # a custom call: the whole cache as operand (a slice would be copied)
            q_full = jnp.zeros((num_slots, *q.shape[1:]), kc.dtype).at[:nb].set(q)
            o = jax.nn.dot_product_attention(
                q_full, kc, vc, key_value_seq_lengths=kv_lens, implementation=impl
            )[:nb]
        x = _out_and_mlp(cfg, p, x, o)
        new_cache.append((kc, vc))
    return tuple(new_cache), _next_tokens(cfg, w, x[:, 0])


class ContiguousLM:
    """A Llama-family model (``jpaged.models.LlamaForCausalLM``) on a contiguous slot cache.

    Args:
      model: the model; its weights are copied per layer (device memory: one more copy).
      num_slots: sequences the cache holds.
      max_len: tokens per slot.
      cache_dtype: K/V dtype (default: the embedding's dtype).
      attention: ``jax.nn.dot_product_attention``'s implementation: None picks ``"cudnn"``
        on a GPU with a 16-bit cache, else ``"xla"`` (jax's own default is always XLA).
        Should cuDNN reject a shape when first compiled, the call falls back to ``"xla"``,
        prints why, and ``attention`` says so (benchmarks record it).

    Raises:
      ValueError: the model has a sliding window (not modelled here) or a size is < 1.
    """

    def __init__(self, model, *, num_slots: int, max_len: int, cache_dtype=None,
                 attention: str | None = None):  # fmt: skip
        cfg = model.config
        if cfg.sliding_window is not None:
            raise ValueError(f"sliding_window={cfg.sliding_window} is not supported here")
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"{num_slots=} and {max_len=} must be >= 1")
        self.config, self.num_slots, self.max_len = cfg, int(num_slots), int(max_len)
        stacked = model.layers.arrays()
        self.weights = {
            "embed": model.embed_VD[...],
            "norm": model.norm_D[...],
            "lm_head": None if model.lm_head_DV is None else model.lm_head_DV[...],
            "layers": [{k: v[i] for k, v in stacked.items()} for i in range(cfg.num_layers)],
        }
        dtype = cache_dtype if cache_dtype is not None else self.weights["embed"].dtype
        shape = (self.num_slots, self.max_len, cfg.num_kv_heads, cfg.head_dim)
        self.cache = tuple(
            (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)
        )
        if attention is None:
            gpu16 = jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2
            attention = "cudnn" if gpu16 else "xla"
        self.attention = attention
        self.fallback: str | None = None
        self.forwards = 0  # device calls of the model (prefill batches and decode steps)

    def _call(self, fn, *args):
        try:
            return fn(self.config, self.attention, *args)
        except Exception as e:  # cuDNN rejected the shape at compile time: nothing ran yet
            if self.attention != "cudnn":
                raise
            self.fallback = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"cuDNN attention unavailable ({self.fallback}); using xla")
            self.attention = "xla"
            return fn(self.config, self.attention, *args)

    def prefill_shape(self, n: int, longest: int) -> tuple[int, int]:
        """The padded (rows, tokens) of a prefill of ``n`` prompts of at most ``longest``."""
        return bucket(n, 1, 1 << 30), bucket(longest, 16, self.max_len)

    def precompile(self, max_prefill_tokens: int, *, threads: int | None = None) -> int:
        """Compiles every shape a run can meet; returns how many programs were compiled.

        Prefill shapes: rows x tokens <= ``max_prefill_tokens`` (or one row), each with its
        cache write; decode: every slot bucket. The programs are lowered one by one and
        compiled by a thread pool (`compile_parallel`); later calls reuse them.
        """
        try:
            return self._precompile(max_prefill_tokens, threads)
        except Exception as e:  # cuDNN rejected a shape: use XLA attention throughout
            if self.attention != "cudnn":
                raise
            self.fallback = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"cuDNN attention unavailable ({self.fallback}); using xla")
            self.attention = "xla"
            return self._precompile(max_prefill_tokens, threads)

    def _precompile(self, max_prefill_tokens: int, threads: int | None) -> int:
        cfg, w, cache, impl = self.config, self.weights, self.cache, self.attention
        dtype = cache[0][0].dtype
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        lowered = []
        S = 16
        while True:
            B = 1
            while self.num_slots >= B and (B == 1 or max_prefill_tokens >= B * S):
                lowered.append(_prefill.lower(cfg, impl, dtype, w, i32((B, S)), i32((B,))))
                kv = tuple(jax.ShapeDtypeStruct((B, S, cfg.num_kv_heads, cfg.head_dim), dtype)
                           for _ in range(cfg.num_layers))  # fmt: skip
                lowered.append(_write_prefill.lower(cache, kv, kv, i32((B,))))
                B *= 2
            if self.max_len <= S:
                break
            S = min(2 * S, self.max_len)
        nb = 8
        while True:
            nb = min(nb, self.num_slots)
            mask = jax.ShapeDtypeStruct((nb,), jnp.bool_)
            lowered.append(_decode.lower(cfg, impl, w, cache, i32((nb,)), i32((nb,)), mask))
            if nb >= self.num_slots:
                break
            nb *= 2
        compile_parallel(lowered, threads)
        return len(lowered)

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> np.ndarray:
        """Writes the prompts' K/V into ``slots``; returns each prompt's next token, i32[n].

        Shapes are bucketed (`prefill_shape`): rows to a power of two, prompts to a power of
        two >= 16 tokens (at most ``max_len``). A slot ``>= num_slots`` is not written.
        """
        n, longest = len(prompts), max(len(p) for p in prompts)
        B, S = self.prefill_shape(n, longest)
        tokens = np.zeros((B, S), np.int32)
        lens = np.ones(B, np.int32)
        rows = np.full(B, self.num_slots, np.int32)  # out of range: not written
        for i, (p, s) in enumerate(zip(prompts, slots, strict=True)):
            tokens[i, : len(p)], lens[i], rows[i] = p, len(p), s
        dtype = self.cache[0][0].dtype
        self.forwards += 1
        ks, vs, nxt = self._call(_prefill, dtype, self.weights, tokens, lens)
        self.cache = _write_prefill(self.cache, ks, vs, rows)
        return np.asarray(nxt)[:n]

    def decode(self, tokens: np.ndarray, positions: np.ndarray, active: np.ndarray) -> np.ndarray:
        """One decode step of slots ``0 .. nb-1`` (arrays of length nb, a bucket); i32[nb]."""
        self.forwards += 1
        self.cache, nxt = self._call(
            _decode,
            self.weights,
            self.cache,
            np.asarray(tokens, np.int32),
            np.asarray(positions, np.int32),
            np.asarray(active, bool),
        )
        return np.asarray(nxt)


@dataclasses.dataclass
class _Req:
    rid: int
    prompt: list[int]
    max_tokens: int
    slot: int = -1
    reserved: int = 0
    num_cached: int = 0  # tokens whose K/V are in the cache
    generated: int = 0
    last_token: int = 0

    @property
    def done(self) -> bool:
        return self.generated >= self.max_tokens


class _SlotSystem:
    """Shared bookkeeping: a FIFO queue, slots handed out lowest first, decode of busy slots."""

    name = "?"

    def __init__(self, lm: ContiguousLM, budget_tokens: int, max_prefill_tokens: int):
        self.lm, self.budget_tokens = lm, int(budget_tokens)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.waiting: deque[_Req] = deque()
        self.running: dict[int, _Req] = {}  # slot -> request
        self.free_slots = list(range(lm.num_slots))
        self.outputs: dict[int, list[int]] = {}  # rid -> generated token ids

    def add(self, rid: int, prompt: list[int], max_tokens: int) -> None:
        if len(prompt) + max_tokens > self.lm.max_len:
            raise ValueError(f"request {rid}: {len(prompt)} + {max_tokens} > {self.lm.max_len}")
        self.waiting.append(_Req(rid, list(prompt), int(max_tokens)))
        self.outputs[rid] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def counts(self) -> dict[str, int]:
        """Model forwards so far; a contiguous system never preempts or swaps."""
        return {"forwards": self.lm.forwards, "preemptions_recompute": 0,
                "preemptions_swap": 0, "swapped_out_bytes": 0}  # fmt: skip

    def _take_slot(self, req: _Req) -> None:
        self.free_slots.sort()
        req.slot = self.free_slots.pop(0)
        self.running[req.slot] = req

    def _prefill(self, reqs: list[_Req]) -> list[tuple[int, int, bool]]:
        nxt = self.lm.prefill([r.prompt for r in reqs], [r.slot for r in reqs])
        for r, t in zip(reqs, nxt, strict=True):
            r.num_cached, r.generated, r.last_token = len(r.prompt), 1, int(t)
            self.outputs[r.rid].append(r.last_token)
        return [(r.rid, r.generated, r.done) for r in reqs]

    def _decode(self, reqs: list[_Req], nb: int | None = None) -> list[tuple[int, int, bool]]:
        """One decode step of ``reqs`` over ``nb`` slot rows (default: up to the last slot)."""
        if nb is None:
            nb = bucket(max(r.slot for r in reqs) + 1, 8, self.lm.num_slots)
        toks, pos, act = np.zeros(nb, np.int32), np.zeros(nb, np.int32), np.zeros(nb, bool)
        for r in reqs:
            toks[r.slot], pos[r.slot], act[r.slot] = r.last_token, r.num_cached, True
        nxt = self.lm.decode(toks, pos, act)
        for r in reqs:
            r.num_cached += 1
            r.generated += 1
            r.last_token = int(nxt[r.slot])
            self.outputs[r.rid].append(r.last_token)
        return [(r.rid, r.generated, r.done) for r in reqs]

    def _release(self, req: _Req) -> None:
        del self.running[req.slot]
        self.free_slots.append(req.slot)


class StaticBatching(_SlotSystem):
    """Static batching with a contiguous ``[B, max_len]`` cache (see the module docstring).

    Args:
      model: ``jpaged.models.LlamaForCausalLM``.
      budget_tokens: the KV budget in token slots; ``B = budget_tokens // max_len``.
      max_len: the longest request (prompt + output).
      max_prefill_tokens: padded-token cap of the prefill batch's bucket (rows stay <= B).
    """

    name = "static"

    def __init__(self, model, *, budget_tokens: int, max_len: int, max_prefill_tokens=2048):
        B = budget_tokens // max_len
        if B < 1:
            raise ValueError(f"{budget_tokens=} must hold one sequence of {max_len=} tokens")
        super().__init__(
            ContiguousLM(model, num_slots=B, max_len=max_len), budget_tokens, max_prefill_tokens
        )
        self.batch: list[_Req] = []

    def step(self) -> list[tuple[int, int, bool]]:
        if not self.batch:
            while self.waiting and self.free_slots:
                req = self.waiting.popleft()
                self._take_slot(req)
                self.batch.append(req)
            # Prefill in row groups of at most max_prefill_tokens padded tokens (activations).
            S = bucket(max(len(r.prompt) for r in self.batch), 16, self.lm.max_len)
            rows = 1 << max(0, (self.max_prefill_tokens // S).bit_length() - 1)  # a power of 2
            out = []
            for i in range(0, len(self.batch), rows):
                out += self._prefill(self.batch[i : i + rows])
            return out
        # The whole batch decodes (finished rows too: their writes are masked, their compute
        # is the static batch's cost) until its longest request finishes.
        live = [r for r in self.batch if not r.done]
        out = self._decode(live, bucket(len(self.batch), 8, self.lm.num_slots))
        if all(r.done for r in self.batch):
            for r in self.batch:
                self._release(r)
            self.batch = []
        return out

    def kv_usage(self) -> KVUsage:
        live = [r.num_cached for r in self.batch if not r.done]
        return KVUsage(self.budget_tokens, len(self.batch) * self.lm.max_len, sum(live),
                       len(self.batch))  # fmt: skip


class Orca(_SlotSystem):
    """Continuous batching with contiguous reservations (see the module docstring).

    Args:
      model: ``jpaged.models.LlamaForCausalLM``.
      policy: ``"max"``, ``"pow2"`` or ``"oracle"``.
      budget_tokens: the KV budget in token slots.
      max_len: the longest request (prompt + output).
      max_num_seqs: most running requests (slots) for ``"pow2"``/``"oracle"``.
      max_prefill_tokens: prompt tokens prefilled per step (at least one request).
    """

    POLICIES = ("max", "pow2", "oracle")

    def __init__(
        self,
        model,
        *,
        policy: str,
        budget_tokens: int,
        max_len: int,
        max_num_seqs: int = 256,
        max_prefill_tokens: int = 2048,
    ):
        if policy not in self.POLICIES:
            raise ValueError(f"{policy=} must be one of {self.POLICIES}")
        slots = budget_tokens // max_len if policy == "max" else max_num_seqs
        if slots < 1:
            raise ValueError(f"{budget_tokens=} must hold one sequence of {max_len=} tokens")
        self.policy, self.name = policy, f"orca-{policy}"
        super().__init__(ContiguousLM(model, num_slots=slots, max_len=max_len), budget_tokens,
                         max_prefill_tokens)  # fmt: skip
        self.reserved = 0

    def _reservation(self, req: _Req) -> int:
        return reservation(self.policy, len(req.prompt), req.max_tokens, self.lm.max_len)

    def step(self) -> list[tuple[int, int, bool]]:
        before = list(self.running.values())
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            need = self._reservation(req)
            fits = self.reserved + need <= self.budget_tokens
            # The padded prefill batch stays within max_prefill_tokens (one prompt always fits).
            longest = max([len(req.prompt)] + [len(r.prompt) for r in admitted])
            B, S = self.lm.prefill_shape(len(admitted) + 1, longest)
            if not fits or (admitted and self.max_prefill_tokens < B * S):
                break
            self.waiting.popleft()
            req.reserved, self.reserved = need, self.reserved + need
            self._take_slot(req)
            admitted.append(req)
        out = self._prefill(admitted) if admitted else []
        if before:
            out += self._decode(before)
        for r in admitted + before:
            if r.done:
                self._release(r)
                self.reserved -= r.reserved
        return out

    def kv_usage(self) -> KVUsage:
        live = sum(r.num_cached for r in self.running.values())
        return KVUsage(self.budget_tokens, self.reserved, live, len(self.running))
