"""The native decode kernel on pages in the CPU's caches and on pages from memory, next to what the machine
streams, so that the kernel's cost per (key, KV head) can be read against a bound:

    OMP_WAIT_POLICY=PASSIVE python benchmarks/decode_from_memory.py [--threads 1,2] [--calls 60]

* "cached": 8 requests x 200 keys (1.6 MB of fp32 K/V), the same pages call after call;
* "memory": 40 requests x 200 keys (8.2 MB), a 64 MB buffer written between two calls so the pages come from
  memory, as in an engine step, where a layer's matmuls evict them; with the 30M Llama's heads (8 / 2 KV), and
  the same number of (key, KV head) pairs laid out with 1 KV head (each head's rows contiguous in a page) and
  with 4, to see whether the pages' layout matters;
* "stream": ``torch.sum`` over 256 MB, and over every other 256 B of it (one KV head's rows of two).

Each call goes through ``cpu_native.paged_decode``'s Python checks (~50 us a call here; the engine's compiled
steps skip them): "wrapper" is a call over one key. Figures are medians; ns per (key, KV head) subtract the
wrapper. D = 64, fp32, block size 16, shuffled pages (``cpu_attention.pages``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from cpu_attention import pages  # noqa: E402

from hf_paged_attn.kernels import cpu_native  # noqa: E402

D = 64
CASES = {  # name -> requests, keys, heads, KV heads, pages from memory
    "cached, 8 x 200, 8/2 heads": (8, 200, 8, 2, False),
    "memory, 40 x 200, 8/2 heads": (40, 200, 8, 2, True),
    "memory, 80 x 200, 4/1 heads": (80, 200, 4, 1, True),
    "memory, 20 x 200, 16/4 heads": (20, 200, 16, 4, True),
}


def median_seconds(fn: Callable[[], object], calls: int, between: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(calls + 5):
        if between is not None:
            between()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])  # the first five: warm-up


def decode_call(batch: int, keys: int, h: int, hk: int) -> Callable[[], torch.Tensor]:
    k_cache, v_cache, table = pages(batch, keys, hk, D, torch.float32)
    q = torch.randn(batch, 1, h, D)
    lens = torch.full((batch,), keys, dtype=torch.int32)
    return lambda: cpu_native.paged_decode(q, k_cache, v_cache, None, None, lens, table, D**-0.5, -1, 0.0, None,
                                           keys)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args(argv)
    sweep = torch.empty(16 << 20)  # 64 MB
    big = torch.randn(64 << 20)  # 256 MB
    every_other = big.view(-1, 2, D)[:, 0, :]  # 256 B of each 512 B
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        wrapper = median_seconds(decode_call(1, 1, 8, 2), args.calls * 10)
        print(f"{threads} thread(s): wrapper {wrapper * 1e6:.0f} us a call")
        for name, (batch, keys, h, hk, from_memory) in CASES.items():
            seconds = median_seconds(decode_call(batch, keys, h, hk), args.calls,
                                     (lambda: sweep.add_(1.0)) if from_memory else None)  # fmt: skip
            pairs = batch * keys * hk
            kernel = max(seconds - wrapper, 1e-9)
            print(f"  {name:30s} {seconds * 1e3:7.3f} ms  {kernel / pairs * 1e9:6.1f} ns per (key, KV head)  "
                  f"{pairs * 2 * D * 4 / kernel / 1e9:5.2f} GB/s of K/V")  # fmt: skip
        for name, tensor in (("contiguous", big), ("every other 256 B", every_other)):
            seconds = median_seconds(tensor.sum, 10)
            print(f"  stream, torch.sum, {name:18s} {tensor.numel() * 4 / seconds / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
