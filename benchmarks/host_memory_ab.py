"""``PagedConfig.keep_freed_memory`` False against None (the default) on a vs-vLLM row, fresh processes alternating.

    python benchmarks/host_memory_ab.py [--row random|demo] [--dtype float32|bfloat16] [--rounds 4] [--passes 4]

The allocator's thresholds are the process's and can't be put back, so each value runs in its own process
(``vs_vllm_worker.ours_engine``: compiled, prefix caching off): a warm-up pass, then ``--passes`` timed passes of
the row's workload, each with its wall time, the process's CPU time and its minor page faults. The rounds
alternate which value goes first. Prints every process's passes, then per value the median pass and CPU time,
the fault range and each round's ratio of medians (None / False). The commands' OpenMP default
(``GOMP_SPINCOUNT=3000``) applies unless the environment sets one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_paged_attn._env import CLI_DEFAULTS, OPENMP_WAITING

if not any(os.environ.get(k) for k in OPENMP_WAITING):
    os.environ.update(CLI_DEFAULTS)  # before torch loads, as the commands run

VALUES = (False, None)


def child(job: dict, value: bool | None, passes: int) -> list[dict]:
    """One process's passes with ``keep_freed_memory=value``."""
    import torch

    from hf_paged_attn_tools.bench.vs_vllm_worker import ours_engine

    torch.set_num_threads(job["threads"])
    engine = ours_engine({**job, "ours_config": {"keep_freed_memory": value}})

    def one_pass() -> dict:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu, start = time.process_time(), time.perf_counter()
        engine.generate(job["prompts"], max_new_tokens=job["max_new_tokens"], progress_bar=False)
        return {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu,
                "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}  # fmt: skip

    one_pass()  # warm-up: first-call paths, the heap's growth to a step's size
    return [one_pass() for _ in range(passes)]


def main(argv: list[str] | None = None) -> None:
    from hf_paged_attn_tools.bench import vs_vllm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    vs_vllm.row_arguments(parser, work_dir=Path(tempfile.gettempdir()) / "hf_paged_attn_vs_vllm")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the value a child process runs, as JSON
    args = parser.parse_args(argv)
    job = {**vs_vllm.workload(args.row, args.work_dir), "dtype": args.dtype, "threads": args.threads}
    if args.child is not None:
        print(json.dumps(child(job, json.loads(args.child), args.passes)))
        return
    runs: dict[bool | None, list[list[dict]]] = {v: [] for v in VALUES}
    for r in range(args.rounds):
        for value in VALUES if r % 2 == 0 else reversed(VALUES):
            command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                       "--child", json.dumps(value)]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=1800)
            passes = json.loads(out.stdout.strip().splitlines()[-1])
            runs[value].append(passes)
            cells = [f"{p['wall']:.2f} s ({p['cpu']:.2f} CPU s, {p['faults']:,} faults)" for p in passes]
            print(f"round {r + 1} keep_freed_memory={value}: " + ", ".join(cells))
    medians = {v: [statistics.median(p["wall"] for p in passes) for passes in runs[v]] for v in VALUES}
    for value in VALUES:
        every = [p for passes in runs[value] for p in passes]
        print(f"keep_freed_memory={value}: pass {statistics.median(p['wall'] for p in every):.2f} s, "
              f"CPU {statistics.median(p['cpu'] for p in every):.2f} s, "
              f"faults {min(p['faults'] for p in every):,}-{max(p['faults'] for p in every):,} a pass")
    print("each round's ratio of median passes, None / False: "
          + ", ".join(f"{new / old:.2f}" for old, new in zip(medians[False], medians[None])))


if __name__ == "__main__":
    main()
