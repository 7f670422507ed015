"""Block allocator: which physical KV blocks are free, who holds the others, and which full
blocks can be reused as a cached prefix.

Plain Python, no torch. Block ids index the first axis of the page tensors; one pool of blocks
serves every attention group (``layers.py``).

Prefix caching: a full block is identified by ``(attention group, digest of every earlier token, its
own token ids, what else it holds)``; the last is b"" for text, the digests of the images whose
placeholder tokens it holds otherwise (``Request.block_extra``). The digest is a SHA-256 chain over
the earlier blocks' tokens (and images), so a block is found by its content alone, even when the
blocks before it were evicted (a sliding-window group needs only the blocks inside its window); dict
lookup compares the block's own token ids themselves, and SHA-256 makes a wrong earlier prefix as
good as impossible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

RELEASED = -1  # a request's block that fell out of its sliding window and was freed early

# (group, digest of the tokens before, the block's tokens, the block's images: b"" for none)
PrefixKey = tuple[int, bytes, tuple[int, ...], bytes]
ROOT_DIGEST = b""


def chain_digest(previous: bytes, tokens: tuple[int, ...], extra: bytes = b"") -> bytes:
    """Digest of a prefix: that of the prefix before this block, extended by the block's tokens (and
    its images' digests, ``extra``)."""
    return hashlib.sha256(previous + array("q", tokens).tobytes() + extra).digest()


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
        self._group = [0] * num_blocks  # the attention group whose tables hold the block (core/layers.py)
        self._used_in: dict[int, int] = {}  # blocks in use per group
        self._key_of: dict[int, PrefixKey] = {}
        self._cached: dict[PrefixKey, int] = {}
        # bumped by reset_prefix_cache: blocks computed under an earlier epoch (other weights) never join the cache
        self.epoch = 0

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

    def num_used_in(self, group: int) -> int:
        """Blocks in use by attention group ``group``'s tables."""
        return self._used_in.get(group, 0)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # ------------------------------------------------------------------ holders
    def allocate(self, num_blocks: int, group: int = 0) -> list[int]:
        """Take ``num_blocks`` free blocks for ``group``'s tables, each with one holder (empty ones
        first, then evict)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            if self._empty:
                block = self._empty.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            self._ref_counts[block] = 1
            self._group[block] = group
            blocks.append(block)
        self._used_in[group] = self._used_in.get(group, 0) + num_blocks
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """Share ``blocks`` with one more holder (copy-on-write children, prefix hits)."""
        for block in blocks:
            if block == RELEASED:
                continue
            if self._ref_counts[block] == 0:  # a cached block comes back into use
                assert block in self._evictable, f"fork of free, uncached block {block}"
                del self._evictable[block]
                self._used_in[self._group[block]] = self._used_in.get(self._group[block], 0) + 1
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
                self._used_in[self._group[block]] -= 1
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._empty.append(block)

    # ------------------------------------------------------------------ prefix cache
    def cached(self, key: PrefixKey) -> int | None:
        """The block holding ``key``'s content, held or free, or None."""
        return self._cached.get(key) if self.enable_prefix_caching else None

    def lookup(self, token_blocks: list[tuple[int, ...]], group: int = 0) -> list[int]:
        """The longest run of cached blocks holding ``token_blocks`` (each a full block's ids) from
        a sequence's start, in ``group``."""
        hits: list[int] = []
        digest = ROOT_DIGEST
        for tokens in token_blocks:
            block = self.cached((group, digest, tokens, b""))
            if block is None:
                break
            hits.append(block)
            digest = chain_digest(digest, tokens)
        return hits

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit unheld in the cache (taking them shrinks the free pool)."""
        return sum(1 for b in blocks if b != RELEASED and self._ref_counts[b] == 0)

    def register(self, block: int, key: PrefixKey) -> None:
        """Record that ``block`` (held, full) holds ``key``'s content."""
        if not self.enable_prefix_caching or block in self._key_of:
            return
        if key not in self._cached:  # a twin computed at the same time stays uncached
            self._cached[key] = block
            self._key_of[block] = key

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (the weights changed: their K/V is stale) and start a new epoch;
        returns how many blocks were forgotten. Free cached blocks become empty; held ones stay with
        their holders, no longer findable."""
        num_forgotten = len(self._key_of)
        self._empty.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._cached.clear()
        self.epoch += 1
        return num_forgotten

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
        used: dict[int, int] = {}
        for block, count in enumerate(self._ref_counts):
            if count:
                used[self._group[block]] = used.get(self._group[block], 0) + 1
        assert used == {g: n for g, n in self._used_in.items() if n}, "per-group use counts disagree"
