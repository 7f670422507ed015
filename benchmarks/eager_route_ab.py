"""Eager passes with and without ``packed_linear.RoutePackedLinears`` (the route an engine's eager steps take while
its compile runs: their linears on oneDNN-packed copies), alternating in one process on one engine
(``compile=False``, the copies made by hand as the compile's start makes them).

    python benchmarks/eager_route_ab.py [--row demo|random] [--dtype float32] [--rounds 6]
        [--all-dtypes]

``--all-dtypes`` routes every packed dtype (``DTYPES``) rather than ``EAGER_DTYPES``: how bf16 was measured.
Prints each pass's tok/s, the medians and their ratio (above 1: the route is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # as our commands run (hf_paged_attn._env.CLI_DEFAULTS)

import torch  # noqa: E402

from hf_paged_attn.runtime.cpu import packed_linear  # noqa: E402
from hf_paged_attn_tools.bench import vs_vllm  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_vllm.row_arguments(parser, row="demo")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--all-dtypes", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    job = {**vs_vllm.workload(args.row, args.work_dir), "dtype": args.dtype, "ours_config": {"compile": False}}
    engine = vs_vllm.ours_engine(job)
    print(f"packed {packed_linear.pack(engine.model)} weights")
    dtypes = None if args.all_dtypes else packed_linear.EAGER_DTYPES
    execute, routed = engine.executor.execute, [False]

    def step(step: object) -> torch.Tensor:
        with packed_linear.RoutePackedLinears(dtypes) if routed[0] else contextlib.nullcontext():
            return execute(step)

    engine.executor.execute = step
    tokens = sum(job["max_new_tokens"])
    passes: dict[str, list[float]] = {"plain": [], "routed": []}
    engine.generate(job["prompts"], max_new_tokens=job["max_new_tokens"], progress_bar=False)  # warm-up
    for r in range(args.rounds):
        for name in ("plain", "routed") if r % 2 == 0 else ("routed", "plain"):
            routed[0] = name == "routed"
            start = time.perf_counter()
            engine.generate(job["prompts"], max_new_tokens=job["max_new_tokens"], progress_bar=False)
            passes[name].append(tokens / (time.perf_counter() - start))
    for name, values in passes.items():
        print(f"{name:6s} median {statistics.median(values):7.0f} tok/s  passes {[round(v) for v in values]}")
    print(f"routed / plain {statistics.median(passes['routed']) / statistics.median(passes['plain']):.3f}")


if __name__ == "__main__":
    main()
