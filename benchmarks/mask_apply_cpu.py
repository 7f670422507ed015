"""A grammar mask applied to a decode step's float32 logits on the CPU, the three ways of
``hf_paged_attn/runtime/generation/structured.py``: native (``kernels/cpu_bitmask.py``, what ``apply_bitmask``
runs on float32 CPU logits), numpy (``apply_bitmask_numpy``, its way without a C compiler) and torch
(``apply_bitmask_torch``, its way for other dtypes and devices); 32 rows (the structured benchmarks' batch),
vocabularies from the bundled model's to Llama 3's, calls alternating.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/mask_apply_cpu.py [--rows 32] [--reps 200] [--vocabs 4096,32000]

All run on one thread (torch's way sets it around its ops), whatever torch's thread count.

Prints the median ms per call of each and the ratios of numpy's and torch's to the native one's, after checking
that all give the same logits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_paged_attn.kernels import cpu_bitmask
from hf_paged_attn.runtime.generation.structured import apply_bitmask_numpy, apply_bitmask_torch

VOCABS = (4096, 32000, 128256)  # the bundled model, Llama 2, Llama 3


def per_call(apply, logits: torch.Tensor, bitmask: torch.Tensor, reps: int) -> float:  # noqa: ANN001
    work = [logits.clone() for _ in range(reps)]  # a fresh copy each call: masked logits stay at -inf
    start = time.perf_counter()
    for x in work:
        apply(x, bitmask)
    return (time.perf_counter() - start) / reps * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--reps", type=int, default=200, help="calls per timing at 4,096 tokens (fewer above)")
    parser.add_argument("--vocabs", default=",".join(map(str, VOCABS)), help="comma-separated vocabulary sizes")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    assert cpu_bitmask.library() is not None, "no C compiler: the native way cannot be built"
    ways = {"native": lambda x, b: cpu_bitmask.apply(x, b, None),
            "numpy": lambda x, b: apply_bitmask_numpy(x.numpy(), b.numpy(), None),
            "torch": lambda x, b: apply_bitmask_torch(x, b, None)}  # fmt: skip
    print(f"{'vocab':>7}  {'native ms':>9}  {'numpy ms':>8}  {'torch ms':>8}  numpy/native  torch/native")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        logits = torch.randn(args.rows, vocab, generator=gen)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (args.rows, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
        results = {}
        for name, apply in ways.items():
            results[name] = logits.clone()
            apply(results[name], bitmask)
        assert torch.equal(results["native"], results["numpy"]) and torch.equal(results["numpy"], results["torch"])
        reps = max(10, args.reps * 4096 // vocab)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(5):  # alternating, so that the machine's load falls on both alike
            for name, apply in ways.items():
                times[name].append(per_call(apply, logits, bitmask, reps))
        c, n, t = (statistics.median(times[name]) for name in ways)
        print(f"{vocab:7d}  {c:9.3f}  {n:8.3f}  {t:8.3f}  {n / c:12.2f}  {t / c:12.2f}")


if __name__ == "__main__":
    main()
