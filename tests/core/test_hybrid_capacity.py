"""The same ``num_blocks`` buys the same memory with or without per-group tables, so per-group tables
only ever let more requests in (issue: a hybrid model's explicit cache shrank to 1/3 and refused a
request that fitted with one table).

Property: any request set that runs with one table for every layer (``hybrid_kv=False``) runs with
per-group tables at the same ``PagedConfig.num_blocks``, never refused, with the same tokens and
no more preemptions. (With prefix caching on, each group caches and evicts its own blocks, so a
hit one table keeps can be evicted in one group and the schedules part; there the property is
"runs, same tokens", and preemptions are compared without caching.) One exception is known and
pinned below: per-group tables may admit a request earlier than one table can, run more requests
at once and finish in fewer steps, yet preempt once more later (1 request set in 20,000 random ones).
The random search runs derandomized, so CI sees the same 600 sets every time.
Plain Python: the scheduler and KV-block manager are driven as the engine drives them (greedy
tokens do not depend on the tables; the model-level parity is ``tests/runtime/test_hybrid.py``).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_attn.core.blocks import BlockAllocator
from hf_paged_attn.core.kv_manager import KVBlockManager
from hf_paged_attn.core.layers import LayerKinds
from hf_paged_attn.core.policy import POLICIES
from hf_paged_attn.core.request import Request
from hf_paged_attn.core.scheduler import Scheduler


def run(
    windows: list[int | None],
    share_pages: bool,
    num_blocks: int,
    block_size: int,
    budget: int,
    requests: list[tuple[list[int], int]],
    prefix_caching: bool,
) -> tuple[bool, int, list[list[int]], int]:
    """(every request fits, preemptions, each request's tokens, steps) after running them all to the end.
    A request's next token is a function of its tokens so far, as greedy decoding is."""
    layers = LayerKinds(list(windows), share_pages=share_pages)
    allocator = BlockAllocator(layers.pool_blocks(num_blocks), prefix_caching)
    kv = KVBlockManager(allocator, block_size, layers, budget)
    scheduler = Scheduler(kv, max_num_seqs=8, max_batch_tokens=budget, policy=POLICIES["fcfs"])
    live = []
    for i, (prompt, new) in enumerate(requests):
        request = Request(f"r{i}", prompt, new, sampling=None, arrival=i)
        if not scheduler.can_ever_fit(request):
            return False, 0, [], 0
        scheduler.add(request)
        live.append(request)
    num_steps = 0
    for _ in range(10_000):
        if not scheduler.has_work:
            break
        plan = scheduler.schedule()
        num_steps += 1
        assert plan.scheduled, "a step with work scheduled nothing"
        for s in plan.scheduled:
            kv.commit(s.request, s.num_new_tokens)
        for s in plan.scheduled:
            r = s.request
            if r.num_computed_tokens == r.num_tokens:
                r.output_ids.append(sum(r.all_ids) % 7 + 1)
                if len(r.output_ids) >= r.max_new_tokens:
                    r.finish("length")
                    scheduler.remove(r)
    else:
        raise AssertionError("the requests did not finish")
    assert allocator.num_used_blocks == 0
    allocator.check_invariants()
    return True, scheduler.num_preemptions, [r.output_ids for r in live], num_steps


layer_mixes = st.lists(st.sampled_from([None, 4, 8, 16]), min_size=2, max_size=6).filter(
    lambda w: None in w and len(set(w)) > 1  # a hybrid model: full layers and sliding ones
)
request_sets = st.lists(
    st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=40), st.integers(1, 24)), min_size=1, max_size=6
)


@settings(max_examples=600, deadline=None, derandomize=True)
@given(
    windows=layer_mixes,
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.sampled_from([3, 8, 32]),
    requests=request_sets,
    extra=st.integers(0, 6),
    prefix_caching=st.booleans(),
)
def test_per_group_tables_fit_whatever_one_table_fits(windows, block_size, budget, requests, extra, prefix_caching):
    longest = max(len(p) + n for p, n in requests)
    num_blocks = -(-longest // block_size) + extra  # from "barely the longest request" up
    fits, preemptions, tokens, _ = run(windows, False, num_blocks, block_size, budget, requests, prefix_caching)
    if not fits:
        return
    fits_g, preemptions_g, tokens_g, _ = run(windows, True, num_blocks, block_size, budget, requests, prefix_caching)
    assert fits_g, "refused with per-group tables though it fits one table"
    assert tokens_g == tokens
    if not prefix_caching:
        assert preemptions_g <= preemptions, (preemptions_g, preemptions)


def test_the_issues_cohere2_request_fits_both_ways():
    """3 layers (sliding, full, sliding), window 4096 (Cohere 2's), block size 8: 29 prompt + 30 new
    tokens in 8 blocks of every layer, the cache that ran with hybrid_kv=False."""
    windows = [4096, None, 4096]
    request = [(list(range(1, 30)), 30)]
    assert run(windows, False, 8, 8, 512, request, True)[0]
    assert run(windows, True, 8, 8, 512, request, True)[0]
    assert LayerKinds(windows, share_pages=True).pool_blocks(8) == 8 * 3  # groups of one layer each
    assert LayerKinds(windows, share_pages=False).pool_blocks(8) == 8


def test_the_known_exception_preempts_once_more_in_fewer_steps():
    """Per-group tables admit r3 and r4 at step 4 (one table: at step 16), so five requests share the
    steps and all finish at step 24 instead of 34; r4 is preempted twice on the way, where one table
    preempts r2 once. Same tokens. (Found by a 20,000-set random search; documented in the README.)"""
    windows, block_size, budget, num_blocks = [16, None, 8, 16, 8, 8], 4, 32, 10
    requests = [([2, 1], 16), ([2, 3, 2, 3, 3, 3], 10), ([2, 1, 3, 2, 1, 2, 3, 1, 1, 2, 2, 3, 3, 1, 2, 1, 1, 3, 2, 2, 3,
                2, 1, 3, 3, 1, 2], 3), ([2, 1, 2, 2], 13), ([3], 17)]  # fmt: skip
    fits, preemptions, tokens, steps = run(windows, False, num_blocks, block_size, budget, requests, False)
    fits_g, preemptions_g, tokens_g, steps_g = run(windows, True, num_blocks, block_size, budget, requests, False)
    assert fits and fits_g and tokens_g == tokens
    assert (preemptions, preemptions_g) == (1, 2)
    assert steps_g < steps, (steps_g, steps)
