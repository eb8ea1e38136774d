"""Warm-up: every step program of the configuration compiled, in parallel, then run once.

`warmup_programs` lowers each program of the `BucketGrid` (``BucketGrid.programs``) in the
calling thread (tracing holds the GIL) and compiles them in a thread pool as they come (XLA
releases the GIL; with a persistent compilation cache, a compile is a load from disk).
With a cache directory, each compiled step program is also written to the
`ExecutableStore` there, and a later warm-up loads it from the store in the pool without
tracing or lowering it (`Runner.install` makes the runner call it).
Meanwhile the calling thread runs the page programs of copy-on-write and swap; then it runs
each step program once on inputs that write nothing (padding rows, slot -1), which also sets
up its dispatch. A `WarmupReport` says what was compiled and how long each part took.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time

import jax
import numpy as np

from jpaged.engine.batches import LoopBatch, StepBatch, build_step_batch, sampling_arrays
from jpaged.engine.buckets import BucketGrid, ProgramKey, stop_bucket
from jpaged.engine.chain_join import lower_join_programs
from jpaged.engine.compile_cache import count_cache_hits
from jpaged.engine.executable_store import ExecutableStore
from jpaged.engine.kv_manager import KVManager
from jpaged.engine.runner import SAMPLING_MODES, Runner
from jpaged.kv.page_groups import PageGroups

__all__ = ["ProgramTiming", "WarmupReport", "warmup_programs"]


@dataclasses.dataclass(frozen=True)
class ProgramTiming:
    """One step program's warm-up.

    Attributes:
      name: e.g. ``"loop B=64 greedy"`` (`ProgramKey.name`).
      lower_s: seconds tracing and lowering it (in the calling thread).
      compile_s: seconds compiling it (in a pool thread, beside other compiles), or loading
        it from the persistent cache.
      run_s: seconds of its first run (device set-up included).
      cache_hit: whether the persistent compilation cache held it (False without a cache).
      loaded: whether it came from the `ExecutableStore` (then ``lower_s`` is the time
        its store key took, and ``compile_s`` the load).
    """

    name: str
    lower_s: float
    compile_s: float
    run_s: float
    cache_hit: bool
    loaded: bool = False


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What ``jpaged.LLM.warmup`` compiled, and how long it took.

    Attributes:
      programs: the step programs, in compile order.
      num_page_programs: programs of copy-on-write and swap (compiled one after another in
        the calling thread, while the pool compiles the step programs).
      page_programs_s: seconds they took.
      total_s: wall-clock seconds of the whole warm-up.
      threads: threads that compiled.
      cache_dir: the persistent compilation cache (None: none).
    """

    programs: tuple[ProgramTiming, ...]
    num_page_programs: int
    page_programs_s: float
    total_s: float
    threads: int
    cache_dir: str | None

    @property
    def num_programs(self) -> int:
        """Step programs and page programs."""
        return len(self.programs) + self.num_page_programs

    @property
    def cache_hits(self) -> int:
        """Step programs whose compile was a persistent compilation cache hit."""
        return sum(p.cache_hit for p in self.programs)

    @property
    def num_loaded(self) -> int:
        """Step programs loaded from the executable store (neither traced nor lowered)."""
        return sum(p.loaded for p in self.programs)

    def summary(self) -> str:
        """One line: programs, seconds, cache hits."""
        where = f"cache {self.cache_dir}" if self.cache_dir else "no persistent cache"
        return (f"warm-up: {self.num_programs} programs ({len(self.programs)} step programs, "
                f"{self.num_page_programs} page programs) in {self.total_s:.1f} s on "
                f"{self.threads} threads; of {len(self.programs)} step programs "
                f"{self.num_loaded} loaded compiled, {self.cache_hits} compiled from the "
                f"cache ({where})")  # fmt: skip

    def __str__(self) -> str:
        lines = [self.summary(), f"{'program':<26} {'lower s':>8} {'compile s':>10} "
                                 f"{'run s':>7}  cache"]  # fmt: skip
        for p in self.programs:
            lines.append(f"{p.name:<26} {p.lower_s:>8.2f} {p.compile_s:>10.2f} "
                         f"{p.run_s:>7.2f}  {'hit' if p.cache_hit else '-'}")  # fmt: skip
        lines[2:] = [line + (" loaded" if p.loaded else "")
                     for line, p in zip(lines[2:], self.programs, strict=True)]  # fmt: skip
        lines.append(f"{'page programs':<26} {'':>8} {'':>10} {self.page_programs_s:>7.2f}")
        return "\n".join(lines)


def _inputs(key: ProgramKey, width: int, grouped: bool):
    """Inputs of ``key``'s program that write nothing (padding rows, slot -1); ``grouped``:
    of a pool of two page groups (local slots and tables too)."""
    B, W = key.rows, width
    zeros = np.zeros((B, 5))
    if key.kind == "loop":
        return LoopBatch(
            tokens=np.zeros(B, np.int32), lens=np.zeros(B, np.int32),
            block_tables=np.zeros((B, W), np.int32),
            local_block_tables=np.zeros((B, W), np.int32) if grouped else None,
            active=np.zeros(B, bool),
            live=np.zeros(B, bool), max_steps=np.zeros(B, np.int32),
            min_steps=np.zeros(B, np.int32), stop_ids=np.full((B, stop_bucket(0)), -1, np.int32),
            sampling=sampling_arrays(zeros, B),
        )  # fmt: skip
    local = {"local_slots": [np.zeros(0, np.int32)], "local_tables": []} if grouped else {}
    return build_step_batch(
        [], [np.zeros(0, np.int32)], [], [], sampling_arrays(zeros, B),
        width=W, num_rows=B, num_tokens=key.tokens, **local,
    )  # fmt: skip


def _compile(lowered, store: ExecutableStore | None = None, key: str | None = None):
    """Runs in a pool thread: ``(compiled, seconds, persistent-cache hit, False)``; the
    executable is written to ``store`` under ``key`` where given."""
    with count_cache_hits() as hits:
        t = time.perf_counter()
        compiled = lowered.compile()
        seconds, hit = time.perf_counter() - t, hits() > 0
    if store is not None:
        store.save(key, compiled, from_jax_cache=hit)
    return compiled, seconds, hit, False


def _load(store: ExecutableStore, key: str, in_tree):
    """Runs in a pool thread: ``(compiled or None, seconds, False, True)``."""
    t = time.perf_counter()
    compiled = store.load(key, in_tree)
    return compiled, time.perf_counter() - t, False, True


@dataclasses.dataclass(frozen=True)
class _Planned:
    """A step program on its way: compiling or loading in the pool (``future``)."""

    key: ProgramKey
    program: str  # "step" or "loop"
    statics: dict
    batch: LoopBatch | StepBatch
    store_key: str | None
    future: concurrent.futures.Future
    lower_s: float


def _run_once(runner: Runner, kv: KVManager, p: _Planned, compiled) -> float:
    """Runs ``compiled`` (``p``'s program) once, then installs it (so no other engine runs
    a program that failed here); returns the seconds of the run."""
    t = time.perf_counter()
    out = runner.run_compiled(compiled, kv.cache, p.batch)
    kv.cache = out[0]
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t
    runner.install(p.program, p.statics, kv.cache, p.batch, compiled)
    return seconds


def _finish(runner: Runner, kv: KVManager, store: ExecutableStore | None, p: _Planned):
    """``p``'s compile or load done, its first run: a `ProgramTiming`. A stored program that
    cannot be loaded, or whose first run fails, is removed and compiled here instead."""
    compiled, compile_s, hit, loaded = p.future.result()
    lower_s = p.lower_s
    if loaded and compiled is not None:
        try:
            return ProgramTiming(p.key.name, lower_s, compile_s,
                                 _run_once(runner, kv, p, compiled), hit, True)  # fmt: skip
        except Exception as e:  # any failure of a loaded program: compile it instead
            store.remove(p.store_key, f"its first run failed: {type(e).__name__}: {e}")
            kv.replace_lost_pool()
    if loaded:
        t = time.perf_counter()
        lowered = _lower(runner, kv.cache, p.program, p.statics, p.batch)
        lower_s = time.perf_counter() - t
        compiled, compile_s, hit, _ = _compile(lowered, store, p.store_key)
    return ProgramTiming(p.key.name, lower_s, compile_s, _run_once(runner, kv, p, compiled), hit)


def _statics(key: ProgramKey, num_decode_steps: int) -> tuple[str, dict]:
    """The runner program of ``key`` and its static arguments (as warm-up calls it)."""
    if key.kind == "loop":
        return "loop", dict(num_steps=num_decode_steps, mode=key.mode, num_top=0, processors=())
    return "step", dict(decode=key.kind == "decode", num_top=0, processors=())


def _lower(runner: Runner, cache, program: str, statics: dict, batch):
    trace = runner.trace_loop if program == "loop" else runner.trace_step
    return trace(cache, batch, **statics).lower()


def default_threads(num_programs: int) -> int:
    """Compile threads: one per CPU core, at most 16, at most one per program."""
    return max(1, min(16, os.cpu_count() or 1, num_programs))


def warmup_programs(
    kv: KVManager,
    runner: Runner,
    grid: BucketGrid,
    *,
    width: int,
    num_decode_steps: int | None,
    join: bool = False,
    cache_dir: str | None = None,
    progress: bool | None = None,
    threads: int | None = None,
) -> WarmupReport:
    """Compiles every step program of ``grid`` (lowered here, compiled by ``threads``
    threads) and runs each once; the page programs (`KVManager.warmup_page_programs`) run
    while the pool compiles.

    Args:
      kv: the KV manager (its pool is what the programs take; nothing is written to it).
      runner: the step programs.
      grid: the configuration's buckets.
      width: W, block-table width.
      num_decode_steps: k of the decode loops (None: no decode loop programs).
      join: also the join and grow programs of rows joining a running chain (compiled in
        the pool with the others, on inputs placed as at run time; `lower_join_programs`).
      cache_dir: the persistent compilation cache in use (reported).
      progress: a tqdm bar over the programs (None: where stderr is a terminal).
      threads: compile threads (default `default_threads`).

    Returns:
      The `WarmupReport`.
    """
    t0 = time.perf_counter()
    grouped = isinstance(kv.alloc, PageGroups)
    keys = grid.programs(loops=num_decode_steps is not None, modes=SAMPLING_MODES, join=join)
    join_keys = [key for key in keys if key.kind in ("join", "grow")]
    keys = [key for key in keys if key.kind not in ("join", "grow")]
    threads = threads or default_threads(len(keys) + len(join_keys))
    from tqdm.auto import tqdm

    total = len(keys) + len(join_keys)
    store = ExecutableStore.in_cache_dir(cache_dir, runner.devices)
    bar = tqdm(total=total, desc=f"jpaged warm-up: {total} programs", unit="program",
               disable=None if progress is None else not progress)  # fmt: skip
    timings: list[ProgramTiming] = []
    with concurrent.futures.ThreadPoolExecutor(threads, "jpaged-compile") as pool:
        planned: list[_Planned] = []
        for key in keys:
            t = time.perf_counter()
            program, statics = _statics(key, num_decode_steps)
            batch = _inputs(key, width, grouped)
            skey = store.key(*runner.program_parts(program, statics, kv.cache, batch)) \
                if store is not None else None  # fmt: skip
            if skey is not None and skey in store:
                in_tree = jax.tree.structure(((runner.leaves, kv.cache, batch), {}))
                fut = pool.submit(_load, store, skey, in_tree)
            else:
                lowered = _lower(runner, kv.cache, program, statics, batch)
                fut = pool.submit(_compile, lowered, store, skey)
            planned.append(_Planned(key, program, statics, batch, skey, fut,
                                    time.perf_counter() - t))  # fmt: skip
        # The join and grow programs (small: a few scatters), on a loop's stop-id columns.
        joins = []
        t = time.perf_counter()
        for key, lowered, run in lower_join_programs(runner, join_keys, width=width,
                                                     num_stops=stop_bucket(0),
                                                     grouped=grouped):  # fmt: skip
            joins.append((key, pool.submit(_compile, lowered), time.perf_counter() - t, run))
            t = time.perf_counter()
        # While the pool compiles: the page programs (small; they run on the pool, which no
        # step program uses before its compile is done).
        t = time.perf_counter()
        num_pages = kv.warmup_page_programs(width)
        jax.block_until_ready(kv.cache)
        page_s = time.perf_counter() - t
        for p in planned:
            timings.append(_finish(runner, kv, store, p))
            bar.update(1)
        for key, fut, low, run in joins:
            _, compile_s, hit, _ = fut.result()
            t = time.perf_counter()
            jax.block_until_ready(run())
            timings.append(ProgramTiming(key.name, low, compile_s, time.perf_counter() - t, hit))
            bar.update(1)
    report = WarmupReport(
        programs=tuple(timings), num_page_programs=num_pages, page_programs_s=page_s,
        total_s=time.perf_counter() - t0, threads=threads, cache_dir=cache_dir,
    )  # fmt: skip
    bar.set_postfix_str(f"{report.total_s:.1f} s, {report.num_loaded} loaded, "
                        f"{report.cache_hits} from the cache")  # fmt: skip
    bar.close()
    return report
