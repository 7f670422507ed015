"""Best/median timings of the torch backend's kernels next to a one-SDPA-call-per-request loop.

    hf-paged-attn bench kernels [--threads N] [--cpu-time]

--cpu-time measures process CPU time instead of wall time: steadier on a shared machine, and
equal to wall time with --threads 1 when nothing else competes for the core. With glibc's default
malloc, freshly mmap'd temporaries page-fault on every call (decode ran ~4x slower here); compare with
MALLOC_MMAP_THRESHOLD_=100000000 MALLOC_TRIM_THRESHOLD_=1000000000 or an LD_PRELOADed jemalloc.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn.kernels import reference, torch_backend
from hf_paged_attn.kernels.base import AttentionOptions

H, H_KV, D, BLOCK = 8, 2, 64, 16
SCALE = D**-0.5
CLOCK = [time.perf_counter]


def timed(fn: Callable[[], object], reps: int = 30) -> str:
    """'best/median' microseconds: on a shared machine the best run is the steadier number."""
    fn()
    times = []
    for _ in range(reps):
        start = CLOCK[0]()
        fn()
        times.append(CLOCK[0]() - start)
    return f"{min(times) * 1e6:6.0f}/{statistics.median(times) * 1e6:6.0f}"


def per_request_loop(q, k, v, cu_q, cu_k) -> torch.Tensor:  # noqa: ANN001
    """The alternative design: one SDPA call per request with its own bottom-right causal mask."""
    out = torch.zeros_like(q)
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0))  # [Lq, Lk]
        res = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
            attn_mask=mask, scale=SCALE, enable_gqa=True,
        )  # [H, Lq, D]
        out[q0:q1] = res.transpose(0, 1)
    return out


def bench_varlen(name: str, shapes: list[tuple[int, int]]) -> None:
    q_lens, k_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    q = torch.randn(sum(q_lens), H, D)  # [total_q, H, D]
    k, v = torch.randn(sum(k_lens), H_KV, D), torch.randn(sum(k_lens), H_KV, D)  # [total_k, H_kv, D]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k, v, cu_q, cu_k, max(q_lens), max(k_lens))
    fast = timed(lambda: torch_backend.varlen_attention(*args, options=AttentionOptions(softmax_scale=SCALE)))
    capped = timed(lambda: torch_backend.varlen_attention(*args,
                                                          options=AttentionOptions(softmax_scale=SCALE, softcap=30.0)))
    loop = timed(lambda: per_request_loop(q, k, v, cu_q, cu_k))
    print(f"varlen {name:33s} backend {fast} | softcap {capped} | per-request loop {loop} us")


def bench_decode(batch: int, context: int) -> None:
    per_seq = blocks_for(context + 1, BLOCK)
    num_blocks = batch * per_seq
    table = torch.randperm(num_blocks).view(batch, per_seq).int()  # [B, blocks], shuffled pages
    k_cache, v_cache = torch.randn(num_blocks, BLOCK, H_KV, D), torch.randn(num_blocks, BLOCK, H_KV, D)
    q, k, v = torch.randn(batch, 1, H, D), torch.randn(batch, 1, H_KV, D), torch.randn(batch, 1, H_KV, D)
    lens = torch.full((batch,), context, dtype=torch.int32)

    def loop() -> None:
        for b in range(batch):
            keys = reference.gather_pages(k_cache, table[b], context).transpose(0, 1)  # [H_kv, L, D]
            vals = reference.gather_pages(v_cache, table[b], context).transpose(0, 1)
            F.scaled_dot_product_attention(q[b].transpose(0, 1), keys, vals, scale=SCALE, enable_gqa=True)

    args = (q, k_cache, v_cache, k, v, lens, table)
    fast = timed(lambda: torch_backend.paged_decode_attention(*args, options=AttentionOptions(softmax_scale=SCALE)))
    capped = timed(lambda: torch_backend.paged_decode_attention(*args,
                                                                options=AttentionOptions(softmax_scale=SCALE,
                                                                                         softcap=30.0)))
    slow = timed(loop)
    name = f"{batch} x {context} tokens"
    print(f"decode {name:33s} backend {fast} | softcap {capped} | per-request loop {slow} us")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cpu-time", action="store_true")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    if opts.cpu_time:
        CLOCK[0] = time.process_time
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, H={H} H_kv={H_KV} D={D}")
    bench_decode(32, 200)
    bench_decode(8, 1000)
    bench_varlen("uniform prefill 4 x 128", [(128, 128)] * 4)
    bench_varlen("31 decode rows + 256-token chunk", [(1, 150 + 3 * i) for i in range(31)] + [(256, 512)])
    bench_varlen("6 prompts of mixed lengths", [(n, n) for n in (17, 60, 128, 200, 311, 90)])


if __name__ == "__main__":
    main()
