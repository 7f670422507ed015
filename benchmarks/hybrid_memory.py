"""KV memory of a hybrid (sliding + full layers) model: one block table for every layer against one
per attention group, in one shared pool.

A Gemma-3-shaped config (6 layers: 5 slide a 128-token window, 1 attends to everything; random
weights, hidden size 64, one K/V head of 32 fp32 dims, so a layer-page, one layer's K/V for one
block of 16 tokens, is 4 KiB), ``max_batch_tokens=8192``, requests of 4,096 prompt tokens + 8 new.
Prints the KV held per request at peak (layer-pages), and how many requests decode at once in a
cache of ``--mib`` MiB sized the default way (``memory_fraction`` of the free memory), with
``PagedConfig(hybrid_kv=False)`` (one table, every block kept in every layer) and with per-group
tables (the default), and each group's token capacity (``engine.stats.token_capacity_per_group``).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/hybrid_memory.py [--prompt 4096] [--requests 3] [--mib 10]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.model import memory
from hf_paged_attn_tools.testing import load_pair, save_random_model
from hf_paged_attn_tools.tiny_configs import tiny_config


def gemma3_shaped(window: int, max_positions: int):
    config = tiny_config("gemma3_text")
    config.num_hidden_layers, config.sliding_window, config.max_position_embeddings = 6, window, max_positions
    config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    config.num_key_value_heads, config.head_dim = 1, 32
    return config


def run(paged, prompts: list[list[int]], new: int, hybrid: bool, cache_bytes: int | None, budget: int):
    """(layer-pages held at peak, most requests emitting a token in one step, outputs, stats); the
    cache sized from ``cache_bytes`` the default way, or large when None."""
    config = PagedConfig(block_size=16, max_batch_tokens=budget, hybrid_kv=hybrid, enable_prefix_caching=False,
                         compile=False)  # fmt: skip
    if cache_bytes is None:
        config.num_blocks = 100_000
    found = memory.free_memory_bytes
    memory.free_memory_bytes = lambda device: int((cache_bytes or 0) / config.memory_fraction)
    try:
        engine = ContinuousBatchingEngine(paged, config)
    finally:
        memory.free_memory_bytes = found
    ids = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    most, outputs = 0, {}
    while engine.has_unfinished():
        outs = engine.step()
        most = max(most, sum(1 for o in outs if o.new_ids))
        outputs.update((o.request_id, o.output_ids) for o in outs if o.finished)
    stats = engine.stats
    return stats.peak_used_blocks * engine.layers.num_slots, most, [outputs[i] for i in ids], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--requests", type=int, default=3, help="requests offered at once")
    parser.add_argument("--mib", type=float, default=10.0, help="cache size, sized the default way")
    parser.add_argument("--budget", type=int, default=8192, help="max_batch_tokens")
    args = parser.parse_args()
    torch.manual_seed(0)
    directory = save_random_model(gemma3_shaped(args.window, args.prompt + args.new + 64), tempfile.mkdtemp())
    _, paged = load_pair(directory)
    prompts = [torch.randint(1, 200, (args.prompt,)).tolist() for _ in range(args.requests)]
    before, _, out_before, _ = run(paged, prompts[:1], args.new, False, None, args.budget)
    after, _, out_after, _ = run(paged, prompts[:1], args.new, True, None, args.budget)
    assert out_before == out_after, "per-group tables changed the tokens"
    cache = int(args.mib * (1 << 20))
    _, one, out_one, stats_one = run(paged, prompts, args.new, False, cache, args.budget)
    _, groups, out_groups, stats = run(paged, prompts, args.new, True, cache, args.budget)
    assert out_one == out_groups, "per-group tables changed the tokens"
    print(f"Gemma-3-shaped model (5 sliding layers, window {args.window}, + 1 full), block size 16, "
          f"max_batch_tokens {args.budget}, requests of {args.prompt} + {args.new} tokens")  # fmt: skip
    print(f"{'':40}{'one table':>14}{'per-group tables':>20}")
    print(f"{'KV layer-pages per request at peak':40}{before:>14}{after:>20}")
    print(f"{f'decoding at once in {args.mib:g} MiB ({args.requests} offered)':40}{one:>14}{groups:>20}")
    print(f"{'preemptions':40}{stats_one.num_preemptions:>14}{stats.num_preemptions:>20}")
    print(f"token capacity per group (idle): one table {list(stats_one.token_capacity_per_group)}, "
          f"per-group tables {list(stats.token_capacity_per_group)}")  # fmt: skip


if __name__ == "__main__":
    main()
