"""e2e/bf16: a ~0.5B-parameter random-weight Qwen2 (Qwen2.5-0.5B's sizes), 64 prompts of 64-512
tokens x 128 greedy tokens: the engine (``kernel="auto"``) against transformers' continuous batching
with CUDA graphs on, new tokens/s of each and the ratio (goal >= 2x); and one engine decode step of
all 64 against transformers' sdpa forward of the same batch (goal <= 1.3x), each framed by
torch.cuda.synchronize. Goals unmet are stated on the PASS line; FAIL means an error.
``--device cpu``: a toy Qwen2, 8 prompts of 8-40 tokens x 8 (figures meaningless).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from ..base import Check, Context, Fail
from ..helpers import load_model, qwen2_config, save_random, short_error, sync

if TYPE_CHECKING:
    from hf_paged_attn import PagedConfig

T = TypeVar("T")

# The workload: 64 prompts of 64-512 tokens, 128 new tokens each, greedy, no EOS; the CPU dry run
# keeps its shape at a size the CPU runs in seconds.
E2E_WORK = dict(num_prompts=64, min_len=64, max_len=512, new_tokens=128, max_batch_tokens=4096, step_tokens=24)
TINY_E2E_WORK = dict(num_prompts=8, min_len=8, max_len=40, new_tokens=8, max_batch_tokens=128, step_tokens=16)


def e2e_prompts(work: dict, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(work["min_len"], work["max_len"] + 1, (work["num_prompts"],), generator=gen).tolist()
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lens]


def engine_config(model: torch.nn.Module, prompts: list[list[int]], work: dict) -> PagedConfig:
    """The engine's config: the best kernel for the model (``kernel="auto"``), a cache sized to the
    workload (so both systems leave the rest of the memory alone), the shared token budget."""
    from hf_paged_attn import PagedConfig
    from hf_paged_attn.core.blocks import blocks_for

    config = PagedConfig(
        max_num_seqs=len(prompts), max_batch_tokens=work["max_batch_tokens"], progress_bar=False, seed=0
    ).for_model(model)
    need = sum(blocks_for(len(p) + work["new_tokens"], config.block_size) for p in prompts)
    return config.replace(num_blocks=need + len(prompts))


def time_engine(
    model: torch.nn.Module, prompts: list[list[int]], work: dict, device: torch.device
) -> tuple[float, list[list[int]], str]:
    """New tokens/s of the engine on the whole workload (after a warm-up on its first 8 prompts)."""
    from hf_paged_attn import ContinuousBatchingEngine
    from hf_paged_attn_tools.bench.systems import greedy_config

    config = engine_config(model, prompts, work)
    engine = ContinuousBatchingEngine(model, config, greedy_config())
    engine.generate(prompts[:8], max_new_tokens=4)  # kernels compiled, pages allocated, graphs captured
    sync(device)
    start = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=work["new_tokens"])
    sync(device)
    wall = time.perf_counter() - start
    if any(o.finish_reason == "error" for o in outs):
        raise RuntimeError(f"engine request failed: {next(o.error for o in outs if o.finish_reason == 'error')}")
    return len(prompts) * work["new_tokens"] / wall, [o.output_ids for o in outs], config.kernel


def engine_decode_step(model: torch.nn.Module, prompts: list[list[int]], work: dict, device: torch.device) -> float:
    """Median seconds of one whole engine step (schedule, build, execute, update) while every request
    decodes, each step framed by torch.cuda.synchronize."""
    from hf_paged_attn import ContinuousBatchingEngine
    from hf_paged_attn_tools.bench.systems import greedy_config

    engine = ContinuousBatchingEngine(model, engine_config(model, prompts, work), greedy_config())
    ids = {engine.add_request(p, max_new_tokens=work["step_tokens"]) for p in prompts}
    decoding: set[str] = set()  # requests past their prefill: a step with all of them is a decode step
    times = []
    while engine.has_unfinished():
        all_decode = decoding == ids
        sync(device)
        start = time.perf_counter()
        outs = engine.step()
        sync(device)
        if all_decode and not any(o.finished for o in outs):
            times.append(time.perf_counter() - start)
        decoding |= {o.request_id for o in outs if o.output_ids}
    if not times:
        raise RuntimeError("no step ran with every request decoding")
    return sorted(times)[len(times) // 2]


def forward_only_decode(
    model: torch.nn.Module, prompts: list[list[int]], device: torch.device, iters: int = 10
) -> float:
    """Median seconds of transformers' own forward (sdpa, DynamicCache) for one new token of every
    request, the prompts left-padded into one batch: the model's cost without any engine."""
    from hf_paged_attn_tools.testing import left_padded

    ids, mask = (t.to(device) for t in left_padded(prompts))
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)  # [B, 1]
        for _ in range(iters + 2):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # [B, K + 1]
            positions = mask.sum(-1, keepdim=True) - 1  # [B, 1]
            sync(device)
            start = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True, logits_to_keep=1)  # fmt: skip
            token = out.logits[:, -1:].argmax(-1)
            sync(device)
            times.append(time.perf_counter() - start)
    times = times[2:]  # warm-up
    return sorted(times)[len(times) // 2]


def time_hf_cb(model: torch.nn.Module, prompts: list[list[int]], work: dict) -> tuple[float, list[list[int]], str]:
    """New tokens/s of transformers' continuous batching with CUDA graphs on (its own attention choice:
    flash-attn when installed, else sdpa), after its graph warm-up and a warm-up batch."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from hf_paged_attn_tools.bench.systems import _collect, greedy_config

    cb_config = ContinuousBatchingConfig(
        use_cuda_graph=True, max_batch_tokens=work["max_batch_tokens"], max_requests_per_batch=len(prompts), seed=0
    )
    gen_config = greedy_config()
    gen_config.eos_token_id = -1  # what init_continuous_batching sets for "no EOS"
    # The hints generate_batch gives it (they size its flash-attn decode fast path's block table)
    hints = WorkloadHints(max(map(len, prompts)), work["new_tokens"], len(prompts))
    manager = model.init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    attn = model.config._attn_implementation
    resolved = manager.continuous_batching_config
    how = f"{attn}, cuda graphs (varlen, decode)={resolved.use_cuda_graph}, async={resolved.use_async_batching}"
    try:
        manager.warmup()  # captures its CUDA graphs
        manager.start()
        _collect(manager, [manager.add_request(p, max_new_tokens=4) for p in prompts[:8]], timeout=120)
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=work["new_tokens"]) for p in prompts]
        results = _collect(manager, ids, timeout=120)
        wall = time.perf_counter() - start  # results come back on the host: nothing left to sync
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    outputs = [list(results[r].generated_tokens) for r in ids]
    return len(prompts) * work["new_tokens"] / wall, outputs, how


def run(ctx: Context) -> str:
    work = TINY_E2E_WORK if ctx.tiny else E2E_WORK
    config = qwen2_config(ctx.tiny)
    start = time.perf_counter()
    directory = save_random(config, ctx.device, torch.bfloat16, ctx.subdir("qwen2_"))
    paged, ref = (load_model(directory, attn, ctx.device, torch.bfloat16) for attn in ("paged", "sdpa"))
    params = sum(p.numel() for p in paged.parameters()) / 1e6
    prompts = e2e_prompts(work, config.vocab_size)
    parts = [
        f"{params:.1f}M params built in {time.perf_counter() - start:.0f}s, {len(prompts)} prompts of "
        f"{work['min_len']}-{work['max_len']} tokens x {work['new_tokens']} new, "
        f"max_batch_tokens {work['max_batch_tokens']}"
    ]

    def phase(name: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # keep the figures measured so far
            raise Fail(f"{name}: {short_error(exc)} (after: {'; '.join(parts)})") from exc

    engine_tps, engine_out, kernel = phase("engine", lambda: time_engine(paged, prompts, work, ctx.device))
    parts.append(f"engine[{kernel}] {engine_tps:.0f} tok/s")
    step = phase("engine decode step", lambda: engine_decode_step(paged, prompts, work, ctx.device))
    forward = phase("forward-only", lambda: forward_only_decode(ref, prompts, ctx.device))  # before hf_cb switches it
    step_ratio = step / forward
    parts.append(
        f"decode step of {len(prompts)}: engine {step * 1e3:.2f} ms vs sdpa forward-only {forward * 1e3:.2f} ms = "
        f"{step_ratio:.2f}x (goal <= 1.3x: {'met' if step_ratio <= 1.3 else 'NOT met'})"
    )
    cb_tps, cb_out, cb_how = phase("hf_cb", lambda: time_hf_cb(ref, prompts, work))
    ratio = engine_tps / cb_tps
    same = sum(a == b for a, b in zip(engine_out, cb_out, strict=True))
    parts.append(
        f"hf_cb[{cb_how}] {cb_tps:.0f} tok/s: engine = {ratio:.2f}x "
        f"(goal >= 2x: {'met' if ratio >= 2 else 'NOT met'}); "
        f"{same}/{len(prompts)} requests' tokens equal hf_cb's (bf16: not judged)"
    )
    if ctx.on_cuda:
        torch.cuda.empty_cache()
    return "; ".join(parts) + f", {time.perf_counter() - start:.1f}s"


USES = (
    "hf_paged_attn:PagedConfig(max_num_seqs, max_batch_tokens, progress_bar, seed)",
    "hf_paged_attn:PagedConfig.for_model(model)",
    "hf_paged_attn:PagedConfig.replace",
    "hf_paged_attn:PagedConfig.num_blocks",
    "hf_paged_attn:ContinuousBatchingEngine(model, config, generation_config)",
    "hf_paged_attn:ContinuousBatchingEngine.has_unfinished",
    "hf_paged_attn:ContinuousBatchingEngine.step",
    "hf_paged_attn:ContinuousBatchingEngine.add_request(input_ids, params)",
    "hf_paged_attn:SamplingParams(max_new_tokens)",
    "hf_paged_attn:RequestOutput.error",
    "hf_paged_attn:RequestOutput.request_id",
    "hf_paged_attn:RequestOutput.finished",
    "hf_paged_attn_tools.bench.systems:_collect(manager, ids, timeout)",
    "transformers.generation.configuration_utils:ContinuousBatchingConfig(use_cuda_graph, max_batch_tokens, "
    "max_requests_per_batch, seed)",
    "transformers:Qwen2ForCausalLM.init_continuous_batching(generation_config, continuous_batching_config, "
    "workload_hints)",
    "transformers.generation.continuous_batching:ContinuousBatchingManager.warmup",
    "transformers:Qwen2ForCausalLM.forward(input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep)",
)
CHECKS = [Check("e2e/bf16", run, 300, cpu=True, uses=USES)]
