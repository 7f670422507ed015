"""Intake: the thread-safe door of the engine. Requests and aborts arrive here from any thread;
the engine's loop takes them at the start of each step.

It also keeps the ids of the live requests (queued, running, or a forked sibling still to come),
so that an id is never handed out twice while its request lives.
"""

from __future__ import annotations

import itertools
import threading

from .request import Request


class Intake:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._incoming: list[Request] = []
        self._to_abort: set[Request] = set()  # the requests themselves: an id may be reused later
        self.live: dict[str, Request] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    def add(self, request: Request, request_id: str | None, num_siblings: int = 0) -> str:
        """Name ``request`` and the ``num_siblings`` sequences it will fork (``num_return_sequences``),
        and queue it; ValueError if one of those names is taken."""
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while self._taken(request_id, num_siblings):
                    request_id = f"req-{next(self._ids)}"
            elif taken := self._taken(request_id, num_siblings):
                what = "" if taken == request_id else f" (the id of its forked sequence {taken!r})"
                raise ValueError(f"request_id {request_id!r} is already in use{what}")
            request.request_id = request_id
            request.arrival = next(self._arrivals)
            request.children = [request.fork(index) for index in range(1, num_siblings + 1)]
            for member in [request, *request.children]:
                self.live[member.request_id] = member
            self._incoming.append(request)
        return request_id

    def _taken(self, request_id: str, num_siblings: int) -> str | None:
        """The first of ``request_id`` and its siblings' ids that a live request holds."""
        ids = [request_id] + [f"{request_id}#{i}" for i in range(1, num_siblings + 1)]
        return next((i for i in ids if i in self.live), None)

    def withdraw(self, request_ids: list[str]) -> None:
        """Take back requests not yet taken by the loop (a batch refused part-way)."""
        with self._lock:
            gone = {rid for rid in request_ids if rid in self.live}
            self._incoming = [r for r in self._incoming if r.request_id not in gone]
            for rid in gone:
                for member in [self.live[rid], *self.live[rid].children]:
                    self.live.pop(member.request_id, None)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            request = self.live.get(request_id)
            if request is None:
                raise ValueError(f"unknown request_id {request_id!r} (never added, or already finished)")
            if request.finished:
                return False
            self._to_abort.add(request)
            return True

    def take(self) -> tuple[list[Request], set[Request]]:
        """The requests and aborts that arrived since the last call."""
        with self._lock:
            incoming, self._incoming = self._incoming, []
            to_abort, self._to_abort = self._to_abort, set()
        return incoming, to_abort

    def forget(self, request: Request) -> None:
        with self._lock:
            if self.live.get(request.request_id) is request:
                del self.live[request.request_id]

    @property
    def num_incoming(self) -> int:
        with self._lock:
            return len(self._incoming)
