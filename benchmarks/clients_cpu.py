"""What the libraries that drive transformers ask of the engine, on the bundled demo model, paged
against transformers' own, side by side in one process.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/clients_cpu.py [--rounds 3] [--threads 1]

64 prompts of 4-62 tokens (``demo_generate.make_prompts``), 64 new tokens each:

* ``generate(min_new_tokens=64)`` (a processor that reads the ids: it runs batched per stack of
  rows), the paged model with all 64 prompts in one call against sdpa's padded ``generate`` in
  batches of 16 and with all 64 at once (as ``demo_generate.py`` compares them);
* the same call without ``min_new_tokens`` (EOS off instead: the same work), for what the
  processor itself costs;
* ``generate_batch`` (transformers' continuous-batching API, what TRL calls), paged against
  transformers' own ``generate_batch`` on an sdpa model (its engine on CPU takes "sdpa"), the same
  requests, EOS off (``eos_token_id=-1``) so both do the same work. transformers' engine sizes its
  cache from free memory unless told (35 s for 16 short prompts here): it gets the blocks and batch
  budget the workload needs (``--hf-num-blocks``, ``--hf-max-batch-tokens``), as ours sizes itself.

Each round runs every system once, alternating; printed: every round, then medians and the ratios
of medians, and whether the systems that ran the same options produced the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from demo_generate import make_prompts, padded_generate  # benchmarks/demo_generate.py
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation import ContinuousBatchingConfig

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn.demo import DEMO_MODEL


def timed(fn: Callable[[], list]) -> tuple[float, list]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--hf-num-blocks", type=int, default=256, help="transformers' cache: blocks of 32 tokens")
    parser.add_argument("--hf-max-batch-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # eos_token_id=-1 warns once per request
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    prompts = make_prompts(tokenizer, args.num_prompts)
    pad = tokenizer.pad_token_id
    new = args.max_new_tokens
    min_new = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    no_eos = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=pad)
    hf_cb = ContinuousBatchingConfig(num_blocks=args.hf_num_blocks, max_batch_tokens=args.hf_max_batch_tokens,
                                     page_size=32)  # fmt: skip
    paged = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged").eval()
    sdpa = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa").eval()

    def batch_tokens(out: dict) -> list[list[int]]:
        return [o.generated_tokens for o in out.values()]

    systems: dict[str, Callable[[], list]] = {
        "paged generate": lambda: padded_generate(paged, prompts, len(prompts), min_new, pad),
        "paged, no processor": lambda: padded_generate(paged, prompts, len(prompts), no_eos, pad),
        "sdpa generate b16": lambda: padded_generate(sdpa, prompts, 16, min_new, pad),
        "sdpa generate b64": lambda: padded_generate(sdpa, prompts, len(prompts), min_new, pad),
        "paged generate_batch": lambda: batch_tokens(paged.generate_batch(prompts, generation_config=no_eos)),
        "hf generate_batch": lambda: batch_tokens(
            sdpa.generate_batch(prompts, generation_config=no_eos, continuous_batching_config=hf_cb)
        ),
    }
    print(f"{len(prompts)} prompts x {new} new tokens, threads={args.threads}")
    times: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list] = {}
    for r in range(args.rounds):
        for name, fn in systems.items():
            seconds, outputs[name] = timed(fn)
            times[name].append(seconds)
        print(f"round {r}: " + "  ".join(f"{name} {times[name][-1]:.2f}s" for name in systems), flush=True)
    pairs = [("paged generate", "sdpa generate b16"), ("paged generate", "sdpa generate b64"),
             ("paged generate", "paged, no processor"), ("paged generate_batch", "hf generate_batch")]  # fmt: skip
    for a, b in pairs:
        same = outputs[a] == outputs[b] if b != "paged, no processor" else "n/a (other options)"
        assert all(len(o) == new for o in outputs[a]), f"{a}: not every row generated {new} tokens"
        ratio = statistics.median(times[b]) / statistics.median(times[a])
        print(f"{a:>20} {statistics.median(times[a]):6.2f}s   {b:>17} {statistics.median(times[b]):6.2f}s   "
              f"speed-up x{ratio:.2f}   same tokens: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
