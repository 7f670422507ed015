"""One ``PagedConfig`` field at several values, engines side by side in one process, on a vs-vLLM row's workload.

    python benchmarks/config_ab.py [--row random|demo] [--dtype float32|bfloat16]
        [--field max_batch_tokens] [--values 512,1024,2048] [--rounds 3]

Each value gets its own engine (``vs_vllm_worker.ours_engine``: its own copy of the model, compiled, prefix caching
off), all made before the timing; then every round runs one pass of the row's workload (``vs_vllm.workload``: the
bundled model's 64 x 64, or the 30M Llama's ``uniform`` 64 requests) through each engine in turn, so the
machine's load moves every value alike. Prints each pass and the median tok/s per value, with its ratio to the
first value. The commands' OpenMP default (``GOMP_SPINCOUNT=3000``) applies unless the environment sets one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from hf_paged_attn._env import CLI_DEFAULTS, OPENMP_WAITING

if not any(os.environ.get(k) for k in OPENMP_WAITING):
    os.environ.update(CLI_DEFAULTS)  # before torch loads, as the commands run

from hf_paged_attn_tools.bench import vs_vllm  # noqa: E402
from hf_paged_attn_tools.bench.vs_vllm_worker import ours_engine  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    vs_vllm.row_arguments(parser, work_dir=Path(tempfile.gettempdir()) / "hf_paged_attn_vs_vllm")
    parser.add_argument("--field", default="max_batch_tokens")
    parser.add_argument("--values", default="512,1024,2048", help="comma-separated JSON values")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    job = {**vs_vllm.workload(args.row, args.work_dir), "dtype": args.dtype, "threads": args.threads}
    import torch

    torch.set_num_threads(args.threads)
    values = [json.loads(v) for v in args.values.split(",")]
    engines = {v: ours_engine({**job, "ours_config": {args.field: v}}) for v in values}
    new_tokens = sum(job["max_new_tokens"])

    def one_pass(engine) -> float:  # noqa: ANN001
        start = time.perf_counter()
        engine.generate(job["prompts"], max_new_tokens=job["max_new_tokens"], progress_bar=False)
        return new_tokens / (time.perf_counter() - start)

    for engine in engines.values():
        one_pass(engine)  # warm-up: first-call paths
    rates: dict[object, list[float]] = {v: [] for v in values}
    for r in range(args.rounds):
        for value, engine in engines.items():
            rates[value].append(one_pass(engine))
        print(f"round {r}: " + ", ".join(f"{args.field}={v} {rates[v][-1]:.0f}" for v in values), flush=True)
    base = statistics.median(rates[values[0]])
    for value in values:
        median = statistics.median(rates[value])
        print(f"median {args.field}={value}: {median:.0f} tok/s, {median / base:.2f}x {args.field}={values[0]}")


if __name__ == "__main__":
    main()
