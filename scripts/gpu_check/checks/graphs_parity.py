"""graphs/fp32: greedy parity with sdpa while decode steps replay CUDA graphs
(``runtime/cuda_graphs.py``: the engine's ``executor`` is a ``CudaGraphExecutor``), Triton backend.

12 prompts with different ``max_new_tokens``, 5 queued first and 7 more after 4 steps,
``max_num_seqs=8``, so decode steps run in buckets 8, 4, 2 and 1 while requests finish and start.
Fails unless graphs were captured once per bucket and replayed (the executor's counters).
``--device cpu``: the capture is ``helpers.stand_in_capture`` (replay re-runs the captured forward,
which reads only the static buffers), Triton through its interpreter, and the same scheme at half
the size: 6 prompts of up to 40 tokens, 3 queued after 2 steps, ``max_num_seqs=4`` (buckets 4, 2, 1).
"""

from __future__ import annotations

import time

import torch

from ..base import Check, Context, Fail
from ..helpers import TIE_TOLERANCE, compare_up_to_tie, graph_launcher, load_model, sdpa_greedy, seconds_since

# (prompt lengths, new tokens, requests queued first, steps before the rest, max_num_seqs); the
# requests finish one after another, so the running batch shrinks through every bucket.
SCHEME = ([1, 5, 17, 33, 40, 64, 120, 250, 9, 3, 70, 12], [8 + (7 * i) % 25 for i in range(12)], 5, 4, 8)
TINY_SCHEME = ([1, 17, 40, 9, 25, 3], [4, 8, 12, 6, 10, 14], 3, 2, 4)


def graphs_parity(ctx: Context) -> str:
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn.runtime.cuda_graphs import CudaGraphExecutor

    directory = ctx.tiny_llama()
    ref = load_model(directory, "sdpa", ctx.device)
    paged = load_model(directory, "paged", ctx.device)
    gen = torch.Generator().manual_seed(4)
    lens, new, first, steps, max_num_seqs = TINY_SCHEME if ctx.tiny else SCHEME
    prompts = [torch.randint(2, ref.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    # On the CPU the stand-in launcher builds the graph executor (cuda_graphs=True is refused there).
    config = PagedConfig(kernel="triton", cuda_graphs=True if ctx.on_cuda else None, max_num_seqs=max_num_seqs,
                         max_batch_tokens=128, num_blocks=256)  # fmt: skip
    engine = ContinuousBatchingEngine(paged, config, launcher=graph_launcher(ctx.device))
    runner = engine.executor
    if not isinstance(runner, CudaGraphExecutor):
        raise Fail(f"cuda_graphs=True on one CUDA device built a {type(runner).__name__}, not a CudaGraphExecutor")
    ids = [engine.add_request(p, max_new_tokens=n) for p, n in zip(prompts[:first], new[:first], strict=True)]
    finals = {}
    for _ in range(steps):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    ids += [engine.add_request(p, max_new_tokens=n) for p, n in zip(prompts[first:], new[first:], strict=True)]
    finals.update({o.request_id: o for o in engine.stream() if o.finished})
    if runner.failed:
        raise Fail(f"a capture failed, the engine ran eagerly: {runner.failed}")
    tol = TIE_TOLERANCE[torch.float32]
    compared = 0
    for i, (p, n, rid) in enumerate(zip(prompts, new, ids, strict=True)):
        want, gaps = sdpa_greedy(ref, p, n)
        if finals[rid].finish_reason != "length":
            raise Fail(f"prompt {i} finished with {finals[rid].finish_reason!r}: {finals[rid].error}")
        compared += compare_up_to_tie(f"prompt {i}", finals[rid].output_ids, want, gaps, tol)
    buckets = sorted(runner.captured)
    if runner.num_captures != len(runner.captured) or runner.num_replays <= runner.num_captures:
        raise Fail(f"{runner.num_captures} captures of buckets {buckets}, {runner.num_replays} replays")
    want = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    if not want <= set(buckets):
        raise Fail(f"decode steps replayed only buckets {buckets}, expected {sorted(want)}")
    return (
        f"{len(prompts)} prompts equal sdpa, {compared}/{sum(new)} steps compared (tie tol {tol}); buckets "
        f"{buckets} captured once, {runner.num_replays} replays of {engine.stats.num_steps} steps; table width "
        f"{runner.width} blocks"
    )


def run(ctx: Context) -> str:
    ctx.backend("triton")
    start = time.perf_counter()
    return f"{graphs_parity(ctx)}, {seconds_since(start)}"


USES = (
    "hf_paged_attn:ContinuousBatchingEngine(model, config, launcher)",
    "hf_paged_attn:ContinuousBatchingEngine.executor",
    "hf_paged_attn:ContinuousBatchingEngine.add_request(input_ids, params)",
    "hf_paged_attn:SamplingParams(max_new_tokens)",
    "hf_paged_attn:ContinuousBatchingEngine.step",
    "hf_paged_attn:ContinuousBatchingEngine.stream",
    "hf_paged_attn:ContinuousBatchingEngine.stats",
    "hf_paged_attn.runtime.stats:EngineStats.num_steps",
    "hf_paged_attn:PagedConfig(kernel, cuda_graphs, max_num_seqs, max_batch_tokens, num_blocks)",
    "hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.captured",
    "hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.failed",
    "hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.num_captures",
    "hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.num_replays",
    "hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.width",
    "hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.graph_factory",
    "hf_paged_attn.runtime.config:PagedConfig.placed(model)",
    "hf_paged_attn.runtime.launcher:LocalLauncher.cache_size(model, config, layers, num_blocks)",
    "hf_paged_attn.runtime.launcher:LocalLauncher.executor(model, cache, backend, config, layers, size)",
    "hf_paged_attn:RequestOutput.output_ids",
    "hf_paged_attn:RequestOutput.finish_reason",
)
CHECKS = [Check("graphs/fp32", run, 120, cpu=True, uses=USES)]
