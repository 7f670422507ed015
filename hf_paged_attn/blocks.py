"""Block allocator: which physical KV blocks are free, who holds the others, and which full
blocks can be reused as a cached prefix.

Plain Python, no torch. Block ids index the first axis of every layer's page tensor, so one
allocation serves all layers.

Prefix caching: a full block is identified by ``(parent block id, parent generation, its token
ids)``. Dict lookup compares the token ids themselves, so a hit is never trusted on a hash alone;
the parent's generation changes whenever the parent block is reused for other content, so a stale
child can never be reached through a recycled parent id.
"""

from __future__ import annotations

from collections import OrderedDict, deque

ROOT = (-1, 0)  # parent of a sequence's first block
RELEASED = -1  # a request's block that fell out of its sliding window and was freed early

PrefixKey = tuple[int, int, tuple[int, ...]]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Free blocks, reference counts, and the prefix cache.

    Invariants (``check_invariants``): a block is free with reference count 0, or in use with a
    count equal to its number of holders; free + used == total. Free blocks that still hold a
    cached prefix are evicted least recently used first, and only when no empty block is left, so
    cached blocks never stand in the way of new work.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._empty: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, LRU first
        self._ref_counts = [0] * num_blocks
        self._generation = [0] * num_blocks
        self._key_of: dict[int, PrefixKey] = {}
        self._cached: dict[PrefixKey, int] = {}

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # ------------------------------------------------------------------ holders
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks, each with one holder (empty ones first, then evict)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            if self._empty:
                block = self._empty.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            self._generation[block] += 1  # new content: keys naming the old one go stale
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """Share ``blocks`` with one more holder (copy-on-write children, prefix hits)."""
        for block in blocks:
            if block == RELEASED:
                continue
            if self._ref_counts[block] == 0:  # a cached block comes back into use
                assert block in self._evictable, f"fork of free, uncached block {block}"
                del self._evictable[block]
            self._ref_counts[block] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each block; unheld blocks become free (cached ones stay findable)."""
        for block in blocks:
            if block == RELEASED:
                continue
            assert self._ref_counts[block] > 0, f"double free of block {block}"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._empty.append(block)

    # ------------------------------------------------------------------ prefix cache
    def child_key(self, parent: int | None, tokens: tuple[int, ...]) -> PrefixKey:
        if parent is None:
            return (*ROOT, tokens)
        return (parent, self._generation[parent], tokens)

    def lookup(self, token_blocks: list[tuple[int, ...]]) -> list[int]:
        """The longest run of cached blocks holding ``token_blocks`` (each a full block's ids)."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        parent = None
        for tokens in token_blocks:
            block = self._cached.get(self.child_key(parent, tokens))
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit unheld in the cache (taking them shrinks the free pool)."""
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        """Record that ``block`` (held, full) holds ``tokens`` after ``parent``."""
        if not self.enable_prefix_caching or block in self._key_of:
            return
        if parent is not None and parent not in self._key_of:
            return  # unreachable: lookups walk from the root through cached blocks only
        key = self.child_key(parent, tokens)
        if key not in self._cached:  # a twin computed at the same time stays uncached
            self._cached[key] = block
            self._key_of[block] = key

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._cached[key]

    def check_invariants(self) -> None:
        empty, evictable = set(self._empty), set(self._evictable)
        assert len(empty) == len(self._empty), "a block is twice on the free list"
        assert not empty & evictable, "a block is both empty and cached-free"
        for block, count in enumerate(self._ref_counts):
            free = block in empty or block in evictable
            assert (count == 0) == free, f"block {block}: count {count}, free={free}"
        assert all(b in self._key_of for b in evictable), "an evictable block has no prefix key"
        assert all(self._cached[k] == b for b, k in self._key_of.items()), "prefix maps disagree"
        assert len(self._cached) == len(self._key_of)
