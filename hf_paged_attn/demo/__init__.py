"""Demo: continuous batching on a small model, completions streamed as they finish.

    python -m hf_paged_attn.demo                 # the small model that ships with the package
    python -m hf_paged_attn.demo --model PATH    # any local path or hub id of a causal LM
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

import hf_paged_attn

from .. import ContinuousBatchingEngine, PagedConfig, _env

DEMO_MODEL = Path(__file__).parent.parent / "assets" / "demo-model"

PROMPTS = [
    "The for statement",
    "A list is",
    "The with statement is used to",
    "In Python, a function",
    "The import statement",
    "Exceptions are raised when",
    "A dictionary maps",
    "The return statement",
    "Strings are",
    "The while loop",
    "Classes provide a means of",
    "The built-in function len",
    "An iterator is an object",
    "The try statement specifies exception handlers and",
    "A module is a file containing",
    "The if statement is used for",
    "Integers and floating point numbers",
    "The global statement",
    "When a class definition is entered,",
    "The lambda expression",
    "Comparisons can be chained",
    "The pass statement",
    "A generator function",
    "Keyword arguments",
    "The assert statement is a convenient way to",
    "Each object has an identity, a type and a value.",
    "The del statement",
    "Slicing a sequence",
    "The yield expression",
    "Names refer to objects.",
    "The break statement",
    "A tuple consists of",
]


def main(argv: list[str] | None = None, prog: str = "python -m hf_paged_attn.demo") -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(DEMO_MODEL), help="local path or hub id (default: bundled model)")
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--kernel", default="auto", choices=["auto", "torch", "flash", "triton"])
    parser.add_argument("--block-size", type=int, default=None, help="default: the kernel's (8 for torch on CPU)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()  # the demo model loads in a blink; its "Loading weights" bar is noise
    torch.set_num_threads(max(1, torch.get_num_threads()))

    print(f"hf_paged_attn {hf_paged_attn.__version__}: loading {args.model} with attn_implementation='paged'")
    if _env.APPLIED:  # the command's default, set before torch loaded (a value in the environment wins)
        print("default environment: " + " ".join(f"{k}={v}" for k, v in _env.APPLIED.items()))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="paged").eval()
    engine = ContinuousBatchingEngine(model, PagedConfig(kernel=args.kernel, block_size=args.block_size))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    texts = {}
    for text in prompts:
        ids = tokenizer(text)["input_ids"]
        texts[engine.add_request(ids, max_new_tokens=args.max_new_tokens)] = text

    print(f"{len(texts)} requests of {min(map(len, prompts))}-{max(map(len, prompts))} characters, "
          f"{args.max_new_tokens} new tokens each, {engine.allocator.num_blocks} KV blocks "
          f"of {engine.config.block_size}\n")
    start = time.perf_counter()
    with tqdm(total=len(texts), unit="req", disable=args.no_progress, leave=False) as bar:
        for out in engine.stream():
            if out.finished:
                completion = tokenizer.decode(out.output_ids, skip_special_tokens=True)
                tqdm.write(f"[{out.request_id:>6}] {texts[out.request_id]}\033[1m{completion}\033[0m")
                bar.update(1)
    elapsed = time.perf_counter() - start
    stats = engine.stats
    print(
        f"\n{len(texts)} requests, {stats.num_generated_tokens} new tokens in {elapsed:.2f} s "
        f"({stats.num_generated_tokens / elapsed:.0f} tokens/s), {stats.num_steps} steps, "
        f"peak {stats.peak_used_blocks}/{stats.num_blocks} blocks, {stats.num_preemptions} preemptions"
    )

