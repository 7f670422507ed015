"""Prefix caching: shared prefixes reuse blocks, and outputs stay equal to sdpa and to caching off."""

from __future__ import annotations

import pytest

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn_tools.testing import ragged_prompts, reference_greedy

BS = 4
NEW = 12


def run_one(engine: ContinuousBatchingEngine, prompt: list[int], new: int = NEW):
    engine.add_request(prompt, max_new_tokens=new)
    (final,) = [o for o in engine.stream() if o.finished]
    return final


@pytest.fixture()
def engines(llama_pair):
    _, paged = llama_pair
    on = ContinuousBatchingEngine(paged, PagedConfig(block_size=BS, num_blocks=64, enable_prefix_caching=True))
    off = ContinuousBatchingEngine(paged, PagedConfig(block_size=BS, num_blocks=64, enable_prefix_caching=False))
    return on, off


BASE = ragged_prompts(1, 23, 23, seed=21)[0]  # 23 tokens: 5 full blocks + 3


@pytest.mark.parametrize(
    "second, expected_cached",
    [
        (BASE, 20),  # identical prompt: 5 full blocks hit (23 tokens, the last block is partial)
        (BASE[:12] + [7, 7, 7, 7, 7], 12),  # shares exactly 3 blocks
        (BASE[:14] + [9, 9, 9], 12),  # 3 blocks plus a partial block: only full blocks are reused
        (BASE[:20], 16),  # entirely a cached prefix: the last block is recomputed for its logits
        ([5] + BASE[1:], 0),  # first token differs: nothing in common
    ],
    ids=["identical", "k_blocks", "k_blocks_plus_partial", "whole_prompt_cached", "no_share"],
)
def test_hits_and_parity(llama_pair, engines, second, expected_cached):
    ref, _ = llama_pair
    on, off = engines
    run_one(on, BASE)
    got = run_one(on, second)
    assert got.num_cached_tokens == expected_cached
    want = reference_greedy(ref, second, NEW)
    assert got.output_ids == want
    assert run_one(off, second).output_ids == want
    assert on.allocator.num_used_blocks == 0
    on.allocator.check_invariants()


def test_multi_turn_extends_prompt_and_output(llama_pair, engines):
    ref, _ = llama_pair
    on, _ = engines
    first = run_one(on, BASE)
    follow_up = BASE + first.output_ids + [11, 12, 13]
    got = run_one(on, follow_up)
    # prompt (23) + output (12) = 35 tokens were computed; the first 8 blocks (32 tokens) are cached
    assert got.num_cached_tokens == 32
    assert got.output_ids == reference_greedy(ref, follow_up, NEW)


def test_concurrent_sharing_and_stats(llama_pair):
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=BS, num_blocks=128, enable_prefix_caching=True))
    prefix = ragged_prompts(1, 16, 16, seed=5)[0]
    suffixes = ragged_prompts(6, 1, 9, seed=6)
    run_one(engine, prefix + [1])
    outs = engine.generate([prefix + s for s in suffixes], max_new_tokens=NEW)
    assert all(o.num_cached_tokens == 16 for o in outs)
    for s, o in zip(suffixes, outs):
        assert o.output_ids == reference_greedy(ref, prefix + s, NEW)
    stats = engine.stats
    assert stats.num_cached_tokens == 6 * 16 and 0 < stats.prefix_hit_rate < 1


def test_eviction_under_pressure_keeps_results(llama_pair):
    """A cache too small to keep everything: cached blocks are evicted LRU and results stay right."""
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=BS, num_blocks=24, enable_prefix_caching=True))
    prompts = ragged_prompts(10, 10, 40, seed=8)
    prompts += [p[: len(p) // 2 + 4] for p in prompts[:5]]
    outs = engine.generate(prompts, max_new_tokens=8)
    for p, o in zip(prompts, outs):
        assert o.output_ids == reference_greedy(ref, p, 8)
    assert engine.allocator.num_used_blocks == 0
    engine.allocator.check_invariants()


def test_preemption_with_prefix_caching(llama_pair):
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=BS, num_blocks=30, enable_prefix_caching=True))
    prompts = ragged_prompts(8, 20, 60, seed=9)
    outs = engine.generate(prompts, max_new_tokens=24)
    assert engine.stats.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.output_ids == reference_greedy(ref, p, 24)


@pytest.mark.parametrize("native", [False, True])
def test_concurrent_decodes_attend_to_the_shared_blocks_once(llama_pair, monkeypatch, native):
    """Requests decoding together over 40 shared prompt tokens take the torch backend's cascade path
    (shared blocks once per group, lse merge) and still match sdpa token for token. The native CPU
    kernel, when it runs, reads shared pages in place per request instead: same tokens."""
    from hf_paged_attn.kernels import cpu_native
    from hf_paged_attn.kernels.torch_backend import decode as torch_decode

    if not native:
        monkeypatch.setattr(cpu_native, "library", lambda: None)
    calls = []
    cascade = torch_decode._decode_cascade
    monkeypatch.setattr(torch_decode, "_decode_cascade", lambda *a, **k: calls.append(1) or cascade(*a, **k))
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=BS, num_blocks=160, enable_prefix_caching=True))
    prefix = ragged_prompts(1, 40, 40, seed=8)[0]  # 10 full blocks, above CASCADE_MIN_TOKENS
    suffixes = ragged_prompts(5, 1, 9, seed=9)
    run_one(engine, prefix + [1])
    outs = engine.generate([prefix + s for s in suffixes], max_new_tokens=NEW)
    assert bool(calls) != native, "the cascade path runs exactly when the native kernel does not"
    for s, o in zip(suffixes, outs):
        assert o.output_ids == reference_greedy(ref, prefix + s, NEW)
