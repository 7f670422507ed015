"""The matmul paths torch offers on this CPU, side by side: ``F.linear`` (MKL sgemm in fp32, oneDNN in
bf16), oneDNN on a prepacked weight (``mkldnn._linear_pointwise``, what inductor's freezing emits for
bf16, and ``runtime/cpu/packed_linear.py`` in the compiled forward), the same with q/k/v and gate/up as one
matmul each on their weights concatenated (``runtime/cpu/linear_groups.py``: "grouped") and MKL's packed
sgemm (``mkl._mkl_linear``, inductor's fp32 choice with a static batch size).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/linear_backends_cpu.py [--threads 2] [--reps 7]

Shapes: every projection of the bundled demo model (hidden 256, intermediate 768, 4 heads / 2 KV
heads of 64, vocab 4096) and of the benchmark's 30M Llama (hidden 512, intermediate 1536, 2 KV heads of
64, vocab 8192), at 1, 64 and 512 rows. Prints ms per model step (every projection of every layer
plus the LM head for one row per request) for each path, median of ``--reps`` alternating runs, and its rate in
GFLOP/s (read against the CPU's FMA peak, ``benchmarks/fma_peak.c``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (out_features, in_features, times per step)
MODELS = {
    "demo": {"q": (256, 256, 4), "k": (128, 256, 4), "v": (128, 256, 4), "o": (256, 256, 4),
             "gate": (768, 256, 4), "up": (768, 256, 4), "down": (256, 768, 4), "lm_head": (4096, 256, 1)},
    "30M": {"q": (512, 512, 8), "k": (128, 512, 8), "v": (128, 512, 8), "o": (512, 512, 8),
            "gate": (1536, 512, 8), "up": (1536, 512, 8), "down": (512, 1536, 8), "lm_head": (8192, 512, 1)},
}  # fmt: skip


def paths(w: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each way of computing ``x @ w.T`` (x: [rows, in]) available for ``w``'s dtype."""
    out = {"F.linear": lambda x: F.linear(x, w)}
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    out["onednn packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if w.dtype == torch.float32 and torch._C.has_mkl:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        out["mkl packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl, w, None, rows)
    return out


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


GROUPS = (("q", "k", "v"), ("gate", "up"))  # projections of one input, one matmul when grouped
GROUPED = "onednn packed, grouped"


def grouped(weights: dict[str, torch.Tensor], rows: int) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], str]]:
    """(matmul, the projection whose input it takes) for each matmul of a step with ``GROUPS`` as one packed
    matmul each on their weights concatenated, the other projections packed alone."""
    out, grouped_names = [], {n for group in GROUPS for n in group}
    for group in GROUPS:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([weights[n] for n in group]), rows)
        out.append((lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), group[0]))
    for name in weights.keys() - grouped_names:
        packed = torch.ops.mkldnn._reorder_linear_weight(weights[name], rows)
        out.append((lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), name))
    return out


def step_seconds(model: str, rows: int, dtype: torch.dtype, reps: int, inner: int = 10) -> dict[str, float]:
    """Median seconds of one step's matmuls per path (alternating paths every rep)."""
    cases, weights, inputs = [], {}, {}
    for name, (out_f, in_f, times) in MODELS[model].items():
        w = weights[name] = torch.randn(out_f, in_f, dtype=dtype) * 0.05
        x = inputs[name] = torch.randn(rows, in_f, dtype=dtype)  # the LM head's rows: one per request
        cases.append((paths(w, rows), x, times))
    for fns, x, _ in cases:  # warm-up, and a check that every path computes the same
        ref = fns["F.linear"](x)
        for fn in fns.values():
            torch.testing.assert_close(fn(x).float(), ref.float(), rtol=2e-2, atol=2e-2)
    group_fns = grouped(weights, rows)
    for fn, name in group_fns:  # a group computes its projections' outputs side by side
        members = next((group for group in GROUPS if group[0] == name), (name,))
        want = torch.cat([F.linear(inputs[name], weights[n]) for n in members], -1)
        torch.testing.assert_close(fn(inputs[name]).float(), want.float(), rtol=2e-2, atol=2e-2)
    # one model step of each path: every projection of every layer, the LM head once
    steps = {name: functools.partial(_step, [(fns[name], x, times) for fns, x, times in cases])
             for name in cases[0][0]}  # fmt: skip
    steps[GROUPED] = functools.partial(_step, [(fn, inputs[p], MODELS[model][p][2]) for fn, p in group_fns])
    samples: dict[str, list[float]] = {n: [] for n in steps}
    for rep in range(reps):
        for name in steps if rep % 2 == 0 else reversed(steps):
            start = time.perf_counter()
            for _ in range(inner):
                steps[name]()
            samples[name].append((time.perf_counter() - start) / inner)
    return {n: statistics.median(s) for n, s in samples.items()}


def _step(matmuls: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, int]]) -> None:
    for fn, x, times in matmuls:
        for _ in range(times):
            fn(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--models", default="demo,30M")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import os

    print(f"load {os.getloadavg()[0]:.2f}, {args.threads} threads; ms per step of every projection")
    for model in args.models.split(","):
        for dtype in (torch.float32, torch.bfloat16):
            if not onednn_packs(dtype):
                print(f"{model:5s} {str(dtype)[6:]:9s} skipped: oneDNN does not pack {dtype} weights on this CPU")
                continue
            for rows in (1, 64, 512):
                res = step_seconds(model, rows, dtype, args.reps)
                base = res["F.linear"]
                flops = 2 * rows * sum(o * i * times for o, i, times in MODELS[model].values())
                cells = ", ".join(f"{n} {s * 1e3:.3f} ms ({base / s:.2f}x, {flops / s / 1e9:.0f} GFLOP/s)"
                                  for n, s in res.items())  # fmt: skip
                print(f"{model:5s} {str(dtype)[6:]:9s} rows {rows:4d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
