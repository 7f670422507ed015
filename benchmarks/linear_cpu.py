"""The matmul floor of the benchmark model on this CPU: each projection of a Llama layer and the
LM head, as ``F.linear`` on [1, rows, in] inputs, at 64 rows (a decode step of 64 requests) and
512 rows (a prefill step), with the weights hot in cache.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/linear_cpu.py [--threads 2]

Prints GFLOP/s per projection and the model's matmul milliseconds per token (8 layers + the LM
head for every token). benchmarks/README.md ("Where the time goes") quotes it.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (out_features, in_features, times per token): hidden 512, intermediate 1536, 8 layers, 2 KV heads.
PROJECTIONS = {
    "q": (512, 512, 8),
    "k": (128, 512, 8),
    "v": (128, 512, 8),
    "o": (512, 512, 8),
    "gate": (1536, 512, 8),
    "up": (1536, 512, 8),
    "down": (512, 1536, 8),
    "lm_head": (8192, 512, 1),
}


def seconds_per_call(rows: int, out_features: int, in_features: int, reps: int = 200) -> float:
    x = torch.randn(1, rows, in_features)  # [1, rows, in]: the packed batch of one step
    w = torch.randn(out_features, in_features)
    for _ in range(5):
        F.linear(x, w)
    start = time.perf_counter()
    for _ in range(reps):
        F.linear(x, w)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for rows in (64, 512):
        total = 0.0
        for name, (out_f, in_f, times) in PROJECTIONS.items():
            sec = seconds_per_call(rows, out_f, in_f)
            total += sec * times
            print(f"rows {rows:4d} {name:8s} {sec * 1e3:7.3f} ms  {2 * rows * out_f * in_f / sec / 1e9:6.1f} GFLOP/s")
        print(f"rows {rows:4d} model matmuls {total * 1e3:.1f} ms per step, {total / rows * 1e3:.3f} ms per token\n")


if __name__ == "__main__":
    main()
