"""The scheduler: continuous batching, chunked prefill, admission and preemption, as a plan.

Per step (``Scheduler.schedule``), under a token budget ``max_num_batched_tokens`` and at
most ``max_num_seqs`` sequences:

1. Running requests, oldest first, get their next tokens (one per decoding sequence, a chunk
   for a prefilling one). When the pool runs out, the youngest running request is
   preempted, by recompute (pages freed, tokens computed again later) or by swap (pages
   moved to the host swap space, restored later), chosen per request by cost; see
   ``_preempt``.
2. If nothing was preempted, waiting requests (swapped ones first, then new ones, FCFS)
   are admitted while the pool has room above the watermark and the running sequences'
   lookahead (``lookahead_tokens`` each: the engine's decode chains reserve that many
   positions ahead; admitting into that room would turn every decode loop back into single
   steps once the pool fills).

The scheduler works on the host only: it changes the allocator (the single authority over
pages) and returns a `StepPlan`, data the engine applies: the sequences and token counts
that run, the preemptions, and the device page operations the allocator emitted (swap-outs,
copy-on-write copies, swap-ins) in the order it emitted them. The engine runs those page
operations in that order, and before the step writes the pool: a swap-out's gather reads
its pages before a later copy or write can reuse them.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from jpaged._errors import OutOfPagesError
from jpaged.engine.requests import Request, Sequence, Status
from jpaged.kv.allocator import BlockAllocator
from jpaged.kv.page_groups import swap_out_pages

__all__ = ["PageOp", "PreemptionEvent", "Scheduled", "Scheduler", "StepPlan"]


@dataclasses.dataclass
class Scheduled:
    """A sequence's share of one step: ``num_new`` tokens from ``seq.num_computed`` on."""

    seq: Sequence
    request: Request
    num_new: int

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclasses.dataclass(frozen=True)
class PageOp:
    """One device page operation of a plan.

    Attributes:
      kind: "swap_out" (``(device_page, host_slot)`` pairs: gather the pages to the host),
        "copy" (``(src, dst)`` pages: copy-on-write) or "swap_in" (``(host_slot,
        device_page)`` pairs: scatter host pages back).
      pairs: the pairs, as the allocator returned them.
      request_id: the request whose pages move or are copied.
    """

    kind: str
    pairs: tuple[tuple[int, int], ...]
    request_id: str | None = None


@dataclasses.dataclass
class StepPlan:
    """What one step runs, as data; the engine applies it.

    Attributes:
      scheduled: each running sequence's share of the step (oldest request first).
      num_tokens: total new tokens of ``scheduled``.
      preempted: ``(request_id, mode)`` of the requests preempted while planning ("swap",
        "recompute", or "error" past ``max_preemptions``).
      page_ops: device page operations, in the order the allocator emitted them; the engine
        runs them in this order before the step.
      blocked: (a plan beside a chain of decode loops) a running request could not grow:
        nothing runs (``scheduled`` is empty), but ``page_ops`` still must (copies of the
        requests that grew before it: their slots stay, and no later plan emits them again).
    """

    scheduled: list[Scheduled] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    preempted: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    page_ops: list[PageOp] = dataclasses.field(default_factory=list)
    blocked: bool = False

    @property
    def decode_only(self) -> bool:
        return all(s.num_new == 1 for s in self.scheduled)

    def pairs(self, kind: str) -> list[tuple[int, int]]:
        """Every pair of the page operations of ``kind``, in order."""
        return [pair for op in self.page_ops if op.kind == kind for pair in op.pairs]


@dataclasses.dataclass
class PreemptionEvent:
    request_id: str
    mode: str  # "recompute" or "swap"
    tokens: int  # tokens to recompute (recompute) or KV bytes moved out (swap)
    step: int


class Scheduler:
    """Continuous batching over a ``BlockAllocator``; ``schedule`` returns a `StepPlan`.

    Args:
      allocator: the ``jpaged.BlockAllocator`` (its ``bytes_per_page`` prices swaps).
      max_num_seqs: most sequences in one step.
      max_num_batched_tokens: token budget of one step (chunked prefill beyond it).
      preemption_mode: "auto" (cheaper of the two per request), "recompute" or "swap".
      enable_prefix_caching: admission reuses cached pages of equal prompt prefixes.
      swap_bytes_per_s, recompute_tokens_per_s: the cost model of "auto" preemption
        (a swap moves the bytes out and back; a recompute prefills the computed tokens).
      swap_space_bytes: host memory available for swapped pages.
      max_preemptions: a request preempted more often than this fails ("error"), so an
        undersized pool cannot livelock.
      max_events: preemption events kept in ``events`` (the latest ones).
      lookahead_tokens: positions each running sequence may reserve ahead of its length
        (decode chains); admission keeps the pages they need free.

    Raises:
      ValueError: an unknown ``preemption_mode`` or a negative ``lookahead_tokens``.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "auto",
        enable_prefix_caching: bool = True,
        swap_bytes_per_s: float = 16e9,
        recompute_tokens_per_s: float = 20e3,
        swap_space_bytes: int = 1 << 30,
        max_preemptions: int = 64,
        max_events: int = 4096,
        lookahead_tokens: int = 0,
    ):
        if preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"{preemption_mode=} must be 'auto', 'recompute' or 'swap'")
        self.alloc = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.enable_prefix_caching = enable_prefix_caching
        self._swap_bps, self._recompute_tps = swap_bytes_per_s, recompute_tokens_per_s
        self.swap_space_bytes = swap_space_bytes
        self.max_preemptions = max_preemptions
        if not isinstance(lookahead_tokens, int) or lookahead_tokens < 0:
            raise ValueError(f"{lookahead_tokens=} must be an int >= 0")
        self.lookahead_tokens = lookahead_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.swapped_bytes = 0  # currently on host
        # The latest preemptions (bounded: a long-running server preempts without end).
        self.events: collections.deque[PreemptionEvent] = collections.deque(maxlen=max_events)
        self.counters = collections.Counter()
        self.step_index = 0
        self._finished: list[Request] = []

    # ------------------------------------------------------------------ queue management

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_seq(self, request: Request, seq: Sequence, reason: str) -> None:
        """Marks ``seq`` finished and frees its pages; finishes the request when none is left."""
        if seq.finished:
            return
        seq.finish_reason = reason
        self.alloc.free(seq.seq_id)
        if not request.live_seqs():
            self._finish_request(request)

    def drop_seq(self, request: Request, seq: Sequence) -> None:
        """Frees a sequence that is no longer part of its request (a dropped beam)."""
        self.alloc.free(seq.seq_id)
        request.seqs.remove(seq)

    def fail(self, request: Request, message: str) -> None:
        """Fails a request (finish reason "error") and frees everything it holds."""
        request.error = message
        self._release(request, "error")

    def abort(self, request: Request) -> None:
        self._release(request, "abort")

    def _release(self, request: Request, reason: str) -> None:
        if request.status == Status.SWAPPED:
            self.swapped_bytes -= request.swapped_pages * self.alloc.bytes_per_page
            request.swapped_pages = 0
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = reason
                if self._holds_pages(seq):
                    self.alloc.free(seq.seq_id)
        self._finish_request(request)

    def _holds_pages(self, seq: Sequence) -> bool:
        return seq.seq_id in self.alloc

    def _finish_request(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        self._finished.append(request)

    def take_finished(self) -> list[Request]:
        """Requests finished (or failed, or aborted) since the last call."""
        done, self._finished = self._finished, []
        return done

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> StepPlan:
        """Plans one step (changing the allocator); the engine applies the returned plan."""
        self.step_index += 1
        out = StepPlan()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running):
            req = self.running[i]
            plan = self._plan(req, budget, self.max_num_seqs - len(out.scheduled))
            if plan is None:  # no room in this step's budget; keep its pages, try next step
                i += 1
                continue
            if self._grow(req, plan, out):
                out.scheduled.extend(plan)
                used = sum(p.num_new for p in plan)
                budget -= used
                out.num_tokens += used
                i += 1
                continue
            # Out of pages: preempt the youngest running request (possibly this one).
            victim = self.running[-1]
            preempted = True
            if victim is req and len(self.running) == 1:
                self.fail(req, self._cannot_fit_message(req))
                continue
            mode = self._preempt(victim, out)
            out.preempted.append((victim.request_id, mode))
            out.scheduled = [s for s in out.scheduled if s.request is not victim]
            # `i` stays: retry `req` (or move on if it was the victim and got removed).
        if not preempted:
            self._admit(out, budget)
        if not preempted and not out.scheduled and not self.running and self.waiting:
            # Nothing runs and the head cannot be admitted into an empty pool: fail it rather
            # than spin (validation at add time makes this unreachable for sane settings).
            head = self.waiting[0]
            self.fail(head, f"request {head.request_id!r} cannot be admitted: "
                      + self._cannot_fit_message(head))  # fmt: skip
        return out

    def _plan(self, req: Request, budget: int, seq_room: int) -> list[Scheduled] | None:
        """This step's tokens for the request's live sequences (None: nothing fits now)."""
        seqs = req.live_seqs()
        if len(seqs) > seq_room:
            return None
        if req.refork:  # after a recompute: only the first sequence, up to the prompt's end
            seq = seqs[0]
            num_new = min(len(req.prompt) - seq.num_computed, budget)
            return [Scheduled(seq, req, num_new)] if num_new > 0 else None
        if req.is_beam and req.forked:
            return self._plan_beams(req, seqs, budget)
        plan = []
        for seq in seqs:
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            if num_new <= 0:
                break
            plan.append(Scheduled(seq, req, num_new))
            budget -= num_new
        return plan or None

    def _plan_beams(self, req: Request, seqs: list[Sequence], budget: int):
        """Beams sample together: each beam first computes all but its last token (in chunks
        after a recompute), then all beams run their last token in one step."""
        remaining = [s.num_tokens - s.num_computed for s in seqs]
        if all(r == 1 for r in remaining):
            return [Scheduled(s, req, 1) for s in seqs] if len(seqs) <= budget else None
        plan = []
        for seq, r in zip(seqs, remaining, strict=True):
            num_new = min(r - 1, budget)
            if num_new > 0:
                plan.append(Scheduled(seq, req, num_new))
                budget -= num_new
        return plan or None

    def _grow(self, req: Request, plan: list[Scheduled], out: StepPlan) -> bool:
        """Gives each planned sequence slots for its new tokens; all or nothing (copies
        already emitted stay in ``out``: the pages they fill stay in the tables)."""
        grown: list[tuple[Scheduled, int]] = []
        for p in plan:
            held = self.alloc.num_tokens(p.seq.seq_id)
            extra = p.seq.num_computed + p.num_new - held
            if extra <= 0:
                continue
            try:
                copies = self.alloc.append_slots(p.seq.seq_id, extra)
            except OutOfPagesError:
                for g, before in grown:
                    self.alloc.truncate(g.seq.seq_id, before)
                return False
            if copies:
                out.page_ops.append(PageOp("copy", tuple(copies), req.request_id))
            grown.append((p, held))
        return True

    def _cannot_fit_message(self, req: Request) -> str:
        seqs = req.live_seqs()
        need = sum(s.num_tokens for s in seqs)
        return (
            f"out of KV pages: request {req.request_id!r} needs slots for {need} tokens over "
            f"{len(seqs)} sequence(s) and is alone in a pool of {self.alloc.num_pages} pages of "
            f"{self.alloc.page_size} tokens"
        )

    def lookahead_pages(self, ahead: int = 0) -> int:
        """Pages the running sequences would take to grow ``ahead`` tokens and then reserve
        ``lookahead_tokens`` each (beam search never runs decode loops: no lookahead)."""
        return sum(
            self.alloc.growth_pages(s.seq_id, ahead + (0 if r.is_beam else self.lookahead_tokens))
            for r in self.running for s in r.live_seqs() if s.seq_id in self.alloc
        ) if ahead or self.lookahead_tokens else 0  # fmt: skip

    def _own_lookahead(self, req: Request) -> int:
        """Lookahead pages of a request about to be admitted (its sequences once forked: each
        may first copy the shared last page of the prompt)."""
        if not self.lookahead_tokens or req.is_beam:
            return 0
        per_seq = -(-self.lookahead_tokens // self.alloc.page_size) + (req.fan_out > 1)
        return req.fan_out * per_seq

    def _swap_keep(self, req: Request, keep: int) -> int:
        """Pages a swap-in must leave free beyond the watermark: the lookahead ``keep``, and
        (the engine's rule against swapping straight back out) one page per sequence that
        will run."""
        if not self.running:
            return keep
        seqs = sum(len(r.live_seqs()) for r in self.running) + len(req.live_seqs())
        return max(keep, seqs - self.alloc.watermark_pages)

    @staticmethod
    def _admitted_seqs(req: Request) -> list[Sequence]:
        """The sequences admission registers (after a recompute of a group, the first)."""
        return req.live_seqs()[:1] if req.refork else req.live_seqs()

    def _fits(self, req: Request, keep: int) -> bool:
        """Whether the request's pages fit above the watermark and ``keep`` more pages (a
        group's fresh pages estimated from its lengths); changes nothing."""
        if req.status == Status.SWAPPED:
            ids = [s.seq_id for s in req.live_seqs()]
            return self.alloc.can_swap_in(ids, keep_free=self._swap_keep(req, keep))
        seqs = self._admitted_seqs(req)
        if len(seqs) == 1:
            return self.alloc.can_allocate(seqs[0].num_tokens, token_ids=seqs[0].tokens,
                                           salt=req.salt, keep_free=keep)  # fmt: skip
        free = self.alloc.num_free_pages - self.alloc.watermark_pages - keep
        return sum(-(-s.num_tokens // self.alloc.page_size) for s in seqs) <= free

    def can_admit_head(self, ahead: int = 1) -> bool:
        """Whether the head of the queue would be admitted once every running sequence has
        grown ``ahead`` more tokens (1: the next step's token; in a chain of decode loops
        also the tokens of the loop in flight), keeping the watermark and the running
        sequences' lookahead free; changes nothing. The engine ends a chain of decode loops
        for a waiting request only when this holds."""
        if not self.waiting:
            return False
        req = self.waiting[0]
        seats = sum(len(r.live_seqs()) for r in self.running)
        if seats + len(req.live_seqs()) > self.max_num_seqs:
            return False
        # `_admit` keeps nothing free for an empty batch.
        keep = self.lookahead_pages(ahead) + self._own_lookahead(req) if self.running else 0
        return self._fits(req, keep)

    def _admit(self, out: StepPlan, budget: int, *, seats: int | None = None,
               max_heads: int | None = None) -> None:  # fmt: skip
        """Admits waiting requests, FCFS. ``seats``: sequences already seated (default:
        those of ``out``); ``max_heads``: at most this many (default: no limit)."""
        reserve = None  # the running sequences' lookahead, computed once something waits
        while self.waiting and budget > 0 and max_heads != 0:
            req = self.waiting[0]
            seq_room = self.max_num_seqs - (len(out.scheduled) if seats is None else seats)
            if len(req.live_seqs()) > seq_room:
                return
            if reserve is None:
                reserve = self.lookahead_pages()
            keep = reserve + self._own_lookahead(req) if self.running else 0
            if req.status == Status.SWAPPED:
                if not self._fits(req, keep) or not self._swap_in(req, out):
                    return
                self.swapped_bytes -= req.swapped_pages * self.alloc.bytes_per_page
                req.swapped_pages = 0
            else:
                if not self._allocate_fresh(req, budget, keep):
                    return
            reserve += self._own_lookahead(req)
            if seats is not None:
                seats += len(req.live_seqs())
            if max_heads is not None:
                max_heads -= 1
            self.waiting.popleft()
            req.status = Status.RUNNING
            # Oldest first, by arrival: a re-admitted request regains its place, so the
            # youngest (by arrival) is always the next victim.
            bisect.insort_right(self.running, req, key=lambda r: r.arrival)
            plan = self._plan(req, budget, seq_room)
            if plan is None or not self._grow(req, plan, out):
                continue  # admitted; it gets its tokens next step
            out.scheduled.extend(plan)
            used = sum(p.num_new for p in plan)
            budget -= used
            out.num_tokens += used

    def _allocate_fresh(self, req: Request, budget: int, keep: int = 0) -> bool:
        """Registers the request's sequences in the allocator (prefix hits attached), keeping
        the watermark and ``keep`` more pages (lookahead) free."""
        seqs = self._admitted_seqs(req)
        if len(seqs) == 1 and not self._fits(req, keep):
            return False
        try:
            self._create_seqs(req)  # all or nothing
        except OutOfPagesError:
            return False
        if self.alloc.num_free_pages < self.alloc.watermark_pages + keep and self.running:
            for s in seqs:  # a group (recomputed n > 1 or beams) that eats the watermark
                self.alloc.free(s.seq_id)
                s.num_computed = 0
            return False
        return True

    def _create_seqs(self, req: Request) -> None:
        """Creates the request's admitted sequences in the allocator (all or nothing)."""
        done = []
        try:
            for seq in self._admitted_seqs(req):
                tokens = req.prompt if req.refork else seq.tokens
                seq.num_committed = 0
                if self.enable_prefix_caching and req.reads_prefix_cache:
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

    def _swap_in(self, req: Request, out: StepPlan) -> bool:
        """Swaps a swapped-out request back in (a "swap_in" page operation); False when its
        pages do not fit yet. Keeps one page per sequence that will run free beyond them, so
        the next decode step does not preempt it right back (swap ping-pong when the pool is
        nearly full)."""
        ids = [s.seq_id for s in req.live_seqs()]
        running = self.running
        headroom = sum(len(r.live_seqs()) for r in running) + len(ids) if running else 0
        # Room above the watermark, and ``headroom`` pages left free after the swap (in each
        # page group: a grouped pool's pages of a sequence are spread over two groups).
        keep_free = headroom - self.alloc.watermark_pages
        if not self.alloc.can_swap_in(ids) or not self.alloc.can_swap_in(ids, keep_free=keep_free):
            return False
        pairs = self.alloc.swap_in(ids)
        out.page_ops.append(PageOp("swap_in", tuple(pairs), req.request_id))
        return True

    # ------------------------------------------------------------------ preemption

    def _preempt(self, req: Request, out: StepPlan) -> str:
        req.num_preemptions += 1
        self.running.remove(req)
        if req.num_preemptions > self.max_preemptions:
            self.fail(req, f"preempted more than max_preemptions={self.max_preemptions} times")
            return "error"
        mode = self._choose_mode(req)
        if mode == "swap":
            pairs = self.alloc.swap_out([s.seq_id for s in req.live_seqs()])
            out.page_ops.append(PageOp("swap_out", tuple(pairs), req.request_id))
            req.swapped_pages = len(pairs)
            moved = len(pairs) * self.alloc.bytes_per_page
            self.swapped_bytes += moved
            req.status = Status.SWAPPED
            self.counters["swapped_out_bytes"] += moved
            amount = moved
        else:
            amount = self._drop_kv(req)
        self.counters[f"preemptions_{mode}"] += 1
        self.events.append(PreemptionEvent(req.request_id, mode, amount, self.step_index))
        # Preempted requests go back to the head of the queue (they are older than waiting ones).
        self.waiting.appendleft(req)
        return mode

    def _drop_kv(self, req: Request) -> int:
        """Frees the request's pages; it waits to compute its tokens again (recompute).
        Returns the tokens whose K/V it dropped."""
        amount = 0
        for seq in req.live_seqs():
            amount += seq.num_computed
            if self._holds_pages(seq):
                self.alloc.free(seq.seq_id)
            seq.num_computed = seq.num_committed = 0
        # A forked group recomputes its prompt once (first sequence), then forks it again
        # so the prompt's pages are shared as before (see `_plan`).
        req.refork = req.forked and len(req.live_seqs()) > 1
        req.status = Status.WAITING
        return amount

    def restart_running(self) -> list[Request]:
        """Sends every running request back to the head of the queue, its pages freed, to
        compute its tokens again (the engine's recovery when the device pool was lost).
        Returns them, oldest first."""
        restarted, self.running = self.running, []
        for req in reversed(restarted):
            self._drop_kv(req)
            self.waiting.appendleft(req)
        return restarted

    def _choose_mode(self, req: Request) -> str:
        swap_bytes, swap_s = self._swap_cost(req)
        fits = self.swapped_bytes + swap_bytes <= self.swap_space_bytes
        if self.preemption_mode == "swap":
            return "swap" if fits else "recompute"
        if self.preemption_mode == "recompute":
            return "recompute"
        if len(req.live_seqs()) > 1:
            # A forked group (n > 1, beams) recomputes each sequence separately and keeps only
            # what the prefix cache still holds of the shared prompt; swap keeps the sharing.
            return "swap" if fits else "recompute"
        _, recompute_s = self._recompute_cost(req)
        return "swap" if fits and swap_s < recompute_s else "recompute"

    def _swap_cost(self, req: Request) -> tuple[int, float]:
        """(bytes, seconds) of swapping the request out and back; huge when it cannot."""
        ids = [s.seq_id for s in req.live_seqs()]
        if not ids or self.alloc.num_host_pages == 0 or not self.alloc.can_swap_out(ids):
            return 1 << 62, float("inf")
        nbytes = swap_out_pages(self.alloc, ids) * self.alloc.bytes_per_page
        return nbytes, 2 * nbytes / self._swap_bps

    def _recompute_cost(self, req: Request) -> tuple[int, float]:
        """(tokens, seconds) of computing the request's cached tokens again."""
        tokens = sum(s.num_computed for s in req.live_seqs())
        return tokens, tokens / self._recompute_tps
