"""throughput/bf16: the benchmark's ``uniform`` workload (64 requests, 30M-parameter Llama) in bf16 on
the GPU: new tokens/s of the engine with each available kernel against transformers' padded
``generate`` and its continuous batching, and how many requests' greedy tokens equal padded
``generate``'s (bf16 near-ties may flip a few; reported, not judged). ``--device cpu``: the ``smoke``
workload in fp32.
"""

from __future__ import annotations

import sys
import traceback

import torch

from ..base import Check, Context, Fail
from ..helpers import load_model, short_error, sync


def run(ctx: Context) -> str:
    from hf_paged_attn_tools.bench.systems import run_engine, run_hf_cb, run_hf_padded
    from hf_paged_attn_tools.bench.workloads import WORKLOADS

    work = WORKLOADS["smoke" if ctx.tiny else "uniform"]()
    directory = work.model.save(ctx.subdir("bench_"))
    dtype = torch.float32 if ctx.tiny else torch.bfloat16
    sdpa, paged, cb = (load_model(directory, attn, ctx.device, dtype) for attn in ("sdpa", "paged", "sdpa"))
    sizes = (6,) if ctx.tiny else (16, 64)
    runs = [(f"hf_padded@{n}", lambda n=n: run_hf_padded(sdpa, work, n)) for n in sizes]
    block_sizes = {"flash": 256, "triton": 16, "torch": 16}  # the bench's CPU block size, 8, is below triton's 16
    top = sizes[-1]
    runs += [
        (f"engine[{k}]@{top}", lambda k=k: run_engine(paged, work, top, kernel=k, block_size=block_sizes[k]))
        for k in ctx.available("torch", "triton", "flash")
    ]
    runs.append((f"hf_cb@{top}", lambda: run_hf_cb(cb, work, top)))
    figures, reference, errors = [], None, []
    for name, fn in runs:
        try:
            sync(ctx.device)
            result = fn()
            sync(ctx.device)
        except Exception as exc:  # one system failing must not hide the others' figures
            errors.append(f"{name}: {short_error(exc)}")
            traceback.print_exc(file=sys.stderr)
            continue
        reference = reference or result.outputs
        same = sum(a == b for a, b in zip(result.outputs, reference, strict=True))
        figures.append(f"{name} {result.tokens_per_second:.0f} tok/s ({same}/{work.num_requests} same)")
        print(f"  {figures[-1]}, {result.wall_seconds:.2f}s", flush=True)
    detail = f"{work.new_tokens} new tokens: " + "; ".join(figures)
    if errors:
        raise Fail(f"{detail}; errors: {'; '.join(errors)}")
    return detail


USES = (
    "hf_paged_attn_tools.bench.systems:run_engine(model, work, concurrency, kernel, block_size)",
    "hf_paged_attn_tools.bench.systems:run_hf_padded(model, work, concurrency)",
    "hf_paged_attn_tools.bench.systems:run_hf_cb(model, work, concurrency)",
    "hf_paged_attn_tools.bench.systems:RunResult.outputs",
    "hf_paged_attn_tools.bench.systems:RunResult.tokens_per_second",
    "hf_paged_attn_tools.bench.systems:RunResult.wall_seconds",
    "hf_paged_attn_tools.bench.workloads:ModelSpec.save(directory)",
)
CHECKS = [Check("throughput/bf16", run, 180, cpu=True, uses=USES)]
