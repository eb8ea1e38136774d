"""Data parallelism: independent engine replicas behind one `jpaged.LLM`.

A mesh with a ``"data"`` axis of size R gives R replicas, each a whole engine on its own
devices (a tensor-parallel model over the ``"model"`` axis, or one device): its own pool,
allocator, prefix cache and scheduler. A request runs on one replica from admission to the
end. `ReplicaSet` routes requests (to the replica whose prefix cache holds the longest
prefix of the prompt, else to the one with the fewest unfinished requests) and steps the
replicas, each from its own host thread so that one replica's device work overlaps the
others' host work. The replicas are ``jpaged.LLM`` objects of data size 1; this module does
not import the facade.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

from jpaged.engine.warmup import WarmupReport

__all__ = ["ReplicaSet", "combined_stats", "combined_warmup"]


class ReplicaSet:
    """The replicas of a data-parallel engine.

    Args:
      replicas: engines with ``jpaged.LLM``'s API, one per ``"data"`` index.
    """

    def __init__(self, replicas: Sequence[Any]):
        self.replicas = list(replicas)
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(self.replicas), thread_name_prefix="jpaged-replica"
        )

    def pick(self, prompt: Any, cache_salt: str | None) -> Any:
        """The replica for a new request: the longest cached prefix of ``prompt`` (token ids,
        or a string encoded with the replica's tokenizer), then the fewest unfinished
        requests, then the lowest index."""

        def cached(r) -> int:
            if not r.enable_prefix_caching:
                return 0
            ids = prompt
            if isinstance(prompt, str):
                if r.tokenizer is None:
                    return 0
                ids = r.tokenizer.encode(prompt).ids
            ids = [int(t) for t in ids]
            return r.alloc.match_prefix(ids, cache_salt)[0] if ids else 0

        def load(r) -> int:
            return len(r.scheduler.running) + len(r.scheduler.waiting)

        order = sorted(range(len(self.replicas)),
                       key=lambda i: (-cached(self.replicas[i]), load(self.replicas[i]), i))  # fmt: skip
        return self.replicas[order[0]]

    def owner(self, request_id: str) -> Any:
        """The replica that holds ``request_id`` (None if none does)."""
        return next((r for r in self.replicas if request_id in r._book), None)

    def step(self) -> set[str]:
        """One step of every replica with unfinished requests; the ids they touched."""
        active = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(active) <= 1:
            return set().union(*(r._step() for r in active))
        futures = [self._threads.submit(r._step) for r in active]
        return set().union(*(f.result() for f in futures))


def combined_stats(per_replica: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' ``stats()`` in one: counts and times summed, rates and utilisation
    averaged, ``recompiles`` the first replica's (it counts every trace since it was
    built, the later replicas' included); ``replicas`` lists each replica's figures."""
    out: dict[str, Any] = {}
    for key, first in per_replica[0].items():
        values = [s[key] for s in per_replica]
        if key == "recompiles" or not isinstance(first, int | float):
            out[key] = first
        elif key.endswith(("_rate", "utilisation")):
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(values)
    out["replicas"] = list(per_replica)
    return out


def combined_warmup(per_replica: Sequence[WarmupReport]) -> WarmupReport:
    """The replicas' warm-up reports in one: every replica's programs (named ``r<i> ...``),
    page programs and seconds summed (the replicas warm up one after another)."""
    programs = tuple(
        dataclasses.replace(p, name=f"r{i} {p.name}")
        for i, report in enumerate(per_replica)
        for p in report.programs
    )
    return WarmupReport(
        programs=programs,
        num_page_programs=sum(r.num_page_programs for r in per_replica),
        page_programs_s=sum(r.page_programs_s for r in per_replica),
        total_s=sum(r.total_s for r in per_replica),
        threads=max(r.threads for r in per_replica),
        cache_dir=per_replica[0].cache_dir,
    )
