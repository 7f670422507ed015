"""KV memory of a hybrid (sliding + full layers) model: one block table for every layer against one
per attention group.

A Gemma-3-shaped config (6 layers: 5 slide a 128-token window, 1 attends to everything; random
weights, hidden size 64), block size 16, requests of 4,096 prompt tokens + 16 new. Prints the KV
held per request at peak (in layer-pages: one layer's K/V for one block of 16 tokens) and how many
such requests run at once in the same memory, with ``PagedConfig(hybrid_kv=False)`` (one table,
every block kept in every layer, as before) and with per-group tables (the default).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/hybrid_memory.py [--prompt 4096] [--requests 6]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn_tools.testing import load_pair, save_random_model
from hf_paged_attn_tools.tiny_configs import tiny_config


def gemma3_shaped(window: int, max_positions: int):
    config = tiny_config("gemma3_text")
    config.num_hidden_layers, config.sliding_window, config.max_position_embeddings = 6, window, max_positions
    config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--requests", type=int, default=12, help="requests offered at once for the concurrency run")
    parser.add_argument("--hold", type=int, default=160, help="new tokens per request in the concurrency run, "
                        "enough for the last request to be admitted while the first still runs")  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    directory = save_random_model(gemma3_shaped(args.window, args.prompt + args.new + 64), tempfile.mkdtemp())
    _, paged = load_pair(directory)
    prompts = [torch.randint(1, 200, (args.prompt,)).tolist() for _ in range(args.requests)]
    block_size, budget = 16, 512

    def run(hybrid: bool, layer_pages: int | None, count: int, new: int):
        probe = ContinuousBatchingEngine(paged, PagedConfig(block_size=block_size, num_blocks=1, hybrid_kv=hybrid))
        slots = probe.layers.num_slots  # layer-pages one block id spans
        num_blocks = (layer_pages // slots) if layer_pages else 100_000
        config = PagedConfig(block_size=block_size, num_blocks=num_blocks, hybrid_kv=hybrid,
                             max_batch_tokens=budget, enable_prefix_caching=False)  # fmt: skip
        engine = ContinuousBatchingEngine(paged, config)
        for p in prompts[:count]:
            engine.add_request(p, max_new_tokens=new)
        most_running, outputs = 0, {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.output_ids
            most_running = max(most_running, engine.stats.num_running)
        return engine.stats.peak_used_blocks * slots, most_running, outputs

    before, _, out_before = run(False, None, 1, args.new)
    after, _, out_after = run(True, None, 1, args.new)
    assert out_before == out_after, "per-group tables changed the tokens"
    memory = 2 * before  # layer-pages: what two requests hold today
    _, running_before, _ = run(False, memory, args.requests, args.hold)
    _, running_after, _ = run(True, memory, args.requests, args.hold)
    print(f"Gemma-3-shaped model (5 sliding layers, window {args.window}, + 1 full), block size {block_size}, "
          f"requests of {args.prompt} + {args.new} tokens")  # fmt: skip
    print(f"{'':32}{'one table (before)':>20}{'per-group tables':>20}")
    print(f"{'KV layer-pages per request':32}{before:>20}{after:>20}   ({after / before:.2f} of before)")
    print(f"{'running at once in ' + str(memory) + ' pages':32}{running_before:>20}{running_after:>20}"
          f"   (most seen; {args.requests} offered, {args.hold} new tokens each)")  # fmt: skip


if __name__ == "__main__":
    main()
