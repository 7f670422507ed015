"""The forward-only bound: the workload's tokens pushed through the model in large packed batches.

The model body (embeddings, decoder layers, final norm) is timed on big batches with plain sdpa
causal attention and no cache (``[1, L]`` one long packed row and ``[16, 128]``); the best
throughput of the shapes is kept. The LM head is timed separately, because only sampled positions
need logits. The bound is then

    seconds = (prompt tokens + new tokens - requests) / body tokens/s + new tokens * head seconds/token

(every token but each request's last is fed back into the model; every new token needs one row
of logits). No real system can beat it without skipping work, e.g. by prefix caching, for which
``seconds_unique_prefix`` counts a shared prefix once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from hf_paged_attn_tools.bench.workloads import Workload


def _best_seconds(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Best wall seconds and best process CPU seconds of ``reps`` calls (after one warm-up call)."""
    fn()
    wall, cpu = float("inf"), float("inf")
    for _ in range(reps):
        cpu_start, start = time.process_time(), time.perf_counter()
        fn()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - cpu_start)
    return wall, cpu


@torch.inference_mode()
def measure_forward(model: torch.nn.Module, reps: int = 3) -> dict[str, Any]:
    """Body tokens/s per shape (sdpa causal, no cache) and LM-head seconds per token, in wall time and
    in process CPU time (``*_cpu``: steadier when other processes compete for the cores)."""
    config = model.config
    long_row = min(2048, config.max_position_embeddings)
    shapes = [(1, long_row), (16, min(128, long_row))]
    gen = torch.Generator().manual_seed(0)
    body: dict[str, float] = {}
    body_cpu: dict[str, float] = {}
    for batch, length in shapes:
        ids = torch.randint(1, config.vocab_size, (batch, length), generator=gen)
        wall, cpu = _best_seconds(lambda ids=ids: model.model(input_ids=ids, use_cache=False), reps)
        body[f"[{batch}, {length}]"], body_cpu[f"[{batch}, {length}]"] = batch * length / wall, batch * length / cpu
    hidden = torch.randn(long_row, config.hidden_size, generator=gen, dtype=model.dtype)
    head_wall, head_cpu = _best_seconds(lambda: model.lm_head(hidden).float(), reps)
    return {
        "body_tokens_per_second": body,
        "best_body_tokens_per_second": max(body.values()),
        "head_seconds_per_token": head_wall / long_row,
        "body_tokens_per_cpu_second": body_cpu,
        "best_body_tokens_per_cpu_second": max(body_cpu.values()),
        "head_cpu_seconds_per_token": head_cpu / long_row,
    }


def bound_for(work: Workload, forward: dict[str, Any]) -> dict[str, Any]:
    """Bound seconds and new tokens/s of ``work`` given ``measure_forward``'s figures."""

    def seconds(prompt_tokens: int, clock: str = "") -> float:
        body_tps = forward[f"best_body_tokens_per{clock}_second"]
        head = forward[f"head{clock}_seconds_per_token"]
        return (prompt_tokens + work.new_tokens - work.num_requests) / body_tps + work.new_tokens * head

    result = dict(forward)
    result["seconds"] = seconds(work.prompt_tokens)
    result["cpu_seconds"] = seconds(work.prompt_tokens, "_cpu")
    result["tokens_per_second"] = work.new_tokens / result["seconds"]
    if work.shared_prefix:
        result["seconds_unique_prefix"] = seconds(work.unique_prompt_tokens)
        result["tokens_per_second_unique_prefix"] = work.new_tokens / result["seconds_unique_prefix"]
    return result
