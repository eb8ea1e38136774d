"""Requests and the scheduler: continuous batching, chunked prefill, admission, preemption.

One scheduling unit is a *request* (a prompt with its ``n`` completions or its beams); its
*sequences* are the token streams that own pages in the allocator. Each sequence carries
``tokens`` (prompt + generated) and ``num_computed`` (tokens whose K/V are in the cache);
a step computes ``num_new`` more of them, so prefill, chunked prefill, decode and
recomputation after preemption are one mechanism (vLLM v1's). A sequence samples a token
in the step where its ``num_computed`` reaches ``len(tokens)``.

Per step (``Scheduler.schedule``), under a token budget ``max_num_batched_tokens`` and at
most ``max_num_seqs`` sequences:

1. Running requests, oldest first, get their next tokens (one per decoding sequence, a chunk
   for a prefilling one). When the pool runs out, the youngest running request is
   preempted, by recompute (pages freed, tokens computed again later) or by swap (pages
   copied to host memory, restored later), chosen per request by cost; see ``_preempt``.
2. If nothing was preempted, waiting requests (swapped ones first, then new ones, FCFS)
   are admitted while the pool has room above the watermark and the running sequences'
   lookahead (``lookahead_tokens`` each: the engine's multi-step decode reserves that many
   positions ahead; admitting into that room would turn every decode loop back into single
   steps once the pool fills).

The allocator is the single authority over pages; the scheduler never writes a page
itself. Copy-on-write pairs and swap transfers are handed to callbacks that run them on
device immediately, so they are ordered before any later use of the pages.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from jpaged._errors import OutOfPagesError
from jpaged._sampling import BeamSearchParams, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One token stream with pages in the allocator.

    Attributes:
      seq_id: the allocator's id.
      index: completion index within its request (n > 1), or beam slot.
      tokens: prompt + generated token ids.
      num_prompt: prompt length.
      seed: sampling seed.
      num_computed: tokens whose K/V are in the cache.
      finish_reason: None while running; "stop", "length", "abort" or "error".
      cumulative_logprob: sum of the log-probabilities of the generated tokens.
    """

    seq_id: int
    index: int
    tokens: list[int]
    num_prompt: int
    seed: int
    num_computed: int = 0
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    num_committed: int = 0  # tokens of full pages registered in the prefix cache
    detokenizer: Any = None  # the engine's incremental ``Detokenizer`` of the output text

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and its completions (or beams).

    Attributes:
      request_id: caller's id.
      prompt: prompt token ids.
      params: ``SamplingParams`` or ``BeamSearchParams``.
      arrival: admission order key (monotone).
      seqs: live and finished sequences (for beam search: the live beams).
      status: see ``Status``.
      error: the message when the request failed.
      num_preemptions: how often it was preempted.
      swapped: host copies of its pages while swapped out (engine-owned).
      beam: the beam-search state (``jpaged._beam.BeamState``) or None.
      prompt_text: the prompt string, when given as text.
      salt: prefix-cache salt.
      stop_ids: the token ids that stop a sequence (its stop tokens, and the engine's EOS
        unless ``ignore_eos``), set by the engine at admission.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams | BeamSearchParams
    arrival: int
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    error: str | None = None
    num_preemptions: int = 0
    swapped: Any = None
    beam: Any = None
    prompt_text: str | None = None
    salt: str | None = None
    forked: bool = False
    refork: bool = False
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache
    stop_ids: frozenset[int] = frozenset()  # tokens that stop it (EOS unless ignored)

    def __post_init__(self):
        self.is_beam = isinstance(self.params, BeamSearchParams)

    @property
    def fan_out(self) -> int:
        """Sequences the prompt forks into once prefilled (n, or the beam width)."""
        return self.params.beam_width if self.is_beam else self.params.n

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED


@dataclasses.dataclass
class Scheduled:
    """A sequence's share of one step: ``num_new`` tokens from ``seq.num_computed`` on."""

    seq: Sequence
    request: Request
    num_new: int

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[Scheduled] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    preempted: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return all(s.num_new == 1 for s in self.scheduled)


@dataclasses.dataclass
class PreemptionEvent:
    request_id: str
    mode: str  # "recompute" or "swap"
    tokens: int  # tokens to recompute (recompute) or KV bytes moved out (swap)
    step: int


class Scheduler:
    """Continuous batching over a ``BlockAllocator``.

    Args:
      allocator: the ``jpaged.BlockAllocator``.
      max_num_seqs: most sequences in one step.
      max_num_batched_tokens: token budget of one step (chunked prefill beyond it).
      preemption_mode: "auto" (cheaper of the two per request), "recompute" or "swap".
      swap: engine callbacks ``swap_out(request) -> bytes`` (copies the request's pages to
        host, then frees them) and ``swap_in(request)`` (allocates and restores them; raises
        ``OutOfPagesError`` without side effects when they do not fit), and
        ``swap_cost(request) -> (bytes, seconds)``.
      on_copies: called with copy-on-write ``(src, dst)`` pairs as the allocator emits them.
      recompute_tokens_per_s: prefill throughput assumed by the cost model.
      swap_space_bytes: host memory available for swapped pages.
      max_preemptions: a request preempted more often than this fails ("error"), so an
        undersized pool cannot livelock.
      max_events: preemption events kept in ``events`` (the latest ones).
      lookahead_tokens: positions each running sequence may reserve ahead of its length
        (multi-step decode); admission keeps the pages they need free.
    """

    def __init__(
        self,
        allocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "auto",
        swap_out: Callable[[Request], int],
        swap_in: Callable[[Request], None],
        swap_cost: Callable[[Request], tuple[int, float]],
        recompute_cost: Callable[[Request], tuple[int, float]],
        on_copies: Callable[[list], None],
        on_admit: Callable[[Request], None],
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
        self._swap_out, self._swap_in = swap_out, swap_in
        self._swap_cost, self._recompute_cost = swap_cost, recompute_cost
        self._on_copies, self._on_admit = on_copies, on_admit
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
            self.swapped_bytes -= request.swapped["bytes"]
            request.swapped = None
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

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running):
            req = self.running[i]
            plan = self._plan(req, budget, self.max_num_seqs - len(out.scheduled))
            if plan is None:  # no room in this step's budget; keep its pages, try next step
                i += 1
                continue
            if self._grow(req, plan):
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
            mode = self._preempt(victim)
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

    def _grow(self, req: Request, plan: list[Scheduled]) -> bool:
        """Gives each planned sequence slots for its new tokens; all or nothing."""
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
                self._on_copies(copies)
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

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        reserve = None  # the running sequences' lookahead, computed once something waits
        while self.waiting and budget > 0:
            req = self.waiting[0]
            seq_room = self.max_num_seqs - len(out.scheduled)
            if len(req.live_seqs()) > seq_room:
                return
            if reserve is None:
                reserve = self.lookahead_pages()
            keep = reserve + self._own_lookahead(req) if self.running else 0
            if req.status == Status.SWAPPED:
                if not self._fits(req, keep):
                    return
                try:
                    self._swap_in(req)
                except OutOfPagesError:
                    return
                self.swapped_bytes -= req.swapped["bytes"]
                req.swapped = None
            else:
                if not self._allocate_fresh(req, budget, keep):
                    return
            reserve += self._own_lookahead(req)
            self.waiting.popleft()
            req.status = Status.RUNNING
            # Oldest first, by arrival: a re-admitted request regains its place, so the
            # youngest (by arrival) is always the next victim.
            bisect.insort_right(self.running, req, key=lambda r: r.arrival)
            plan = self._plan(req, budget, seq_room)
            if plan is None or not self._grow(req, plan):
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
            self._on_admit(req)  # creates the sequences (all or nothing)
        except OutOfPagesError:
            return False
        if self.alloc.num_free_pages < self.alloc.watermark_pages + keep and self.running:
            for s in seqs:  # a group (recomputed n > 1 or beams) that eats the watermark
                self.alloc.free(s.seq_id)
                s.num_computed = 0
            return False
        return True

    # ------------------------------------------------------------------ preemption

    def _preempt(self, req: Request) -> str:
        req.num_preemptions += 1
        self.running.remove(req)
        if req.num_preemptions > self.max_preemptions:
            self.fail(req, f"preempted more than max_preemptions={self.max_preemptions} times")
            return "error"
        mode = self._choose_mode(req)
        if mode == "swap":
            moved = self._swap_out(req)
            req.swapped["bytes"] = moved
            self.swapped_bytes += moved
            req.status = Status.SWAPPED
            self.counters["swapped_out_bytes"] += moved
            amount = moved
        else:
            amount = 0
            for seq in req.live_seqs():
                amount += seq.num_computed
                self.alloc.free(seq.seq_id)
                seq.num_computed = seq.num_committed = 0
            # A forked group recomputes its prompt once (first sequence), then forks it again
            # so the prompt's pages are shared as before (see `_plan`).
            req.refork = req.forked and len(req.live_seqs()) > 1
            req.status = Status.WAITING
        self.counters[f"preemptions_{mode}"] += 1
        self.events.append(PreemptionEvent(req.request_id, mode, amount, self.step_index))
        # Preempted requests go back to the head of the queue (they are older than waiting ones).
        self.waiting.appendleft(req)
        return mode

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
