"""The engine with this torch backend against an older one (a file), in one process, alternating.

    git show a0127ba:hf_paged_attn/kernels/torch_backend.py > /tmp/torch_backend_old.py
    OMP_WAIT_POLICY=PASSIVE python benchmarks/ab_backend.py /tmp/torch_backend_old.py [--workload uniform]

Both runs use one model and one engine configuration (``hf_paged_attn.bench``'s ``run_engine``,
prefix caching off); only the module the attention function calls differs (``engine.backend``).
Prints each round, the medians and their ratio, and whether both produced the same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
from types import ModuleType

import torch
from transformers import AutoModelForCausalLM

import hf_paged_attn.bench.systems as systems
from hf_paged_attn.bench.workloads import WORKLOADS
from hf_paged_attn.engine import ContinuousBatchingEngine


def load_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_backend_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", help="path of the older torch_backend.py")
    parser.add_argument("--workload", default="uniform", choices=[w for w in WORKLOADS if w != "scale"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    baseline = load_module(args.baseline)
    work = WORKLOADS[args.workload]()
    with tempfile.TemporaryDirectory(prefix="hf_paged_attn_ab_") as directory:
        work.model.save(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged").eval()

    original_init = ContinuousBatchingEngine.__init__
    use: dict[str, ModuleType | None] = {"backend": None}

    def init(self, *a, **k) -> None:  # noqa: ANN001, ANN002, ANN003
        original_init(self, *a, **k)
        if use["backend"] is not None:
            self.backend = use["backend"]

    ContinuousBatchingEngine.__init__ = init
    times: dict[str, list[float]] = {"this": [], "baseline": []}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for name in (["this", "baseline"] if r % 2 == 0 else ["baseline", "this"]):
            use["backend"] = baseline if name == "baseline" else None
            run = systems.run_engine(model, work, args.concurrency)
            times[name].append(run.wall_seconds)
            tokens[name] = run.outputs
        print(f"round {r + 1}: this {times['this'][-1]:.2f} s, baseline {times['baseline'][-1]:.2f} s", flush=True)
    this, base = statistics.median(times["this"]), statistics.median(times["baseline"])
    print(f"{args.workload} @{args.concurrency}, {args.threads} threads: this {work.new_tokens / this:.1f} new tok/s, "
          f"baseline {work.new_tokens / base:.1f} new tok/s: {base / this:.2f}x; "
          f"same tokens: {tokens['this'] == tokens['baseline']}")  # fmt: skip


if __name__ == "__main__":
    main()
