"""Naive per-request attention: the oracle every backend is tested against.

Slow on purpose: one request at a time, explicit masks, float64 maths. Never used on the hot path.
"""

from __future__ import annotations

import torch

from .base import AttentionOptions


def attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    options: AttentionOptions,
) -> torch.Tensor:
    """Attention of one request. q: [q_len, H, D]; k, v: [k_len, H_kv, D] -> [q_len, H, D].

    Queries sit at the end of the keys (bottom-right alignment): query i has absolute position
    ``k_len - q_len + i``. A query that sees no key (and has no sink) outputs zeros, as flash-attn does.
    k and v are plain tensors: ``options.k_scales`` / ``v_scales`` are not read.
    """
    softmax_scale, softcap, sinks, causal = options.softmax_scale, options.softcap, options.sinks, options.causal
    q_len, num_heads, head_dim = q.shape
    k_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    if k_len == 0:  # nothing to attend to (a sink alone contributes no value): zeros, as flash-attn
        return torch.zeros_like(q)
    qd, kd, vd = q.double(), k.double(), v.double()
    kd = kd.repeat_interleave(group, dim=1)  # [k_len, H, D]
    vd = vd.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * softmax_scale  # [H, q_len, k_len]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(k_len - q_len, k_len, device=q.device).unsqueeze(1)  # [q_len, 1]
    k_pos = torch.arange(k_len, device=q.device).unsqueeze(0)  # [1, k_len]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
    left, right = options.window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        visible &= k_pos >= q_pos - left
    if right >= 0:
        visible &= k_pos <= q_pos + right
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
        scores = torch.cat([scores, sink_col], dim=-1)  # [H, q_len, k_len + 1]
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    weights = torch.where(denom > 0, weights / denom.clamp_min(1e-300), torch.zeros_like(weights))
    if sinks is not None:
        weights = weights[..., :k_len]
    out = torch.einsum("hqk,khd->qhd", weights, vd)
    return out.to(q.dtype)


def varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    options: AttentionOptions,
) -> torch.Tensor:
    """Packed varlen attention, one request at a time. Shapes as the backends' ``varlen_attention``."""
    out = torch.zeros_like(q)
    for b in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 > q0:
            out[q0:q1] = attend_one(q[q0:q1], k[k0:k1], v[k0:k1], options=options)
    return out


def gather_pages(
    cache: torch.Tensor, block_table_row: torch.Tensor, length: int
) -> torch.Tensor:
    """The first ``length`` tokens of one request from its pages. cache: [num_blocks, block_size, H_kv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table_row.to(cache.device).long()[pos // block_size]
    return cache[blocks, pos % block_size]  # [length, H_kv, D]
