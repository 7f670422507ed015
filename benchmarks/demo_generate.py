"""``model.generate`` on the bundled demo model, paged against sdpa's padded ``generate``, side by side.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/demo_generate.py [--rounds 5] [--threads 2]

64 prompts of 4-62 tokens (seeded), 64 new tokens each (EOS ignored, so every system does the
same work), greedy. Each round runs, in one process and alternating: the paged model's
``generate`` with all prompts in one call, sdpa's padded ``generate`` in batches of 16 and sdpa's
``generate`` with all 64 at once (and, with ``--baseline-backend FILE``, the paged model on an older
torch backend). Prints every round, then medians and the ratios of medians, and
checks that the systems produced the same tokens (bar numerical near-ties, see
``hf_paged_attn_tools.testing.compare_greedy``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import baseline_backend  # benchmarks/baseline_backend.py
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn import PagedConfig
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.runtime.cpu.compiled import wait_compiled
from hf_paged_attn_tools.bench.profile import StepProfile, format_profile
from hf_paged_attn_tools.bench.workloads import demo_prompts as make_prompts
from hf_paged_attn_tools.testing import left_padded


def padded_generate(model, prompts: list[list[int]], batch: int, config: GenerationConfig, pad: int,  # noqa: ANN001
                    **kwargs) -> list:  # fmt: skip
    outs = []
    for i in range(0, len(prompts), batch):
        ids, mask = left_padded(prompts[i : i + batch], pad)
        seq = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **kwargs)
        outs += seq[:, ids.shape[1] :].tolist()
    return outs


def timed(fn: Callable[[], list]) -> tuple[float, float, list]:
    """(wall seconds, process CPU seconds, output): CPU time is the steadier figure on a loaded machine."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - start, time.process_time() - cpu, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", default="both", choices=["both", "on", "off"],
                        help="the paged model with PagedConfig(compile=True), compile=False or both (two instances)")
    parser.add_argument("--baseline-backend", metavar="FILE",
                        help="also the paged model with an older torch backend (baseline_backend.py)")
    parser.add_argument("--profile", action="store_true",
                        help="instead: one run of each system under hf_paged_attn_tools.bench.profile's StepProfile "
                        "(CPU time with --threads 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    prompts = make_prompts(tokenizer, args.num_prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad
    )
    dtype = getattr(torch, args.dtype)
    paged = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=dtype).eval()
    sdpa = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa", dtype=dtype).eval()
    systems: dict[str, Callable[[], list]] = {}
    if args.compile in ("both", "on"):  # its own instance: the compiled forward is kept per model
        compiled = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=dtype).eval()
        on = PagedConfig(compile=True)
        systems["paged generate, compiled"] = lambda: padded_generate(
            compiled, prompts, len(prompts), config, pad, paged_config=on
        )
        start = time.perf_counter()
        padded_generate(compiled, prompts[:4], 4, config, pad, paged_config=on)  # starts the compile
        wait_compiled(compiled)
        print(f"compiled the paged model's forward in {time.perf_counter() - start:.1f} s (warm-up included)")
    if args.compile in ("both", "off"):
        off = PagedConfig(compile=False)
        systems["paged generate (one call)"] = lambda: padded_generate(
            paged, prompts, len(prompts), config, pad, paged_config=off
        )
    systems["sdpa generate @16"] = lambda: padded_generate(sdpa, prompts, 16, config, pad)
    systems[f"sdpa generate @{len(prompts)}"] = lambda: padded_generate(sdpa, prompts, len(prompts), config, pad)
    if args.baseline_backend:
        old = baseline_backend.load(args.baseline_backend)

        def paged_baseline() -> list:
            with baseline_backend.engines_use(old):
                return padded_generate(paged, prompts, len(prompts), config, pad)

        systems["paged, baseline backend"] = paged_baseline
    if args.profile:
        models = {"compiled": compiled if args.compile != "off" else None, "paged": paged, "sdpa": sdpa}
        for name, run in systems.items():
            model = models["compiled" if "compiled" in name else "sdpa" if "sdpa" in name else "paged"]
            run()  # warm-up
            profile = StepProfile(model, time.thread_time if args.threads == 1 else time.perf_counter)
            with profile.record():
                run()
            print(f"{name}:\n{format_profile(profile.summary())}")
        return
    lens = [len(p) for p in prompts]
    print(f"load {os.getloadavg()[0]:.2f}; {len(prompts)} prompts of {min(lens)}-{max(lens)} tokens x "
          f"{args.max_new_tokens} new tokens, {args.threads} threads, {args.dtype}")  # fmt: skip
    for run in systems.values():  # warm-up: allocations, first-call paths
        run()
    times: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list] = {}
    for r in range(args.rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))  # alternate who goes first
        for name in order:
            seconds, cpu_seconds, outputs[name] = timed(systems[name])
            times[name].append(seconds)
            cpu[name].append(cpu_seconds)
        print(f"round {r + 1}: " + ", ".join(f"{name} {times[name][-1]:.2f} s" for name in systems), flush=True)
    first = next(iter(systems))
    medians = {name: statistics.median(t) for name, t in times.items()}
    tokens = len(prompts) * args.max_new_tokens
    cpu_medians = {name: statistics.median(t) for name, t in cpu.items()}
    for name, med in medians.items():
        cpu_ratio = cpu_medians[name] / cpu_medians[first]
        print(f"{name:<28} median {med:.3f} s ({cpu_medians[name]:.3f} s CPU)  {tokens / med:7.0f} new tok/s  "
              f"paged is {med / medians[first]:.2f}x faster ({cpu_ratio:.2f}x in CPU time)")
    for name in systems:
        if name != first:
            same = sum(a == b for a, b in zip(outputs[first], outputs[name]))
            print(f"same tokens as {name}: {same}/{len(prompts)} requests")


if __name__ == "__main__":
    main()
