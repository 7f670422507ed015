"""Per-group tables in one shared pool, against one table for every layer (``hybrid_kv=False``) at the
same ``num_blocks`` (the same bytes): admission by need lets a hybrid model hold more requests at once.

Promises, tested over random layer mixes, block sizes, token budgets and request sets:

- whatever runs with one table runs with per-group tables, with the same tokens;
- capacity: requests alike (the same prompt length and new tokens) never decode fewer at once;
- bounded recomputation: without prefix caching, per-group tables feed again (after preemptions)
  fewer than one longest request's tokens more than one table does. They may preempt more often
  (they admit more), but a preemption among requests holding less recomputes less. (With prefix
  caching each group caches and evicts its own blocks and hits shorten recomputation, so only
  "runs, same tokens" is compared there.)

The random searches run derandomized, so CI sees the same sets every time. Plain Python: the
scheduler and KV-block manager are driven as the engine drives them (greedy tokens do not depend
on the tables; the model-level checks are ``tests/runtime/test_hybrid.py`` and
``test_hybrid_concurrency.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_attn.core.blocks import BlockAllocator
from hf_paged_attn.core.kv_manager import KVBlockManager
from hf_paged_attn.core.layers import LayerKinds
from hf_paged_attn.core.policy import POLICIES
from hf_paged_attn.core.request import Request
from hf_paged_attn.core.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class Run:
    fits: bool  # every request could ever fit
    num_preemptions: int = 0
    tokens: list[list[int]] = field(default_factory=list)  # each request's generated tokens
    num_steps: int = 0
    num_recomputed: int = 0  # tokens fed beyond each request's own (prefix hits subtract)
    most_decoding: int = 0  # most requests feeding a generated token in one step


def run(
    windows: list[int | None],
    share_pages: bool,
    num_blocks: int,
    block_size: int,
    budget: int,
    requests: list[tuple[list[int], int]],
    prefix_caching: bool,
) -> Run:
    """Run the requests to the end. A request's next token is a function of its tokens so far, as
    greedy decoding is."""
    layers = LayerKinds(list(windows), share_pages=share_pages)
    allocator = BlockAllocator(layers.pool_blocks(num_blocks), prefix_caching)
    kv = KVBlockManager(allocator, block_size, layers, budget)
    scheduler = Scheduler(kv, max_num_seqs=8, max_batch_tokens=budget, policy=POLICIES["fcfs"])
    live = []
    for i, (prompt, new) in enumerate(requests):
        request = Request(f"r{i}", prompt, new, sampling=None, arrival=i)
        if not scheduler.can_ever_fit(request):
            return Run(False)
        scheduler.add(request)
        live.append(request)
    num_steps = num_fed = most_decoding = 0
    for _ in range(10_000):
        if not scheduler.has_work:
            break
        plan = scheduler.schedule()
        num_steps += 1
        assert plan.scheduled, "a step with work scheduled nothing"
        most_decoding = max(most_decoding, sum(1 for s in plan.scheduled if _decodes(s.request, s.num_new_tokens)))
        for s in plan.scheduled:
            num_fed += s.num_new_tokens
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
    own = sum(len(p) + n - 1 for p, n in requests)  # the last sampled token is never fed
    tokens = [r.output_ids for r in live]
    return Run(True, scheduler.num_preemptions, tokens, num_steps, num_fed - own, most_decoding)


def _decodes(request: Request, num_new: int) -> bool:
    return num_new == 1 and bool(request.output_ids) and request.num_computed_tokens == request.num_tokens - 1


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
def test_per_group_tables_run_whatever_one_table_runs(windows, block_size, budget, requests, extra, prefix_caching):
    longest = max(len(p) + n for p, n in requests)
    num_blocks = -(-longest // block_size) + extra  # from "barely the longest request" up
    one = run(windows, False, num_blocks, block_size, budget, requests, prefix_caching)
    if not one.fits:
        return
    per_group = run(windows, True, num_blocks, block_size, budget, requests, prefix_caching)
    assert per_group.fits, "refused with per-group tables though it fits one table"
    assert per_group.tokens == one.tokens
    if not prefix_caching:
        assert per_group.num_recomputed < one.num_recomputed + longest, (per_group, one)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    windows=layer_mixes,
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.sampled_from([3, 8, 32, 64]),
    prompt=st.lists(st.integers(1, 3), min_size=1, max_size=60),
    new=st.integers(1, 24),
    num_requests=st.integers(2, 8),
    extra=st.integers(0, 40),
)
def test_requests_alike_never_decode_fewer_at_once(windows, block_size, budget, prompt, new, num_requests, extra):
    requests = [(prompt, new)] * num_requests
    num_blocks = -(-(len(prompt) + new) // block_size) + extra
    one = run(windows, False, num_blocks, block_size, budget, requests, False)
    per_group = run(windows, True, num_blocks, block_size, budget, requests, False)
    assert per_group.fits and per_group.tokens == one.tokens
    assert per_group.most_decoding >= one.most_decoding, (per_group.most_decoding, one.most_decoding)


def test_the_issues_gemma3_shape_decodes_three_at_once():
    """6 layers (5 slide a 128-token window, 1 full), block size 16, ``max_batch_tokens=8192``,
    three requests of 4,096 prompt tokens + 8 new, in 426 blocks of every layer (2,556 of one layer
    with per-group tables, 10 MiB of the engine test's model). One table: 257 blocks each, one at a
    time. Per-group tables: a request's 4,096-token chunk takes 257 blocks in each of the 6 groups
    while it runs, then it holds 257 + 5 x 9: the others are admitted one a step and all decode."""
    windows = [128] * 5 + [None]
    requests = [([1 + i % 3] * 4096, 8) for i in range(3)]
    one = run(windows, False, 426, 16, 8192, requests, False)
    per_group = run(windows, True, 426, 16, 8192, requests, False)
    assert (one.most_decoding, per_group.most_decoding) == (1, 3)
    assert per_group.tokens == one.tokens
    assert (one.num_steps, per_group.num_steps) == (24, 10)


def test_the_issues_cohere2_request_fits_both_ways():
    """3 layers (sliding, full, sliding), window 4096 (Cohere 2's), block size 8: 29 prompt + 30 new
    tokens in 8 blocks of every layer, the cache that ran with hybrid_kv=False."""
    windows = [4096, None, 4096]
    request = [(list(range(1, 30)), 30)]
    assert run(windows, False, 8, 8, 512, request, True).fits
    assert run(windows, True, 8, 8, 512, request, True).fits
    assert LayerKinds(windows, share_pages=True).pool_blocks(8) == 8 * 3  # groups of one layer each
    assert LayerKinds(windows, share_pages=False).pool_blocks(8) == 8


def test_more_preemptions_can_mean_less_recomputation():
    """Per-group tables admit r3 and r4 early, so five requests share the steps and all finish at
    step 22 instead of 34; on the way they preempt three times where one table preempts once, yet
    feed 12 tokens again where one table feeds 28. Same tokens."""
    windows, block_size, budget, num_blocks = [16, None, 8, 16, 8, 8], 4, 32, 10
    requests = [([2, 1], 16), ([2, 3, 2, 3, 3, 3], 10), ([2, 1, 3, 2, 1, 2, 3, 1, 1, 2, 2, 3, 3, 1, 2, 1, 1, 3, 2, 2, 3,
                2, 1, 3, 3, 1, 2], 3), ([2, 1, 2, 2], 13), ([3], 17)]  # fmt: skip
    one = run(windows, False, num_blocks, block_size, budget, requests, False)
    per_group = run(windows, True, num_blocks, block_size, budget, requests, False)
    assert one.fits and per_group.fits and per_group.tokens == one.tokens
    assert (one.num_preemptions, per_group.num_preemptions) == (1, 3)
    assert (one.num_recomputed, per_group.num_recomputed) == (28, 12)
    assert (one.num_steps, per_group.num_steps) == (34, 22)
