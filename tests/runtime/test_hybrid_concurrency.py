"""How many requests a hybrid model (sliding and full layers) decodes at once in a measured number of
bytes, with the cache sized the default way (``memory_fraction`` of the free memory), against one
block table for every layer (``hybrid_kv=False``) in the same bytes; and the same tokens as the
reference (issue: per-group tables admitted no more requests than one table would)."""

from __future__ import annotations

import pytest
import torch

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn.runtime.model import memory
from hf_paged_attn_tools.testing import compare_greedy, load_pair, save_random_model
from hf_paged_attn_tools.tiny_configs import tiny_config

MiB = 1 << 20
REFERENCE = {"gemma2": "eager", "gpt_oss": "eager"}  # softcap / sinks: the reference sdpa lacks


def most_decoding_at_once(paged, prompts: list[list[int]], new: int, hybrid: bool, cache_bytes: int, budget: int):
    """(most requests that emitted a token in one step, each request's tokens, the engine), the cache
    sized from ``cache_bytes`` the default way: free memory times ``memory_fraction``."""
    config = PagedConfig(block_size=16, max_batch_tokens=budget, hybrid_kv=hybrid, enable_prefix_caching=False)
    free = int(cache_bytes / config.memory_fraction)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "free_memory_bytes", lambda device: free)
        engine = ContinuousBatchingEngine(paged, config)
    ids = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    most, outputs = 0, {}
    while engine.has_unfinished():
        outs = engine.step()
        most = max(most, sum(1 for o in outs if o.new_ids))
        outputs.update((o.request_id, o.output_ids) for o in outs if o.finished)
    return most, [outputs[i] for i in ids], engine


def reference_tokens(ref, prompts: list[list[int]], new: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        outs.append(out[0, len(p) :].tolist())
    return outs


def test_gemma3_shaped_decodes_three_4k_requests_at_once_in_10_mib(tmp_path):
    """6 layers (5 slide a 128-token window, 1 full), block size 16, one K/V head of 32 fp32 dims: a
    layer-page (one layer's K/V for one block) is 4 KiB, so 10 MiB hold 2,560 of them, 426 of every
    layer with one table. A request of 4,096 + 8 tokens holds 257 blocks in every layer with one
    table (1 at a time), and 257 + 5 × ~9 afterwards with per-group tables, 257 × 6 during its
    4,096-token prefill chunk: all three decode together."""
    config = tiny_config("gemma3_text")
    config.num_hidden_layers, config.sliding_window, config.max_position_embeddings = 6, 128, 4352
    config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    config.num_key_value_heads, config.head_dim = 1, 32
    ref, paged = load_pair(save_random_model(config, tmp_path))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 200, (4096,), generator=gen).tolist() for _ in range(3)]
    one_table, _, _ = most_decoding_at_once(paged, prompts, 8, False, 10 * MiB, 8192)
    per_group, tokens, engine = most_decoding_at_once(paged, prompts, 8, True, 10 * MiB, 8192)
    assert engine.allocator.num_blocks == 10 * MiB // (2 * 16 * 32 * 4) == 2560
    assert (one_table, per_group) == (1, 3), (one_table, per_group)
    problems = compare_greedy(ref, prompts, reference_tokens(ref, prompts, 8), tokens)
    assert not problems, problems
    # every group's tables can take the whole pool when idle: 6x one table's 426 blocks of 16 tokens
    assert engine.stats.token_capacity_per_group == (2560 * 16,) * 6


@pytest.mark.parametrize("name", ["gemma2", "cohere2", "gpt_oss"])
def test_hybrid_mix_decodes_more_at_once_than_one_table(tmp_path, name):
    """Tiny Gemma 2 / Cohere 2 / gpt-oss: sliding and full layers alternate (2 groups of 2 layers),
    window 32, block size 16, ``max_batch_tokens=8192``. Six requests of 384 + 24 tokens in the
    bytes of 2.5 such requests with one table (130 blocks of one group's layers): one table decodes
    2 at once (2 before admission by need). Per-group tables: 4, each request holding 25 + about 4
    blocks once its prefill chunk (24 blocks in each group while it runs) is committed."""
    config = tiny_config(name)
    config.sliding_window, config.max_position_embeddings = 32, 512
    ref, paged = load_pair(save_random_model(config, tmp_path), reference=REFERENCE.get(name, "sdpa"))
    prompt, new = 384, 24
    per_request = blocks_for(prompt + new - 1, 16) * memory.bytes_per_block(paged.config, 16, torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 200, (prompt,), generator=gen).tolist() for _ in range(6)]
    one_table, tokens_one, _ = most_decoding_at_once(paged, prompts, new, False, int(2.5 * per_request), 8192)
    per_group, tokens, engine = most_decoding_at_once(paged, prompts, new, True, int(2.5 * per_request), 8192)
    assert len(engine.layers.groups) == 2
    assert (one_table, per_group) == (2, 4), (one_table, per_group, name)
    assert tokens == tokens_one
    problems = compare_greedy(ref, prompts, reference_tokens(ref, prompts, new), tokens)
    assert not problems, f"{name}: {problems}"


def test_stats_report_each_groups_token_capacity(tmp_path):
    """While requests run, a group's capacity is what its tables hold plus the free pool: the
    full group's (it holds every block) exceeds a sliding group's (it holds its window)."""
    config = tiny_config("gemma3_text")
    config.sliding_window = 8
    _, paged = load_pair(save_random_model(config, tmp_path))
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64, enable_prefix_caching=False))
    assert engine.stats.token_capacity_per_group == (engine.allocator.num_blocks * 4,) * 2
    engine.add_request(list(range(1, 81)), max_new_tokens=4)
    engine.step()
    sliding, full = engine.stats.token_capacity_per_group  # groups in order of first appearance
    free = engine.allocator.num_free_blocks * 4
    assert full == free + 80 and free < sliding < full, (sliding, full, free)
    one = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64, hybrid_kv=False))
    assert one.stats.token_capacity_per_group == (64 * 4,)
