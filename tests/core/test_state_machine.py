"""Stateful property test of BlockAllocator + Scheduler (plain Python, no model).

A hypothesis ``RuleBasedStateMachine`` adds requests (token ids from a two-letter alphabet, so
prompts share prefixes and the prefix cache hits), runs schedule + commit steps, samples a token for
every request whose chunk reached its end, finishes requests at ``max_new_tokens``, aborts, and forks
copy-on-write children. The cache is tiny, so preemption and eviction happen all the time.

Besides the allocator's own invariants and the block accounting, the machine keeps a model of the
page contents: every slot written in a step holds the whole token prefix that produced its K/V.
Block copies are applied before the step's writes (as the engine does), writes must go to blocks
the writer holds alone, and every running request must read back exactly its own prefix from its
block table — so a wrong prefix hit, a missed copy-on-write or a reused block still in use shows up
as a content mismatch, not just as a count.

Speculative steps (``speculative_step``): decoding requests propose tokens (``lookahead``), the
scheduler reserves room for them, their K/V is written after the last token's, a random prefix of
them is accepted and the rest rolled back (commit of the verified count, ``trim``), as
``runtime/speculative`` does. A rejected proposal's K/V sits in the pages like any other, so a
block registered in the prefix cache while holding one shows up as a cached block whose content is
not its key's.

Requests that score their prompt (``prompt_logprobs``, ``add_scoring``) must be fed every prompt
position once: no step may start one past a position not yet scored (a prefix hit would), and a
finished one has exactly one score per prompt token. ``weights_changed`` does what a manager's
pause does after the caller may have changed the weights: prefix caching goes off, and no request
admitted after it may be served from the cache.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hf_paged_attn.core.blocks import ROOT_DIGEST, BlockAllocator, blocks_for, chain_digest
from hf_paged_attn.core.kv_manager import KVBlockManager
from hf_paged_attn.core.policy import POLICIES
from hf_paged_attn.core.request import Request, Status, TokenLogprob
from hf_paged_attn.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

ALPHABET = (1, 2)
MAX_PROMPT = 12
MAX_NEW = 8
Slot = tuple[int, ...]  # the token prefix whose last token's K/V sits in a slot


class CountingAllocator(BlockAllocator):
    """A BlockAllocator that counts evictions of cached blocks (for the non-vacuity test)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False) -> None:
        super().__init__(num_blocks, enable_prefix_caching)
        self.num_evictions = 0

    def _forget(self, block: int) -> None:
        if block in self._key_of:
            self.num_evictions += 1
        super()._forget(block)


class Simulation:
    """Drives a Scheduler the way the engine does, with a model of the pages instead of tensors."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_batch_tokens: int,
        prefix_caching: bool,
        policy: str = "fcfs",
    ) -> None:
        self.block_size = block_size
        self.allocator = CountingAllocator(num_blocks, prefix_caching)
        self.kv = KVBlockManager(self.allocator, block_size)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_batch_tokens, POLICIES[policy])
        self.pages: list[list[Slot | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.live: list[Request] = []  # added, not finished: each is running or waiting
        self.prompts: list[list[int]] = []
        self.num_copies = 0
        self.num_finished = 0
        self.num_forks = 0
        self.num_proposed = 0  # speculative tokens fed, accepted, and blocks trimmed after a rejection
        self.num_accepted = 0
        self.num_trimmed = 0
        self.num_scored = 0  # prompt positions scored (prompt_logprobs)
        self.hits_frozen: int | None = None  # prefix-cache hits when the weights changed
        self._ids = 0

    @property
    def capacity(self) -> int:
        return self.allocator.num_blocks * self.block_size

    def _new_id(self) -> str:
        self._ids += 1
        return f"r{self._ids}"

    # ------------------------------------------------------------------ operations
    def add(self, prompt: list[int], max_new_tokens: int, priority: int = 0, scores_prompt: bool = False) -> Request:
        """Queue a request, clamped so it can ever fit (the engine refuses the others)."""
        prompt = prompt[: self.capacity] or [ALPHABET[0]]
        max_new_tokens = max(1, min(max_new_tokens, self.capacity - len(prompt) + 1))
        request = Request(self._new_id(), list(prompt), max_new_tokens, None, self._ids, priority=priority)
        if scores_prompt:  # as add_request(prompt_logprobs=0) sets it up
            request.num_prompt_logprobs, request.prompt_logprobs = 0, [None]
        assert self.scheduler.can_ever_fit(request)
        self.scheduler.add(request)
        self.live.append(request)
        self.prompts.append(list(prompt))
        return request

    def step(self, tokens: list[int], fork_first: bool = False) -> SchedulerOutput:
        """schedule, copy blocks, write the scheduled tokens, commit, then sample and finish.

        ``fork_first`` forks the first sampled request right after its sample, as the engine does
        for ``num_return_sequences``: the child shares every block and draws a different token.
        """
        plan = self.scheduler.schedule()
        self._check_plan(plan)
        self._score_prompts(plan)
        self._apply_copies(plan.block_copies)
        for s in plan.scheduled:
            self._write(s.request, s.request.num_computed_tokens, s.num_new_tokens)
        for s in plan.scheduled:
            self.kv.commit(s.request, s.num_new_tokens)
        for s in plan.scheduled:  # what the step's attention reads: also for requests that finish now
            self._check_reads(s.request)
        sampled = [s.request for s in plan.scheduled if s.request.num_computed_tokens == s.request.num_tokens]
        if fork_first and sampled:
            child = self.fork(sampled[0])
            token = tokens[0] if tokens else ALPHABET[0]
            child.output_ids.append(ALPHABET[(ALPHABET.index(token) + 1) % len(ALPHABET)])
            if len(child.output_ids) >= child.max_new_tokens:
                self.finish(child, "length")
        for i, request in enumerate(sampled):
            request.output_ids.append(tokens[i % len(tokens)] if tokens else ALPHABET[0])
            if len(request.output_ids) >= request.max_new_tokens:
                self.finish(request, "length")
        return plan

    def speculative_step(self, tokens: list[int], proposals: list[list[int]], accepts: list[int]) -> SchedulerOutput:
        """A step where decoding requests propose tokens, as ``runtime/speculative`` runs it: the
        i-th decoding request proposes ``proposals[i]`` (within its ``max_new_tokens``), the
        scheduler reserves what fits, the proposals' K/V is written, ``accepts[i]`` of them are
        accepted (mod their count + 1) and then one more token (a rejection's correction differs from
        the rejected proposal); the verified tokens are committed and the rest of the room trimmed."""
        decoding = [r for r in self.scheduler.running if r.num_pending_tokens == 1 and not r.group]
        for i, request in enumerate(decoding):
            room = request.max_new_tokens - len(request.output_ids) - 1
            request.draft_ids = list(proposals[i % len(proposals)][: max(room, 0)]) if proposals else []
            request.lookahead = len(request.draft_ids)
        plan = self.scheduler.schedule()
        self._check_plan(plan)
        self._score_prompts(plan)
        scheduled = []
        for s in plan.scheduled:  # what Speculator.propose does: proposals cut to the room granted, a new plan
            request = s.request
            granted = s.num_new_tokens - request.num_pending_tokens
            request.draft_ids = request.draft_ids[: max(granted, 0)]
            fed = request.num_pending_tokens + len(request.draft_ids)
            if s.num_new_tokens > fed:
                self.kv.trim(request, request.num_computed_tokens + fed)
            scheduled.append(ScheduledRequest(request, min(s.num_new_tokens, fed), tuple(request.draft_ids)))
        plan = dataclasses.replace(plan, scheduled=scheduled)
        self._apply_copies(plan.block_copies)
        for s in plan.scheduled:
            r = s.request
            self._write(r, r.num_computed_tokens, s.num_new_tokens, r.all_ids + r.draft_ids)
        sampled = []
        for i, s in enumerate(plan.scheduled):
            r, draft = s.request, s.request.draft_ids
            if not draft:
                self.kv.commit(r, s.num_new_tokens)
                if r.num_computed_tokens == r.num_tokens:
                    sampled.append(r)
                continue
            accepted = accepts[i % len(accepts)] % (len(draft) + 1) if accepts else 0
            last = tokens[i % len(tokens)] if tokens else ALPHABET[0]
            if accepted < len(draft) and last == draft[accepted]:  # a correction differs from what it rejects
                last = ALPHABET[(ALPHABET.index(last) + 1) % len(ALPHABET)]
            emitted = (draft[:accepted] + [last])[: r.max_new_tokens - len(r.output_ids)]
            self.num_proposed += len(draft)
            self.num_accepted += accepted
            r.draft_ids, r.lookahead = [], 0
            r.output_ids.extend(emitted)
            self.kv.commit(r, len(emitted))  # the last token and the accepted proposals before the last emitted
            before = len(r.block_ids)
            self.kv.trim(r)
            self.num_trimmed += before - len(r.block_ids)
            self._check_reads(r)
            if len(r.output_ids) >= r.max_new_tokens:
                self.finish(r, "length")
        for s in plan.scheduled:
            if s.request in sampled:
                self._check_reads(s.request)
        for i, request in enumerate(sampled):
            request.output_ids.append(tokens[i % len(tokens)] if tokens else ALPHABET[0])
            if len(request.output_ids) >= request.max_new_tokens:
                self.finish(request, "length")
        for request in self.scheduler.running + self.scheduler.waiting:
            request.draft_ids, request.lookahead = [], 0
        return plan

    def _score_prompts(self, plan: SchedulerOutput) -> None:
        """What ``Updater._score_prompts`` records for the step's scoring requests, checked first:
        the chunk starts at or before the first position not scored yet."""
        for s in plan.scheduled:
            r = s.request
            if not r.scores_prompt:
                continue
            assert r.num_computed_tokens <= len(r.prompt_logprobs) - 1, (
                f"{r.request_id}: the step starts at {r.num_computed_tokens}, past position "
                f"{len(r.prompt_logprobs) - 1}, which is not scored yet (a prefix hit skipped it)"
            )
            positions = r.prompt_positions(r.num_computed_tokens, s.num_new_tokens)
            r.prompt_logprobs += [TokenLogprob(r.prompt_ids[p + 1], 0.0) for p in positions]
            self.num_scored += len(positions)

    def finish(self, request: Request, reason: str) -> None:
        if reason == "length" and request.prompt_logprobs is not None:
            assert len(request.prompt_logprobs) == len(request.prompt_ids), "each prompt token scored once"
            assert [e.token_id for e in request.prompt_logprobs[1:]] == request.prompt_ids[1:]
        self.scheduler.remove(request)
        request.finish(reason)
        self.live.remove(request)
        self.num_finished += 1

    def fork(self, parent: Request) -> Request:
        """A copy-on-write child, as the engine makes for num_return_sequences."""
        assert parent.status is Status.RUNNING
        child = Request(
            self._new_id(),
            parent.prompt_ids,
            parent.max_new_tokens,
            None,
            parent.arrival,
            output_ids=list(parent.output_ids),
            num_computed_tokens=parent.num_computed_tokens,
            block_ids=self.allocator.fork(parent.block_ids),
        )
        self.scheduler.add_running(child)
        self.live.append(child)
        self.num_forks += 1
        return child

    def drain(self, max_steps: int = 5000) -> int:
        """Step until no work is left (liveness: no preemption livelock); returns the step count."""
        for n in range(max_steps):
            if not self.scheduler.has_work:
                return n
            self.step([ALPHABET[n % len(ALPHABET)]])
            self.check()
        raise AssertionError(f"still {len(self.live)} requests unfinished after {max_steps} steps")

    def remove_all(self) -> None:
        for request in list(self.live):
            self.finish(request, "abort")

    # ------------------------------------------------------------------ page model
    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        # The engine copies all pairs at once (dst = src reads every src before any write).
        snapshot = {src: list(self.pages[src]) for src, _ in copies}
        for src, dst in copies:
            self.pages[dst] = list(snapshot[src])
        self.num_copies += len(copies)

    def _write(self, request: Request, first: int, num_new: int, ids: list[int] | None = None) -> None:
        """``ids``: what the request feeds (its tokens, then a speculative step's proposals)."""
        size = self.block_size
        ids = request.all_ids if ids is None else ids
        for pos in range(first, first + num_new):
            index = pos // size
            assert index < len(request.block_ids), f"{request.request_id}: no block for position {pos}"
            block = request.block_ids[index]
            assert self.allocator.ref_count(block) == 1, (
                f"{request.request_id} writes position {pos} into block {block} shared by "
                f"{self.allocator.ref_count(block)} holders"
            )
            assert block not in self.allocator._key_of, f"{request.request_id} overwrites cached block {block}"
            self.pages[block][pos % size] = tuple(ids[: pos + 1])

    # ------------------------------------------------------------------ checks
    def _check_plan(self, plan: SchedulerOutput) -> None:
        scheduled = [s.request for s in plan.scheduled]
        assert len({id(r) for r in scheduled}) == len(scheduled), "a request scheduled twice"
        assert not {id(r) for r in scheduled} & {id(r) for r in plan.preempted}, "scheduled and preempted"
        assert sum(s.num_new_tokens for s in plan.scheduled) <= self.scheduler.max_batch_tokens
        for s in plan.scheduled:
            assert s.request.status is Status.RUNNING
            ahead = s.num_new_tokens - s.request.num_pending_tokens
            assert 1 <= s.num_new_tokens and ahead <= (s.request.lookahead if s.request.num_pending_tokens == 1 else 0)
        assert plan.num_lookahead_tokens == sum(max(s.num_new_tokens - s.request.num_pending_tokens, 0)
                                                for s in plan.scheduled)  # fmt: skip
        for request in plan.preempted:
            assert request.status is Status.WAITING and not request.block_ids
            assert not request.draft_ids and not request.lookahead, "a preempted request keeps its proposals"
            assert request.num_computed_tokens == 0 and request in self.scheduler.waiting

    def _check_reads(self, request: Request) -> None:
        """Every computed position of ``request`` holds the K/V of its own token prefix."""
        ids, size = request.all_ids, self.block_size
        for pos in range(request.num_computed_tokens):
            got = self.pages[request.block_ids[pos // size]][pos % size]
            assert got == tuple(ids[: pos + 1]), f"{request.request_id} reads wrong K/V at position {pos}"

    def check(self) -> None:
        alloc, sched, size = self.allocator, self.scheduler, self.block_size
        alloc.check_invariants()
        if self.hits_frozen is not None:
            assert self.kv.num_cached_tokens == self.hits_frozen, "a prefix hit after the weights changed"
        free = set(alloc._empty) | set(alloc._evictable)
        used = {b for b in range(alloc.num_blocks) if alloc.ref_count(b) > 0}
        assert not free & used, f"blocks both free and in use: {sorted(free & used)}"
        assert free | used == set(range(alloc.num_blocks)), "a block is neither free nor in use"
        assert alloc.num_free_blocks + alloc.num_used_blocks == alloc.num_blocks
        assert len(free) == alloc.num_free_blocks and len(used) == alloc.num_used_blocks

        # Every holder is a running request; reference counts are exactly the holder counts.
        holders = Counter(b for r in sched.running for b in r.block_ids)
        assert all(len(set(r.block_ids)) == len(r.block_ids) for r in sched.running), "block twice in a table"
        for block in range(alloc.num_blocks):
            assert alloc.ref_count(block) == holders.get(block, 0), (
                f"block {block}: ref count {alloc.ref_count(block)}, held by {holders.get(block, 0)} requests"
            )

        # Queues agree with request states and with the set of live requests.
        assert all(r.status is Status.RUNNING for r in sched.running)
        assert all(r.status is Status.WAITING and not r.block_ids for r in sched.waiting)
        queued = [id(r) for r in sched.running] + [id(r) for r in sched.waiting]
        assert len(set(queued)) == len(queued), "a request is queued twice"
        assert set(queued) == {id(r) for r in self.live}, "live requests and queues disagree"

        # Every running request holds blocks for exactly its computed tokens, with the right K/V.
        for r in sched.running:
            assert r.num_computed_tokens <= r.num_tokens
            assert len(r.block_ids) == blocks_for(r.num_computed_tokens, size), (
                f"{r.request_id}: {len(r.block_ids)} blocks for {r.num_computed_tokens} computed tokens"
            )
            self._check_reads(r)

        # Every cached block holds its key's tokens, after exactly the prefix its key's digest names.
        for (group, digest, tokens, _images), block in alloc._cached.items():
            content = self.pages[block]
            assert group == 0, "one attention group here"
            assert all(c is not None for c in content), f"cached block {block} is not full"
            assert tuple(c[-1] for c in content) == tokens, f"cached block {block} holds other tokens"
            before = content[0][:-1]  # every token before the block's first
            assert len(before) % size == 0, f"cached block {block} does not start on a block boundary"
            want = ROOT_DIGEST
            for i in range(0, len(before), size):
                want = chain_digest(want, tuple(before[i : i + size]))
            assert digest == want, f"cached block {block} follows other content than its key says"


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort / fork sequences on a tiny cache; teardown drains and removes."""

    prefix_caching = True
    policy = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self.sim: Simulation | None = None

    @initialize(
        num_blocks=st.integers(2, 10),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 6),
        max_batch_tokens=st.integers(1, 16),
        first=st.lists(
            st.tuples(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=MAX_PROMPT), st.integers(1, MAX_NEW)),
            min_size=1,
            max_size=6,
        ),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_batch_tokens: int,
        first: list[tuple[list[int], int]],
    ) -> None:
        """A tiny cache, and a first few requests so that every example has work to schedule."""
        self.sim = Simulation(num_blocks, block_size, max_num_seqs, max_batch_tokens, self.prefix_caching, self.policy)
        for prompt, max_new in first:
            self.sim.add(prompt, max_new)

    @rule(
        prompt=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=MAX_PROMPT),
        max_new=st.integers(1, MAX_NEW),
        priority=st.integers(-2, 2),
    )
    def add(self, prompt: list[int], max_new: int, priority: int) -> None:
        self.sim.add(prompt, max_new, priority)

    @rule(
        pick=st.integers(0, 1 << 16),
        cut=st.integers(0, MAX_PROMPT),
        suffix=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=4),
        max_new=st.integers(1, MAX_NEW),
    )
    def add_sharing_prefix(self, pick: int, cut: int, suffix: list[int], max_new: int) -> None:
        """A prompt that starts like an earlier one (prefix hits, also on evicted/recycled chains)."""
        base = self.sim.prompts[pick % len(self.sim.prompts)] if self.sim.prompts else []
        self.sim.add(base[:cut] + suffix, max_new)

    @rule(
        tokens=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=8),
        repeat=st.integers(1, 3),
        fork_first=st.booleans(),
    )
    def step(self, tokens: list[int], repeat: int, fork_first: bool) -> None:
        for i in range(repeat):
            if i:
                self.sim.check()
            self.sim.step(tokens[i:] + tokens[:i], fork_first=fork_first and i == 0)

    @rule(
        tokens=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=8),
        proposals=st.lists(st.lists(st.sampled_from(ALPHABET), max_size=5), min_size=1, max_size=4),
        accepts=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    )
    def speculative_step(self, tokens: list[int], proposals: list[list[int]], accepts: list[int]) -> None:
        self.sim.speculative_step(tokens, proposals, accepts)

    # abort and fork are no-ops when there is nothing to pick (cheaper for hypothesis than preconditions)
    @rule(pick=st.integers(0, 1 << 16))
    def abort(self, pick: int) -> None:
        if self.sim.live:
            self.sim.finish(self.sim.live[pick % len(self.sim.live)], "abort")

    @rule(
        prompt=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=MAX_PROMPT),
        max_new=st.integers(1, MAX_NEW),
    )
    def add_scoring(self, prompt: list[int], max_new: int) -> None:
        """A request scoring its prompt (often one whose prefix is cached: the alphabet has two letters)."""
        self.sim.add(prompt, max_new, scores_prompt=True)

    @rule(roll=st.integers(0, 7))
    def weights_changed(self, roll: int) -> None:
        """What a manager's pause does: the cached K/V may be stale, so nothing later hits it.
        (One draw in 8: most examples keep the prefix cache on to the end.)"""
        if roll:
            return
        self.sim.allocator.enable_prefix_caching = False
        if self.sim.hits_frozen is None:
            self.sim.hits_frozen = self.sim.kv.num_cached_tokens

    @rule(pick=st.integers(0, 1 << 16))
    def fork(self, pick: int) -> None:
        """Fork any running request, also one part-way through its prefill (not one scoring its
        prompt: the engine forks after the prompt's first sample, when its scores are complete)."""
        running = [r for r in self.sim.scheduler.running if not r.scores_prompt]
        if running:
            self.sim.fork(running[pick % len(running)])

    @invariant()
    def consistent(self) -> None:
        if self.sim is not None:
            self.sim.check()

    def teardown(self) -> None:
        if self.sim is None:
            return
        sched, alloc = self.sim.scheduler, self.sim.allocator
        # shown by pytest --hypothesis-show-statistics: how often examples preempt, hit, evict, copy
        event(f"preempted={sched.num_preemptions > 0}")
        event(f"prefix hit={sched.kv.num_cached_tokens > 0}")
        event(f"evicted={alloc.num_evictions > 0}")
        event(f"copied={self.sim.num_copies > 0}")
        event(f"forked={self.sim.num_forks > 0}")
        event(f"speculated={self.sim.num_accepted > 0 and self.sim.num_trimmed > 0}")
        event(f"scored a prompt={self.sim.num_scored > 0}")
        event(f"weights changed={self.sim.hits_frozen is not None}")
        # Liveness: left alone, the queued work finishes (no preemption livelock) and frees everything.
        drained = copy.deepcopy(self.sim)
        drained.drain()
        assert drained.allocator.num_free_blocks == drained.allocator.num_blocks
        # Removing everything (running, waiting, forked children) frees every block.
        self.sim.remove_all()
        self.sim.check()
        assert alloc.num_free_blocks == alloc.num_blocks, f"{alloc.num_used_blocks} blocks leaked"
        assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks))


MACHINE_SETTINGS = settings(
    max_examples=50, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class PrefixCachingMachine(SchedulerMachine):
    prefix_caching = True


class NoPrefixCachingMachine(SchedulerMachine):
    prefix_caching = False


class PriorityMachine(SchedulerMachine):
    """The same machine under the ``priority`` policy: requests of mixed priorities are admitted
    and preempted out of arrival order, and every invariant must still hold."""

    prefix_caching = True
    policy = "priority"


TestWithPrefixCaching = PrefixCachingMachine.TestCase
TestWithPrefixCaching.settings = MACHINE_SETTINGS
TestWithoutPrefixCaching = NoPrefixCachingMachine.TestCase
TestWithoutPrefixCaching.settings = MACHINE_SETTINGS
TestWithPriorityPolicy = PriorityMachine.TestCase
TestWithPriorityPolicy.settings = MACHINE_SETTINGS


# ---------------------------------------------------------------------- the machine is not vacuous
def random_run(
    prefix_caching: bool,
    seed: int,
    num_ops: int = 400,
    num_blocks: int = 6,
    block_size: int = 2,
    speculate: bool = False,
) -> Simulation:
    """The machine's own operations, chosen at random with a fixed seed, on a tiny cache."""
    rng = random.Random(seed)
    sim = Simulation(num_blocks, block_size, max_num_seqs=4, max_batch_tokens=8, prefix_caching=prefix_caching)
    for _ in range(num_ops):
        op = rng.random()
        if op < 0.25 or not sim.prompts:
            prompt = [rng.choice(ALPHABET) for _ in range(rng.randint(1, MAX_PROMPT))]
            sim.add(prompt, rng.randint(1, MAX_NEW))
        elif op < 0.35:
            base = rng.choice(sim.prompts)
            sim.add(base[: rng.randint(0, len(base))] + [rng.choice(ALPHABET)], rng.randint(1, MAX_NEW))
        elif op < 0.40 and sim.live:
            sim.finish(rng.choice(sim.live), "abort")
        elif op < 0.45 and sim.scheduler.running:
            sim.fork(rng.choice(sim.scheduler.running))
        elif op < 0.70 and speculate:
            proposals = [[rng.choice(ALPHABET) for _ in range(rng.randint(0, 5))] for _ in range(3)]
            accepts = [rng.randint(0, 5) for _ in range(3)]
            sim.speculative_step([rng.choice(ALPHABET) for _ in range(4)], proposals, accepts)
        else:
            sim.step([rng.choice(ALPHABET) for _ in range(4)], fork_first=rng.random() < 0.1)
        sim.check()
    sim.drain()
    return sim


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sequences_preempt_hit_evict_and_copy(seed: int) -> None:
    sim = random_run(prefix_caching=True, seed=seed)
    assert sim.scheduler.num_preemptions > 0, "no preemption: the cache is not small enough"
    assert sim.kv.num_cached_tokens > 0, "no prefix hit"
    assert sim.allocator.num_evictions > 0, "no eviction of a cached block"
    assert sim.num_copies > 0, "no copy-on-write"
    assert sim.num_finished > 50
    assert sim.allocator.num_used_blocks == 0


def test_random_sequences_without_prefix_caching_never_hit() -> None:
    sim = random_run(prefix_caching=False, seed=0)
    assert sim.scheduler.num_preemptions > 0 and sim.num_copies > 0
    assert sim.kv.num_cached_tokens == 0 and sim.allocator.num_cached_blocks == 0
    assert sim.allocator.num_evictions == 0
    assert sim.allocator.num_used_blocks == 0


@pytest.mark.parametrize("block_size, num_blocks", [(1, 5), (2, 4), (2, 8), (4, 3), (4, 6)])
def test_seeded_sweep(block_size: int, num_blocks: int) -> None:
    """Cheap fixed-seed sweep over cache shapes, with every check of the machine after each step
    (catches rare interleavings, e.g. a stale prefix chain through a recycled parent block)."""
    for seed in range(4):
        for prefix_caching in (True, False):
            sim = random_run(prefix_caching, seed, num_ops=300, num_blocks=num_blocks, block_size=block_size)
            assert sim.allocator.num_used_blocks == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_speculative_steps_accept_reject_and_roll_back(seed: int) -> None:
    """Speculative steps among the others: proposals accepted and rejected, rolled back by trim,
    requests preempted mid-speculation; every check of the machine holds after every operation."""
    sim = random_run(prefix_caching=True, seed=seed, speculate=True)
    assert sim.num_accepted > 10 and sim.num_proposed - sim.num_accepted > 10
    assert sim.num_trimmed > 0, "no rejected proposal ever left a block to give back"
    assert sim.scheduler.num_preemptions > 0 and sim.kv.num_cached_tokens > 0
    assert sim.allocator.num_used_blocks == 0


@pytest.mark.parametrize("block_size, num_blocks", [(1, 5), (2, 4), (4, 6)])
def test_seeded_speculative_sweep(block_size: int, num_blocks: int) -> None:
    for seed in range(3):
        for prefix_caching in (True, False):
            sim = random_run(prefix_caching, seed, 300, num_blocks, block_size, speculate=True)
            assert sim.allocator.num_used_blocks == 0


def test_recycled_parent_does_not_lead_to_its_old_children() -> None:
    """The rare interleaving the machine has to stumble on, spelled out: a cached chain's first
    block is evicted and recomputed with other tokens while its child stays cached; a prompt that
    walks through the new content must not reach the old child."""
    sim = Simulation(num_blocks=3, block_size=1, max_num_seqs=4, max_batch_tokens=8, prefix_caching=True)
    first = sim.add([1, 2, 1], 1)
    sim.step([1])
    assert first.finished and sim.allocator.num_cached_blocks == 3
    sim.add([2], 1)  # needs one block: evicts the least recently freed, the chain's first block
    sim.step([1])
    sim.check()
    late = sim.add([2, 2, 1], 1)  # hits the recomputed block; the old child holds (1, 2), not (2, 2)
    sim.step([1])
    sim.check()
    assert late.finished and late.num_cached_tokens == 1
    sim.drain()
    assert sim.allocator.num_used_blocks == 0
