"""Sampled tokens into sequences: stop and length checks, forks, beam steps, prefix commits.

`TokenAppender` is what the engine does with the tokens a step returns: it appends them to
their sequences (with their ``logprobs`` entries when asked) and finishes a sequence on a
stop token, a stop string (`jpaged.engine.stop_strings`) or a length limit (through the
scheduler, which frees its pages); records prompt log-probabilities; forks a prompt into
its ``n`` completions or a beam into the candidates that keep it (pages shared, no copy);
registers newly full pages in the prefix cache; and, for a model whose every layer has a
sliding window, gives back the pages that fell out of the window (`jpaged.kv.window`; for a
model mixing windowed and global layers, the local page group's, `jpaged.kv.page_groups`).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from jpaged.engine import beam, stop_strings
from jpaged.engine.counters import Counters
from jpaged.engine.outputs import logprob_entry
from jpaged.engine.requests import Request, Sequence
from jpaged.engine.scheduler import Scheduler
from jpaged.kv.allocator import BlockAllocator

__all__ = ["TokenAppender"]


class TokenAppender:
    """Applies sampled tokens to sequences.

    Args:
      alloc: the allocator (forks, prefix-cache commits).
      scheduler: finishes and drops sequences (it frees their pages).
      counters: ``tokens_generated`` is added to.
      max_model_len: longest sequence.
      enable_prefix_caching: register full pages in the prefix cache.
      tokenizer: decodes text for stop strings and ``Logprob.decoded_token`` (None: ids only).
      sliding_window: the model's window when every layer has one (the largest), or with two
        page groups the local layers' (the local group's pages go back), else None: computed
        pages outside it go back to the pool.
    """

    def __init__(
        self,
        alloc: BlockAllocator,
        scheduler: Scheduler,
        counters: Counters,
        *,
        max_model_len: int,
        enable_prefix_caching: bool,
        tokenizer: Any = None,
        sliding_window: int | None = None,
    ):
        self.alloc = alloc
        self.scheduler = scheduler
        self.counters = counters
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.tokenizer = tokenizer
        self.sliding_window = sliding_window
        self._seq_ids = itertools.count()

    def new_seq_id(self) -> int:
        """A fresh allocator id for a sequence."""
        return next(self._seq_ids)

    def append(self, req: Request, seq: Sequence, token: int, lp: float, top=None) -> None:
        """Appends one sampled token; finishes the sequence on a stop token, a stop string or
        a limit.

        Args:
          top: the token's ``(top logprobs f32[N], top ids i32[N], rank)`` from the device
            (with ``logprobs``), else None.
        """
        seq.tokens.append(token)
        seq.cumulative_logprob += lp
        self.counters.tokens_generated += 1
        p = req.params
        if p.logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(logprob_entry(token, lp, top, p.logprobs, self.tokenizer))
        reason = None
        after_min = seq.num_generated >= p.min_tokens
        if token in req.stop_ids and after_min:
            reason = "stop"
            seq.stop_reason = token if token in p.stop_token_ids else None
        elif p.stop and self.tokenizer is not None:
            hit = stop_strings.scan(seq, self.tokenizer, p.stop)
            if hit is not None and after_min:
                reason = "stop"
                seq.text_end, seq.stop_reason = hit
        if reason is None and (
            seq.num_generated >= p.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.scheduler.finish_seq(req, seq, reason)

    def append_many(self, req: Request, seq: Sequence, tokens: list[int], lps: list[float],
                    tops=None) -> int:  # fmt: skip
        """``append`` of each token in turn until the sequence finishes; returns how many
        were appended (tokens after a stop are dropped). Without stop tokens, stop strings
        or log-probability entries only the length limits can end it: one slice.

        Args:
          tops: per token its ``top`` triple (``append``), or None.
        """
        p = req.params
        if req.stop_ids or p.stop or p.logprobs is not None:
            for i, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
                self.append(req, seq, tok, lp, None if tops is None else tops[i])
                if seq.finished:
                    return i + 1
            return len(tokens)
        room = max(1, min(p.max_tokens - seq.num_generated, self.max_model_len - seq.num_tokens))
        n = min(len(tokens), room)
        seq.tokens.extend(tokens[:n])
        c = seq.cumulative_logprob
        for lp in lps[:n]:  # in order, as one append after another would add them
            c += lp
        seq.cumulative_logprob = c
        self.counters.tokens_generated += n
        if n == room:
            self.scheduler.finish_seq(req, seq, "length")
        return n

    def record_prompt_logprobs(self, req: Request, positions: list[int], targets: list[int],
                               prompt, rows: list[int]) -> None:  # fmt: skip
        """Stores the prompt log-probabilities a step computed: entry ``positions[i]`` (the
        prompt token ``targets[i]``) from token row ``rows[i]`` of the step's ``prompt``
        output ``(logprob f32[T], top f32[T, N], ids i32[T, N], rank i32[T])``. Entries
        already stored (a recompute after preemption) are kept."""
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * len(req.prompt)
        lp_T, vals_TN, ids_TN, rank_T = prompt
        k = req.num_prompt_logprobs
        for pos, tok, r in zip(positions, targets, rows, strict=True):
            if req.prompt_logprobs[pos] is None:
                req.prompt_logprobs[pos] = logprob_entry(
                    tok, lp_T[r], (vals_TN[r], ids_TN[r], rank_T[r]), k, self.tokenizer
                )

    def commit_pages(self, req: Request, seq: Sequence) -> None:
        """Registers newly computed full pages in the prefix cache (only on a page boundary)."""
        full = seq.num_computed // self.alloc.page_size * self.alloc.page_size
        if not self.enable_prefix_caching or full <= seq.num_committed or seq.finished:
            return
        self.alloc.commit_full_pages(seq.seq_id, seq.tokens[:full], req.salt, verify=False)
        seq.num_committed = full

    def release_outside_window(self, seq: Sequence) -> None:
        """Gives back the pages of ``seq`` no later query sees (keys at positions <=
        ``num_computed - sliding_window``); call it after ``commit_pages``, once the step
        that computed them is dispatched (later device calls run after it)."""
        if self.sliding_window is not None and not seq.finished and seq.seq_id in self.alloc:
            self.alloc.release_outside_window(seq.seq_id, seq.num_computed, self.sliding_window)

    def fork(self, req: Request, parent: Sequence, index: int, seed: int) -> Sequence:
        """A new sequence sharing every page of ``parent`` (refcounts + 1, no copy)."""
        child = Sequence(self.new_seq_id(), index, list(parent.tokens), parent.num_prompt, seed,
                         parent.num_computed, cumulative_logprob=parent.cumulative_logprob,
                         num_committed=parent.num_committed,
                         logprobs=None if parent.logprobs is None else list(parent.logprobs))  # fmt: skip
        self.alloc.fork(parent.seq_id, child.seq_id)
        req.seqs.append(child)
        return child

    def refork(self, req: Request, seq0: Sequence) -> None:
        """The recomputed prompt is in ``seq0``'s pages: the group's other sequences share them
        again (each then recomputes its own generated tokens)."""
        for seq in req.live_seqs()[1:]:
            self.alloc.fork(seq0.seq_id, seq.seq_id)
            seq.num_computed, seq.num_committed = seq0.num_computed, seq0.num_committed
        req.refork = False

    def beam_step(self, req: Request, entries: list[tuple[Sequence, int]], top) -> None:
        """One beam-search step: selects the next beams from the rows' top log-probabilities
        ``top = (lp f32[R, K], ids i32[R, K])``, forking kept beams and dropping the rest."""
        lp_RK, ids_RK = top
        seqs = [s for s, _ in entries]
        rows = [r for _, r in entries]
        choices = beam.select(
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
                child = self.fork(req, parent, j, parent.seed)
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
            self.counters.tokens_generated += 1
