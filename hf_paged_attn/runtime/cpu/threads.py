"""Adaptive intra-op threads on the CPU: each step runs with the thread count (1 or torch's) that ran
steps of its size faster, measured as the engine runs.

Why: a step is many short parallel regions (every linear, every fused kernel of the compiled graph,
every layer's attention). With ``OMP_WAIT_POLICY=PASSIVE`` the second thread sleeps between them, and
waking it costs ~50 us a region on the 2-core VMs of docs/performance.md: more than it saves on a
small model, while the 30M model's float32 prefill needs both cores. With a short spin
(``GOMP_SPINCOUNT``) the second thread pays off on a quiet machine, and loses 1.5x when another
process holds the core. No fixed rule covers every model, dtype, step size and machine load, so the
engine measures: ``ThreadTuner`` times the steps of each size bucket with each candidate count,
alternating, keeps the faster (median of ``TRIALS``; sooner when one is clearly faster in every step,
``EARLY_TRIALS``, a choice of fewer threads that holds for ``EARLY_HOLD_STEPS`` timed steps before the others
run again, as a choice by less than ``CLEAR_MARGIN`` does), and checks it again every ``REMEASURE_STEPS`` steps
of the bucket, since the machine's load changes: the other counts run ``EARLY_TRIALS`` steps each against the
choice's recent steps. A rare step size borrows the count its measured neighbours agree on (``RARE_STEPS``).

The measurements belong to the model, not the engine (``tuner_for``: one tuner per model and set of candidate
counts, kept for the model's later engines, as its compiled forward is): ``model.generate`` makes an engine
per call, and a fresh tuner ran its first steps of every size on one thread and two again, alternating; on
the 30M Llama's 64 requests a new engine's run took 1.08x as long as one that kept the model's tuner (median
of 5 rounds, 0.89-1.13x a round), on the bundled model 1.085x (8 rounds, 0.98-1.15x; ``benchmarks/tuner_ab.py``,
docs/performance.md, "Adaptive threads").

``ThreadTunedExecutor`` wraps the engine's executor (the seam of ``executor.py``): the chosen count
holds for the step's forward only, and the caller's count is back after it. ``torch.set_num_threads``
is process-wide, though: another thread whose first torch op falls inside a one-thread step starts
with one thread (a server's handler threads, say; they do little torch work). oneDNN and the native
attention kernel read the count at every call, and so do the compiled forward's inductor kernels
(``cpp.dynamic_threads``); dynamo guards on it, so the compiled forward has one graph, compiled at the
largest candidate, which every step enters at that count and runs at its own
(``compiled.STEP_THREADS``).
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...attention.step import StepMetadata

TRIALS = 5  # timed steps per candidate before a bucket decides
# A bucket decides sooner, after EARLY_TRIALS steps of each candidate, when one candidate's slowest step
# beat every other's fastest by CLEAR_MARGIN: a step size that comes twice a run (the 30M model's 129-256
# token steps) would otherwise alternate for many runs, at 360 ms a step on one thread against 197 on two.
EARLY_TRIALS = 2
CLEAR_MARGIN = 1.25
# An early decision holds for EARLY_HOLD_STEPS steps of its bucket, timed, then the other candidates run
# EARLY_TRIALS steps each and the medians decide again (and hold REMEASURE_STEPS): two steps each can catch
# a moment when another process held a core, and a bundled-model process then ran every step on one thread
# (1,742 tokens/s against 2,642-2,741). Measuring all TRIALS again instead cost the 30M model's prompt steps
# five steps on one thread (1.4 s of a 14 s run).
# A clear early win for the most threads holds for REMEASURE_STEPS at once: another process's load slows the steps on
# more threads (it takes one of their cores), not those on fewer, so it was no moment's load. Its confirmation
# cost the 30M model's float32 prompt steps two steps on one thread (0.24 s against 0.13 each) in a pass of 4.7 s.
EARLY_HOLD_STEPS = 32
# Steps of a bucket after which it checks its choice again: the other counts run EARLY_TRIALS steps each, and
# their medians are weighed against those of the choice's last EARLY_HOLD_STEPS steps (measuring every count
# TRIALS times from scratch cost five steps on the slower count where two tell).
REMEASURE_STEPS = 256
# A bucket that has seen fewer than RARE_STEPS steps runs the count its measured neighbours agree on, if they
# do (``ThreadTuner.inferred``): a step size that comes once a run (the 30M model's last prompt step, 183
# tokens) would otherwise alternate for runs, at 0.28 s on one thread against 0.15 on two.
RARE_STEPS = 2 * TRIALS


def bucket(num_tokens: int) -> int:
    """Steps of 2^(k-1) < tokens <= 2^k share bucket k: their cost per step is alike."""
    return max(num_tokens - 1, 0).bit_length()


@dataclass(slots=True)
class Bucket:
    """One step size's measurements: seconds per step of each candidate, and the choice."""

    samples: dict[int, list[float]]
    choice: int | None = None
    steps_since_choice: int = 0
    seen: int = 0  # steps recorded in all
    early: bool = False  # the choice came from EARLY_TRIALS steps each: it holds (timed) for EARLY_HOLD_STEPS
    confirming: bool = False  # after an early choice: the others' EARLY_TRIALS steps against its held timings


@dataclass(slots=True)
class ThreadTuner:
    """Chooses, per step-size bucket, the fastest of ``candidates`` thread counts from timed steps."""

    candidates: tuple[int, ...]
    trials: int = TRIALS
    remeasure_steps: int = REMEASURE_STEPS
    buckets: dict[int, Bucket] = field(default_factory=dict)
    # The forward these timings are of (an executor's ``graph_ready``: eager, then the compiled graph): an
    # executor that runs another one resets them. Kept here, not in the executor, so that a model's later
    # engines, which find its graph compiled, keep what the earlier ones measured.
    phase: object = None
    # Engines of one model share its tuner (``tuner_for``); an executor holds this around each use.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.candidates or any(not isinstance(c, int) or c < 1 for c in self.candidates):
            raise ValueError(f"ThreadTuner candidates must be positive ints, got {self.candidates!r}")

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of ``num_tokens``: the candidate measured least (while the
        bucket measures), else the bucket's choice."""
        state = self._bucket(num_tokens)
        if state.choice is not None:
            return state.choice
        if state.seen < RARE_STEPS and (inferred := self.inferred(num_tokens)) is not None:
            return inferred
        return min(self.candidates, key=lambda c: len(state.samples[c]))  # alternates: ties go in order

    def inferred(self, num_tokens: int) -> int | None:
        """The count that the decided buckets around ``num_tokens`` imply, or None: the nearest smaller and larger
        ones when they agree; the smallest alone when it chose the fewest threads (smaller steps gain less
        from threads), the largest alone when it chose the most."""
        key = bucket(num_tokens)
        decided = {k: b.choice for k, b in self.buckets.items() if b.choice is not None and k != key}
        below = [k for k in decided if k < key]
        above = [k for k in decided if k > key]
        low = decided[max(below)] if below else None
        high = decided[min(above)] if above else None
        if low is not None and high is not None:
            return low if low == high else None
        if high is not None and high == min(self.candidates):
            return high
        if low is not None and low == max(self.candidates):
            return low
        return None

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A step of ``num_tokens`` ran ``seconds`` with ``threads``."""
        state = self._bucket(num_tokens)
        state.seen += 1
        if state.choice is not None:
            state.steps_since_choice += 1
            if threads == state.choice:  # the held choice's timings: what the check weighs the others against
                state.samples[threads].append(seconds)
            hold = EARLY_HOLD_STEPS if state.early else self.remeasure_steps
            if state.steps_since_choice >= hold:  # the load may have changed: the other counts run again
                held = state.samples[state.choice][-EARLY_HOLD_STEPS:]
                state.samples = {c: held if c == state.choice else [] for c in self.candidates}
                state.confirming, state.early = True, False
                state.choice, state.steps_since_choice = None, 0
            return
        if threads in state.samples:
            state.samples[threads].append(seconds)
        needed = EARLY_TRIALS if state.confirming else self.trials  # confirming: the held choice has its timings
        if all(len(times) >= needed for times in state.samples.values()):
            medians = {c: statistics.median(state.samples[c]) for c in self.candidates}
            state.choice = min(self.candidates, key=medians.__getitem__)
            state.confirming = False
            # A close call (some other count within CLEAR_MARGIN) holds only EARLY_HOLD_STEPS before it is checked
            # again, as an early choice is: a moment of load can tip it, and then it would hold for
            # ``remeasure_steps`` (a bundled-model process's 33-64-token steps on one thread for a whole benchmark,
            # 1,537-1,561 tokens/s against 1,987-2,180 on two).
            state.early = any(medians[c] < medians[state.choice] * CLEAR_MARGIN for c in medians if c != state.choice)
        elif not state.confirming:
            state.choice = self._clear_winner(state)
            # fewer threads than the most: a moment's load on the other cores may have chosen it, check it soon
            state.early = state.choice is not None and state.choice != max(self.candidates)

    @staticmethod
    def _clear_winner(state: Bucket) -> int | None:
        """The candidate whose slowest step beat every other's fastest by ``CLEAR_MARGIN``, once each
        has ``EARLY_TRIALS`` steps; else None."""
        samples = state.samples
        if any(len(times) < EARLY_TRIALS for times in samples.values()):
            return None
        best = min(samples, key=lambda c: max(samples[c]))
        others = [min(times) for c, times in samples.items() if c != best]
        return best if all(max(samples[best]) * CLEAR_MARGIN < fastest for fastest in others) else None

    def reset(self) -> None:
        """Forget every measurement (the forward changed: e.g. the compiled graph took over)."""
        self.buckets.clear()

    def choices(self) -> dict[int, int]:
        """Bucket -> chosen thread count, for the buckets that have decided (for stats and tests)."""
        return {k: b.choice for k, b in sorted(self.buckets.items()) if b.choice is not None}

    def _bucket(self, num_tokens: int) -> Bucket:
        key = bucket(num_tokens)
        state = self.buckets.get(key)
        if state is None:
            state = self.buckets[key] = Bucket({c: [] for c in self.candidates})
        return state


def candidates(max_threads: int) -> tuple[int, ...]:
    """One thread against all of them (the two ends; counts between were not measured)."""
    return (1,) if max_threads <= 1 else (1, max_threads)


_TUNERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, ...], ThreadTuner]] = weakref.WeakKeyDictionary()
_TUNERS_LOCK = threading.Lock()


def tuner_for(model: torch.nn.Module, counts: tuple[int, ...]) -> ThreadTuner:
    """``model``'s tuner for the candidate ``counts``, made at its first engine and kept (weakly, with the
    model) for the later ones: a step of a size the model has measured runs its choice from the first step."""
    with _TUNERS_LOCK:
        tuners = _TUNERS.setdefault(model, {})
        tuner = tuners.get(counts)
        if tuner is None:
            tuner = tuners[counts] = ThreadTuner(counts)
        return tuner


class ThreadTunedExecutor:
    """``inner``'s steps, each with the thread count ``tuner`` chooses for its size; the caller's count
    is restored after every step (a caller that changes it between steps gets the tuner of 1 and the new
    count). ``tuners(counts)`` gives the tuner of a set of counts: the model's (``tuner_for``) in an engine, a
    new one by default. When the inner executor's ``graph_ready`` is not the tuner's ``phase`` (a compiled
    forward replaced the eager one) the tuner starts over: the eager steps' timings say nothing about the
    graph's."""

    def __init__(
        self,
        inner: object,
        counts: tuple[int, ...],
        clock: Callable[[], float] = time.perf_counter,
        tuners: Callable[[tuple[int, ...]], ThreadTuner] = ThreadTuner,
    ) -> None:
        self.inner = inner
        self.max_threads = max(counts)  # the caller's count (``candidates``' largest)
        self.tuners = tuners
        self.tuner = tuners(counts)
        self.clock = clock

    def __getattr__(self, name: str) -> object:  # the inner executor's extras (wait, compiled, eager, ...)
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def execute(self, step: StepMetadata) -> torch.Tensor:
        before = torch.get_num_threads()
        if before != self.max_threads:  # the caller changed torch's count: tune between 1 and the new one
            self.max_threads, self.tuner = before, self.tuners(candidates(before))
        tuner = self.tuner
        with tuner.lock:
            phase = getattr(self.inner, "graph_ready", None)
            if phase != tuner.phase:
                tuner.reset()
                tuner.phase = phase
            threads = tuner.choose(step.num_tokens)
        torch.set_num_threads(threads)
        start = self.clock()
        try:
            logits = self.inner.execute(step)
        finally:
            torch.set_num_threads(before)
        with tuner.lock:
            tuner.record(step.num_tokens, threads, self.clock() - start)
        return logits

    def close(self) -> None:
        self.inner.close()
