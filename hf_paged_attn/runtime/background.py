"""One engine stepped by a thread of its own: the loop behind transformers' continuous-batching manager
(``integration/manager.py``) and the server (``serve/engine_loop.py``).

The thread steps while the engine has unfinished requests and sleeps on a condition variable otherwise
(no polling): whoever adds a request calls ``wake``. ``hold`` keeps it from stepping, and returns once
no step is in flight, so that another thread may change what a step reads (weights, the prefix cache);
``release`` lets it go on. ``stop`` ends it, after the work left (``"flush"``) or at the next step's end
(``"hard"``); a stop overrides a hold, so that a stopping owner never waits on a forgotten one.

The owner gets each step's outputs on the thread (``deliver``, after every step), and decides what a step that raises
means (``on_error``: the outputs to deliver and go on, or None to end the loop). The engine catches a
failing forward itself and fails only that step's requests, so ``on_error`` is a last resort.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal

from ..core.request import RequestOutput
from .engine import ContinuousBatchingEngine

StopMode = Literal["flush", "hard"]


class EngineThread:
    """Steps ``engine`` in a background thread. ``wake``, ``hold``, ``release`` and ``stop`` may be called
    from any thread; ``deliver`` and ``on_error`` run on the engine's thread."""

    def __init__(
        self,
        engine: ContinuousBatchingEngine,
        deliver: Callable[[list[RequestOutput]], None],
        on_error: Callable[[Exception], list[RequestOutput] | None],
        name: str = "hf-paged-engine",
        has_work: Callable[[], bool] | None = None,
    ) -> None:
        """``has_work``: whether there is something to step for (default: the engine has unfinished requests);
        an owner that adds requests from other threads may count only those it has finished adding."""
        self.engine = engine
        self._has_work = has_work or engine.has_unfinished
        self._deliver = deliver
        self._on_error = on_error
        self._name = name
        self._cond = threading.Condition()
        self._num_holds = 0  # callers that asked the thread not to step (guarded by _cond)
        self._stepping = False  # a step is in flight (guarded by _cond)
        self._stop: StopMode | None = None  # guarded by _cond
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stop_mode(self) -> StopMode | None:
        return self._stop

    def wake(self) -> None:
        """A request was added (or aborted): step if the thread sleeps."""
        with self._cond:
            self._cond.notify_all()

    def hold(self, timeout: float | None = None) -> bool:
        """Keep the thread from stepping until ``release``; True once no step is in flight (within ``timeout``
        seconds; False otherwise, and the hold stands: release it)."""
        with self._cond:
            self._num_holds += 1
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._stepping or not self.is_alive(), timeout)

    def release(self) -> None:
        with self._cond:
            self._num_holds = max(self._num_holds - 1, 0)
            self._cond.notify_all()

    def stop(self, mode: StopMode = "flush", timeout: float | None = None) -> bool:
        """End the loop: once nothing is left (``"flush"``), or after the step in flight (``"hard"``: what is
        left stays unfinished, for the owner to fail). A hard stop overrides a flush. True if the thread ended
        within ``timeout`` seconds (None: wait)."""
        with self._cond:
            if self._stop != "hard":
                self._stop = mode
            self._cond.notify_all()
        if self._thread is None or self._thread is threading.current_thread():
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _may_step(self) -> bool:
        """(under _cond) Whether to step now: work left, and no hold unless stopping."""
        return self._has_work() and (self._stop is not None or not self._num_holds)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._cond:
                self._cond.notify_all()  # a hold waiting on a thread that has ended

    def _loop(self) -> None:
        while True:
            with self._cond:
                # Every add or abort wakes it; the timeout only bounds what a missed wake would cost.
                self._cond.wait_for(lambda: self._stop is not None or self._may_step(), timeout=1.0)
                if self._stop == "hard" or (self._stop == "flush" and not self._has_work()):
                    return
                if not self._may_step():
                    continue
                self._stepping = True
            try:
                outputs: list[RequestOutput] | None = self.engine.step()
            except Exception as exc:
                outputs = self._on_error(exc)
            finally:
                with self._cond:
                    self._stepping = False
                    self._cond.notify_all()  # a hold waits for the step to end
            if outputs is None:
                return
            self._deliver(outputs)  # every step's, none included: the owner's bookkeeping runs per step
