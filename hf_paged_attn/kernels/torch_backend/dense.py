"""Batched dense attention on padded tensors: SDPA where it can express the call, an explicit
matmul + fp32 softmax where it can't (softcap, sinks). The building block of the torch backend's
varlen, decode and prefill paths."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MAX_SCORES = 1 << 25  # fp32 elements of one explicit score chunk (128 MiB)


def key_visibility(
    q_pos: torch.Tensor, k_pos: torch.Tensor, k_len: torch.Tensor, causal: bool, window: tuple[int, int]
) -> torch.Tensor:
    """Key visibility. q_pos [B, Lq, 1] absolute positions, k_pos [Lk], k_len [B, 1, 1] -> [B, Lq, Lk]."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    visible = k_pos < k_len  # [B, 1, Lk]: padding keys are never visible
    if left >= 0:
        visible = visible & (k_pos >= q_pos - left)
    if right >= 0:
        visible = visible & (k_pos <= q_pos + right)
    return visible.expand(-1, q_pos.shape[1], -1)  # [B, Lq, Lk]


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Matmul + fp32 softmax (softcap, sinks). q [B, H, Lq, D]; k, v [B, H_kv, Lk, D]; mask [B, 1, Lq, Lk]."""
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    k, v = k.float().contiguous(), v.float().contiguous()  # matmul on strided views is ~4x slower
    step = max(1, _MAX_SCORES // max(1, b * h * lk))
    if lq > step:  # bound the [B, H, step, Lk] score matrix of long prompts
        parts = []
        for i in range(0, lq, step):
            part_mask = None if mask is None else mask[:, :, i : i + step]
            parts.append(explicit_attention(q[:, :, i : i + step], k, v, part_mask, scale, softcap, sinks))
        return torch.cat(parts, dim=2)
    qf = q.float().reshape(b, hk, h // hk * lq, d)  # [B, H_kv, group * Lq, D]: heads sharing a kv head
    scores = (qf @ k.transpose(-1, -2)).view(b, h, lq, lk).mul_(scale)  # [B, H, Lq, Lk]
    if softcap > 0:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, h, 1, 1).expand(b, h, lq, 1)  # [B, H, Lq, 1]
        scores = torch.cat([scores, sink], dim=-1)  # [B, H, Lq, Lk + 1]: the sink joins the denominator
    probs = scores.softmax(dim=-1)[..., :lk].reshape(b, hk, h // hk * lq, lk)  # [B, H_kv, group * Lq, Lk]
    return (probs @ v).view(b, h, lq, d).to(q.dtype)  # [B, H, Lq, D]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Batched attention. q [B, H, Lq, D]; k, v [B, H_kv, Lk, D]; mask bool [B, 1, Lq, Lk] -> [B, H, Lq, D].

    ``is_causal`` (only with ``mask=None``) means a square top-left causal mask. Rows seeing no key are zeros.
    """
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    if is_causal and (softcap > 0 or sinks is not None):
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril().expand(b, 1, lq, lk)
    if softcap > 0 or sinks is not None:
        out = explicit_attention(q, k, v, mask, scale, softcap, sinks)
    elif lq == 1:  # one query token: fold the group's heads into the query axis, mask broadcasts as is
        folded = q.reshape(b, hk, h // hk, d)  # [B, H_kv, group, D]
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
        out = out.reshape(b, h, 1, d)  # [B, H, 1, D]
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=h != hk
        )
    if mask is not None:  # a query with no visible key outputs zeros (flash-attn), never NaN
        out = torch.where(mask.any(dim=-1, keepdim=True), out, 0.0)
    return out


