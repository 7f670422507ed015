"""LoRA adapters per request: the paged engine against PEFT's own mixed batch on sdpa.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/lora.py [--model 30M|demo] [--rounds 3] [--threads 1]
        [--requests 48] [--new 64] [--low 16] [--high 256] [--peft-batch 16]

The benchmarks' 30M random Llama (``hf_paged_attn_tools.bench.workloads.FULL_MODEL``: 8 layers, hidden 512,
vocab 8192; ``--model demo`` the demo model's shape, 4 layers, hidden 256) with no EOS, two random PEFT LoRA
adapters (rank 16 on q/k/v/o, and rank 8 on q/v/up/down), 48 requests of ``--low`` to ``--high`` prompt
tokens spread over the two adapters and the base (a, b, base, a, b, base, ...), greedy, 64 new tokens each:
  - ``peft sdpa x48``: PEFT's ``generate(adapter_names=[...])`` on an sdpa base, the 48 rows in one batch,
    left-padded to the longest prompt (as a user would call it);
  - ``peft sdpa xB``: the same in batches of ``--peft-batch`` rows, in request order, each padded to its longest;
  - ``paged generate``: the same ``generate(adapter_names=[...])`` call on a "paged" base (the engine inside);
  - ``paged engine``: ``ContinuousBatchingEngine(peft_model)``, one request per row under its adapter;
  - ``paged no adapter``: the same engine's work on the base model alone (no LoRA layers), the same rows;
  - ``paged engine compiled`` and ``paged no adapter compiled``: those two with the compiled CPU forward
    (``PagedConfig(compile=True)``; the rows' adapters are a graph input, ``runtime/model/lora_rows.py``), each model
    compiled once before the rounds (not timed).
Every round runs each system, in an order rotating by round; figures are medians of the process CPU time
(``--clock wall`` for wall time) and tokens per second (new tokens) over them. The engine's tokens are checked
equal to PEFT's (bar numerical near-ties, ``compare_greedy``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn_tools.bench.workloads import FULL_MODEL, ModelSpec
from hf_paged_attn_tools.testing import compare_greedy, left_padded, save_random_lora

ADAPTERS = {
    "a": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], seed=1, std=0.05),
    "b": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], seed=2, std=0.05),
}
CYCLE = ["a", "b", None]
MODELS = {
    "30M": FULL_MODEL,
    "demo": ModelSpec(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2),  # fmt: skip
}


def build(directory: str, spec: ModelSpec) -> tuple[str, dict[str, str]]:
    base = spec.save(f"{directory}/base")
    return base, {name: save_random_lora(base, f"{directory}/{name}", **cfg) for name, cfg in ADAPTERS.items()}


def peft_model(base: str, adapters: dict[str, str], attn: str) -> PeftModel:
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation=attn, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapters["a"], adapter_name="a")
    model.load_adapter(adapters["b"], adapter_name="b")
    return model.eval()


def prompts_of(num: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (num,), generator=gen).tolist()
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def timed(fn: Callable[[], list[list[int]]], clock: str) -> tuple[float, list[list[int]]]:
    now = time.process_time if clock == "cpu" else time.perf_counter
    start = now()
    out = fn()
    return now() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="30M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--low", type=int, default=16)
    p.add_argument("--high", type=int, default=256)
    p.add_argument("--peft-batch", type=int, default=16)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    base, adapters = build(tempfile.mkdtemp(prefix="lora_bench_"), spec)
    prompts = prompts_of(args.requests, args.low, args.high, spec.vocab_size)
    names = [CYCLE[i % len(CYCLE)] for i in range(args.requests)]
    peft_names = [n or "__base__" for n in names]
    sdpa, paged = peft_model(base, adapters, "sdpa"), peft_model(base, adapters, "paged")
    plain = AutoModelForCausalLM.from_pretrained(base, attn_implementation="paged", dtype=torch.float32).eval()
    config = PagedConfig(max_num_seqs=args.requests, compile=False)
    compiled = config.replace(compile=True)
    for model in (paged, plain):  # the compile, before any round: an engine made with compile="startup" waits for it
        ContinuousBatchingEngine(model, config.replace(compile="startup")).shutdown()

    def run_generate(model: PeftModel, batch: int, **kwargs) -> list[list[int]]:
        out = []
        for start in range(0, args.requests, batch):
            ids, mask = left_padded(prompts[start : start + batch])
            with torch.inference_mode():
                rows = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                                      adapter_names=peft_names[start : start + batch], **kwargs)  # fmt: skip
            out += rows[:, ids.shape[1] :].tolist()
        return out

    def run_engine(model: torch.nn.Module, with_adapters: bool, config: PagedConfig = config) -> list[list[int]]:
        with ContinuousBatchingEngine(model, config) as engine:
            rows = [dict(input_ids=q, max_new_tokens=args.new, ignore_eos=True,
                         adapter_name=n if with_adapters else None) for q, n in zip(prompts, names)]  # fmt: skip
            return [o.output_ids for o in engine.collect(engine.add_all(rows))]

    peft_b = f"peft sdpa x{args.peft_batch}"
    systems = {
        f"peft sdpa x{args.requests}": lambda: run_generate(sdpa, args.requests),
        peft_b: lambda: run_generate(sdpa, args.peft_batch),
        "paged generate": lambda: run_generate(paged, args.requests, paged_config=config),
        "paged engine": lambda: run_engine(paged, True),
        "paged no adapter": lambda: run_engine(plain, False),
        "paged engine compiled": lambda: run_engine(paged, True, compiled),
        "paged no adapter compiled": lambda: run_engine(plain, False, compiled),
    }
    peft_all = next(iter(systems))
    times: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = list(systems)[r % len(systems) :] + list(systems)[: r % len(systems)]
        for name in order:
            seconds, outputs[name] = timed(systems[name], args.clock)
            times[name].append(seconds)
            print(f"  round {r}: {name:25s} {seconds:7.2f} s", flush=True)
    problems = []
    for adapter in CYCLE:
        rows = [i for i, n in enumerate(names) if n == adapter]
        sdpa.set_adapter(adapter or "a")
        with sdpa.disable_adapter() if adapter is None else contextlib.nullcontext():
            for system in ("paged generate", "paged engine", "paged engine compiled"):
                problems += compare_greedy(sdpa, [prompts[i] for i in rows], [outputs[peft_all][i] for i in rows],
                                           [outputs[system][i] for i in rows])  # fmt: skip
    tokens = args.requests * args.new
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.model} model, {args.requests} requests ({', '.join(sorted({n or 'base' for n in names}))}), "
          f"{args.low}-{args.high} prompt tokens, {args.new} new tokens each, {args.threads} thread(s), "
          f"median of {args.rounds} rounds ({args.clock} time)")  # fmt: skip
    for name in systems:
        print(f"  {name:25s} {median[name]:7.2f} s  {tokens / median[name]:8.1f} tok/s")
    for ours in ("paged generate", "paged engine", "paged engine compiled"):
        baselines = [peft_all, peft_b, "paged no adapter"] + ["paged no adapter compiled"] * ("compiled" in ours)
        for theirs in baselines:
            print(f"  {ours} / {theirs}: {median[theirs] / median[ours]:.2f}x")
    print(f"  tokens equal to PEFT's (bar near-ties): {'yes' if not problems else problems}")


if __name__ == "__main__":
    main()
