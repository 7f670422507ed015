import pytest

from hf_paged_attn.core.blocks import ROOT_DIGEST, BlockAllocator, chain_digest, root_digest


def test_allocate_fork_free_round_trip():
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free_blocks == 5
    shared = alloc.fork(a[:2])
    assert [alloc.ref_count(b) for b in a] == [2, 2, 1]
    alloc.free(a)
    assert alloc.num_free_blocks == 6  # the forked two are still held
    alloc.free(shared)
    assert alloc.num_free_blocks == 8
    alloc.check_invariants()


def test_can_allocate_and_exhaustion():
    alloc = BlockAllocator(2)
    assert alloc.can_allocate(2) and not alloc.can_allocate(3)
    alloc.allocate(2)
    with pytest.raises(RuntimeError, match="only 0 free"):
        alloc.allocate(1)


def test_double_free_is_caught():
    alloc = BlockAllocator(2)
    (b,) = alloc.allocate(1)
    alloc.free([b])
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([b])


def test_zero_blocks_refused():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


def prefix_allocator(n=8):
    return BlockAllocator(n, enable_prefix_caching=True)


def key(before: list[tuple[int, ...]], tokens: tuple[int, ...], group: int = 0):
    """The prefix key of a block holding ``tokens`` after the full blocks ``before``."""
    digest = ROOT_DIGEST
    for block in before:
        digest = chain_digest(digest, block)
    return (group, digest, tokens, b"")


def test_prefix_lookup_walks_the_chain_and_verifies_tokens():
    alloc = prefix_allocator()
    a, b = alloc.allocate(2)
    alloc.register(a, key([], (1, 2)))
    alloc.register(b, key([(1, 2)], (3, 4)))
    assert alloc.lookup([(1, 2), (3, 4), (5, 6)]) == [a, b]
    assert alloc.lookup([(1, 2), (3, 5)]) == [a]
    assert alloc.lookup([(3, 4)]) == []  # same tokens, other prefix: no hit
    assert alloc.lookup([(1, 2)], group=1) == []  # another attention group's tables: no hit
    assert alloc.lookup([(1, 2)], adapter="a") == []  # the same tokens under a LoRA adapter: other K/V


def test_each_adapter_roots_its_own_chain():
    alloc = prefix_allocator()
    (a,) = alloc.allocate(1)
    alloc.register(a, (0, chain_digest(root_digest("x"), (1, 2)), (3, 4), b""))
    assert root_digest(None) == ROOT_DIGEST
    assert len({root_digest(None), root_digest("x"), root_digest("y")}) == 3
    assert alloc.lookup([(1, 2), (3, 4)], adapter="x") == []  # the first block was never registered
    alloc.register(alloc.allocate(1)[0], (0, root_digest("x"), (1, 2), b""))
    assert len(alloc.lookup([(1, 2), (3, 4)], adapter="x")) == 2
    assert alloc.lookup([(1, 2), (3, 4)], adapter="y") == alloc.lookup([(1, 2), (3, 4)]) == []
    disabled = BlockAllocator(4)
    (c,) = disabled.allocate(1)
    disabled.register(c, key([], (1, 2)))
    assert disabled.lookup([(1, 2)]) == []


def test_a_block_is_found_by_content_even_when_earlier_blocks_were_evicted():
    """Sliding-window groups need only the blocks inside their window: a block's key names the
    content before it, not the block that held it."""
    alloc = prefix_allocator(3)
    a, b = alloc.allocate(2)
    alloc.register(a, key([], (1,)))
    alloc.register(b, key([(1,)], (2,)))
    alloc.free([b, a])  # tail first: b is the least recently used
    assert sorted(alloc.allocate(2)) == sorted([2, b])  # the empty block, then the LRU cached one (b)
    assert alloc.cached(key([(1,)], (2,))) is None and alloc.cached(key([], (1,))) == a
    alloc.check_invariants()


def test_cached_free_blocks_are_evicted_last_and_lru():
    alloc = prefix_allocator(4)
    a, b, c, d = alloc.allocate(4)
    alloc.register(a, key([], (1,)))
    alloc.register(b, key([], (2,)))
    alloc.free([a, b, c, d])  # a and b stay cached; c and d are empty
    assert alloc.num_free_blocks == 4 and alloc.num_cached_blocks == 2
    assert sorted(alloc.allocate(2)) == sorted([c, d])  # empty blocks go first
    assert alloc.allocate(1) == [a]  # then the least recently freed cached block
    assert alloc.lookup([(1,)]) == [] and alloc.lookup([(2,)]) == [b]
    alloc.check_invariants()


def test_a_reused_block_is_not_found_by_its_old_content():
    alloc = prefix_allocator(2)
    a, b = alloc.allocate(2)
    alloc.register(a, key([], (1,)))
    alloc.register(b, key([(1,)], (2,)))  # b holds (2,) after (1,)
    alloc.free([a])  # a is evictable, b still held
    assert alloc.allocate(1) == [a]  # a is evicted and reused for other content...
    alloc.register(a, key([], (9,)))
    # ...so b, computed after (1,), must not be found after (9,)
    assert alloc.lookup([(9,), (2,)]) == [a]
    assert alloc.lookup([(1,), (2,)]) == []
    alloc.check_invariants()


def test_fork_of_cached_free_block_takes_it_out_of_the_free_pool():
    alloc = prefix_allocator(2)
    (a,) = alloc.allocate(1)
    alloc.register(a, key([], (1, 2)))
    alloc.free([a])
    assert alloc.num_free_blocks == 2
    assert alloc.num_evictable([a]) == 1
    alloc.fork([a])
    assert alloc.num_free_blocks == 1 and alloc.ref_count(a) == 1
    alloc.check_invariants()
