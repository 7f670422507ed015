"""Models that mix sliding-window and full-attention layers: one block table per attention group,
window-aware admission and prefix hits, tail-first eviction (issue: hybrid models)."""

from __future__ import annotations

import pytest
import torch

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.core.blocks import RELEASED, blocks_for
from hf_paged_attn.core.kv_manager import blocks_at_peak
from hf_paged_attn.core.layers import LayerKinds
from hf_paged_attn_tools.testing import compare_greedy, load_pair, save_random_model
from hf_paged_attn_tools.tiny_configs import tiny_config

REFERENCE = {"gemma2": "eager", "gpt_oss": "eager"}  # softcap / sinks: the reference sdpa lacks


def mixed_qwen2():
    config = tiny_config("qwen2")
    config.use_sliding_window, config.max_window_layers, config.sliding_window = True, 1, 8
    config.layer_types = ["full_attention"] + ["sliding_attention"] * (config.num_hidden_layers - 1)
    return config


CONFIGS = {
    "gemma2": lambda: tiny_config("gemma2"),
    "gemma3_text": lambda: tiny_config("gemma3_text"),
    "cohere2": lambda: tiny_config("cohere2"),
    "gpt_oss": lambda: tiny_config("gpt_oss"),
    "mistral": lambda: tiny_config("mistral"),
    "qwen2_mixed": mixed_qwen2,
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    name = request.param
    directory = save_random_model(CONFIGS[name](), tmp_path_factory.mktemp(name))
    return (name, *load_pair(directory, reference=REFERENCE.get(name, "sdpa")))


def greedy_one_by_one(ref, prompts: list[list[int]], new: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize(
    "block_size, max_batch_tokens, num_blocks",
    [(4, 512, 400), (16, 5, 400), (4, 7, None)],  # chunked prefill; None: a cache so small it preempts
)
def test_greedy_parity_with_group_tables(pair, block_size, max_batch_tokens, num_blocks):
    name, ref, paged = pair
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(1, 200, (13,), generator=gen).tolist()  # a common head: prefix hits
    prompts = [shared + torch.randint(1, 200, (n,), generator=gen).tolist() for n in (3, 19, 9, 25)]
    prompts += [prompts[1]]  # a whole prompt again
    new = 20
    if num_blocks is None:  # barely the longest request (a sliding window's share, or one table): preemptions
        layers = LayerKinds.from_config(paged.config)
        peak = blocks_at_peak(max(map(len, prompts)) + new, block_size, layers.groups, max_batch_tokens) + 4
        one_table = blocks_for(max(map(len, prompts)) + new - 1, block_size)  # the last token needs no slot
        num_blocks = min(one_table, -(-peak // layers.pool_blocks(1)))  # PagedConfig.num_blocks: every layer's
    config = PagedConfig(block_size=block_size, max_batch_tokens=max_batch_tokens, num_blocks=num_blocks)
    engine = ContinuousBatchingEngine(paged, config)
    released = []
    ids = [engine.add_request(prompts[0], max_new_tokens=new)]
    finals, first_token = {}, False
    while engine.has_unfinished():
        for out in engine.step():
            first_token = first_token or bool(out.output_ids)
            if out.finished:
                finals[out.request_id] = out
        released += [b == RELEASED for r in engine.scheduler.running for t in r.block_tables for b in t]
        if first_token and len(ids) == 1:  # the shared head is cached now
            ids += [engine.add_request(p, max_new_tokens=new) for p in prompts[1:4]]
        if len(finals) >= 2 and len(ids) == 4:
            ids.append(engine.add_request(prompts[4], max_new_tokens=new))  # a whole prompt again
    got = [finals[i].output_ids for i in ids]
    problems = compare_greedy(ref, prompts, greedy_one_by_one(ref, prompts, new), got)
    assert not problems, f"{name}: {problems}"
    mixed = len(set(engine.layers.windows)) > 1
    assert len(engine.layers.groups) > 1 if mixed else len(engine.layers.groups) == 1
    assert any(released), "no block left a window: the test did not exercise window release"
    assert engine.stats.num_cached_tokens > 0, "no prefix hit"
    if max_batch_tokens == 7:  # the tiny cache: full, and one table preempts (hybrids hold less per
        stats = engine.stats  # request, so they may not)
        assert stats.peak_used_blocks == stats.num_blocks and (mixed or stats.num_preemptions > 0), stats
    assert engine.allocator.num_used_blocks == 0
    engine.allocator.check_invariants()


def test_a_gemma3_shaped_request_holds_a_fifth_of_the_blocks(tmp_path):
    """5 sliding layers (window 16) and 1 full layer, block size 4: a long request's sliding tables
    hold only their window, so one block id per layer-page and ~(n + 5 * window) / n of the blocks."""
    config = tiny_config("gemma3_text")
    config.num_hidden_layers, config.sliding_window = 6, 16
    config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    ref, paged = load_pair(save_random_model(config, tmp_path))
    prompt = torch.randint(1, 200, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    peaks = {}
    for hybrid in (True, False):
        cfg = PagedConfig(block_size=4, num_blocks=2000, hybrid_kv=hybrid, enable_prefix_caching=False)
        engine = ContinuousBatchingEngine(paged, cfg)
        (out,) = engine.generate([prompt], max_new_tokens=10)
        assert out.output_ids == greedy_one_by_one(ref, [prompt], 10)[0]
        # layer-pages held at peak: a block spans num_slots layers
        peaks[hybrid] = engine.stats.peak_used_blocks * engine.layers.num_slots
    assert peaks[False] == 6 * 40  # 160 tokens in blocks of 4, in every layer
    assert peaks[True] <= 40 + 5 * (16 // 4 + 2 + 128 // 4)  # full layer + each window (+ a prefill chunk)
    assert peaks[True] < peaks[False] / 2.5


def engine_for_repros(model, block_size: int, num_blocks: int) -> ContinuousBatchingEngine:
    config = PagedConfig(block_size=block_size, num_blocks=num_blocks, max_batch_tokens=512)
    return ContinuousBatchingEngine(model, config)


def cached_tokens_of_rerun(engine, first: list[int], between: list[int]) -> int:
    engine.generate([first], max_new_tokens=1)
    engine.generate([between], max_new_tokens=1)
    (again,) = engine.generate([first], max_new_tokens=1)
    return again.num_cached_tokens


def test_tail_first_eviction_keeps_a_chain_head(llama_pair):
    """block_size 4, 6 blocks: A (17 tokens) caches 4 blocks; B (12 tokens) evicts one of them.
    Freed tail first, the evicted block is A's last: A again still hits 12 tokens."""
    _, paged = llama_pair
    engine = engine_for_repros(paged, block_size=4, num_blocks=6)
    a, b = list(range(1, 18)), list(range(100, 112))
    assert cached_tokens_of_rerun(engine, a, b) == 12


def test_a_sliding_hit_needs_only_the_window(tmp_path):
    """Mistral, window 16, block 4: a 49-token prompt caches 12 blocks; an 88-token request then
    evicts the 4 that left the window first. A hit needs only the window before the hit point."""
    config = tiny_config("mistral")
    config.sliding_window = 16
    _, paged = load_pair(save_random_model(config, tmp_path))
    engine = engine_for_repros(paged, block_size=4, num_blocks=26)
    first = list(range(1, 50))
    (out,) = engine.generate([first], max_new_tokens=1)
    (again,) = engine.generate([first], max_new_tokens=1)
    assert again.num_cached_tokens == 48
    engine.generate([list(range(100, 188))], max_new_tokens=1)
    (third,) = engine.generate([first], max_new_tokens=1)
    assert third.num_cached_tokens == 48
    assert third.output_ids == out.output_ids


@pytest.mark.parametrize("window", [4096, 12])
def test_the_same_num_blocks_runs_both_ways(tmp_path, window):
    """The issue's case: a Cohere 2 of 3 layers (sliding, full, sliding), one request of 29 prompt +
    30 new tokens, block size 8. ``num_blocks=8`` ran with one table and was refused with per-group
    tables (a block held one layer there, so 8 blocks were 1/3 of the memory). Now the same
    ``num_blocks`` runs both ways with the same tokens, and a second request preempts no more."""
    config = tiny_config("cohere2")
    config.num_hidden_layers, config.sliding_window = 3, window
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    ref, paged = load_pair(save_random_model(config, tmp_path), reference=REFERENCE.get("cohere2", "sdpa"))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in (29, 21)]
    runs = {}
    for hybrid in (False, True):
        engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=8, num_blocks=8, hybrid_kv=hybrid))
        outs = engine.generate(prompts, max_new_tokens=30)
        runs[hybrid] = ([o.output_ids for o in outs], engine.stats.num_preemptions, len(engine.layers.groups))
    assert runs[True][2] == 3 and runs[False][2] == 1  # per-group tables really ran
    assert runs[True][0] == runs[False][0]
    problems = compare_greedy(ref, prompts, greedy_one_by_one(ref, prompts, 30), runs[True][0])
    assert not problems, problems
    assert runs[True][1] <= runs[False][1] and runs[False][1] > 0, runs  # one table had to preempt
