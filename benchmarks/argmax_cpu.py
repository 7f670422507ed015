"""``row_argmax`` (hf_paged_attn/runtime/generation/argmax.py) against ``torch.argmax`` on a decode step's logits:
64 rows (a full batch) of float32, vocabularies from the bundled model's to Qwen2's, calls alternating; and each of
``row_argmax``'s two paths forced, numpy's one pass and the threaded chunks (``NUMPY_MAX`` picks between them).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/argmax_cpu.py [--rows 64] [--threads 2] [--reps 200]

Prints the median ms per call of each and the ratio of torch's to ``row_argmax``'s (above 1: ``row_argmax`` is
faster), after checking that all give the same indices.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_paged_attn.runtime.generation import argmax
from hf_paged_attn.runtime.generation.argmax import row_argmax

VOCABS = (4096, 8192, 32000, 128256, 151936)  # the bundled model, the 30M bench model, Llama 2, Llama 3, Qwen2


def per_call(fn, logits: torch.Tensor, reps: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    for _ in range(reps):
        fn(logits)
    return (time.perf_counter() - start) / reps * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{'vocab':>7}  {'torch.argmax ms':>15}  {'numpy ms':>8}  {'chunks ms':>9}  {'row_argmax ms':>13}  ratio")
    with torch.inference_mode():
        for vocab in VOCABS:
            logits = torch.randn(args.rows, vocab)
            assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
            reps = max(10, args.reps * 8192 // vocab)
            plain, numpy, chunks, ours = [], [], [], []
            for _ in range(5):  # alternating, so that the machine's load falls on all alike
                plain.append(per_call(lambda x: x.argmax(dim=-1), logits, reps))
                ours.append(per_call(row_argmax, logits, reps))
                for times, bound in ((numpy, logits.numel()), (chunks, 0)):
                    argmax.NUMPY_MAX, default = bound, argmax.NUMPY_MAX
                    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
                    times.append(per_call(row_argmax, logits, reps))
                    argmax.NUMPY_MAX = default
            a, n, c, b = (statistics.median(t) for t in (plain, numpy, chunks, ours))
            print(f"{vocab:7d}  {a:15.3f}  {n:8.3f}  {c:9.3f}  {b:13.3f}  {a / b:5.2f}")


if __name__ == "__main__":
    main()
