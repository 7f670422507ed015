"""Scheduler: budget, decode-first order, chunked prefill, admission and preemption."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_attn.core.blocks import RELEASED, BlockAllocator
from hf_paged_attn.core.kv_manager import KVBlockManager
from hf_paged_attn.core.request import Request, Status
from hf_paged_attn.core.scheduler import Scheduler


def make(num_blocks=16, block_size=4, max_num_seqs=8, max_batch_tokens=16):
    alloc = BlockAllocator(num_blocks)
    return alloc, Scheduler(KVBlockManager(alloc, block_size), max_num_seqs, max_batch_tokens)


def req(n_prompt, max_new=8, arrival=0):
    return Request(f"r{arrival}", list(range(1, n_prompt + 1)), max_new, None, arrival)


def commit(plan):
    """Pretend the step ran: tokens computed, one token sampled where the chunk reached the end."""
    for s in plan.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        if s.request.num_computed_tokens == s.request.num_tokens:
            s.request.output_ids.append(0)


def test_chunked_prefill_respects_budget():
    _, sched = make(max_batch_tokens=5)
    r = req(12)
    sched.add(r)
    sizes = []
    for _ in range(3):
        plan = sched.schedule()
        sizes.append([s.num_new_tokens for s in plan.scheduled])
        commit(plan)
    assert sizes == [[5], [5], [2]]
    assert r.output_ids == [0] and len(r.block_ids) == 3


def test_decodes_go_first_then_prefill_fills_budget():
    _, sched = make(max_batch_tokens=8)
    a, b = req(3, arrival=0), req(20, arrival=1)
    sched.add(a)
    commit(sched.schedule())  # a prefilled (3), b gets 5 of its 20
    sched.add(b)
    plan = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("r0", 1), ("r1", 7)]


def test_max_num_seqs_limits_admission():
    _, sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(req(2, arrival=i))
    plan = sched.schedule()
    assert len(plan.scheduled) == 2 and len(sched.waiting) == 1


def test_preemption_frees_the_newest_and_requeues_it_first():
    alloc, sched = make(num_blocks=4, block_size=4, max_batch_tokens=64)
    a, b = req(8, max_new=8, arrival=0), req(8, max_new=8, arrival=1)
    sched.add(a)
    sched.add(b)
    commit(sched.schedule())  # both prefilled: 2 blocks each, cache full
    assert alloc.num_free_blocks == 0
    plan = sched.schedule()  # a needs a third block for position 8: b is preempted
    assert plan.preempted == [b] and b.status is Status.WAITING and b.num_computed_tokens == 0
    assert [s.request for s in plan.scheduled] == [a]
    assert sched.waiting[0] is b and sched.num_preemptions == 1
    alloc.check_invariants()


def test_can_ever_fit_counts_the_last_token_as_free():
    alloc, sched = make(num_blocks=2, block_size=4, max_batch_tokens=64)
    r = req(8, max_new=1)
    assert sched.can_ever_fit(r)
    too_long = req(8, max_new=3)
    assert not sched.can_ever_fit(too_long)


def test_remove_frees_blocks():
    alloc, sched = make()
    r = req(6)
    sched.add(r)
    commit(sched.schedule())
    sched.remove(r)
    assert alloc.num_free_blocks == 16 and not sched.has_work


def test_copy_on_write_of_shared_partial_block():
    alloc, sched = make(num_blocks=8, block_size=4)
    parent = req(6)
    sched.add(parent)
    commit(sched.schedule())
    child = Request("c", parent.prompt_ids, 8, None, 1, output_ids=[5])
    child.block_ids = alloc.fork(parent.block_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    sched.add_running(child)
    plan = sched.schedule()
    # both write position 6, inside the shared second block: one of them copies it first
    assert len(plan.block_copies) == 1
    src, dst = plan.block_copies[0]
    assert src in parent.block_ids or src in child.block_ids
    assert parent.block_ids[1] != child.block_ids[1]
    assert parent.block_ids[0] == child.block_ids[0] and alloc.ref_count(parent.block_ids[0]) == 2
    alloc.check_invariants()


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=6), forks=st.lists(st.integers(0, 5), max_size=3),
       ahead=st.integers(0, 2), released=st.integers(0, 3))  # fmt: skip
def test_kv_waste_counts_each_distinct_block_once(lengths, forks, ahead, released):
    """The set-based kv_waste equals the block-by-block definition: each distinct block (forks share
    theirs) holds the most tokens any of its requests has in it; released blocks count for nothing."""
    size = 4
    kv = KVBlockManager(BlockAllocator(200), size)
    requests = []
    for i, n in enumerate(lengths):
        r = Request(f"r{i}", [1] * max(n, 1), 4, None, i)
        r.block_ids.extend(kv.allocator.allocate(-(-n // size) + ahead))
        r.num_computed_tokens = n
        requests.append(r)
    for i, source in enumerate(forks):
        child = Request(f"c{i}", [1], 4, None, 100 + i)
        kv.fork(requests[source % len(requests)], child)
        requests.append(child)
    r = requests[0]
    for i in range(min(released, r.num_computed_tokens // size)):  # a sliding window's freed blocks
        kv.allocator.free([r.block_ids[i]])
        r.block_ids[i] = RELEASED
    filled: dict[int, int] = {}
    for r in requests:
        for i, block in enumerate(r.block_ids):
            if block != RELEASED:
                filled[block] = max(filled.get(block, 0), min(size, r.num_computed_tokens - i * size))
    used = kv.allocator.num_used_blocks
    expected = 1.0 - sum(max(f, 0) for f in filled.values()) / (used * size) if used else 0.0
    assert kv.kv_waste(requests) == pytest.approx(expected)
