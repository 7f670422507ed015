"""KV memory of beam search: paged beams sharing blocks vs transformers' beam search (sdpa).

4 beams over a 512-token prompt. The engine's beams share the prompt's blocks (and their common
prefix) by reference count, so at peak they hold at most the prompt's blocks + 4 x (generated
blocks + 1); transformers' beam search keeps one full K/V copy of the sequence per beam.

    python benchmarks/beam_memory.py [--prompt 512 --beams 4 --new 64 --block-size 16]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GenerationConfig

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn_tools.testing import load_pair, save_random_model, tiny_llama_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(2)

    config = tiny_llama_config(max_position_embeddings=args.prompt + args.new + 16)
    ref, paged = load_pair(save_random_model(config, tempfile.mkdtemp(prefix="beam_memory_")))
    prompt = torch.randint(1, config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    # bytes of one token's K and V over all layers
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * paged.dtype.itemsize
    block_bytes = per_token * args.block_size

    gen_config = GenerationConfig(num_beams=args.beams, do_sample=False, eos_token_id=None)
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=args.block_size, num_blocks=4096))
    (out,) = engine.generate([prompt], max_new_tokens=args.new, generation_config=gen_config)
    peak = engine.stats.peak_used_blocks
    bound = blocks_for(args.prompt, args.block_size) + args.beams * (blocks_for(args.new, args.block_size) + 1)

    want = ref.generate(torch.tensor([prompt]), max_new_tokens=args.new, num_beams=args.beams, do_sample=False,
                        eos_token_id=None, return_dict_in_generate=True)  # fmt: skip
    cache = want.cache
    hf_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    same = want.sequences[0, args.prompt :].tolist() == out.output_ids

    prompt_blocks, new_blocks = blocks_for(args.prompt, args.block_size), blocks_for(args.new, args.block_size)
    hf_tokens = cache.layers[0].keys.shape[-2]
    print(f"beam search: {args.beams} beams, {args.prompt}-token prompt, {args.new} new tokens, "
          f"block size {args.block_size}")  # fmt: skip
    verdict = "OK" if peak <= bound else "OVER"
    print(f"  paged engine peak       : {peak} blocks = {peak * block_bytes / 2**20:.2f} MiB (bound: prompt "
          f"{prompt_blocks} + {args.beams} x ({new_blocks} + 1) = {bound} blocks) {verdict}")  # fmt: skip
    print(f"  transformers beam search: {hf_bytes / 2**20:.2f} MiB of K/V ({args.beams} copies x {hf_tokens} tokens)")
    print(f"  transformers / paged    : {hf_bytes / (peak * block_bytes):.2f}x   same best hypothesis: {same}")

if __name__ == "__main__":
    main()
