"""The compiled forward with and without ``runtime/cpu/sampled_rows.py`` (only the sampled rows after the last
attention), in one process: two copies of a ``vs_vllm.py`` row's model, one compiled with the pass and one
without (``sampled_rows.move_row_selections`` a no-op while it compiles), their engines' runs alternating so both
see the same host. Prints each run's wall time, the medians, their ratio and whether the tokens agree.

    python benchmarks/sampled_rows_ab.py [--row random|demo] [--new-tokens workload|N] [--rounds 4]

``--new-tokens 1``: the prompts only (the prefill steps, where the pass saves work); ``workload``: the row's
own new-token counts. Timings are noisy on shared cores: read the per-round ratios, not one run.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # as our commands run (hf_paged_attn._env.CLI_DEFAULTS)

import torch  # noqa: E402

from hf_paged_attn import ContinuousBatchingEngine  # noqa: E402
from hf_paged_attn.runtime.cpu import sampled_rows  # noqa: E402
from hf_paged_attn_tools.bench import vs_vllm  # noqa: E402
from hf_paged_attn_tools.bench.ab import report  # noqa: E402


def engine_for(job: dict, pass_on: bool) -> ContinuousBatchingEngine:
    """A fresh copy of the row's model and an engine whose compiled forward has the pass on or off."""
    real = sampled_rows.move_row_selections
    if not pass_on:  # the pass leaves the graph as it is: every row through every layer
        sampled_rows.move_row_selections = lambda graph: 0
    try:
        # compiled here and now (ours_engine waits for the compile), never served from a graph cached with the pass
        with torch._inductor.config.patch(force_disable_caches=True):
            return vs_vllm.ours_engine({**job, "dtype": "float32", "ours_config": {"compile": True}})
    finally:
        sampled_rows.move_row_selections = real


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_vllm.row_arguments(parser, dtype=False)
    parser.add_argument("--new-tokens", default="workload", help="'workload' or a number for every prompt")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    job = vs_vllm.workload(args.row, args.work_dir)
    new = job["max_new_tokens"] if args.new_tokens == "workload" else int(args.new_tokens)
    engines = {"on": engine_for(job, True), "off": engine_for(job, False)}
    for engine in engines.values():  # warm-up: first-call paths
        engine.generate(job["prompts"], max_new_tokens=new, progress_bar=False)
    walls: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            outs = engine.generate(job["prompts"], max_new_tokens=new, progress_bar=False)
            walls[name].append(time.perf_counter() - start)
            tokens[name] = [list(o.output_ids) for o in outs]
    report(walls, tokens, f"row {args.row}, new tokens {args.new_tokens}")

if __name__ == "__main__":
    main()
