"""The bridge between one engine and the asyncio server: a background thread steps the engine.

The thread (``EngineThread``, the loop transformers' manager runs too) runs ``engine.step()`` while any
request is unfinished and sleeps on a condition variable otherwise (no polling). Each step's outputs go
to the event loop in one ``call_soon_threadsafe`` call, which puts each output on the asyncio.Queue of
the HTTP request that asked for it. ``add_request`` and ``abort`` are the engine's thread-safe entry
points.

``submit`` may run in any thread, and holds no lock across ``add_request``: a constrained request
compiles its grammar there (milliseconds to tens on a large vocabulary), which must stall neither
the event loop nor the engine thread. So the request's id is ours, chosen first: its subscriber is in
place before the engine can emit for it, and the engine thread can tell an id still being added
(``_adding``) from one it never knew.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import EngineThread, RequestOutput
from .metrics import ServeMetrics

logger = logging.getLogger("hf_paged_attn.serve")


@dataclass(slots=True)
class _Subscriber:
    queue: asyncio.Queue
    tag: Any  # handed back with every output (the choice index)
    arrival: float
    last: float | None = None  # when its last tokens arrived


class EngineLoop:
    """Owns the engine thread. ``submit``/``abort`` are called from the event loop's thread."""

    def __init__(self, engine: Any, metrics: ServeMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stats = engine.stats  # refreshed by the engine thread after every step
        self._cond = threading.Condition()
        self._live: set[str] = set()  # submitted and not yet seen finished (guarded by _cond)
        self._adding: set[str] = set()  # in add_request now (guarded by _cond)
        self._finished_early: set[str] = set()  # of those, seen finished before add_request returned (_cond)
        self._ids = itertools.count()
        self._stopping = False  # the thread ends once nothing is left
        self._closed = False  # no new requests (draining past its deadline, or stopping)
        self._reasons: dict[str, str] = {}  # aborted ids -> the finish reason the metrics count (guarded by _cond)
        self._failing: set[str] = set()  # failed by _fail_all, their error outputs not yet delivered (_cond)
        self._failed: set[str] = set()  # failed by _fail_all, their aborts not yet carried out in the engine (_cond)
        self._thread = EngineThread(engine, self._after_step, self._fail_all, has_work=self._has_work)
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: dict[str, _Subscriber] = {}  # set before add_request, read and popped by the event loop

    # ----------------------------------------------------------------------------- event-loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()
        self._started = True

    @property
    def num_unfinished(self) -> int:
        with self._cond:
            return len(self._live) + len(self._adding)

    def submit(self, input_ids: Sequence[int], queue: asyncio.Queue, tag: Any, **kwargs: Any) -> str:
        """Queue one request; its outputs arrive on ``queue`` as ``(tag, RequestOutput)``. Any thread.
        The engine's ValueError for bad input propagates and nothing is queued."""
        request_id = f"srv-{next(self._ids)}"
        with self._cond:
            if self._stopping or self._closed:
                raise RuntimeError("the server is shutting down")
            self._adding.add(request_id)
        self._subscribers[request_id] = _Subscriber(queue, tag, time.perf_counter())
        try:
            self.engine.add_request(list(input_ids), request_id=request_id, **kwargs)
        except BaseException:
            self._subscribers.pop(request_id, None)
            with self._cond:
                self._adding.discard(request_id)
            raise
        with self._cond:
            self._adding.discard(request_id)
            closed = self._stopping or self._closed
            if request_id in self._finished_early:  # one step took it to its end already
                self._finished_early.discard(request_id)
            elif not closed:
                self._live.add(request_id)
        self._thread.wake()
        if closed:  # the server began stopping meanwhile: the thread may be gone
            self._subscribers.pop(request_id, None)
            self._abort_in_engine(request_id)
            raise RuntimeError("the server is shutting down")
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(input_ids))
        return request_id

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop delivering ``request_id``'s outputs and cancel it; its blocks free at the next step.
        ``reason``: what the metrics count it as ("stop" when the server found a stop sequence)."""
        if self._subscribers.pop(request_id, None) is None:
            return  # already finished and delivered
        if reason != "abort":
            with self._cond:
                self._reasons[request_id] = reason
        self._abort_in_engine(request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except ValueError:  # finished in the engine meanwhile
            pass
        self._thread.wake()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            sub = self._subscribers.get(out.request_id)
            if sub is None:  # aborted by its client
                continue
            if out.new_ids and self.metrics:
                if sub.last is None:
                    self.metrics.time_to_first_token.observe(now - sub.arrival)
                else:
                    self.metrics.inter_token_latency.observe((now - sub.last) / len(out.new_ids))
            if out.new_ids:
                sub.last = now
            sub.queue.put_nowait((sub.tag, out))
            if out.finished:
                self._subscribers.pop(out.request_id, None)

    # ----------------------------------------------------------------------------- engine thread
    def _has_work(self) -> bool:
        """Requests submitted and not finished, or failed ones whose aborts wait: a request still in
        ``add_request`` (``_adding``) is not stepped for until ``submit`` has decided to keep it."""
        with self._cond:
            return bool(self._live or self._failed or self._failing)

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        """A step's bookkeeping, on the engine thread: who is still live, the metrics, the outputs to the event loop."""
        outputs = self._drop_failed(outputs)
        with self._cond:
            relabel = {}
            for out in outputs:
                if out.finished:
                    if out.request_id in self._adding:  # finished before submit counted it live
                        self._finished_early.add(out.request_id)
                    self._live.discard(out.request_id)
                    if out.request_id in self._reasons:
                        relabel[out.request_id] = self._reasons.pop(out.request_id)
        try:  # bookkeeping must never stop the thread: every open request would hang
            self.stats = self.engine.stats
            if self.metrics:
                self.metrics.record_step(outputs, relabel)
        except Exception:
            logger.exception("updating the metrics failed")
        if outputs:
            try:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        """A step raised past the engine's own guard: every live request fails (and is answered), and the loop
        goes on to free their blocks."""
        logger.exception("engine step failed; failing every unfinished request", exc_info=exc)
        with self._cond:
            ids = list(self._live)
        outputs = []
        for request_id in ids:
            try:
                self.engine.abort(request_id)
            except ValueError:
                pass
            outputs.append(RequestOutput(request_id, [], [], [], True, "error", f"{type(exc).__name__}: {exc}"))
        with self._cond:  # the engine frees their blocks at its next step: take it now, not when a request comes
            self._failing = set(ids)  # a step that fails again gives up on the earlier ones: no loop on a broken engine
        return outputs

    def _drop_failed(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``outputs`` less the aborts of the requests ``_fail_all`` failed (already answered, and counted): the
        errors ``_fail_all`` returned pass, and the step after them carries out their aborts."""
        with self._cond:
            failed, self._failed, self._failing = self._failed, self._failing, set()
        return [out for out in outputs if out.request_id not in failed] if failed else outputs

    # ----------------------------------------------------------------------------- holds (any thread)
    def hold(self, timeout: float) -> bool:
        """Keep the engine thread from stepping until ``release``; True once no step is in flight (within
        ``timeout`` seconds; False otherwise, and the hold stands: release it). While held, the engine's
        state (weights, prefix cache) may be changed from another thread. Requests may still be submitted;
        they wait. Stopping the server overrides a hold."""
        return self._thread.hold(timeout)

    def release(self) -> None:
        self._thread.release()

    def abort_running(self) -> int:
        """Abort every unfinished request (their clients get an ``"abort"`` output) without closing the
        loop to new ones. Returns how many were aborted."""
        with self._cond:
            ids = list(self._live)
        for request_id in ids:
            self._abort_in_engine(request_id)
        return len(ids)

    def abort_all(self) -> int:
        """Refuse new requests and abort every unfinished one; their subscribers still get the final
        ``"abort"`` output (a stream ends with an error event). Returns how many were aborted."""
        with self._cond:
            self._closed = True
            ids = list(self._live)
        for request_id in ids:
            self._abort_in_engine(request_id)
        return len(ids)

    def stop(self, timeout: float) -> bool:
        """Abort what is left, let the thread finish the aborts and exit; True if it did in time."""
        with self._cond:
            self._stopping = True
        self.abort_all()
        if not self._started:
            return True
        return self._thread.stop("flush", timeout)
