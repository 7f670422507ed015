"""The torch backend's varlen path, reading the pages (the cache writes a step's new K/V with
``write_kv``). On CPU the native kernel (``cpu_native.paged_prefill``) attends every request in
place, tiled flash-attention style, except for the calls that SDPA runs faster from gathered pages
(``cpu_native.sdpa_prefill_wins``: long chunks and prompts with AVX2 or portable kernels). Where it
can't run (no C compiler, float16, CUDA), requests that feed one token
in a mixed step are attended by the native decode kernel if it can, and the prefilling requests'
visible keys are gathered from the pages and attended by ``varlen_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import cpu_native
from ..base import AttentionOptions
from ..kv_dtype import dequantize_int8, write_pages
from .varlen import varlen_attention


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """k, v [N, H_kv, D] written at the flat slots [N] of the pages [num_blocks, block_size, H_kv, D],
    rounded to the pages' dtype (fp8 pages: ``kv_dtype.to_pages``; int8 pages: their scales
    [num_blocks, block_size, H_kv] written beside them)."""
    write_pages(k_cache, k_scales, k, slot_mapping)
    write_pages(v_cache, v_scales, v, slot_mapping)


@dataclass(slots=True)
class _PagedVarlenPlan:
    """Layer-independent part of ``paged_prefill_attention`` for one forward (its ``memo``)."""

    one_rows: torch.Tensor | None  # [n] query rows of the requests attended in place (one query each)
    one_lens: torch.Tensor | None  # [n] int32 keys each attends
    one_table: torch.Tensor | None  # [n, W] int32 their block tables
    one_max: int
    rows: torch.Tensor | None  # [Nq] query rows of the gathered requests, packed
    slots: torch.Tensor | None  # [K] flat slots of their visible keys, packed
    cu_q: torch.Tensor | None  # [R + 1] int32
    cu_k: torch.Tensor | None  # [R + 1] int32
    memo: dict  # varlen_attention's own plan for the gathered requests


def _paged_varlen_plan(
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    window_left: int,
    in_place: bool,
) -> _PagedVarlenPlan:
    """Which requests are attended in place (``in_place``: one query each) and which gathered: for
    those, the slots of the keys their queries can see (from the first query's window on: the
    blocks before it may already be freed)."""
    cu_q, used = cu_seqlens_q.tolist(), seqused_k.tolist()
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    ones = [b for b, n in enumerate(q_lens) if n == 1 and used[b] > 0] if in_place else []
    gathered = [b for b, n in enumerate(q_lens) if n > (1 if in_place else 0) and used[b] > 0]
    device = block_table.device
    plan = _PagedVarlenPlan(None, None, None, 0, None, None, None, None, {})
    if ones:
        index = torch.tensor(ones, device=device)
        plan.one_rows = torch.tensor([cu_q[b] for b in ones], device=device)
        plan.one_lens = seqused_k[index].to(torch.int32).contiguous()
        plan.one_table = block_table[index].to(torch.int32).contiguous()
        plan.one_max = max(used[b] for b in ones)
    if gathered:
        starts = [max(used[b] - q_lens[b] - window_left, 0) if window_left >= 0 else 0 for b in gathered]
        k_lens = [used[b] - s for b, s in zip(gathered, starts)]
        rows_k = torch.repeat_interleave(torch.tensor(gathered), torch.tensor(k_lens)).to(device)  # [K] request
        positions = torch.cat([torch.arange(s, used[b]) for b, s in zip(gathered, starts)]).to(device)  # [K]
        pages = block_table[rows_k, positions // block_size].long().clamp_min(0)  # [K]
        plan.slots = pages * block_size + positions % block_size
        plan.rows = torch.cat([torch.arange(cu_q[b], cu_q[b + 1]) for b in gathered]).to(device)
        plan.cu_q = torch.tensor([0, *torch.tensor([q_lens[b] for b in gathered]).cumsum(0).tolist()],
                                 dtype=torch.int32, device=device)  # fmt: skip
        plan.cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return plan


def _sdpa_wins(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, window_left: int, memo: dict | None) -> bool:
    """``cpu_native.sdpa_prefill_wins`` for this call's requests (their visible keys: the window's, if
    any), once per forward and window."""
    key = ("sdpa_prefill_wins", window_left)
    found = memo.get(key) if memo is not None else None
    if found is None:
        cu_q, used = cu_seqlens_q.tolist(), seqused_k.tolist()
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
        k_lens = [min(k, q + window_left) if window_left >= 0 else k for q, k in zip(q_lens, used)]
        found = cpu_native.sdpa_prefill_wins(q_lens, k_lens)
        if memo is not None:
            memo[key] = found
    return found


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    options: AttentionOptions,
    memo: dict | None = None,
) -> torch.Tensor:
    """Packed queries against each request's first ``seqused_k[b]`` keys, read from the pages (the
    step's own K/V already written there). Semantics of ``varlen_attention`` (bottom-right causal);
    q [total_q, H, D], pages [num_blocks, block_size, H_kv, D], block_table int32 [B, W].
    ``max_seqlen_k`` is accepted for the protocol only. ``memo``: the forward's dict, as in
    ``paged_decode_attention``. int8 pages (``options.k_scales``, ``v_scales``): the native kernels do not read
    them, so they are gathered and dequantized. Returns [total_q, H, D] in q.dtype."""
    softmax_scale, causal, window_size = options.softmax_scale, options.causal, options.window_size
    softcap, sinks, k_scales, v_scales = options.softcap, options.sinks, options.k_scales, options.v_scales
    int8 = k_scales is not None
    # The native kernel ignores the right side of a window, which only a non-causal call sees.
    native = not int8 and q.device.type == "cpu" and (causal or window_size[1] < 0)
    if native and not _sdpa_wins(cu_seqlens_q, seqused_k, window_size[0], memo):
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0
        out = cpu_native.paged_prefill(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, softmax_scale,
                                       window_size[0], softcap, sinks, max_seqlen_q, causal=causal)  # fmt: skip
        if out is not None:
            return out
    block_size = k_cache.shape[1]
    window = tuple(window_size)
    native_dtype = q.dtype in (torch.float32, torch.bfloat16)
    in_place = not int8 and q.device.type == "cpu" and native_dtype and cpu_native.library() is not None
    key = ("paged_varlen", block_size, causal, window, in_place)
    plan = memo.get(key) if memo is not None else None
    if plan is None:
        plan = _paged_varlen_plan(cu_seqlens_q, seqused_k, block_table, block_size, window[0], in_place)
        if memo is not None:
            memo[key] = plan
    out = torch.zeros_like(q)  # [total_q, H, D]; requests without keys or queries stay zeros
    if plan.one_rows is not None:
        one = cpu_native.paged_decode(
            q[plan.one_rows].unsqueeze(1), k_cache, v_cache, None, None, plan.one_lens, plan.one_table,
            softmax_scale, window[0], softcap, sinks, plan.one_max,
        )  # fmt: skip
        if one is None:  # a layout the native kernel does not read: this step gathers everything
            plan = _paged_varlen_plan(cu_seqlens_q, seqused_k, block_table, block_size, window[0], False)
            if memo is not None:
                memo[key] = plan
        else:
            out[plan.one_rows] = one[:, 0]
    if plan.rows is not None:
        hk, d = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache.view(-1, hk, d).index_select(0, plan.slots)  # [K, H_kv, D]
        values = v_cache.view(-1, hk, d).index_select(0, plan.slots)
        if int8:
            keys = dequantize_int8(keys, k_scales.view(-1, hk).index_select(0, plan.slots), q.dtype)
            values = dequantize_int8(values, v_scales.view(-1, hk).index_select(0, plan.slots), q.dtype)
        else:  # fp8 pages widened
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        out[plan.rows] = varlen_attention(
            q[plan.rows], keys, values, plan.cu_q, plan.cu_k, 0, 0, options=options, memo=plan.memo
        )
    return out
