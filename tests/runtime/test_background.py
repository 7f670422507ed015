"""``EngineThread`` (``runtime/background.py``), the loop behind the manager and the server, on a stand-in
engine whose steps the test controls: it steps only while there is work, a hold waits for the step in
flight and keeps the next from starting, a flush drains, a hard stop leaves work unfinished, a stop
overrides a hold, and a step that raises goes to ``on_error``."""

from __future__ import annotations

import threading

import pytest

from hf_paged_attn import EngineThread, RequestOutput

WAIT = 10.0  # seconds: every wait is bounded


class StandInEngine:
    """``num_left`` steps of work; each step emits one output and may wait on ``gate`` or raise ``fail``."""

    def __init__(self, num_left: int = 0) -> None:
        self.num_left = num_left
        self.num_steps = 0
        self.gate: threading.Event | None = None
        self.in_step = threading.Event()
        self.fail: Exception | None = None

    def has_unfinished(self) -> bool:
        return self.num_left > 0

    def step(self) -> list[RequestOutput]:
        self.in_step.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        if self.fail is not None:
            raise self.fail
        self.num_steps += 1
        self.num_left -= 1
        return [RequestOutput(f"r{self.num_steps}", [1], [2], [2], self.num_left == 0)]


def started(engine: StandInEngine, **kwargs) -> tuple[EngineThread, list[RequestOutput]]:
    delivered: list[RequestOutput] = []
    thread = EngineThread(engine, delivered.extend, kwargs.pop("on_error", lambda exc: None), **kwargs)
    thread.start()
    return thread, delivered


def test_steps_while_there_is_work_and_a_flush_drains() -> None:
    engine = StandInEngine()
    thread, delivered = started(engine)
    engine.num_left = 3
    thread.wake()
    assert thread.stop("flush", WAIT)
    assert engine.num_steps == 3 and [o.request_id for o in delivered] == ["r1", "r2", "r3"]


def test_a_hold_waits_for_the_step_in_flight_and_keeps_the_next_from_starting() -> None:
    engine = StandInEngine(num_left=5)
    engine.gate = threading.Event()
    thread, _ = started(engine)
    assert engine.in_step.wait(WAIT)
    assert not thread.hold(timeout=0.05)  # a step is in flight
    engine.gate.set()
    assert thread.hold(timeout=WAIT)  # the step ended (two holds now stand)
    steps = engine.num_steps
    assert not engine.in_step.clear() and not engine.in_step.wait(0.2)  # no step while held
    assert engine.num_steps == steps
    thread.release()
    thread.release()
    assert thread.stop("flush", WAIT) and engine.num_left == 0


def test_a_hard_stop_overrides_a_hold_and_leaves_work_unfinished() -> None:
    engine = StandInEngine(num_left=100)
    thread = EngineThread(engine, print, lambda exc: None)
    assert thread.hold(timeout=WAIT)  # held from the start: not one step
    thread.start()
    assert thread.stop("hard", WAIT)
    assert not thread.is_alive() and engine.num_left == 100 and thread.stop_mode == "hard"


def test_a_step_that_raises_goes_to_on_error() -> None:
    engine = StandInEngine(num_left=2)
    engine.fail = RuntimeError("boom")
    seen: list[Exception] = []

    def on_error(exc: Exception) -> list[RequestOutput] | None:
        seen.append(exc)
        return None  # end the loop

    thread, delivered = started(engine, on_error=on_error)
    assert thread.stop("flush", WAIT) or not thread.is_alive()
    assert [str(e) for e in seen] == ["boom"] and delivered == []
    assert thread.hold(timeout=WAIT)  # a hold on an ended thread never hangs


@pytest.mark.parametrize("mode", ["flush", "hard"])
def test_a_thread_never_started_stops_at_once(mode) -> None:
    assert EngineThread(StandInEngine(3), print, lambda exc: None).stop(mode, WAIT)
