"""A model's later engines with the thread choices its earlier engines measured (``threads.tuner_for``: the
default) against engines that start measuring afresh (a new ``ThreadTuner``: what every engine did before),
in one process on one model, a new engine a run (as ``model.generate`` makes one a call), runs alternating so
both see the same host. Prints each run's wall time, the medians, their ratio and whether the tokens agree.

    python benchmarks/tuner_ab.py [--row random|demo] [--rounds 6]

A first engine runs the row's workload once before the rounds: the compile, and the model's tuner's first
measurements. Timings are noisy on shared cores: read the per-round ratios, not one run.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # as our commands run (hf_paged_attn._env.CLI_DEFAULTS)

import torch  # noqa: E402

from hf_paged_attn import ContinuousBatchingEngine  # noqa: E402
from hf_paged_attn.runtime.cpu.threads import ThreadTuner  # noqa: E402
from hf_paged_attn_tools.bench import vs_vllm  # noqa: E402
from hf_paged_attn_tools.bench.ab import report  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_vllm.row_arguments(parser, dtype=False)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    job = {**vs_vllm.workload(args.row, args.work_dir), "dtype": "float32"}
    first = vs_vllm.ours_engine(job)  # compiles; its tuner is the model's

    def run(engine: ContinuousBatchingEngine) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = engine.generate(job["prompts"], max_new_tokens=job["max_new_tokens"], progress_bar=False)
        return time.perf_counter() - start, [list(o.output_ids) for o in outs]

    run(first)  # the model's first measurements
    walls: dict[str, list[float]] = {"kept": [], "fresh": []}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name in walls:
            engine = ContinuousBatchingEngine(first.model, first.config, generation_config=first.generation_config,
                                              num_blocks=first.allocator.num_blocks)  # fmt: skip
            if name == "fresh":  # as before: the engine's own new tuner
                engine.executor.tuner = ThreadTuner(engine.executor.tuner.candidates)
            seconds, tokens[name] = run(engine)
            walls[name].append(seconds)
            engine.shutdown()
    report(walls, tokens, f"row {args.row}, a new engine a run")


if __name__ == "__main__":
    main()
