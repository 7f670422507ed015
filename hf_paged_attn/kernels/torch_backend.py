"""Pure-torch backend: what every CPU user runs, so it is vectorised and leans on SDPA.

Design (measured on CPU, see ``benchmarks/kernels_cpu.py``):

* varlen: requests are bucketed by (query length, key-length power of two) and each bucket is one
  padded, batched attention call. A uniform batch (all prefills of one shape) is one call on a view
  of the packed tensors; decode-like rows (q_len 1) of a mixed batch share one call whatever their
  context lengths, while each prefill chunk gets its own call so nothing pads to the longest prompt.
  Padding inside a bucket is at most 2x on the key axis and is masked out.
* decode: the block table gathers every request's pages into [batch, max_len, H_kv, D] in one
  indexing op, a length/window mask hides the tail, and one batched attention call does the rest.
  The query heads that share a kv head are folded into the query axis ([B, H_kv, group, D]), which
  runs 2-3x faster than SDPA's ``enable_gqa`` for a single query token.
* SDPA computes everything it can express; softcap and sinks can't go through it, so they take an
  explicit matmul + fp32 softmax path (chunked over queries to bound the score matrix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MAX_SCORES = 1 << 25  # fp32 elements of one explicit score chunk (128 MiB)


def _visible(
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


def _explicit(
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
            parts.append(_explicit(q[:, :, i : i + step], k, v, part_mask, scale, softcap, sinks))
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


def _attend(
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
        out = _explicit(q, k, v, mask, scale, softcap, sinks)
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
    return _visible(q_pos, k_pos, k_len, causal, tuple(window)).unsqueeze(1), False


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed variable-length attention (flash-attn ``flash_attn_varlen_func`` semantics).

    q [total_q, H, D]; k, v [total_k, H_kv, D]; cu_seqlens_q / cu_seqlens_k int32 [batch + 1];
    sinks [H] -> [total_q, H, D] in q.dtype. ``max_seqlen_*`` are accepted for API parity only.
    """
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for b in range(len(cu_q) - 1):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len > 0 and k_len > 0:  # no keys: the zeros below are the answer
            groups.setdefault((q_len, k_len.bit_length()), []).append(b)
    out = torch.zeros_like(q)  # [total_q, H, D]
    h, d = q.shape[1], q.shape[2]
    for (q_len, _), reqs in groups.items():
        k_lens = [cu_k[b + 1] - cu_k[b] for b in reqs]
        width, n = max(k_lens), len(reqs)
        q_rows = _rows([cu_q[b] for b in reqs], [q_len] * n, q_len, q.device)
        k_rows = _rows([cu_k[b] for b in reqs], k_lens, width, q.device)
        qp = q[q_rows].unflatten(0, (n, q_len)).transpose(1, 2)  # [B, H, Lq, D]
        kp = k[k_rows].unflatten(0, (n, width)).transpose(1, 2)  # [B, H_kv, Lk, D]
        vp = v[k_rows].unflatten(0, (n, width)).transpose(1, 2)  # [B, H_kv, Lk, D]
        mask, is_causal = _group_mask(q_len, k_lens, width, causal, window_size, q.device)
        res = _attend(qp, kp, vp, mask, is_causal, softmax_scale, softcap, sinks)  # [B, H, Lq, D]
        out[q_rows] = res.transpose(1, 2).reshape(n * q_len, h, d).to(q.dtype)  # [B * Lq, H, D]
    return out


def _append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """Write the new token of each request in place at its absolute position ``pos`` [B].

    caches [num_blocks, block_size, H_kv, D]; k, v [B, 1, H_kv, D]. The block must be allocated.
    """
    block_size = k_cache.shape[1]
    blocks = block_table.gather(1, (pos // block_size).view(-1, 1)).view(-1).long()  # [B]
    k_cache[blocks, pos % block_size] = k[:, 0].to(k_cache.dtype)  # [B, H_kv, D] into B slots
    v_cache[blocks, pos % block_size] = v[:, 0].to(v_cache.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-token decode over a paged KV cache (flash-attn ``flash_attn_with_kvcache`` semantics).

    q [B, 1, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D]; k, v [B, 1, H_kv, D] or None;
    cache_seqlens int32 [B] (length before appending); block_table int32 [B, max_blocks], -1 = unallocated.
    Returns [B, 1, H, D] in q.dtype.
    """
    lens = cache_seqlens.long()  # [B]
    if k is not None and v is not None:
        _append(k_cache, v_cache, k, v, lens, block_table)
        lens = lens + 1
    max_len = int(lens.max()) if lens.numel() else 0
    if max_len == 0:
        return torch.zeros_like(q)
    block_size = k_cache.shape[1]
    pages = block_table[:, : -(-max_len // block_size)].long().clamp_min(0)  # [B, n_blocks]; -1 masked below
    # index_select copies whole pages (memcpy); plain advanced indexing is ~5-20x slower on CPU
    shape = (pages.shape[0], -1, *k_cache.shape[2:])  # [B, n_blocks * block_size, H_kv, D]
    keys = k_cache.index_select(0, pages.flatten()).view(shape).transpose(1, 2)  # [B, H_kv, L, D]
    values = v_cache.index_select(0, pages.flatten()).view(shape).transpose(1, 2)  # [B, H_kv, L, D]
    k_len = lens.view(-1, 1, 1)  # [B, 1, 1]
    k_pos = torch.arange(keys.shape[2], device=q.device)  # [L]
    mask = _visible(k_len - 1, k_pos, k_len, causal, tuple(window_size)).unsqueeze(1)  # [B, 1, 1, L]
    out = _attend(
        q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), mask, False, softmax_scale, softcap, sinks
    )  # [B, H, 1, D]
    return out.transpose(1, 2).to(q.dtype)  # [B, 1, H, D]
