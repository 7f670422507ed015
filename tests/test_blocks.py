import pytest

from hf_paged_attn.blocks import BlockAllocator


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
