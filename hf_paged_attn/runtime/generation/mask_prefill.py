"""The next step's grammar masks, filled while the engine's own Python runs.

Between two forwards the engine runs Python on one core: the step's update (the matchers accept their tokens),
the outputs, the next schedule, the next step's inputs. llguidance fills masks with the GIL released, so
``MaskPrefill.start``, called once the update has advanced every matcher, fills the masks of the running
constrained requests on a thread of its own, on the core that Python leaves idle; the next step's sampler
``take``s them and fills synchronously only the rows it did not get (a request admitted since, a matcher changed
since). A matcher is used by one thread at a time: nothing advances, rolls back or copies a matcher between
``start`` and ``take`` (the sampler takes them first; the update that advances them runs after it).

Filling the masks on a thread beside the forward instead was slower on two cores, where the forward takes both
(docs/structured.md). The thread needs the GIL to begin, though, and the engine's Python holds it until the
forward lets go: on the demo model (32 rows) the fill began a median 0.79 ms after ``start`` (p10 0.39, p90 0.91),
the forward 0.47 ms after it, so most fills overlap the forward's start. Handing the thread the GIL at ``start``
(waiting on an event it sets) began them after 0.15 ms but held the engine's thread that long: 0.88x the free
throughput against 0.90x without, in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .structured import GrammarCompiler, Matcher, apply_bitmask, by_compiler
from .structured import mask_rows as structured_mask_rows


@dataclass(frozen=True, slots=True)
class Prefilled:
    """One matcher's mask: row ``row`` of ``bitmask``, filled at the matcher's state (``num_tokens``, ``ended``)."""

    matcher: Matcher
    num_tokens: int
    ended: bool
    bitmask: torch.Tensor
    row: int

    def current(self, matcher: Matcher) -> bool:
        """Whether the mask is ``matcher``'s as it is now."""
        return matcher is self.matcher and matcher.num_tokens == self.num_tokens and matcher.ended == self.ended


class MaskPrefill:
    """Fills masks ahead on one thread of its own (made at the first ``start``)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[Future[None], dict[int, Prefilled]] | None = None

    def start(self, matchers: Sequence[Matcher]) -> None:
        """Fill the masks of ``matchers`` (the next step's constrained requests) in the background."""
        self.take()  # one fill at a time (a step whose sampler took nothing left one running)
        if not matchers:
            return
        jobs, masks = [], {}
        for compiler, group, _ in by_compiler(matchers, range(len(matchers))):
            bitmask = compiler.allocate_bitmask(len(group))  # [len(group), ceil(vocab / 32)] int32
            jobs.append((compiler, group, bitmask))
            for row, m in enumerate(group):
                masks[id(m)] = Prefilled(m, m.num_tokens, m.ended, bitmask, row)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hf-paged-masks")
        self._pending = (self._pool.submit(_fill, jobs), masks)

    def take(self) -> dict[int, Prefilled]:
        """The masks filled since ``start`` (waiting for the fill to end), by ``id`` of their matcher; empty if
        none was started or the fill failed (the sampler then fills every row itself)."""
        if self._pending is None:
            return {}
        future, masks = self._pending
        self._pending = None
        try:
            future.result()
        except Exception:  # the sampler's own fill reports whatever is wrong with a matcher
            return {}
        return masks

    def close(self) -> None:
        self.take()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def mask_rows(
    logits: torch.Tensor, matchers: Sequence[Matcher], rows: Sequence[int], prefilled: dict[int, Prefilled]
) -> None:
    """``structured.mask_rows`` taking each matcher's mask from ``prefilled`` where it is current there, filling
    the others' as it does."""
    rest_matchers, rest_rows = [], []
    by_bitmask: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # id -> (bitmask, its rows, logits rows)
    for matcher, row in zip(matchers, rows, strict=True):
        mask = prefilled.get(id(matcher))
        if mask is None or not mask.current(matcher):
            rest_matchers.append(matcher)
            rest_rows.append(row)
            continue
        _, sources, targets = by_bitmask.setdefault(id(mask.bitmask), (mask.bitmask, [], []))
        sources.append(mask.row)
        targets.append(row)
    for bitmask, sources, targets in by_bitmask.values():
        if sources != list(range(bitmask.shape[0])):  # not every row, in order: [len(sources), words]
            bitmask = bitmask.index_select(0, torch.tensor(sources))
        apply_bitmask(logits, bitmask, targets)
    if rest_matchers:
        structured_mask_rows(logits, rest_matchers, rest_rows)


def _fill(jobs: list[tuple[GrammarCompiler, list[Matcher], torch.Tensor]]) -> None:
    for compiler, matchers, bitmask in jobs:
        compiler.fill_bitmasks(matchers, bitmask)
