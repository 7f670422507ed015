"""Block allocator: which physical KV blocks are free, and how many holders each used block has.

Plain Python, no torch. Block ids index the first axis of every layer's page tensor, so one
allocation serves all layers.
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Free list plus reference counts over ``num_blocks`` physical blocks.

    Invariants (checked by ``check_invariants`` in tests): a block is either free with reference
    count 0, or in use with a count equal to its number of holders; free + used == total.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks, each with one holder."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """Share ``blocks`` with one more holder (copy-on-write children, prefix hits)."""
        for block in blocks:
            assert self._ref_counts[block] > 0, f"fork of free block {block}"
            self._ref_counts[block] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each block; blocks nobody holds go back to the free list."""
        for block in blocks:
            assert self._ref_counts[block] > 0, f"double free of block {block}"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice on the free list"
        for block, count in enumerate(self._ref_counts):
            assert (count == 0) == (block in free), f"block {block}: count {count}, free={block in free}"
