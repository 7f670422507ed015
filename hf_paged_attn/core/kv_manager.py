"""KV-block manager: each request's block tables, one per attention group, between the scheduler
(policy) and the block allocator (free list, reference counts, prefix index).

Plain Python, no torch. Only this module changes a request's tables (``request.block_tables``)
and ``request.num_computed_tokens``; the scheduler asks it whether blocks can be had (``admit``,
``reserve``) and tells it what ran (``commit``), what was not kept (``trim``: rejected speculative
tokens) and what left (``release``).
"""

from __future__ import annotations

from .blocks import RELEASED, BlockAllocator, PrefixKey, blocks_for, chain_digest, root_digest
from .layers import AttentionGroup, LayerKinds
from .request import Request


def blocks_at_peak(
    num_tokens: int, block_size: int, groups: list[AttentionGroup], max_batch_tokens: int | None = None
) -> int:
    """Blocks a request of ``num_tokens`` cached tokens holds at most, over all groups: a full
    group holds all of them, a sliding group its window plus the chunk being computed (blocks leave
    the window only once a step is committed)."""
    full = blocks_for(num_tokens, block_size)
    total = 0
    for group in groups:
        if group.window is None or max_batch_tokens is None:
            total += full
        else:
            total += min(full, blocks_for(group.window + max_batch_tokens, block_size) + 1)
    return total


class KVBlockManager:
    """Block tables: admit (prefix hits), reserve (copy on write), commit (register full blocks,
    free what left a window), fork and release.

    Invariant: in every group, a request holds ``blocks_for(num_computed_tokens + scheduled,
    block_size)`` table entries, of which those wholly before its group's window are ``RELEASED``
    (a speculative step reserves room for its proposed tokens too; ``trim`` gives back what the
    rejected ones held once the verified ones are committed).
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        layers: LayerKinds | None = None,
        max_batch_tokens: int | None = None,
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.layers = layers or LayerKinds([])
        self.max_batch_tokens = max_batch_tokens  # bounds a sliding group's blocks during a prefill chunk
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) pending for the next step
        self.num_prompt_tokens = 0  # of admitted requests
        self.num_cached_tokens = 0  # of those, served from the prefix cache

    @property
    def groups(self) -> list[AttentionGroup]:
        return self.layers.groups

    def tables(self, request: Request) -> list[list[int]]:
        """The request's block table of each group (group 0's is ``request.block_ids``)."""
        if len(self.groups) < 2:  # one group: the common case, called several times per request and step
            return [request.block_ids]
        missing = len(self.groups) - 1 - len(request.extra_block_ids)
        if missing > 0:
            request.extra_block_ids.extend([] for _ in range(missing))
        return request.block_tables

    # ------------------------------------------------------------------ capacity
    def blocks_needed(self, request: Request, copies: int = 1) -> int:
        """Blocks ``copies`` sequences as long as ``request`` hold at most at once. The last sampled
        token is never fed back, so it needs no slot."""
        one = blocks_at_peak(request.max_total_tokens - 1, self.block_size, self.groups, self.max_batch_tokens)
        return copies * one

    def can_ever_fit(self, request: Request, copies: int = 1) -> bool:
        return self.blocks_needed(request, copies) <= self.allocator.num_blocks

    def token_capacity(self) -> list[int]:
        """Tokens each group's tables can hold now: what they hold plus every free block. The pool
        is shared, so each group can take all of it; one table's figure is the same for every layer."""
        free = self.allocator.num_free_blocks
        return [(self.allocator.num_used_in(g) + free) * self.block_size for g in range(len(self.groups))]

    # ------------------------------------------------------------------ admission
    def admit(self, request: Request, budget: int) -> bool:
        """Give a waiting request its cached prefix and blocks for its first chunk (at most
        ``budget`` tokens); False, changing nothing, when the blocks are not there.

        Admission by need from the one pool every group shares: the request gets in when the
        blocks each of its groups needs for that chunk are free, whatever the other groups hold.
        A sliding group holds the whole chunk's blocks during its step (the kernels read a chunk's
        keys from the pages, so they are written there first) and frees all but its window's when
        the step is committed. Requests that later outgrow the pool are preempted (``Scheduler``).

        A hit of ``n`` blocks needs, in a full group, the first ``n`` blocks cached; in a sliding
        group only those inside the window of the next query. When every known token hits the
        cache, the last one is still recomputed: its logits are needed to sample the next token.
        A request scoring its prompt (``prompt_logprobs``) gets no hit: every position's logits are needed.
        """
        size = self.block_size
        tokens = request.all_ids
        # the last token is never a hit (see above); a prompt still to be scored, none: it is fed whole
        full_blocks = range((len(tokens) - 1) // size if not request.scores_prompt else 0)
        found = [
            [self.allocator.cached(self._key(request, g, i)) for i in full_blocks] for g in range(len(self.groups))
        ]
        num_hit = self._num_hit(found)
        tables = []
        for group, hits in zip(self.groups, found):  # a sliding group skips what is out of its window
            first = self._first_visible_block(num_hit, group)
            tables.append([RELEASED] * first + hits[first:num_hit])
        num_cached = num_hit * size
        num_new = min(len(tokens) - num_cached, budget)
        new_per_group = blocks_for(num_cached + num_new, size) - num_hit
        revived = [self.allocator.num_evictable(t) for t in tables]  # cached free blocks the hits take back
        if not self.allocator.can_allocate(len(self.groups) * new_per_group + sum(revived)):
            return False
        for table, hits in zip(self.tables(request), tables):
            table[:] = self.allocator.fork(hits)
        request.num_computed_tokens = num_cached
        request.cache_epoch = self.allocator.epoch  # its K/V (hits included) is of the current weights
        if request.num_preemptions == 0:  # count what a fresh request was spared, not recomputes
            request.num_cached_tokens = num_cached
            self.num_prompt_tokens += len(request.prompt_ids)
            self.num_cached_tokens += num_cached
        assert self.reserve(request, num_new)
        return True

    def _num_hit(self, found: list[list[int | None]]) -> int:
        """The most leading blocks every group can serve from the cache."""
        num_hit = len(found[0]) if found else 0
        for group, hits in zip(self.groups, found):  # full groups: an unbroken run from the start
            if group.window is None:
                num_hit = min(num_hit, next((i for i, b in enumerate(hits) if b is None), len(hits)))
        while num_hit > 0:  # sliding groups: the window before the hit point
            if all(
                None not in hits[self._first_visible_block(num_hit, group) : num_hit]
                for group, hits in zip(self.groups, found)
            ):
                break
            num_hit -= 1
        return num_hit

    def _first_visible_block(self, num_blocks: int, group: AttentionGroup) -> int:
        """The first block that the query after ``num_blocks`` full blocks sees in ``group``."""
        if group.window is None:
            return 0
        return max(num_blocks * self.block_size - group.window + 1, 0) // self.block_size

    def _key(self, request: Request, group: int, index: int) -> PrefixKey:
        """Prefix-cache key of full block ``index`` of ``request`` in ``group``. The digests of the
        blocks before it are kept on the request (its tokens are only ever appended), so each
        block is hashed once in the request's life, not once per block that fills after it. The chain
        starts from the request's adapter's root: two adapters never share a block; a block an image
        touches carries the image's digest (``Request.block_extra``)."""
        size, digests, root = self.block_size, request.block_digests, root_digest(request.adapter)
        while len(digests) < index:  # digests[i]: every token (and image) up to the end of block i
            i = len(digests)
            tokens, extra = tuple(request.token_slice(i * size, size)), request.block_extra(i * size, (i + 1) * size)
            digests.append(chain_digest(digests[-1] if i else root, tokens, extra))
        before = digests[index - 1] if index else root
        extra = request.block_extra(index * size, (index + 1) * size)
        return (group, before, tuple(request.token_slice(index * size, size)), extra)

    # ------------------------------------------------------------------ growth
    def reserve(self, request: Request, num_new: int) -> bool:
        """Blocks for ``num_new`` more tokens in every group; a shared block about to be written is
        copied first."""
        first = request.num_computed_tokens
        cow_index = first // self.block_size
        if len(self.groups) < 2:  # most calls: one table whose last block has room and is this request's alone
            table = request.block_ids
            last = table[cow_index] if cow_index < len(table) else RELEASED
            if blocks_for(first + num_new, self.block_size) <= len(table) and (
                last == RELEASED or self.allocator.ref_count(last) < 2
            ):
                return True
        tables = self.tables(request)
        needs = []
        for table in tables:
            needed = max(blocks_for(first + num_new, self.block_size) - len(table), 0)
            shared = table[cow_index] if cow_index < len(table) else RELEASED
            copy = shared != RELEASED and self.allocator.ref_count(shared) > 1
            needs.append((needed, copy))
        wanted = sum(n + c for n, c in needs)
        if not wanted:  # most decode steps: the last block has room, and it is this request's alone
            return True
        if not self.allocator.can_allocate(wanted):
            return False
        for group, (table, (needed, copy)) in enumerate(zip(tables, needs)):
            if copy:
                shared = table[cow_index]
                (fresh,) = self.allocator.allocate(1, group)
                self.allocator.free([shared])
                table[cow_index] = fresh
                self.copies.append((shared, fresh))
            table.extend(self.allocator.allocate(needed, group))
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def commit(self, request: Request, num_new: int) -> None:
        """``num_new`` tokens of ``request`` are now in the cache: blocks they filled join the
        prefix cache, and blocks no later query can see are freed."""
        size = self.block_size
        first_full = request.num_computed_tokens // size
        request.num_computed_tokens += num_new
        last_full = request.num_computed_tokens // size
        # a request whose earlier K/V is of weights since replaced (reset_prefix_cache) caches nothing
        if self.allocator.enable_prefix_caching and request.cache_epoch == self.allocator.epoch:
            for g, table in enumerate(self.tables(request)):
                for i in range(first_full, last_full):
                    if table[i] != RELEASED:
                        self.allocator.register(table[i], self._key(request, g, i))
        for group, table in zip(self.groups, self.tables(request)):
            if group.window is not None:
                self._release_out_of_window(request, table, group.window)

    def _release_out_of_window(self, request: Request, table: list[int], window: int) -> None:
        """The next query, at position ``num_computed_tokens``, sees keys from
        ``num_computed_tokens - window + 1`` on: the blocks wholly before that are freed."""
        first_visible = request.num_computed_tokens - window + 1
        for i in range(max(first_visible, 0) // self.block_size):
            if table[i] != RELEASED:
                self.allocator.free([table[i]])
                table[i] = RELEASED

    def trim(self, request: Request, num_tokens: int | None = None) -> None:
        """Give back the table entries past the blocks of the first ``num_tokens`` tokens (default:
        ``num_computed_tokens``) in every group: room reserved for speculative tokens that were
        shortened or rejected. Those blocks were allocated by ``reserve`` for this request alone and
        hold no committed token, so none of them is in the prefix cache."""
        keep = blocks_for(request.num_computed_tokens if num_tokens is None else num_tokens, self.block_size)
        for table in self.tables(request):
            if len(table) > keep:
                self.allocator.free(table[: keep - 1 : -1] if keep else table[::-1])  # tail first
                del table[keep:]

    # ------------------------------------------------------------------ sharing and release
    def fork(self, parent: Request, child: Request) -> None:
        """``child`` shares every block of ``parent`` (copy on write) and its computed tokens."""
        for source, table in zip(self.tables(parent), self.tables(child)):
            table[:] = self.allocator.fork(source)
        child.num_computed_tokens = parent.num_computed_tokens
        child.cache_epoch = parent.cache_epoch

    def release(self, request: Request) -> None:
        """Give back every block of ``request`` (finished, aborted or preempted). Freed tail first,
        so the least recently used cached block is a chain's last one and the chain's head, which
        every later hit needs, is evicted last."""
        for table in self.tables(request):
            self.allocator.free(table[::-1])
            table.clear()
        request.num_computed_tokens = 0

    def kv_waste(self, requests: list[Request]) -> float:
        """Share of the blocks in use that hold no token (each distinct block counted once). Called
        whenever the peak grows, so the full blocks go through a set in one call per table."""
        size = self.block_size
        used = self.allocator.num_used_blocks
        full: set[int] = set()
        partly: dict[int, int] = {}  # the block a request is filling, and blocks reserved ahead of it
        for r in requests:
            whole = r.num_computed_tokens // size
            for table in self.tables(r):
                full.update(table[:whole])
                for i in range(whole, len(table)):
                    partly[table[i]] = max(partly.get(table[i], 0), r.num_computed_tokens - i * size)
        full.discard(RELEASED)
        tokens = len(full) * size + sum(max(n, 0) for b, n in partly.items() if b not in full and b != RELEASED)
        return 1.0 - tokens / (used * size) if used else 0.0
