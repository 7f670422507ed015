"""Scheduler: which requests run this step, and how many of their tokens. Policy only: block
tables are the KV manager's.

Plain Python, no torch. Each step spends a token budget (``max_batch_tokens``) in this order:
running requests that decode (one token each, plus the room for the tokens a speculating request
proposes: ``Request.lookahead``), running requests part-way through a chunked
prefill, then waiting requests in the policy's order (``policy.py``). When blocks run out, the
running request the policy ranks last is preempted by recompute: its blocks are freed and it waits
again, to be prefilled later from its prompt plus the tokens it already generated (identical
results). A beam search's beams are preempted together, all or none: a victim's whole group goes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .kv_manager import KVBlockManager
from .policy import POLICIES, SchedulingPolicy
from .request import Request, Status


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # fed this step, starting at request.num_computed_tokens
    draft_ids: tuple[int, ...] = ()  # speculative proposals fed after the request's known tokens


@dataclass(slots=True)
class SchedulerOutput:
    """The step's plan. Built by ``schedule`` (and, for speculative proposals, ``Speculator.propose``,
    which returns a new one); nothing changes it after: the executor and the updater only read it."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)
    num_lookahead_tokens: int = 0  # room reserved for speculative tokens (``Request.lookahead``)


class Scheduler:
    def __init__(
        self,
        kv: KVBlockManager,
        max_num_seqs: int,
        max_batch_tokens: int,
        policy: SchedulingPolicy = POLICIES["fcfs"],
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.policy = policy
        self.waiting: list[Request] = []  # sorted by the policy's key
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_ever_fit(self, request: Request) -> bool:
        # A preempted beam group is recomputed beam by beam (sharing only prefix-cache hits): every
        # beam's whole sequence must fit at once, or the group could wait forever for its last beams.
        return self.kv.can_ever_fit(request, copies=request.group.num_beams if request.group is not None else 1)

    def add(self, request: Request) -> None:
        assert self.can_ever_fit(request), "engine must refuse requests that can never fit"
        request.status = Status.WAITING
        bisect.insort(self.waiting, request, key=self.policy.key)

    def add_running(self, request: Request) -> None:
        """A forked sibling joins the running set directly (it shares its parent's blocks)."""
        request.status = Status.RUNNING
        self.running.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.release(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batch_tokens
        scheduled: set[int] = set()
        # Decodes first (they are cheap and keep latency low), then continuing prefill chunks.
        decodes, chunks = [], []
        for request in self.running:
            pending = request.num_pending_tokens  # (changes within this loop only for a request preempted in it)
            (decodes if pending <= 1 else chunks).append((request, pending))
        for request, pending in decodes + chunks:
            if budget == 0:
                break
            if request.status is not Status.RUNNING or not pending:
                continue  # preempted earlier in this loop, or a beam waiting for its group's other beams
            num_new = min(pending, budget)
            ahead = self._lookahead(request, budget) if request.lookahead > 0 else 0
            if ahead:
                num_new += ahead
                out.num_lookahead_tokens += ahead
            else:
                while not self.kv.reserve(request, num_new):
                    victim = self._pick_victim(exclude=scheduled | {id(request)})
                    self._preempt(victim or request, out)
                    if victim is None:
                        break
            if request.status is Status.RUNNING:
                out.scheduled.append(ScheduledRequest(request, num_new))
                scheduled.add(id(request))
                budget -= num_new
        # Admit waiting requests in the policy's order; stop at the first that does not fit, so
        # that a long prompt is not starved by shorter ones behind it. None is admitted in a step
        # that had to preempt: the freed blocks go to the requests already running.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            if not self.kv.admit(request, budget):
                break
            num_new = min(request.num_pending_tokens, budget)
            self.waiting.pop(0)
            request.status = Status.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        out.block_copies = self.kv.take_copies()
        return out

    def _lookahead(self, request: Request, budget: int) -> int:
        """Speculative decoding: room for up to ``request.lookahead`` proposed tokens after a decode
        step's one, reserved (and counted in the budget) if the blocks are free; 0 otherwise, and
        then the step is an ordinary decode: speculation never preempts anyone."""
        ahead = min(request.lookahead, budget - 1)
        if ahead <= 0 or request.num_pending_tokens != 1:
            return 0
        return ahead if self.kv.reserve(request, 1 + ahead) else 0

    def recompute_all(self) -> int:
        """Preempt every running request (the weights changed: the K/V they hold is stale): each waits to
        recompute its prompt and the tokens it has generated. Returns how many were preempted."""
        out = SchedulerOutput()
        for request in list(self.running):
            if request in self.running:  # a beam group goes whole, with its first member
                self._preempt(request, out)
        return len(out.preempted)

    def _pick_victim(self, exclude: set[int]) -> Request | None:
        """The policy's victim among running requests none of whose group is in ``exclude``."""
        candidates = [r for r in self.running if not any(id(m) in exclude for m in _group_of(r))]
        return self.policy.victim(candidates) if candidates else None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Preempt ``request`` with its whole beam group (members scheduled this step are unscheduled)."""
        group = _group_of(request)
        out.scheduled = [s for s in out.scheduled if s.request not in group]
        for member in group:
            if member in self.running:
                self.running.remove(member)
            if member.status is Status.WAITING:
                continue
            self.kv.release(member)
            member.draft_ids, member.lookahead = [], 0  # its proposals go too: they follow tokens it must recompute
            member.num_preemptions += 1
            self.add(member)
            out.preempted.append(member)
        self.num_preemptions += 1


def _group_of(request: Request) -> list[Request]:
    """The requests preempted together with ``request``: its beam group's live beams, or itself."""
    return list(request.group.beams) if request.group is not None else [request]
