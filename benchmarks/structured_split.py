"""Where a constrained batch's extra time goes, in-process: ``structured_serve.py --workload list``'s batches (32
requests of 48 tokens, ``LIST_SCHEMA`` against free ones with ``ignore_eos``) run on one engine of the bundled
model, alternating, each split by the engine's parts (wall seconds on the engine's thread) and the mask fill's
own wall time on its thread.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/structured_split.py [--rounds 12] [--clients 32] [--threads 2]

Parts: ``forward`` (the executor's call: the compiled forward, on both cores), ``schedule``, ``build_step``,
``sample`` (of which ``take``: waiting for the masks filled ahead, and ``mask_rows``: applying them), ``update``
(of which ``accept``: the matchers advanced by their tokens), ``prefill_masks`` (starting the next step's fill),
``rest`` (the engine's other Python); ``fill (thread)``, the masks filled ahead on their own thread, overlaps the
others. Prints the medians in ms a batch and the free / constrained ratio of the batches' wall times (no HTTP:
the server's ratio, ``structured_serve.py``, is diluted by its per-request work).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks
from step_split import add_wall_time  # noqa: E402
from structured_serve import LIST_MAX_TOKENS, LIST_SCHEMA  # noqa: E402

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn.demo import DEMO_MODEL  # noqa: E402

# (name, where, attribute); an indented name is inside another part's time (shown, not added to the total)
PARTS = (
    ("forward", "executor", "execute"),
    ("schedule", "scheduler", "schedule"),
    ("build_step", "worker_module", "build_step"),
    ("sample", "sampler", "sample"),
    ("  take", "MaskPrefill", "take"),
    ("  mask_rows", "mask_prefill", "mask_rows"),
    ("update", "updater", "update"),
    ("  accept", "Matcher", "accept"),
    ("prefill_masks", "sampler", "prefill_masks"),
    ("fill (thread)", "mask_prefill", "_fill"),
)


def wrap_parts(engine: ContinuousBatchingEngine, spent: dict[str, float]) -> None:
    """Every part of ``PARTS`` adds its wall seconds to ``spent[name]``."""
    from hf_paged_attn.runtime import worker
    from hf_paged_attn.runtime.generation import mask_prefill, structured

    owners = {"executor": engine.executor, "scheduler": engine.scheduler, "worker_module": worker,
              "sampler": engine.worker.sampler, "updater": engine.updater, "mask_prefill": mask_prefill,
              "MaskPrefill": mask_prefill.MaskPrefill, "Matcher": structured.Matcher}  # fmt: skip
    for name, owner, attr in PARTS:
        add_wall_time(owners[owner], attr, spent, name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged")
    engine = ContinuousBatchingEngine(model, PagedConfig(compile="startup"))
    prompts = [tokenizer(f"List number {i}, as JSON:")["input_ids"] for i in range(args.clients)]

    def batch(constrained: bool) -> None:
        extra = {"structured": {"json": LIST_SCHEMA}} if constrained else {"ignore_eos": True}
        ids = [engine.add_request(p, max_new_tokens=LIST_MAX_TOKENS, tokenizer=tokenizer, **extra) for p in prompts]
        counts = [len(out.output_ids) for out in engine.collect(ids)]
        assert counts == [LIST_MAX_TOKENS] * len(prompts), f"an output ended before {LIST_MAX_TOKENS} tokens: {counts}"

    for _ in range(3):  # warm-up: the grammar, the steps' sizes, the thread tuner's first choices
        batch(True)
        batch(False)
    spent: dict[str, float] = defaultdict(float)
    wrap_parts(engine, spent)
    walls: dict[bool, list[float]] = {True: [], False: []}
    parts: dict[bool, dict[str, list[float]]] = {True: defaultdict(list), False: defaultdict(list)}
    for _ in range(args.rounds):
        for constrained in (True, False):
            spent.clear()
            start = time.perf_counter()
            batch(constrained)
            wall = time.perf_counter() - start
            walls[constrained].append(wall)
            for name, _, _ in PARTS:
                parts[constrained][name].append(spent[name])
            added = sum(v for k, v in spent.items() if not k.startswith(" ") and k != "fill (thread)")
            parts[constrained]["rest"].append(wall - added)
    engine.shutdown()
    print(f"{args.clients} requests x {LIST_MAX_TOKENS} tokens, {args.rounds} rounds, {args.threads} threads; "
          "ms a batch, medians")  # fmt: skip
    print(f"  {'part':16s} {'constrained':>12s} {'free':>8s} {'extra':>8s}")
    for name in [n for n, _, _ in PARTS] + ["rest"]:
        c, f = (statistics.median(parts[k][name]) * 1e3 for k in (True, False))
        print(f"  {name:16s} {c:12.1f} {f:8.1f} {c - f:8.1f}")
    c, f = statistics.median(walls[True]), statistics.median(walls[False])
    print(f"  {'wall':16s} {c * 1e3:12.1f} {f * 1e3:8.1f} {(c - f) * 1e3:8.1f}")
    print(f"free / constrained wall: {f / c:.3f}")


if __name__ == "__main__":
    main()
