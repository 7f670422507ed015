"""Scheduler: which requests run this step, and how many of their tokens.

Plain Python, no torch. Each step spends a token budget (``max_batch_tokens``) in this order:
running requests that decode (one token each), running requests part-way through a chunked
prefill, then waiting requests in arrival order. When blocks run out, the most recently admitted
running request is preempted by recompute: its blocks are freed and it is queued again at the front,
to be prefilled later from its prompt plus the tokens it already generated (identical results).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .blocks import RELEASED, BlockAllocator, blocks_for
from .request import Request, Status


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # fed this step, starting at request.num_computed_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_batch_tokens: int
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.window: int | None = None  # set by the engine when every layer slides the same window
        self.num_prompt_tokens = 0  # of admitted requests
        self.num_cached_tokens = 0  # of those, served from the prefix cache

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_ever_fit(self, request: Request) -> bool:
        # The last sampled token is never fed back, so it needs no slot.
        return blocks_for(request.max_total_tokens - 1, self.block_size) <= self.allocator.num_blocks

    def add(self, request: Request) -> None:
        assert self.can_ever_fit(request), "engine must refuse requests that can never fit"
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A forked child joins the running set directly (it shares its parent's blocks)."""
        request.status = Status.RUNNING
        self.running.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batch_tokens
        scheduled: set[int] = set()
        # Decodes first (they are cheap and keep latency low), then continuing prefill chunks.
        for request in sorted(self.running, key=lambda r: r.num_pending_tokens > 1):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_pending_tokens, budget)
            while not self._reserve(request, num_new, out.block_copies):
                victim = self._pick_victim(exclude=scheduled | {id(request)})
                self._preempt(victim or request, out)
                if victim is None:
                    break
            if request.status is Status.RUNNING:
                out.scheduled.append(ScheduledRequest(request, num_new))
                scheduled.add(id(request))
                budget -= num_new
        # Admit waiting requests in arrival order; stop at the first that does not fit, so that
        # a long prompt is not starved by shorter ones behind it. None is admitted in a step that
        # had to preempt: the freed blocks go to the requests already running.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            if not self._admit(request, budget, out.block_copies):
                break
            num_new = min(request.num_pending_tokens, budget)
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def commit(self, scheduled: list[ScheduledRequest]) -> None:
        """The step ran: its tokens are in the cache; blocks that became full join the prefix cache."""
        size = self.block_size
        for s in scheduled:
            request = s.request
            first_full = request.num_computed_tokens // size
            request.num_computed_tokens += s.num_new_tokens
            tokens = request.all_ids
            for i in range(first_full, request.num_computed_tokens // size):
                parent = request.block_ids[i - 1] if i else None
                if parent != RELEASED:
                    self.allocator.register(request.block_ids[i], parent, tuple(tokens[i * size : (i + 1) * size]))
            if self.window is not None:
                self._release_out_of_window(request)

    def _release_out_of_window(self, request: Request) -> None:
        """Free the blocks no future query can see: the next query, at position
        ``num_computed_tokens``, sees keys from ``num_computed_tokens - window + 1`` on."""
        first_visible = request.num_computed_tokens - self.window + 1
        for i in range(max(first_visible, 0) // self.block_size):
            if request.block_ids[i] != RELEASED:
                self.allocator.free([request.block_ids[i]])
                request.block_ids[i] = RELEASED

    def _admit(self, request: Request, budget: int, copies: list[tuple[int, int]]) -> bool:
        """Reserve blocks for a waiting request's first chunk, reusing cached prefix blocks.

        When every known token hits the cache, the last one is still recomputed: its logits are
        needed to sample the next token.
        """
        size = self.block_size
        tokens = request.all_ids
        hits = self.allocator.lookup(
            [tuple(tokens[i * size : (i + 1) * size]) for i in range((len(tokens) - 1) // size)]
        )
        num_cached = len(hits) * size
        num_new = min(len(tokens) - num_cached, budget)
        needed = blocks_for(num_cached + num_new, size) - len(hits)
        if not self.allocator.can_allocate(needed + self.allocator.num_evictable(hits)):
            return False
        request.block_ids = self.allocator.fork(hits)
        request.num_computed_tokens = num_cached
        if request.num_preemptions == 0:  # count what a fresh request was spared, not recomputes
            request.num_cached_tokens = num_cached
            self.num_prompt_tokens += len(request.prompt_ids)
            self.num_cached_tokens += num_cached
        assert self._reserve(request, num_new, copies)
        return True

    def _reserve(self, request: Request, num_new: int, copies: list[tuple[int, int]]) -> bool:
        """Make sure blocks exist for ``num_new`` more tokens; copy a shared block before writing it."""
        first = request.num_computed_tokens
        needed = blocks_for(first + num_new, self.block_size) - len(request.block_ids)
        cow_index = first // self.block_size
        needs_copy = (
            cow_index < len(request.block_ids) and self.allocator.ref_count(request.block_ids[cow_index]) > 1
        )
        if not self.allocator.can_allocate(max(needed, 0) + needs_copy):
            return False
        if needs_copy:
            shared = request.block_ids[cow_index]
            (fresh,) = self.allocator.allocate(1)
            self.allocator.free([shared])
            request.block_ids[cow_index] = fresh
            copies.append((shared, fresh))
        if needed > 0:
            request.block_ids.extend(self.allocator.allocate(needed))
        return True

    def _pick_victim(self, exclude: set[int]) -> Request | None:
        for request in reversed(self.running):
            if id(request) not in exclude:
                return request
        return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _release(self, request: Request) -> None:
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
