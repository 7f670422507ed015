"""A compiled decode step's attention with and without ``cpu_attention._lean_decode`` (the step's native calls
prepared once, each layer's only setting its pointers), in one process on one engine: the attention op looks
``cpu_attention._lean_decode`` up at run time, and the general variant puts one that always declines in its place,
so both variants run the same graph,
their runs alternating so both see the same host. Prints each run's wall time, the medians, their ratio
and whether the tokens agree.

    python benchmarks/lean_decode_ab.py [--row random|demo] [--prompts N] [--new-tokens workload|N] [--rounds 5]

``--prompts 1 --new-tokens 128``: batch 1 (decode steps of one request, where the op's own cost weighs most);
the defaults: the row's whole workload. Timings are noisy on shared cores: read the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # as our commands run (hf_paged_attn._env.CLI_DEFAULTS)

import torch  # noqa: E402

from hf_paged_attn.runtime.cpu import attention as cpu_attention  # noqa: E402
from hf_paged_attn_tools.bench import vs_vllm  # noqa: E402
from hf_paged_attn_tools.bench.ab import report  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_vllm.row_arguments(parser, dtype=False)
    parser.add_argument("--prompts", type=int, default=0, help="the row's first N prompts (0: all)")
    parser.add_argument("--new-tokens", default="workload", help="'workload' or a number for every prompt")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    job = vs_vllm.workload(args.row, args.work_dir)
    prompts = job["prompts"][: args.prompts or None]
    new = job["max_new_tokens"][: len(prompts)] if args.new_tokens == "workload" else int(args.new_tokens)
    counts = new if isinstance(new, list) else [new] * len(prompts)
    engine = vs_vllm.ours_engine({**job, "prompts": prompts, "max_new_tokens": counts, "dtype": "float32",
                                  "ours_config": {"compile": True}})  # fmt: skip
    walls: dict[str, list[float]] = {"lean": [], "general": []}
    tokens: dict[str, list[list[int]]] = {}
    lean = cpu_attention._lean_decode
    for round_ in range(args.rounds + 1):  # round 0: warm-up of both
        for name in walls:
            cpu_attention._lean_decode = lean if name == "lean" else lambda *args: None
            start = time.perf_counter()
            outs = engine.generate(prompts, max_new_tokens=new, progress_bar=False)
            if round_:
                walls[name].append(time.perf_counter() - start)
            tokens[name] = [list(o.output_ids) for o in outs]
    cpu_attention._lean_decode = lean
    report(walls, tokens, f"row {args.row}, {len(prompts)} prompts, new tokens {args.new_tokens}")

if __name__ == "__main__":
    main()
