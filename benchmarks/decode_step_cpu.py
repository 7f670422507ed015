"""The torch backend's decode attention for every layer of one step, against an older backend file.

    git show a0127ba:hf_paged_attn/kernels/torch_backend.py > /tmp/torch_backend_old.py
    OMP_WAIT_POLICY=PASSIVE python benchmarks/decode_step_cpu.py /tmp/torch_backend_old.py [--threads 2]

64 requests, block size 8, shuffled pages, a new token appended per request and layer; the layers
of a step share one memo (as ``StepMetadata.memo`` in the engine), each layer has its own pages.
Shapes of the bundled demo model (4 layers, 4 heads, 2 KV heads, contexts 4-126) and of the bench's
30M Llama on ``uniform`` (8 layers, 8 heads, 2 KV heads, contexts 16-384). Alternating, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import baseline_backend  # benchmarks/baseline_backend.py
import torch

from hf_paged_attn.kernels import torch_backend

SHAPES = {  # batch, heads, kv heads, head dim, shortest and longest context, layers
    "demo": (64, 4, 2, 64, 4, 126, 4),
    "uniform": (64, 8, 2, 64, 16, 384, 8),
}


def setup(b: int, h: int, h_kv: int, d: int, low: int, high: int, layers: int, bs: int = 8) -> tuple:
    lens = torch.randint(low, high, (b,)).int()
    need = [(int(n) + bs) // bs for n in lens]  # blocks, the appended token included
    num_blocks = sum(need) + 10
    caches = [(torch.randn(num_blocks, bs, h_kv, d), torch.randn(num_blocks, bs, h_kv, d)) for _ in range(layers)]
    free = torch.randperm(num_blocks).tolist()
    table = torch.full((b, max(need)), -1, dtype=torch.int32)
    for row in range(b):
        table[row, : need[row]] = torch.tensor([free.pop() for _ in range(need[row])])
    q, k, v = torch.randn(b, 1, h, d), torch.randn(b, 1, h_kv, d), torch.randn(b, 1, h_kv, d)
    return q, caches, k, v, lens, table


def step(module, case: tuple, memo: dict | None) -> None:  # noqa: ANN001
    """Every layer's decode attention of one step; ``memo`` shared by the layers (None: an old backend)."""
    q, caches, k, v, lens, table = case
    extra = {"memo": memo} if memo is not None else {}
    for k_cache, v_cache in caches:
        module.paged_decode_attention(q, k_cache, v_cache, k, v, lens, table, softmax_scale=0.125, **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", help="path of the older torch_backend.py")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    old = baseline_backend.load(args.baseline)
    for name, shape in SHAPES.items():
        case = setup(*shape)
        new_times, old_times = [], []
        for _ in range(args.reps + 2):
            start = time.perf_counter()
            step(torch_backend, case, {})
            new_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            step(old, case, None)
            old_times.append(time.perf_counter() - start)
        new_ms, old_ms = (1e3 * statistics.median(t[2:]) for t in (new_times, old_times))
        print(f"{name} ({shape[-1]} layers, {args.threads} threads): this {new_ms:.2f} ms, "
              f"baseline {old_ms:.2f} ms per step: {old_ms / new_ms:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
