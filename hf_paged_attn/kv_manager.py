"""KV-block manager: each request's block table, between the scheduler (policy) and the block
allocator (free list, reference counts, prefix index).

Plain Python, no torch. Only this module changes ``request.block_ids`` and
``request.num_computed_tokens``; the scheduler asks it whether blocks can be had (``admit``,
``reserve``) and tells it what ran (``commit``) and what left (``release``).
"""

from __future__ import annotations

from .blocks import RELEASED, BlockAllocator, blocks_for
from .layers import LayerKinds
from .request import Request


class KVBlockManager:
    """Block tables: admit (prefix hits), reserve (copy on write), commit (register full blocks,
    free what left the window), fork and release.

    Invariant: a request holds exactly ``blocks_for(num_computed_tokens + scheduled, block_size)``
    entries, of which the ones before its window may be ``RELEASED``.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, layers: LayerKinds | None = None) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.layers = layers or LayerKinds([])
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) pending for the next step
        self.num_prompt_tokens = 0  # of admitted requests
        self.num_cached_tokens = 0  # of those, served from the prefix cache

    def can_ever_fit(self, request: Request) -> bool:
        # The last sampled token is never fed back, so it needs no slot.
        return blocks_for(request.max_total_tokens - 1, self.block_size) <= self.allocator.num_blocks

    def admit(self, request: Request, budget: int) -> bool:
        """Give a waiting request its cached prefix and blocks for its first chunk (at most
        ``budget`` tokens); False, changing nothing, when the blocks are not there.

        When every known token hits the cache, the last one is still recomputed: its logits are
        needed to sample the next token.
        """
        size = self.block_size
        tokens = request.all_ids
        full_blocks = [tuple(tokens[i * size : (i + 1) * size]) for i in range((len(tokens) - 1) // size)]
        hits = self.allocator.lookup(full_blocks)
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
        assert self.reserve(request, num_new)
        return True

    def reserve(self, request: Request, num_new: int) -> bool:
        """Blocks for ``num_new`` more tokens; a shared block about to be written is copied first."""
        first = request.num_computed_tokens
        needed = blocks_for(first + num_new, self.block_size) - len(request.block_ids)
        cow_index = first // self.block_size
        needs_copy = cow_index < len(request.block_ids) and self.allocator.ref_count(request.block_ids[cow_index]) > 1
        if not self.allocator.can_allocate(max(needed, 0) + needs_copy):
            return False
        if needs_copy:
            shared = request.block_ids[cow_index]
            (fresh,) = self.allocator.allocate(1)
            self.allocator.free([shared])
            request.block_ids[cow_index] = fresh
            self.copies.append((shared, fresh))
        if needed > 0:
            request.block_ids.extend(self.allocator.allocate(needed))
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
        tokens = request.all_ids
        for i in range(first_full, request.num_computed_tokens // size):
            parent = request.block_ids[i - 1] if i else None
            if parent != RELEASED:
                self.allocator.register(request.block_ids[i], parent, tuple(tokens[i * size : (i + 1) * size]))
        window = self.layers.uniform_window
        if window is not None:
            self._release_out_of_window(request, window)

    def _release_out_of_window(self, request: Request, window: int) -> None:
        """The next query, at position ``num_computed_tokens``, sees keys from
        ``num_computed_tokens - window + 1`` on: the blocks wholly before that are freed."""
        first_visible = request.num_computed_tokens - window + 1
        for i in range(max(first_visible, 0) // self.block_size):
            if request.block_ids[i] != RELEASED:
                self.allocator.free([request.block_ids[i]])
                request.block_ids[i] = RELEASED

    def fork(self, parent: Request, child: Request) -> None:
        """``child`` shares every block of ``parent`` (copy on write) and its computed tokens."""
        child.block_ids = self.allocator.fork(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens

    def release(self, request: Request) -> None:
        """Give back every block of ``request`` (finished, aborted or preempted). Freed tail first,
        so the least recently used cached block is a chain's last one and the chain's head, which
        every later hit needs, is evicted last."""
        self.allocator.free(request.block_ids[::-1])
        request.block_ids = []
        request.num_computed_tokens = 0

    def kv_waste(self, requests: list[Request]) -> float:
        """Share of the blocks in use that hold no token (each distinct block counted once)."""
        size = self.block_size
        used = self.allocator.num_used_blocks
        filled: dict[int, int] = {}
        for r in requests:
            for i, block in enumerate(r.block_ids):
                if block != RELEASED:
                    filled[block] = max(filled.get(block, 0), min(size, r.num_computed_tokens - i * size))
        return 1.0 - sum(max(f, 0) for f in filled.values()) / (used * size) if used else 0.0
