"""Packed variable-length attention over K/V given as tensors (flash-attn's
``flash_attn_varlen_func`` semantics). The torch backend's paged prefill gathers each prefilling
request's visible keys from the pages and attends them here.

Requests are bucketed by (query length, key-length power of two) and each bucket is one padded,
batched attention call. A uniform batch (all prefills of one shape) is one call on a view of the
packed tensors; prefill chunks of one length share a call, so nothing pads to the longest. Padding
inside a bucket is at most 2x on the key axis and is masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import AttentionOptions
from .dense import attend, key_visibility


def _rows(starts: list[int], lens: list[int], width: int, device: torch.device) -> slice | torch.Tensor:
    """Packed-token rows of requests padded to ``width``: a slice when they are contiguous and full,
    else a [B * width] index where padding repeats the request's last token (masked later)."""
    n = len(starts)
    if all(x == width for x in lens) and starts == list(range(starts[0], starts[0] + n * width, width)):
        return slice(starts[0], starts[0] + n * width)
    start = torch.tensor(starts, device=device).view(n, 1)  # [B, 1]
    last = torch.tensor(lens, device=device).view(n, 1) - 1  # [B, 1]
    pos = torch.arange(width, device=device).view(1, width)  # [1, width]
    return (start + torch.minimum(pos, last)).flatten()  # [B * width]


def _group_mask(
    q_len: int, k_lens: list[int], width: int, causal: bool, window: tuple[int, int], device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(mask [B, 1, Lq, Lk] or None, is_causal) for requests sharing ``q_len``, keys padded to ``width``."""
    if all(x == width for x in k_lens) and tuple(window) == (-1, -1) and (not causal or q_len == width):
        return None, causal
    k_len = torch.tensor(k_lens, device=device).view(-1, 1, 1)  # [B, 1, 1]
    q_pos = k_len - q_len + torch.arange(q_len, device=device).view(1, -1, 1)  # [B, Lq, 1], bottom-right
    k_pos = torch.arange(width, device=device)  # [Lk]
    return key_visibility(q_pos, k_pos, k_len, causal, tuple(window)).unsqueeze(1), False


@dataclass(slots=True)
class _Bucket:
    """Requests attended in one padded call: their rows in the packed tensors and their mask."""

    q_len: int
    n: int  # requests
    width: int  # keys per request after padding
    q_rows: slice | torch.Tensor  # [n * q_len] packed query rows
    k_rows: slice | torch.Tensor  # [n * width] packed key rows (padding repeats a request's last key)
    mask: torch.Tensor | None  # bool [n, 1, q_len, width]
    is_causal: bool


def _varlen_plan(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool, window: tuple[int, int]
) -> tuple[list[_Bucket], bool]:
    """The buckets of a packed batch, and whether they cover every query row (else the rest are zeros)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    device = cu_seqlens_q.device
    groups: dict[tuple[int, int], list[int]] = {}
    for b in range(len(cu_q) - 1):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len > 0 and k_len > 0:  # no keys: the zeros below are the answer
            groups.setdefault((q_len, k_len.bit_length()), []).append(b)
    buckets = []
    for (q_len, _), reqs in groups.items():
        k_lens = [cu_k[b + 1] - cu_k[b] for b in reqs]
        width, n = max(k_lens), len(reqs)
        q_rows = _rows([cu_q[b] for b in reqs], [q_len] * n, q_len, device)
        k_rows = _rows([cu_k[b] for b in reqs], k_lens, width, device)
        mask, is_causal = _group_mask(q_len, k_lens, width, causal, window, device)
        buckets.append(_Bucket(q_len, n, width, q_rows, k_rows, mask, is_causal))
    covered = sum(b.n * b.q_len for b in buckets) == cu_q[-1]
    return buckets, covered


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    options: AttentionOptions,
    memo: dict | None = None,
) -> torch.Tensor:
    """Packed variable-length attention (flash-attn ``flash_attn_varlen_func`` semantics).

    q [total_q, H, D]; k, v [total_k, H_kv, D]; cu_seqlens_q / cu_seqlens_k int32 [batch + 1];
    sinks [H] -> [total_q, H, D] in q.dtype. ``max_seqlen_*`` are accepted for API parity only.
    ``memo``: a dict that lives for one forward, as in ``paged_decode_attention`` (the bucketing, row
    indices and masks are made by the first layer); every call of a step passes the same cu_seqlens.
    ``options.k_scales`` / ``v_scales`` are not read: k and v are plain tensors.
    """
    causal, window_size, softmax_scale = options.causal, options.window_size, options.softmax_scale
    softcap, sinks = options.softcap, options.sinks
    key = ("varlen", causal, tuple(window_size))
    plan = memo.get(key) if memo is not None else None
    if plan is None:
        plan = _varlen_plan(cu_seqlens_q, cu_seqlens_k, causal, tuple(window_size))
        if memo is not None:
            memo[key] = plan
    buckets, covered = plan
    out = torch.empty_like(q) if covered else torch.zeros_like(q)  # [total_q, H, D]
    h, d = q.shape[1], q.shape[2]
    for bucket in buckets:
        n, q_len, width = bucket.n, bucket.q_len, bucket.width
        qp = q[bucket.q_rows].unflatten(0, (n, q_len)).transpose(1, 2)  # [B, H, Lq, D]
        kp = k[bucket.k_rows].unflatten(0, (n, width)).transpose(1, 2)  # [B, H_kv, Lk, D]
        vp = v[bucket.k_rows].unflatten(0, (n, width)).transpose(1, 2)  # [B, H_kv, Lk, D]
        res = attend(qp, kp, vp, bucket.mask, bucket.is_causal, softmax_scale, softcap, sinks)  # [B, H, Lq, D]
        out[bucket.q_rows] = res.transpose(1, 2).reshape(n * q_len, h, d).to(q.dtype)  # [B * Lq, H, D]
    return out


