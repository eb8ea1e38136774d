"""``jpaged.LLM``'s single step: one device call over a scheduled batch, sampling,
forks, beam search, and the page callbacks the scheduler makes (admission, copy-on-write,
swap).

``StepMixin`` is one part of ``jpaged.LLM`` (``jpaged/_engine.py``): its methods use the
engine's state (``cache``, ``alloc``, ``scheduler``, ``runner``, the counters) set up by
``LLM.__init__``.
"""

from __future__ import annotations

import math
import time

import numpy as np

from jpaged import _beam
from jpaged._errors import OutOfPagesError
from jpaged._scheduler import Request
from jpaged._scheduler import Sequence as Seq
from jpaged._step import SamplingArrays, bucket, build_step_batch, pad_to
from jpaged.kv.cache import copy_pages, gather_pages, scatter_pages


class StepMixin:
    """Page callbacks and the single (ragged or decode) step of ``jpaged.LLM``."""

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
        t = time.perf_counter()
        self.cache, tok_R, lp_R, top = self.runner.step(
            self.cache, batch, decode=decode, num_top=num_top
        )
        self._timing["dispatch_s"] += time.perf_counter() - t
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
        reason = None
        if token in req.stop_ids and seq.num_generated >= p.min_tokens:
            reason = "stop"
        elif seq.num_generated >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish_seq(req, seq, reason)

    def _append_many(self, req: Request, seq: Seq, tokens: list[int], lps: list[float]) -> int:
        """``_append`` of each token in turn until the sequence finishes; returns how many
        were appended. Without stop tokens only the length limits can end it: one slice."""
        p = req.params
        if req.stop_ids:
            for i, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
                self._append(req, seq, tok, lp)
                if seq.finished:
                    return i + 1
            return len(tokens)
        room = max(1, min(p.max_tokens - seq.num_generated, self.max_model_len - seq.num_tokens))
        n = min(len(tokens), room)
        seq.tokens.extend(tokens[:n])
        c = seq.cumulative_logprob
        for lp in lps[:n]:  # in order, as one _append after another would add them
            c += lp
        seq.cumulative_logprob = c
        self._tokens_generated += n
        if n == room:
            self.scheduler.finish_seq(req, seq, "length")
        return n

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


def _sampling_arrays(samp: np.ndarray, R: int) -> SamplingArrays:
    samp = np.asarray(samp, np.float64).reshape(-1, 5)
    return SamplingArrays(
        temperature=pad_to(samp[:, 0].astype(np.float32), R, 0.0),
        top_k=pad_to(samp[:, 1].astype(np.int32), R, 0),
        top_p=pad_to(samp[:, 2].astype(np.float32), R, 1.0),
        seed=pad_to(samp[:, 3].astype(np.int32), R, 0),
        position=pad_to(samp[:, 4].astype(np.int32), R, 0),
    )
