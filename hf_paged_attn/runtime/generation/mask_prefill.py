"""The next step's grammar masks, filled while the engine's own Python runs.

Between two forwards the engine runs Python on one core: the step's update (the matchers accept their tokens),
the outputs, the next schedule, the next step's inputs. llguidance fills masks with the GIL released, so
``MaskPrefill.start``, called once the update has advanced every matcher, fills the masks of the running
constrained requests on a thread of its own, on the core that Python leaves idle; the next step's sampler
``take``s them and fills synchronously only the rows it did not get (a request admitted since, a matcher changed
since). A matcher is used by one thread at a time: nothing advances, rolls back or copies a matcher between
``start`` and ``take`` (the sampler takes them first; the update that advances them runs after it).

Filling the masks on a thread beside the forward instead was slower on two cores, where the forward takes both
(docs/structured.md). The thread needs the GIL to begin, and each Python line it runs before llguidance's native
call lets go of the GIL is a wait for the engine's thread (the next ``build_step`` took ~100 us more a step on the
demo model). So ``start`` prepares the call whole (``GrammarCompiler.bitmask_filler``), and the thread is a plain
loop over a queue, not a ``ThreadPoolExecutor`` (whose futures run Python under locks before and after each
call). Handing the thread the GIL at ``start`` (waiting on an event it sets) began the fill sooner but held the
engine's thread as long: 0.88x the free throughput against 0.90x without, in one process.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .structured import Matcher, apply_bitmask, by_compiler
from .structured import mask_rows as structured_mask_rows


@dataclass(frozen=True, slots=True)
class FilledGroup:
    """One compiler's matchers and their masks: row ``i`` of ``bitmask`` is ``matchers[i]``'s at ``states[i]``."""

    matchers: tuple[Matcher, ...]
    states: tuple[tuple[int, bool], ...]  # each matcher's (num_tokens, ended) when its mask was filled
    bitmask: torch.Tensor  # [len(matchers), ceil(vocab / 32)] int32


class Filled:
    """The masks a fill made (``MaskPrefill.take``): which matchers have one, and whether it is still theirs."""

    __slots__ = ("groups", "_rows")

    def __init__(self, groups: Sequence[FilledGroup] = ()) -> None:
        self.groups = tuple(groups)
        self._rows: dict[int, tuple[FilledGroup, int]] | None = None  # id(matcher) -> (group, row), made when asked

    def __len__(self) -> int:
        return sum(len(g.matchers) for g in self.groups)

    def row_of(self, matcher: Matcher) -> tuple[torch.Tensor, int] | None:
        """(bitmask, row) of ``matcher``'s mask where it is the matcher's as it is now; else None."""
        if self._rows is None:
            self._rows = {id(m): (g, i) for g in self.groups for i, m in enumerate(g.matchers)}
        found = self._rows.get(id(matcher))
        if found is None:
            return None
        group, row = found
        if group.matchers[row] is not matcher or group.states[row] != (matcher.num_tokens, matcher.ended):
            return None
        return group.bitmask, row


NOTHING = Filled()


class MaskPrefill:
    """Fills masks ahead on one thread of its own (made at the first ``start``)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[list[Callable[[], None]] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[bool] = queue.SimpleQueue()  # one entry a job: whether it filled
        self._thread: threading.Thread | None = None
        self._pending: Filled | None = None

    def start(self, matchers: Sequence[Matcher]) -> None:
        """Fill the masks of ``matchers`` (the next step's constrained requests) in the background."""
        self.take()  # one fill at a time (a step whose sampler took nothing left one running)
        if not matchers:
            return
        groups, calls = [], []
        for compiler, group, _ in by_compiler(matchers, range(len(matchers))):
            bitmask = compiler.allocate_bitmask(len(group))  # [len(group), ceil(vocab / 32)] int32
            calls.append(compiler.bitmask_filler(group, bitmask))
            groups.append(FilledGroup(tuple(group), tuple((m.num_tokens, m.ended) for m in group), bitmask))
        if self._thread is None:
            self._thread = threading.Thread(target=_work, args=(self._jobs, self._done), name="hf-paged-masks",
                                            daemon=True)  # fmt: skip
            self._thread.start()
            weakref.finalize(self, self._jobs.put, None)  # an engine dropped without close: the thread ends too
        self._jobs.put(calls)
        self._pending = Filled(groups)

    def take(self) -> Filled:
        """The masks filled since ``start`` (waiting for the fill to end); none if none was started or the fill
        failed (the sampler then fills every row itself)."""
        if self._pending is None:
            return NOTHING
        filled, self._pending = self._pending, None
        return filled if self._done.get() else NOTHING

    def close(self) -> None:
        self.take()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


def _work(jobs: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    """The fill thread: each job's calls, then whether they all ran (an error is the sampler's to report: it fills
    those rows itself)."""
    while (calls := jobs.get()) is not None:
        try:
            _fill(calls)
        except BaseException:  # whatever it was, ``take`` must get its answer, and the thread serve the next job
            done.put(False)
        else:
            done.put(True)


def _fill(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


def mask_rows(logits: torch.Tensor, matchers: Sequence[Matcher], rows: Sequence[int], filled: Filled | None) -> None:
    """``structured.mask_rows`` taking each matcher's mask from ``filled`` where it is current there, filling
    the others' as it does (all of them when ``filled`` is None)."""
    filled = NOTHING if filled is None else filled
    if len(filled.groups) == 1:  # the usual step: one compiler's masks, every one taken in the order filled
        group = filled.groups[0]
        if (
            len(group.matchers) == len(matchers)
            and all(a is b for a, b in zip(group.matchers, matchers))
            and all(s == (m.num_tokens, m.ended) for s, m in zip(group.states, matchers))
        ):  # fmt: skip
            apply_bitmask(logits, group.bitmask, rows)
            return
    rest_matchers, rest_rows = [], []
    by_bitmask: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # id -> (bitmask, its rows, logits rows)
    for matcher, row in zip(matchers, rows, strict=True):
        found = filled.row_of(matcher)
        if found is None:
            rest_matchers.append(matcher)
            rest_rows.append(row)
            continue
        bitmask, source = found
        _, sources, targets = by_bitmask.setdefault(id(bitmask), (bitmask, [], []))
        sources.append(source)
        targets.append(row)
    for bitmask, sources, targets in by_bitmask.values():
        if sources != list(range(bitmask.shape[0])):  # not every row, in order: [len(sources), words]
            bitmask = bitmask.index_select(0, torch.tensor(sources))
        apply_bitmask(logits, bitmask, targets)
    if rest_matchers:
        structured_mask_rows(logits, rest_matchers, rest_rows)
