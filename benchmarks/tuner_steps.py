"""What the thread tuner's measuring costs, pass by pass: one engine on a ``vs_vllm.py`` row, many passes of its
workload, and per pass the steps the tuner ran on fewer threads than the most (``threads.ThreadTuner``: its first
trials, the checks of its choices), by step-size bucket, with their mean time against the same bucket's steps on
all threads, and the seconds those steps took.

    python benchmarks/tuner_steps.py [--row random|demo] [--dtype float32] [--passes 22]

The engine is ``vs_vllm.ours_engine``'s (compiled, prefix caching off). Pass 0 carries the tuner's first trials
of every bucket; the later ones show its checks (a bucket checks its choice every ``REMEASURE_STEPS`` of its steps).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # as our commands run (hf_paged_attn._env.CLI_DEFAULTS)

import torch  # noqa: E402

from hf_paged_attn.runtime.cpu import threads  # noqa: E402
from hf_paged_attn_tools.bench import vs_vllm  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_vllm.row_arguments(parser)
    parser.add_argument("--passes", type=int, default=22)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps: list[tuple[int, int, float]] = []  # (bucket, threads, seconds) of the pass's steps
    record = threads.ThreadTuner.record

    def recorded(self: threads.ThreadTuner, num_tokens: int, count: int, seconds: float) -> None:
        steps.append((threads.bucket(num_tokens), count, seconds))
        record(self, num_tokens, count, seconds)

    threads.ThreadTuner.record = recorded
    job = {**vs_vllm.workload(args.row, args.work_dir), "dtype": args.dtype}
    engine = vs_vllm.ours_engine(job)
    fewer_in_all = 0.0
    for p in range(args.passes):
        steps.clear()
        start = time.perf_counter()
        engine.generate(job["prompts"], max_new_tokens=job["max_new_tokens"], progress_bar=False)
        wall = time.perf_counter() - start
        times: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for key, count, seconds in steps:
            times[key][count].append(seconds)
        fewer = {key: [s for c, ss in by.items() if c < args.threads for s in ss] for key, by in times.items()}
        spent = sum(sum(few) for few in fewer.values())
        fewer_in_all += spent if p else 0.0
        cells = []
        for key, few in sorted(fewer.items()):
            if not few:
                continue
            most = times[key].get(args.threads, [])
            cells.append(f"bucket {key}: {len(few)} x {1e3 * sum(few) / len(few):.0f} ms"
                         + (f" (all threads {1e3 * sum(most) / len(most):.0f} ms)" if most else ""))  # fmt: skip
        print(f"pass {p}: {wall:.2f} s; on fewer threads {spent:.3f} s" + (": " + ", ".join(cells) if cells else ""))
    print(f"passes 1-{args.passes - 1}: {fewer_in_all:.2f} s of steps on fewer threads")


if __name__ == "__main__":
    main()
