"""Passes right after start against the eager and the compiled speed: is any pass slower than eager while the
background compile runs? Fresh processes (``hf_paged_attn_tools/bench/vs_vllm_worker.py``), alternating.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/steady_start.py [--rows demo-float32,demo-bfloat16] [--rounds 3] \\
        [--configs '{"compile": false}' '{}' '{"compile": "startup"}' \\
                   '{"env": {"TORCHINDUCTOR_COMPILE_THREADS": "1"}}']

Each process: the bundled demo model (64 prompts x 64 new tokens, ``vs_vllm.workload``), the engine made
with one ``PagedConfig`` override (its ``"env"``: environment variables of the process instead), a warm-up
pass and ``--reps`` timed passes right after start, then the compile waited for and ``--reps`` passes after
it. A round runs one process per config, the order alternating between rounds. Prints every pass's tok/s
and, per config, the medians over rounds of each pass position, of the slowest pass, and of the compiled
passes; the first config (eager by default) is the bar no pass should fall below. Greedy tokens of every
config are compared with the first's (equal in fp32; bf16 parts after near-ties).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_paged_attn_tools.bench import vs_vllm  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="demo-float32,demo-bfloat16")
    parser.add_argument("--configs", nargs="+", default=['{"compile": false}', "{}", '{"compile": "startup"}'])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "hf_paged_attn" / "vs_vllm")
    args = parser.parse_args(argv)
    # A config's "env" becomes a variant of vs_vllm's system "ours" (the environment of its process).
    variants, systems = [], {}
    for i, config in enumerate(args.configs):
        env = json.loads(config).get("env")
        systems[config] = f"ours+c{i}" if env else "ours"
        if env:
            variants.append(f"c{i}:" + ",".join(f"{k}={v}" for k, v in env.items()))
    env_args = argparse.Namespace(threads=args.threads, ours_preload="none", variant=variants, timeout=1800,
                                  vllm_python=None)  # fmt: skip
    for row in args.rows.split(","):
        model, dtype = row.split("-")
        base = {**vs_vllm.workload(model, args.work_dir), "dtype": dtype, "reps": args.reps, "threads": args.threads}
        new_tokens = sum(base["max_new_tokens"])
        runs: dict[str, list[dict]] = {c: [] for c in args.configs}
        for r in range(args.rounds):
            for config in args.configs if r % 2 == 0 else args.configs[::-1]:
                settings = {k: v for k, v in json.loads(config).items() if k != "env"}
                res = vs_vllm.run_process(systems[config], {**base, "ours_config": settings}, env_args, args.work_dir)
                runs[config].append(res)
                print(vs_vllm.process_line(row, r, config, res, new_tokens), flush=True)
        print(f"== {row} (load {os.getloadavg()[0]:.2f}), medians over {args.rounds} processes, tok/s:")
        first = runs[args.configs[0]]
        for config, results in runs.items():
            start = [[new_tokens / t for t in res["start"]["times"]] for res in results]
            compiled = [statistics.median(new_tokens / t for t in res["compiled"]["times"]) for res in results]
            by_pass = [statistics.median(p[i] for p in start) for i in range(args.reps)]
            same = sum(a == b for a, b in zip(results[-1]["compiled"]["tokens"], first[-1]["compiled"]["tokens"]))
            print(f"   {config:<24} passes after start {' / '.join(f'{x:.0f}' for x in by_pass)}, slowest "
                  f"{statistics.median(min(p) for p in start):.0f}; after the compile "
                  f"{statistics.median(compiled):.0f}; compile "
                  f"{statistics.median(r['compile_seconds'] for r in results):.1f} s; same tokens as the first config "
                  f"{same}/{len(first[-1]['compiled']['tokens'])}", flush=True)


if __name__ == "__main__":
    main()
