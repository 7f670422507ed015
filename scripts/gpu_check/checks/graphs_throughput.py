"""graphs/bf16: the benchmark's ``uniform`` workload (64 requests, 30M-parameter Llama, bf16) with
CUDA graphs off and on, per graph-safe kernel (triton, flash): new tokens/s of a second run (the
first captures the graphs and compiles), the first run's time, ms per step, and how many requests'
tokens equal the eager run's. Figures only; FAIL if graphs were on but never replayed.
``--device cpu``: the ``smoke`` workload in fp32, graphs through ``helpers.stand_in_capture``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..base import Check, Context, Fail, Skip
from ..helpers import graph_launcher, load_model, sync

if TYPE_CHECKING:
    from hf_paged_attn.runtime.executor import Executor
    from hf_paged_attn_tools.bench.workloads import Workload


def run_workload(
    ctx: Context, model: torch.nn.Module, work: Workload, kernel: str, block_size: int, graphs: bool
) -> tuple[list[list[int]], list[float], int, float, Executor]:
    """(outputs, [first run s, second run s], steps of the second, ms per step, the executor)."""
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn_tools.bench.systems import MAX_BATCH_TOKENS, greedy_config

    config = PagedConfig(
        kernel=kernel, block_size=block_size, num_blocks=work.num_blocks, max_num_seqs=64,
        max_batch_tokens=MAX_BATCH_TOKENS, progress_bar=False, seed=0, cuda_graphs=graphs and ctx.on_cuda,
    )  # fmt: skip
    launcher = graph_launcher(ctx.device) if graphs else None
    engine = ContinuousBatchingEngine(model, config, greedy_config(), launcher=launcher)
    seconds = []
    for _ in range(2):  # the first run compiles kernels and captures the buckets
        before = engine.stats
        sync(ctx.device)
        start = time.perf_counter()
        outs = engine.generate(work.prompts, max_new_tokens=work.max_new_tokens)
        sync(ctx.device)
        seconds.append(time.perf_counter() - start)
    after = engine.stats
    steps = after.num_steps - before.num_steps
    step_ms = (after.busy_seconds - before.busy_seconds) / steps * 1e3
    return [o.output_ids for o in outs], seconds, steps, step_ms, engine.executor


def run(ctx: Context) -> str:
    from hf_paged_attn.runtime.cuda_graphs import CudaGraphExecutor
    from hf_paged_attn_tools.bench.workloads import WORKLOADS

    kernels = ctx.available("triton", "flash")
    if not kernels:
        raise Skip(f"no graph-safe kernel: triton {ctx.backend_or_reason('triton')}")
    work = WORKLOADS["smoke" if ctx.tiny else "uniform"]()
    directory = work.model.save(ctx.subdir("graphs_bench_"))
    model = load_model(directory, "paged", ctx.device, torch.float32 if ctx.tiny else torch.bfloat16)
    parts = []
    for kernel in kernels:
        block_size = 256 if kernel == "flash" else 16
        results = {}
        for graphs in (False, True):
            outputs, seconds, steps, step_ms, runner = run_workload(ctx, model, work, kernel, block_size, graphs)
            replayed = isinstance(runner, CudaGraphExecutor)
            extra = f", {runner.num_captures} graphs, {runner.num_replays} replays" if replayed else ""
            print(f"  {kernel} graphs {'on' if graphs else 'off'}: runs {seconds[0]:.2f}s / {seconds[1]:.2f}s, "
                  f"{steps} steps, {step_ms:.2f} ms/step{extra}", flush=True)  # fmt: skip
            if graphs and (not replayed or runner.num_replays == 0 or runner.failed):
                failed = runner.failed if replayed else f"the executor is a {type(runner).__name__}"
                raise Fail(f"{kernel}: graphs on but none replayed ({failed})")
            results[graphs] = (outputs, seconds, step_ms)
        (eager, (t_off, s_off), ms_off), (graphed, (t_on, s_on), ms_on) = results[False], results[True]
        same = sum(a == b for a, b in zip(eager, graphed, strict=True))
        rate_off, rate_on = work.new_tokens / s_off, work.new_tokens / s_on
        parts.append(
            f"{kernel}: off {rate_off:.0f} tok/s ({ms_off:.2f} ms/step), on {rate_on:.0f} tok/s ({ms_on:.2f} ms/step) "
            f"= {rate_on / rate_off:.2f}x; first run with captures {t_on:.2f}s vs {t_off:.2f}s; "
            f"{same}/{work.num_requests} same tokens"
        )
    return "; ".join(parts)


USES = (
    "hf_paged_attn_tools.bench.workloads:Workload.model",
    "hf_paged_attn_tools.bench.workloads:Workload.prompts",
    "hf_paged_attn_tools.bench.workloads:Workload.max_new_tokens",
    "hf_paged_attn_tools.bench.workloads:Workload.num_blocks",
    "hf_paged_attn_tools.bench.workloads:Workload.new_tokens",
    "hf_paged_attn_tools.bench.workloads:Workload.num_requests",
    "hf_paged_attn_tools.bench.workloads:ModelSpec.save(directory)",
    "hf_paged_attn:ContinuousBatchingEngine(model, config, generation_config, launcher)",
    "hf_paged_attn:ContinuousBatchingEngine.executor",
    "hf_paged_attn:PagedConfig(kernel, block_size, num_blocks, max_num_seqs, max_batch_tokens, progress_bar, seed, "
    "cuda_graphs)",
    "hf_paged_attn.runtime.stats:EngineStats.num_steps",
    "hf_paged_attn.runtime.stats:EngineStats.busy_seconds",
    "hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.num_captures",
    "hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.num_replays",
    "hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.failed",
)
CHECKS = [Check("graphs/bf16", run, 180, cpu=True, uses=USES)]
