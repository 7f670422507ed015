"""e2e/fp32-parity: Qwen2.5-0.5B's architecture with 2 layers, paged (triton in fp32; flash in bf16,
it has no fp32, when importable) against sdpa, greedy, through prefix hits, chunked prefill and mixed
steps. Every prefill step writes its K/V with the backend's ``write_kv`` and attends through its
``paged_prefill_attention``, straight from the pages (the gather path is gone: the check counts both
calls instead of counting gathers). ``--device cpu``: the same architecture at toy width, shorter
prompts, 8 new tokens, Triton through its interpreter.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..base import Check, Context, Fail, Skip

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
from ..helpers import NEW_TOKENS, TIE_TOLERANCE, load_model, qwen2_config, save_random, seconds_since


def counting(counts: Counter, name: str, fn: Callable) -> Callable:
    def wrapper(*args: object, **kwargs: object) -> object:
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def parity_of_kernel(ctx: Context, config: PreTrainedConfig, prompts: list[list[int]], new: int, kernel: str) -> str:
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn_tools.testing import compare_greedy

    dtype = torch.bfloat16 if kernel == "flash" else torch.float32
    directory = save_random(config, ctx.device, dtype, ctx.subdir("qwen2_parity_"))
    ref, paged = (load_model(directory, attn, ctx.device, dtype) for attn in ("sdpa", "paged"))
    expected = []
    for p in prompts:
        ids = torch.tensor([p], device=ctx.device)
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        expected.append(out[0, len(p) :].tolist())
    block = 256 if kernel == "flash" else 16
    # 64 tokens a step: prompts of 45-340 tokens prefill in chunks beside other requests' decodes
    engine = ContinuousBatchingEngine(
        paged, PagedConfig(kernel=kernel, block_size=block, max_batch_tokens=64, num_blocks=256)
    )
    # The executor runs the engine's backend instance: count its calls there.
    backend, counts = engine.backend, Counter()
    for name in ("write_kv", "paged_prefill_attention", "paged_decode_attention"):
        setattr(backend, name, counting(counts, name, getattr(backend, name)))
    first = engine.generate(prompts[:1], max_new_tokens=new)  # its full blocks are cached now
    outs = first + engine.generate(prompts[1:], max_new_tokens=new)
    got = [o.output_ids for o in outs]
    problems = compare_greedy(ref, prompts, expected, got, TIE_TOLERANCE[dtype])
    if problems:
        raise Fail(f"{kernel}: " + "; ".join(problems))
    cached = sum(o.num_cached_tokens for o in outs)
    prefills, writes = counts["paged_prefill_attention"], counts["write_kv"]
    if not prefills or writes != prefills or not (cached or block > 40):
        raise Fail(f"{kernel}: {dict(counts)} calls, {cached} cached tokens")
    exact = sum(a == b for a, b in zip(expected, got, strict=True))
    return (
        f"{kernel} ({str(dtype)[6:]}): {exact}/{len(prompts)} equal (rest up to a near-tie), "
        f"{prefills} paged prefill calls after as many write_kv, {counts['paged_decode_attention']} decode calls "
        f"from Python (graph replays not counted), {cached} cached tokens"
    )


def run(ctx: Context) -> str:
    kernels = ctx.available("triton", "flash")
    if not kernels:
        raise Skip(f"no kernel that prefills from the pages: triton {ctx.backend_or_reason('triton')}")
    start = time.perf_counter()
    config = qwen2_config(ctx.tiny, num_layers=2)
    gen = torch.Generator().manual_seed(4)
    head = torch.randint(2, config.vocab_size, (40,), generator=gen).tolist()  # shared: prefix hits
    tails = (5, 30, 80) if ctx.tiny else (5, 30, 80, 150, 300)
    prompts = [head + torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in tails]
    new = 8 if ctx.tiny else NEW_TOKENS
    parts = [parity_of_kernel(ctx, config, prompts, new, kernel) for kernel in kernels]
    lens = f"{len(head) + min(tails)}-{len(head) + max(tails)}"
    detail = f"{len(prompts)} prompts of {lens} tokens (shared first 40) x {new}: " + "; ".join(parts)
    return f"{detail}, {seconds_since(start)}"


USES = (
    "hf_paged_attn:ContinuousBatchingEngine.backend",
    "hf_paged_attn:ContinuousBatchingEngine.generate(prompts, max_new_tokens)",
    "hf_paged_attn:PagedConfig(kernel, block_size, max_batch_tokens, num_blocks)",
    "hf_paged_attn:RequestOutput.num_cached_tokens",
    "hf_paged_attn.kernels.base:AttentionBackend.write_kv",
    "hf_paged_attn.kernels.base:AttentionBackend.paged_prefill_attention",
    "hf_paged_attn.kernels.base:AttentionBackend.paged_decode_attention",
    "hf_paged_attn_tools.testing:compare_greedy(reference_model, prompts, expected, actual, tie_tolerance)",
)
CHECKS = [Check("e2e/fp32-parity", run, 150, cpu=True, uses=USES)]
