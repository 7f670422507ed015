"""Speculative decoding on the paged engine, against plain decoding and transformers' own.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/speculative.py [--part lookup|draft|all] [--rounds 5] [--threads 1]

Greedy, 128 new tokens per request, EOS ignored (every system does the same work), all outputs
checked equal to plain greedy's (bar numerical near-ties: ``compare_greedy``).

``lookup``: the bundled demo model (which repeats itself, as documentation does), prompt lookup
(``prompt_lookup_num_tokens=K``) on against off:
  - batch 1: each of the first ``--prompts`` demo prompts alone (one ``generate`` call each, summed):
    sdpa ``generate``, sdpa with transformers' prompt lookup, paged ``generate``, paged with prompt lookup;
  - batch 16 and 64: 16 / 64 demo prompts in one paged ``generate`` call, with and without.
``draft``: a draft model (``assistant_model=``) on a model 4x the demo's size: the demo model with
12 more decoder layers of random weights after its 4 (it agrees with the demo about 4 times in 5,
as a larger model of a family agrees with its small one; not a trained model), the demo model as
its draft; and a random 1-layer model with the demo's vocabulary as a draft that never agrees.
Systems: sdpa ``generate`` alone and with transformers' assisted decoding (batch 1), paged ``generate``
alone, with the demo draft, with the stranger; at batch 1 and 16.

The machine may be shared: every round runs every system, in an order rotating by round, and the
figures are medians with ratios of medians, of the process CPU time (with one thread, the work a
system does, steadier than wall time when other processes share the cores; ``--clock wall`` for
wall time). Acceptance rate (accepted / proposed) and new tokens per request and engine step come
from one extra engine run per configuration after the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig, SpeculativeConfig
from hf_paged_attn.demo import DEMO_MODEL, PROMPTS
from hf_paged_attn_tools.testing import compare_greedy, left_padded

NEW = 128
CLOCK = "cpu"  # --clock
PAD = 2  # the demo tokenizer's pad id


def load(path: str, attn: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()


def deepened_demo(directory: str, extra_layers: int = 12, scale: float = 3.0, seed: int = 0) -> str:
    """The demo model with ``extra_layers`` decoder layers after its own, random, their output
    projections scaled by ``scale`` (3: the demo model's greedy tokens are the deepened one's about
    4 times in 5, as a small model of a family agrees with a large one)."""
    demo = load(str(DEMO_MODEL), "sdpa")
    config = demo.config.__class__.from_dict(demo.config.to_dict())
    config.num_hidden_layers += extra_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v for k, v in demo.state_dict().items()}
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all(".layers." in k for k in missing), missing
    with torch.no_grad():
        for layer in model.model.layers[demo.config.num_hidden_layers :]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(directory)
    return directory


def stranger(directory: str) -> str:
    """A random 1-layer model with the demo's vocabulary: a draft that never agrees."""
    config = load(str(DEMO_MODEL), "sdpa").config
    config = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 1})
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def greedy(**extra: object) -> dict:
    return dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=PAD, **extra)


def one_by_one(model: torch.nn.Module, prompts: list[list[int]], **options: object) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), **greedy(**options))[0, len(p) :].tolist() for p in prompts]


def batched(model: torch.nn.Module, prompts: list[list[int]], **options: object) -> list[list[int]]:
    ids, mask = left_padded(prompts, pad=PAD)
    out = model.generate(input_ids=ids, attention_mask=mask, **greedy(**options))
    return out[:, ids.shape[1] :].tolist()


def engine_figures(model: torch.nn.Module, prompts: list[list[int]], spec: SpeculativeConfig | None) -> str:
    """Acceptance and tokens per step of one engine run (what generate runs inside)."""
    config = GenerationConfig(**greedy())
    engine = ContinuousBatchingEngine(model, PagedConfig(num_blocks=4096, max_num_seqs=len(prompts), speculative=spec),
                                      generation_config=config)  # fmt: skip
    if len(prompts) == 1:
        for p in prompts:
            engine.generate([p], max_new_tokens=NEW)
    else:
        engine.generate(prompts, max_new_tokens=NEW)
    s = engine.stats
    # the requests run in lockstep (same length, admitted at once): steps after the prefill ones
    decode_steps = max(s.num_steps - (len(prompts) if len(prompts) == 1 else 1), 1)
    per_step = (NEW - 1) / decode_steps if len(prompts) > 1 else (NEW - 1) * len(prompts) / decode_steps
    return (f"acceptance {s.acceptance_rate:.2f} ({s.num_accepted_tokens}/{s.num_draft_tokens}), "
            f"{per_step:.2f} new tokens per request and step")


def rounds(systems: dict[str, Callable[[], list[list[int]]]], count: int, tokens: int) -> dict[str, float]:
    """Median seconds of each system over ``count`` rounds, order rotating; checks every system's
    tokens against the first one's."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    outputs: dict[str, list[list[int]]] = {}
    clock = time.process_time if CLOCK == "cpu" else time.perf_counter
    for r in range(count):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = clock()
            outputs[name] = systems[name]()
            times[name].append(clock() - start)
        print(f"  round {r + 1} (load {os.getloadavg()[0]:.1f}): "
              + ", ".join(f"{n} {tokens / t[-1]:.0f}" for n, t in times.items()) + " tok/s", flush=True)  # fmt: skip
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def report(title: str, medians: dict[str, float], tokens: int, baseline: str) -> None:
    print(f"{title}: median tokens/s, and against {baseline}")
    for name, seconds in medians.items():
        print(f"  {name:<34} {tokens / seconds:7.0f} tok/s   x{medians[baseline] / seconds:.2f}")


def check(reference: torch.nn.Module, prompts: list[list[int]], outputs: dict[str, list[list[int]]]) -> None:
    first = next(iter(outputs.values()))
    for name, got in outputs.items():
        problems = compare_greedy(reference, prompts, first, got)
        if problems:
            print(f"  {name}: tokens differ from plain greedy: {problems[:2]}")


def lookup_part(args: argparse.Namespace, tokenizer) -> None:  # noqa: ANN001
    sdpa, paged = load(str(DEMO_MODEL), "sdpa"), load(str(DEMO_MODEL), "paged")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    k = args.k
    alone = prompts[: args.prompts]
    systems = {
        "sdpa generate": lambda: one_by_one(sdpa, alone),
        f"sdpa prompt lookup (k={k})": lambda: one_by_one(sdpa, alone, prompt_lookup_num_tokens=k),
        "paged generate": lambda: one_by_one(paged, alone),
        f"paged prompt lookup (k={k})": lambda: one_by_one(paged, alone, prompt_lookup_num_tokens=k),
    }
    one_by_one(paged, alone[:1], prompt_lookup_num_tokens=k)  # warm-up
    medians, outputs = rounds(systems, args.rounds, NEW * len(alone))
    check(sdpa, alone, outputs)
    report(f"batch 1 ({len(alone)} prompts, one at a time)", medians, NEW * len(alone), "paged generate")
    print(f"  engine: {engine_figures(paged, alone[:1], SpeculativeConfig(k))} (first prompt)")
    for size in args.batches:
        batch = (prompts * (size // len(prompts) + 1))[:size]
        systems = {
            "paged generate": lambda b=batch: batched(paged, b),
            f"paged prompt lookup (k={k})": lambda b=batch: batched(paged, b, prompt_lookup_num_tokens=k),
        }
        medians, outputs = rounds(systems, args.rounds, NEW * size)
        check(sdpa, batch, outputs)
        report(f"batch {size} (one generate call)", medians, NEW * size, "paged generate")
        print(f"  engine: {engine_figures(paged, batch, SpeculativeConfig(k))}")


def draft_part(args: argparse.Namespace, tokenizer) -> None:  # noqa: ANN001
    with tempfile.TemporaryDirectory() as big_dir, tempfile.TemporaryDirectory() as other_dir:
        deepened_demo(big_dir)
        stranger(other_dir)
        target_sdpa, target = load(big_dir, "sdpa"), load(big_dir, "paged")
        draft_sdpa, draft = load(str(DEMO_MODEL), "sdpa"), load(str(DEMO_MODEL), "paged")
        other = load(other_dir, "paged")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    k = args.k
    alone = prompts[: args.prompts]
    systems = {
        "sdpa generate": lambda: one_by_one(target_sdpa, alone),
        f"sdpa assisted (demo draft, k={k})": lambda: one_by_one(target_sdpa, alone, assistant_model=draft_sdpa,
                                                                  num_assistant_tokens=k),  # fmt: skip
        "paged generate": lambda: one_by_one(target, alone),
        f"paged + demo draft (k={k})": lambda: one_by_one(target, alone, assistant_model=draft, num_assistant_tokens=k),
        f"paged + stranger draft (k={k})": lambda: one_by_one(target, alone, assistant_model=other,
                                                               num_assistant_tokens=k),  # fmt: skip
    }
    medians, outputs = rounds(systems, args.rounds, NEW * len(alone))
    check(target_sdpa, alone, outputs)
    report(f"draft model, batch 1 ({len(alone)} prompts, one at a time)", medians, NEW * len(alone), "paged generate")
    for name, d in (("demo draft", draft), ("stranger", other)):
        print(f"  engine, {name}: {engine_figures(target, alone[:1], SpeculativeConfig(k, d))} (first prompt)")
    for size in args.batches[:1]:
        batch = (prompts * (size // len(prompts) + 1))[:size]
        systems = {
            "paged generate": lambda b=batch: batched(target, b),
            f"paged + demo draft (k={k})": lambda b=batch: batched(target, b, assistant_model=draft,
                                                                    num_assistant_tokens=k),  # fmt: skip
            f"paged + stranger draft (k={k})": lambda b=batch: batched(target, b, assistant_model=other,
                                                                        num_assistant_tokens=k),  # fmt: skip
        }
        medians, outputs = rounds(systems, args.rounds, NEW * size)
        check(target_sdpa, batch, outputs)
        report(f"draft model, batch {size}", medians, NEW * size, "paged generate")
        for name, d in (("demo draft", draft), ("stranger", other)):
            print(f"  engine, {name}: {engine_figures(target, batch, SpeculativeConfig(k, d))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("lookup", "draft", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=4, help="tokens proposed per step (at most)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts run one at a time for batch 1")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    global CLOCK
    CLOCK = args.clock
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    print(f"{NEW} new tokens, greedy; {args.threads} threads; load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.part in ("lookup", "all"):
        lookup_part(args, tokenizer)
    if args.part in ("draft", "all"):
        draft_part(args, tokenizer)


if __name__ == "__main__":
    main()
