"""The jpaged engine behind the serving harness: `JpagedSystem` (``jpaged.LLM``, paged pool) and
`ReservingJpaged` (the same engine admitting by contiguous reservations, Orca's policies).

`ReservingJpaged` answers the question the contiguous baselines cannot: how much of jpaged's
advantage is the paged memory and how much the implementation. It runs jpaged's own engine,
with the same decode loops, dispatch overlap, kernels and prefill, but admits a request only
when its contiguous reservation (``_baselines.reservation``: ``max_len`` for "max", prompt +
output rounded up to a power of two for "pow2", prompt + true output for "oracle") fits the
KV budget beside the reservations of the running requests, as Orca does. The difference
between jpaged and ``reserve-max`` is then the memory policy alone.
"""

from __future__ import annotations

from collections import deque

import _baselines
import jax.numpy as jnp

import jpaged
from jpaged.kv.cache import pages_for_budget

__all__ = ["RUN_COUNTS", "JpagedSystem", "ReservingJpaged", "equal_memory_pages"]

# What every system counts (``counts()``): model forwards (device passes over the weights),
# preemptions by recompute and by swap, and bytes swapped out to the host.
RUN_COUNTS = ("forwards", "preemptions_recompute", "preemptions_swap", "swapped_out_bytes")


def equal_memory_pages(model, budget_tokens: int, page_size: int, cache_dtype) -> int:
    """Pages of a ``cache_dtype`` pool (scales included) in the bytes of ``budget_tokens``
    tokens of K/V in the model's dtype."""
    cfg = model.config
    itemsize = jnp.dtype(model.embed_VD[...].dtype).itemsize
    kv_bytes = budget_tokens * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    return pages_for_budget(kv_bytes, cfg.num_layers, cfg.num_kv_heads, page_size, cfg.head_dim,
                            cache_dtype)  # fmt: skip


class JpagedSystem:
    """`jpaged.LLM` behind the harness's system interface (add / step / kv_usage).

    ``n`` > 1 (parallel sampling) samples at temperature 1; ``n`` == 1 is greedy. No host
    swap space unless ``swap_space`` (bytes) is given: the baselines have none, so the KV
    budget is the same for every system; preemption is then by recompute.

    ``cache_dtype`` (e.g. "fp8", "int8"): a quantized pool in the memory that
    ``budget_tokens`` model-dtype tokens take, so it holds more tokens (``pool_tokens``).
    """

    name = "jpaged"

    def __init__(self, model, *, budget_tokens: int, page_size: int, max_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int = 2048,
                 num_decode_steps: int = 1, enable_prefix_caching: bool = False,
                 swap_space: int = 0, cache_dtype=None, **kw):  # fmt: skip
        self.page_size = page_size
        num_pages = budget_tokens // page_size
        if cache_dtype is not None:
            kw["cache_dtype"] = cache_dtype
            num_pages = equal_memory_pages(model, budget_tokens, page_size, cache_dtype)
        self.pool_tokens = num_pages * page_size
        self.llm = jpaged.LLM(
            model, page_size=page_size, num_pages=num_pages,
            max_num_seqs=max_num_seqs, max_model_len=max_len,
            max_num_batched_tokens=max_num_batched_tokens, num_decode_steps=num_decode_steps,
            enable_prefix_caching=enable_prefix_caching, eos_token_id=[], swap_space=swap_space,
            **kw,
        )  # fmt: skip
        self.outputs: dict[int, list[list[int]]] = {}
        self.num_cached_tokens: dict[int, int] = {}
        self._rid: dict[str, int] = {}  # engine request id -> harness id (reusable per run)

    def add(self, rid: int, prompt: list[int], max_tokens: int, *, n: int = 1,
            beam_width: int = 0) -> None:  # fmt: skip
        if beam_width:
            params = jpaged.BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens,
                                             ignore_eos=True)  # fmt: skip
        else:
            params = jpaged.SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True,
                                           temperature=0.0 if n == 1 else 1.0, seed=rid)  # fmt: skip
        self._rid[self.llm.add_request(prompt, params)] = rid

    def step(self) -> list[tuple[int, int, bool]]:
        events = []
        for out in self.llm.step():
            rid = self._rid[out.request_id]
            if out.error:
                raise RuntimeError(f"jpaged failed request {rid}: {out.error}")
            self.outputs[rid] = [c.token_ids for c in out.outputs]
            self.num_cached_tokens[rid] = out.num_cached_tokens
            # Tokens of the request = its longest completion (n > 1 completions run together).
            events.append((rid, max(len(c.token_ids) for c in out.outputs), out.finished))
        return events

    def has_work(self) -> bool:
        return self.llm.has_unfinished_requests()

    def counts(self) -> dict[str, int]:
        """Model forwards (single steps, decode-loop steps, and the steps run beside a chain
        or starting one), preemptions and swap bytes so far (`RUN_COUNTS`)."""
        s = self.llm.stats()
        steps = s["single_steps"] + s["steps_beside_chain"] + s["chains_from_steps"]
        return {"forwards": steps + s["loop_decode_steps"],
                "preemptions_recompute": s["preemptions_recompute"],
                "preemptions_swap": s["preemptions_swap"],
                "swapped_out_bytes": s["swapped_out_bytes"]}  # fmt: skip

    def kv_usage(self) -> _baselines.KVUsage:
        """Pages held (the allocator's count) and tokens whose K/V are in them.

        During a chain of multi-step decode loops the allocator holds the reserved pages but
        learns the new tokens only when the chain ends; those tokens (in private, reserved
        pages) are added from the engine's sequences (``num_computed``: an engine internal).
        """
        llm, C = self.llm, self.page_size
        s = llm.alloc.stats()
        lag = 0
        for req in llm.scheduler.running:
            for seq in req.live_seqs():
                if seq.seq_id in llm.alloc:
                    lag += max(0, seq.num_computed - llm.alloc.num_tokens(seq.seq_id))
        return _baselines.KVUsage(s.total_pages * C, s.used_pages * C, s.live_tokens + lag,
                                  s.num_seqs)  # fmt: skip


class ReservingJpaged:
    """jpaged's engine under an Orca reservation policy (see the module docstring).

    Args:
      inner: the `JpagedSystem` (its pool is the KV budget).
      policy: "max", "pow2" or "oracle".
      budget_tokens: the KV budget the reservations share.
      max_len: the longest request (prompt + output).

    Raises:
      ValueError: an unknown policy, or a budget that holds no request of ``max_len``.
    """

    def __init__(self, inner: JpagedSystem, *, policy: str, budget_tokens: int, max_len: int):
        if policy not in _baselines.Orca.POLICIES:
            raise ValueError(f"{policy=} must be one of {_baselines.Orca.POLICIES}")
        if budget_tokens < max_len:
            raise ValueError(f"{budget_tokens=} must hold one sequence of {max_len=} tokens")
        self.inner, self.policy, self.name = inner, policy, f"reserve-{policy}"
        self.budget_tokens, self.max_len = int(budget_tokens), int(max_len)
        self.waiting: deque[tuple] = deque()
        self.held: dict[int, int] = {}  # rid -> reserved tokens
        self.reserved = 0

    @property
    def llm(self) -> jpaged.LLM:
        return self.inner.llm

    @property
    def outputs(self) -> dict[int, list[list[int]]]:
        return self.inner.outputs

    def add(self, rid: int, prompt: list[int], max_tokens: int, **kw) -> None:
        if len(prompt) + max_tokens > self.max_len:
            raise ValueError(f"request {rid}: {len(prompt)} + {max_tokens} > {self.max_len}")
        self.waiting.append((rid, prompt, max_tokens, kw))

    def _admit(self) -> None:
        """FCFS, while the head's reservation fits and a seat is free."""
        while self.waiting and len(self.held) < self.llm.max_num_seqs:
            rid, prompt, max_tokens, kw = self.waiting[0]
            need = _baselines.reservation(self.policy, len(prompt), max_tokens, self.max_len)
            if self.reserved + need > self.budget_tokens:
                break
            self.waiting.popleft()
            self.held[rid] = need
            self.reserved += need
            self.inner.add(rid, prompt, max_tokens, **kw)

    def step(self) -> list[tuple[int, int, bool]]:
        self._admit()
        events = self.inner.step() if self.inner.has_work() else []
        for rid, _, done in events:
            if done and rid in self.held:
                self.reserved -= self.held.pop(rid)
        return events

    def has_work(self) -> bool:
        return bool(self.waiting) or self.inner.has_work()

    def counts(self) -> dict[str, int]:
        return self.inner.counts()

    def kv_usage(self) -> _baselines.KVUsage:
        """The reserved slots are what this policy allocates; the live tokens are the
        engine's."""
        u = self.inner.kv_usage()
        return _baselines.KVUsage(self.budget_tokens, self.reserved, u.live_tokens, u.num_seqs)
