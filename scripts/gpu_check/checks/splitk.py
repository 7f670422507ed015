"""splitk/bf16: kernel-only TB/s (CUDA graph replay) of the Triton decode (``kernels/triton_ops.py``)
by split-K count, ``auto`` being ``_choose_num_splits`` (its count in brackets), with the per-call
time of ``auto``; the same at block_size 16 (the engine's default for Triton: tiles span pages);
then, for one 32K-token request, by launch knobs (``_DECODE_BLOCK_N`` keys per iteration, warps,
pipeline stages). Figures only, to tune those constants. The forced counts go through
``triton_ops.paged_decode_attention(num_splits=)``: the backend's protocol entry point has no such
argument. ``--device cpu``: tiny shapes, the interpreter, the host timer.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..base import Check, Context, Fail
from ..helpers import decode_problem, short_error, time_cuda, time_kernel

CASES = (  # block size, batch, context, forced split counts
    (256, 1, 32768, (8, 16, 33, 66, 128)),
    (256, 8, 8192, (1, 4, 8, 17, 33)),
    (256, 64, 4096, (1, 2, 4)),
    (16, 1, 32768, (33, 128)),
    (16, 64, 4096, (1,)),
)
TINY_CASES = ((16, 1, 512, (2, 4)), (16, 4, 128, (1, 2)))
KNOBS = ((64, None, None), (32, None, None), (128, None, None), (64, 8, None), (128, 8, None), (64, 4, 2), (64, 4, 4),
         (128, 4, 2), (32, 4, 4))  # fmt: skip


def run(ctx: Context) -> str:
    ctx.backend("triton")  # Skip when unavailable
    from hf_paged_attn.kernels import triton_ops

    h_kv, group, d = (2, 2, 32) if ctx.tiny else (8, 4, 128)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count if ctx.on_cuda else 1
    parts: list[str] = []  # filled as it goes: a FAIL still shows what was measured
    try:
        for bs, batch, context, choices in TINY_CASES if ctx.tiny else CASES:
            parts.append(by_splits(ctx, triton_ops, sms, bs, batch, context, choices, (h_kv, group, d)))
        parts.append(by_knobs(ctx, triton_ops, (h_kv, group, d), 512 if ctx.tiny else 32768))
    except Exception as exc:
        raise Fail(short_error(exc) + (f" (after: {'; '.join(parts)})" if parts else "")) from exc
    return "; ".join(parts)


def by_splits(
    ctx: Context, ops: ModuleType, sms: int, bs: int, batch: int, context: int, choices: tuple[int, ...],
    dims: tuple[int, int, int],
) -> str:  # fmt: skip
    """``ops``: ``triton_ops``; ``dims``: K/V heads, query heads per K/V head, head dim."""
    from hf_paged_attn.kernels.base import AttentionOptions

    h_kv, group, d = dims
    q, k_cache, v_cache, seqlens, table, moved = decode_problem(batch, context, bs, h_kv, group, d, ctx.device)
    auto = ops._choose_num_splits(batch, h_kv, table.shape[1] * bs, sms)
    row, per_call = [], 0.0
    for splits in (None, *choices):

        def step(splits: int | None = splits) -> torch.Tensor:
            return ops.paged_decode_attention(
                q, k_cache, v_cache, None, None, seqlens, table, options=AttentionOptions(softmax_scale=d**-0.5),
                num_splits=splits,
            )

        seconds, _ = time_kernel(step, ctx.device)
        row.append(f"{f'auto({auto})' if splits is None else splits}:{moved / seconds / 1e12:.2f}")
        if splits is None:
            per_call = time_cuda(step, ctx.device)
    if ctx.on_cuda:
        del q, k_cache, v_cache, seqlens, table
        torch.cuda.empty_cache()
    block = "" if bs == 256 else f"block={bs} "
    return f"{block}B={batch} ctx={context} TB/s by splits {' '.join(row)} (auto per call {per_call * 1e3:.3f} ms)"


def by_knobs(ctx: Context, ops: ModuleType, dims: tuple[int, int, int], context: int) -> str:
    """One long request, automatic splits, by (keys per iteration, num_warps, num_stages); the
    module constants are set for the sweep and restored after. None: Triton's default."""
    from hf_paged_attn.kernels.base import AttentionOptions

    h_kv, group, d = dims
    knobs = ("_DECODE_BLOCK_N", "_DECODE_NUM_WARPS", "_DECODE_NUM_STAGES")
    saved = {k: getattr(ops, k) for k in knobs}
    bs = 16 if ctx.tiny else 256
    q, k_cache, v_cache, seqlens, table, moved = decode_problem(1, context, bs, h_kv, group, d, ctx.device)

    def step() -> torch.Tensor:
        options = AttentionOptions(softmax_scale=d**-0.5)
        return ops.paged_decode_attention(q, k_cache, v_cache, None, None, seqlens, table, options=options)

    row = []
    try:
        for block_n, warps, stages in KNOBS[:3] if ctx.tiny else KNOBS:
            ops._DECODE_BLOCK_N, ops._DECODE_NUM_WARPS, ops._DECODE_NUM_STAGES = block_n, warps, stages
            try:
                seconds, _ = time_kernel(step, ctx.device)
                row.append(f"{block_n}/{warps or '-'}/{stages or '-'}:{moved / seconds / 1e12:.2f}")
            except Exception as exc:  # e.g. out of shared memory: report it and go on
                row.append(f"{block_n}/{warps or '-'}/{stages or '-'}:{type(exc).__name__}")
    finally:
        for k, value in saved.items():
            setattr(ops, k, value)
    return f"B=1 ctx={context} auto TB/s by keys/warps/stages " + " ".join(row)


USES = (
    "hf_paged_attn.kernels.triton_ops:_choose_num_splits(batch, num_kv_heads, max_len, num_sms)",
    "hf_paged_attn.kernels.triton_ops:paged_decode_attention(options, num_splits)",
    "hf_paged_attn.kernels.base:AttentionOptions(softmax_scale)",
    "hf_paged_attn.kernels.triton_ops:_DECODE_BLOCK_N",
    "hf_paged_attn.kernels.triton_ops:_DECODE_NUM_WARPS",
    "hf_paged_attn.kernels.triton_ops:_DECODE_NUM_STAGES",
)
CHECKS = [Check("splitk/bf16", run, 180, cpu=True, uses=USES)]
