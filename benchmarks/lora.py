"""LoRA adapters per request: the paged engine against PEFT's own mixed batch on sdpa.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/lora.py [--rounds 3] [--threads 1] [--requests 48] [--new 64]

The demo model's shape (Llama, 4 layers, hidden 256, vocab 4096) with random weights and no EOS, two
random PEFT LoRA adapters (rank 16 on q/k/v/o, and rank 8 on q/v/up/down), 48 requests of 16 to 64 prompt
tokens spread over the two adapters and the base (a, b, base, a, b, base, ...), greedy, 64 new tokens each:
  - ``peft sdpa``: PEFT's ``generate(adapter_names=[...])`` on an sdpa base, the 48 rows in one padded batch;
  - ``paged engine``: ``ContinuousBatchingEngine(peft_model)``, one request per row under its adapter;
  - ``paged no adapter``: the same engine's work on the base model alone (no LoRA layers), the same rows.
Every round runs each system, in an order rotating by round; figures are medians of the process CPU time
(``--clock wall`` for wall time) and tokens per second over them. The engine's tokens are checked equal to
PEFT's (bar numerical near-ties, ``compare_greedy``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn_tools.testing import (
    compare_greedy,
    left_padded,
    ragged_prompts,
    save_random_lora,
    save_random_model,
    tiny_llama_config,
)

ADAPTERS = {
    "a": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], seed=1, std=0.05),
    "b": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], seed=2, std=0.05),
}
CYCLE = ["a", "b", None]


def build(directory: str) -> tuple[str, dict[str, str]]:
    config = tiny_llama_config(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=4096, initializer_range=0.05)  # fmt: skip
    base = save_random_model(config, f"{directory}/base")
    return base, {name: save_random_lora(base, f"{directory}/{name}", **cfg) for name, cfg in ADAPTERS.items()}


def peft_model(base: str, adapters: dict[str, str], attn: str) -> PeftModel:
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation=attn, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapters["a"], adapter_name="a")
    model.load_adapter(adapters["b"], adapter_name="b")
    return model.eval()


def timed(fn: Callable[[], list[list[int]]], clock: str) -> tuple[float, list[list[int]]]:
    now = time.process_time if clock == "cpu" else time.perf_counter
    start = now()
    out = fn()
    return now() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base, adapters = build(tempfile.mkdtemp(prefix="lora_bench_"))
    prompts = ragged_prompts(args.requests, 16, 64, seed=0)
    names = [CYCLE[i % len(CYCLE)] for i in range(args.requests)]
    sdpa, paged = peft_model(base, adapters, "sdpa"), peft_model(base, adapters, "paged")
    plain = AutoModelForCausalLM.from_pretrained(base, attn_implementation="paged", dtype=torch.float32).eval()
    config = PagedConfig(max_num_seqs=args.requests, compile=False)
    ids, mask = left_padded(prompts)

    def run_peft() -> list[list[int]]:
        with torch.inference_mode():
            out = sdpa.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                                adapter_names=[n or "__base__" for n in names])  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    def run_engine(model: torch.nn.Module, with_adapters: bool) -> list[list[int]]:
        with ContinuousBatchingEngine(model, config) as engine:
            rows = [dict(input_ids=q, max_new_tokens=args.new, ignore_eos=True,
                         adapter_name=n if with_adapters else None) for q, n in zip(prompts, names)]  # fmt: skip
            return [o.output_ids for o in engine.collect(engine.add_all(rows))]

    systems = {
        "peft sdpa": run_peft,
        "paged engine": lambda: run_engine(paged, True),
        "paged no adapter": lambda: run_engine(plain, False),
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = list(systems)[r % len(systems) :] + list(systems)[: r % len(systems)]
        for name in order:
            seconds, outputs[name] = timed(systems[name], args.clock)
            times[name].append(seconds)
    problems = []
    for adapter in CYCLE:
        rows = [i for i, n in enumerate(names) if n == adapter]
        sdpa.set_adapter(adapter or "a")
        context = sdpa.disable_adapter() if adapter is None else _nothing()
        with context:
            problems += compare_greedy(sdpa, [prompts[i] for i in rows], [outputs["peft sdpa"][i] for i in rows],
                                       [outputs["paged engine"][i] for i in rows])  # fmt: skip
    tokens = args.requests * args.new
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.requests} requests ({', '.join(sorted({n or 'base' for n in names}))}), {args.new} new tokens each, "
          f"{args.threads} thread(s), median of {args.rounds} rounds ({args.clock} time)")  # fmt: skip
    for name in systems:
        print(f"  {name:17s} {median[name]:7.2f} s  {tokens / median[name]:8.1f} tok/s")
    print(f"  paged engine / peft sdpa:        {median['peft sdpa'] / median['paged engine']:.2f}x")
    print(f"  paged engine / paged no adapter: {median['paged no adapter'] / median['paged engine']:.2f}x")
    print(f"  tokens equal to PEFT's (bar near-ties): {'yes' if not problems else problems}")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
