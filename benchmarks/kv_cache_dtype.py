"""fp8 and int8 KV pages against the model's own dtype on this CPU: decode tokens/s at the same batch, and how many
requests a fixed KV budget admits at once (issue #53; figures in docs/performance.md):

    OMP_WAIT_POLICY=PASSIVE python benchmarks/kv_cache_dtype.py [--batch 16] [--prompt 256] [--new 64] [--rounds 3]

Decode: ``--batch`` requests of ``--prompt`` tokens of real text (the bundled model and tokenizer) prefill,
then ``--new`` tokens each are timed, steps after every request's first token only (best of ``--rounds``,
dtypes interleaved so that a noisy neighbour hits each alike). Admission: ``--admit`` requests of the same
prompts ask for ``--new`` tokens under ``kv_cache_memory_bytes=--budget-mib``; the figure is the most that
ran at once (``engine.stats.num_running``). Eager forwards unless ``--compile``; the model in ``--model-dtype``.
"""

from __future__ import annotations

import argparse
import time
from pydoc_data.topics import topics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.demo import DEMO_MODEL

DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")


def prompts(tokenizer, num: int, length: int) -> list[list[int]]:
    ids = tokenizer("\n".join(topics[name] for name in sorted(topics))).input_ids
    return [ids[i * 97 : i * 97 + length] for i in range(num)]  # overlapping windows, no two alike


def decode_tokens_per_second(model, batch: list[list[int]], new: int, dtype: str, compile_: bool) -> float:
    config = PagedConfig(kv_cache_dtype=dtype, max_num_seqs=len(batch), max_batch_tokens=4096,
                         enable_prefix_caching=False, compile=compile_, num_blocks=len(batch) * 64)  # fmt: skip
    engine = ContinuousBatchingEngine(model, config)
    for prompt in batch:
        engine.add_request(prompt, max_new_tokens=new, ignore_eos=True)
    while engine.stats.num_generated_tokens < len(batch):  # the prefills, each emitting its first token
        engine.step()
    start, first = time.perf_counter(), engine.stats.num_generated_tokens
    while engine.stats.num_running:
        engine.step()
    return (engine.stats.num_generated_tokens - first) / (time.perf_counter() - start)


def admitted(model, batch: list[list[int]], new: int, dtype: str, budget: int) -> tuple[int, int]:
    config = PagedConfig(kv_cache_dtype=dtype, kv_cache_memory_bytes=budget, max_num_seqs=len(batch),
                         max_batch_tokens=8192, enable_prefix_caching=False, compile=False)  # fmt: skip
    engine = ContinuousBatchingEngine(model, config)
    for prompt in batch:
        engine.add_request(prompt, max_new_tokens=new, ignore_eos=True)
    most = 0
    while engine.stats.num_running or engine.stats.num_waiting:
        engine.step()
        most = max(most, engine.stats.num_running)
    return most, engine.stats.token_capacity_per_group[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--admit", type=int, default=64)
    p.add_argument("--budget-mib", type=float, default=4.0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    dtype = getattr(torch, args.model_dtype)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=dtype).eval()
    print(f"bundled model ({model.dtype}), torch {torch.__version__}, {torch.get_num_threads()} threads")
    batch = prompts(tokenizer, args.batch, args.prompt)
    best = dict.fromkeys(DTYPES, 0.0)
    for _ in range(args.rounds):
        for dtype in DTYPES:
            best[dtype] = max(best[dtype], decode_tokens_per_second(model, batch, args.new, dtype, args.compile))
    print(f"decode, {args.batch} requests x {args.prompt} prompt tokens, {args.new} new (best of {args.rounds}):")
    for dtype in DTYPES:
        print(f"  {dtype:9s} {best[dtype]:8.1f} tok/s  x{best[dtype] / best['auto']:.2f}")
    many = prompts(tokenizer, args.admit, args.prompt)
    print(f"admitted at once, kv_cache_memory_bytes = {args.budget_mib} MiB, {args.admit} requests x "
          f"({args.prompt} + {args.new}) tokens:")  # fmt: skip
    base = None
    for dtype in DTYPES:
        most, capacity = admitted(model, many, args.new, dtype, int(args.budget_mib * (1 << 20)))
        base = base or most
        print(f"  {dtype:9s} {most:4d} requests (x{most / base:.2f}), {capacity} tokens of KV")


if __name__ == "__main__":
    main()
