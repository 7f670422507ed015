"""``hf_paged_attn_tools.bench`` systems in alternating rounds, one process: medians and ratios of medians.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/rounds.py [--workload uniform] [--rounds 3] \
        [--runs engine@64,hf_cb@64,hf_padded@16] [--baseline-backend OLD_torch_backend.py]

On a shared machine one run of each system (what ``python -m hf_paged_attn_tools.bench`` does) can land
in a quiet or a busy minute; here every round runs every system, the order rotating from round to
round, and the figures are the medians. Each round also checks that every system produced the
engine's greedy tokens. ``--baseline-backend FILE`` adds ``engine-baseline@64``: the same engine
with the attention function calling the torch backend module loaded from FILE (an older version,
e.g. ``git show REV:hf_paged_attn/kernels/torch_backend.py > FILE``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import baseline_backend  # benchmarks/baseline_backend.py
import torch
from transformers import AutoModelForCausalLM

from hf_paged_attn_tools.bench.systems import MODEL_KIND, SYSTEMS, run_engine
from hf_paged_attn_tools.bench.workloads import WORKLOADS


def baseline_system(path: str):  # noqa: ANN201
    """``run_engine`` with every engine it builds calling the backend module in ``path``."""
    module = baseline_backend.load(path)

    def run(model, work, level):  # noqa: ANN001, ANN202
        with baseline_backend.engines_use(module):
            return run_engine(model, work, level)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="uniform", choices=list(WORKLOADS))
    parser.add_argument("--runs", default="engine@64,hf_cb@64,hf_padded@16", help="system@concurrency, ...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline-backend", metavar="FILE", help="also run engine-baseline@64 on this backend file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = [(s, int(c)) for s, c in (r.split("@") for r in args.runs.split(","))]
    systems, kinds = dict(SYSTEMS), dict(MODEL_KIND)
    if args.baseline_backend:
        systems["engine-baseline"], kinds["engine-baseline"] = baseline_system(args.baseline_backend), "paged"
        runs.insert(1, ("engine-baseline", runs[0][1]))
    work = WORKLOADS[args.workload]()
    models = {}
    with tempfile.TemporaryDirectory(prefix="hf_paged_attn_rounds_") as directory:
        work.model.save(directory)
        for system, _ in runs:
            kind = kinds[system]
            if kind not in models:
                attn = "paged" if kind == "paged" else "sdpa"
                models[kind] = AutoModelForCausalLM.from_pretrained(
                    directory, attn_implementation=attn, dtype=torch.float32
                ).eval()
    print(f"{work.name}: {work.num_requests} requests, {work.new_tokens} new tokens; {args.threads} threads; "
          f"load average before: {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    times: dict[str, list[float]] = {f"{s}@{c}": [] for s, c in runs}
    cpu: dict[str, list[float]] = {name: [] for name in times}  # process CPU time: steadier under load
    for r in range(args.rounds):
        order = runs[r % len(runs) :] + runs[: r % len(runs)]
        reference = None
        for system, level in order:
            result = systems[system](models[kinds[system]], work, level)
            times[f"{system}@{level}"].append(result.wall_seconds)
            cpu[f"{system}@{level}"].append(result.cpu_seconds)
            reference = reference or result.outputs
            if result.outputs != reference:
                print(f"  {system}@{level} produced other tokens than {order[0][0]}")
        print(f"round {r + 1} (load {os.getloadavg()[0]:.2f}): "
              + ", ".join(f"{name} {work.new_tokens / t[-1]:.1f} tok/s" for name, t in times.items()), flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    cpu_medians = {name: statistics.median(t) for name, t in cpu.items()}
    first = next(iter(medians))
    for name, seconds in medians.items():
        print(f"{name:<18} median {work.new_tokens / seconds:7.1f} new tok/s ({seconds:.2f} s wall, "
              f"{cpu_medians[name]:.2f} s CPU); {first} is {seconds / medians[first]:.2f}x as fast "
              f"({cpu_medians[name] / cpu_medians[first]:.2f}x in CPU time)")  # fmt: skip


if __name__ == "__main__":
    main()
