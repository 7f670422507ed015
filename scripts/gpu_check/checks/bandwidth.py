"""bandwidth/<backend>: the paged decode entry point's K/V bytes read per second, as a share of the
device's peak memory bandwidth: kernel-only (calls replayed from a CUDA graph, for a graph-safe
backend), then one call with its host launches (what runs before 2026-12 printed alone). A large
batch (bandwidth bound across requests) and one long request (split-K's case). Figures only.
``--device cpu``: tiny shapes and the host timer, to run the code, not to measure it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ..base import BACKEND_NAMES, Check, Context, Fail
from ..helpers import decode_problem, device_name, peak_bandwidth, short_error, time_cuda, time_kernel

if TYPE_CHECKING:
    from hf_paged_attn.kernels.base import AttentionBackend


def run(ctx: Context, name: str) -> str:
    from hf_paged_attn.kernels import BACKENDS

    backend = ctx.backend(name)
    where = device_name(ctx.device)
    peak = peak_bandwidth(where) if ctx.on_cuda else None
    h_kv, group, d, bs = (2, 2, 32, 16) if ctx.tiny else (8, 4, 128, 256)
    shapes = ((4, 64), (1, 256)) if ctx.tiny else ((64, 4096), (1, 32768))
    parts: list[str] = []  # filled as it goes: a FAIL still shows what was measured
    try:
        how = measure(ctx, backend, BACKENDS[name].graph_safe, shapes, (h_kv, group, d, bs), peak, parts)
    except Exception as exc:  # keep the figures measured so far
        raise Fail(short_error(exc) + (f" (after: {'; '.join(parts)})" if parts else "")) from exc
    where = where if peak else f"{where}, peak unknown: absolute only"
    head = f"bf16 H_kv={h_kv} group={group} D={d} block={bs} on {where}, kernel time from {how}"
    return head + "; " + "; ".join(parts)


def measure(
    ctx: Context,
    backend: AttentionBackend,
    graph_safe: bool,
    shapes: tuple[tuple[int, int], ...],
    dims: tuple[int, int, int, int],
    peak: float | None,
    parts: list[str],
) -> str:
    """Appends a figure per (batch, context) of ``shapes`` to ``parts``; returns how the kernel time
    was taken. ``dims``: K/V heads, query heads per K/V head, head dim, block size."""
    from hf_paged_attn.kernels.base import AttentionOptions

    h_kv, group, d, bs = dims
    how = ""
    for batch, context in shapes:
        q, k_cache, v_cache, seqlens, table, moved = decode_problem(batch, context, bs, h_kv, group, d, ctx.device)

        def step(q: torch.Tensor = q, k_cache: torch.Tensor = k_cache, v_cache: torch.Tensor = v_cache,
                 seqlens: torch.Tensor = seqlens, table: torch.Tensor = table) -> torch.Tensor:  # fmt: skip
            return backend.paged_decode_attention(
                q, k_cache, v_cache, None, None, seqlens, table, options=AttentionOptions(softmax_scale=d**-0.5)
            )

        seconds, how = time_kernel(step, ctx.device, graph=graph_safe)
        per_call = time_cuda(step, ctx.device)
        rate = moved / seconds
        share = f" = {rate / peak:.0%} of {peak / 1e12:.2f} TB/s" if peak else ""
        parts.append(
            f"B={batch} ctx={context}: {seconds * 1e3:.3f} ms, {rate / 1e12:.2f} TB/s{share}; "
            f"per call {per_call * 1e3:.3f} ms, {moved / per_call / 1e12:.2f} TB/s"
        )
        del q, k_cache, v_cache, seqlens, table, step
        if ctx.on_cuda:
            torch.cuda.empty_cache()
    return how


USES = (
    "hf_paged_attn.kernels:BACKENDS",
    "hf_paged_attn.kernels.base:AttentionBackend.graph_safe",
    "hf_paged_attn.kernels.base:AttentionBackend.paged_decode_attention"
    "(q, k_cache, v_cache, k, v, cache_seqlens, block_table, options)",
    "hf_paged_attn.kernels.base:AttentionOptions(softmax_scale)",
)
CHECKS = [
    Check(f"bandwidth/{name}", functools.partial(run, name=name), 60, cpu=True, uses=USES) for name in BACKEND_NAMES
]
