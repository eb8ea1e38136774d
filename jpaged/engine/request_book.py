"""The engine's requests by id, and when a finished one is dropped.

`RequestBook` keeps every unfinished request and the finished ones until ``keep_finished``
newer ones have finished, so a long-running server's memory stays bounded while
``LLM.get_output`` still answers for recent requests. Requests that fail when added
(`jpaged.engine.intake.RequestIntake.make_request` finishes them at once) are reported by
the next step, like the requests a step finished.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from jpaged.engine.requests import Request

__all__ = ["RequestBook"]


class RequestBook:
    """Requests by id (``by_id``), oldest finished dropped first.

    Args:
      keep_finished: finished requests kept; older ones are dropped by `retire`.
    """

    def __init__(self, keep_finished: int):
        self.keep_finished = keep_finished
        self.by_id: dict[str, Request] = {}
        self._finished_ids: collections.deque[str] = collections.deque()  # oldest first
        self._failed_at_add: set[str] = set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def __getitem__(self, request_id: str) -> Request:
        return self.by_id[request_id]

    def get(self, request_id: str) -> Request | None:
        return self.by_id.get(request_id)

    def lookup(self, request_id: str) -> Request:
        """The request ``request_id``.

        Raises:
          ValueError: no such request (never added, or finished and dropped).
        """
        req = self.by_id.get(str(request_id))
        if req is None:
            raise ValueError(
                f"unknown {request_id=} (finished requests are kept for the last "
                f"keep_finished={self.keep_finished} only)"
            )
        return req

    def add(self, req: Request) -> None:
        """Keeps ``req`` (a request finished already, i.e. failed when added, is reported by
        the next `settle`).

        Raises:
          ValueError: its id is in use.
        """
        if req.request_id in self.by_id:
            raise ValueError(f"request_id={req.request_id!r} is already in use")
        self.by_id[req.request_id] = req
        if req.finished:
            self._failed_at_add.add(req.request_id)

    def discard(self, request_id: str) -> Request | None:
        """Forgets a request whose id never reached the caller; returns it (None if unknown)."""
        self._failed_at_add.discard(request_id)
        return self.by_id.pop(request_id, None)

    def retire(self) -> None:
        """Drops the oldest finished requests beyond ``keep_finished``."""
        while len(self._finished_ids) > self.keep_finished:
            req = self.by_id.get(self._finished_ids.popleft())
            if req is not None and req.finished:
                del self.by_id[req.request_id]

    def settle(self, touched: set[str], done: Iterable[str]) -> set[str]:
        """Records a step's finished requests (``done``, and those failed when added since the
        last step); returns the ids the step reports: ``touched``, ``done`` and those."""
        done = list(done) + sorted(self._failed_at_add - set(done))
        self._finished_ids.extend(done)
        self._failed_at_add = set()
        return touched | set(done)
