"""The attention function registered as ``"paged"``.

It reads the step's metadata (the ``paged_metadata`` forward kwarg) and picks a path:
decode (every request feeds one token: the paged decode kernel reads K/V through the block table
and appends the new token in place) or varlen (any prefill: the cache has already packed each
request's K/V, the varlen kernel attends over them; or, for a backend that prefills from the pages,
the cache has only written the new K/V and the paged prefill kernel reads every key through the
block table). Without metadata, e.g. a plain
``model(input_ids, labels=...)`` forward, it computes exactly what ``sdpa`` would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from .cache import ACTIVE_STEP, pad_head_dim, prefills_from_pages
from .model_checks import check_attention_call
from .step import StepMetadata


@dataclass(frozen=True, slots=True)
class PagedWindow:
    """The "paged" mask of a sliding-window layer inside a step: no tensor, only the window."""

    size: int


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature. query: [1, H, N, D]; key/value: [1, H_kv, K, D] as returned
    by ``PagedAttentionCache.update`` (``check_attention_call`` refuses anything else). The step comes
    from the ``paged_metadata`` kwarg, or from ``ACTIVE_STEP`` for models whose decoder layers drop
    kwargs. Returns ([1, N, H, D_v], None)."""
    meta: StepMetadata | None = kwargs.get("paged_metadata") or ACTIVE_STEP.get()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if meta is None:
        return plain_attention(module, query, key, value, attention_mask, dropout, scale, softcap, s_aux, **kwargs)
    meta = meta.on(query.device)  # layers spread over devices: the step's tensors where this one runs
    if isinstance(attention_mask, PagedWindow):
        sliding_window, attention_mask = sliding_window or attention_mask.size, None
    layer = check_attention_call(module, key, value, attention_mask, meta)
    meta = meta.for_group(layer.group)  # the block tables of this layer's attention group
    layer.window = sliding_window  # what this layer really sees: lets the engine free older blocks
    value_dim = value.shape[-1]
    from_pages = not meta.is_decode and prefills_from_pages(meta.backend)  # K/V already in the pages
    if query.shape[-1] != layer.width or value_dim != layer.width:  # K and V head dims differ (latent attention)
        query = pad_head_dim(query, layer.width)
        if not from_pages:
            key, value = pad_head_dim(key, layer.width), pad_head_dim(value, layer.width)

    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    options = dict(softmax_scale=scale, causal=True, window_size=window, softcap=softcap or 0.0, sinks=s_aux)
    q = query[0].transpose(0, 1)  # [N, H, D]
    if getattr(meta.backend, "STEP_MEMO", False):  # the backend reuses per-step work across layers
        options["memo"] = meta.memo
    if meta.is_decode:
        out = meta.backend.paged_decode_attention(
            q.unsqueeze(1),  # [B, 1, H, D]: one token per request
            layer.keys,
            layer.values,
            key[0].transpose(0, 1).unsqueeze(1),  # [B, 1, H_kv, D], appended in place
            value[0].transpose(0, 1).unsqueeze(1),
            meta.cache_seqlens,
            meta.block_table,
            **options,
        ).squeeze(1)  # [N, H, D]
    elif from_pages:
        out = meta.backend.paged_prefill_attention(
            q,
            layer.keys,
            layer.values,
            meta.cu_seq_lens_q,
            seqused_k(meta),
            meta.block_table,
            meta.max_length_q,
            **options,
        )
    else:
        out = meta.backend.varlen_attention(
            q,
            key[0].transpose(0, 1),  # [K, H_kv, D]
            value[0].transpose(0, 1),
            meta.cu_seq_lens_q,
            meta.cu_seq_lens_k,
            meta.max_length_q,
            meta.max_length_k,
            **options,
        )
    return out[..., :value_dim].unsqueeze(0), None  # [1, N, H, D_v]


def seqused_k(meta: StepMetadata) -> torch.Tensor:
    """int32 [B]: the keys request b attends, counted from its first token (cached + new), made once
    per step and group. The same in every group: a sliding layer's kernel skips what its window hides,
    so the blocks a sliding group has already released are never read."""
    used = meta.memo.get("seqused_k")
    if used is None:
        q_lens = meta.cu_seq_lens_q[1:] - meta.cu_seq_lens_q[:-1]  # [B]
        used = meta.memo["seqused_k"] = (meta.cache_seqlens + q_lens).to(torch.int32)
    return used


def plain_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scale: float,
    softcap: float | None,
    s_aux: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Outside a paged step: sdpa, or its explicit equivalent where sdpa lacks softcap or sinks."""
    if softcap is None and s_aux is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scale, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, H, K, D]
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scale  # [B, H, Q, K]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:
        q_len, k_len = scores.shape[-2:]
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    if s_aux is not None:
        sinks = s_aux.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sinks], dim=-1)  # [B, H, Q, K + 1]
    weights = torch.softmax(scores, dim=-1)
    if s_aux is not None:
        weights = weights[..., :-1]
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training).to(value.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None  # [B, Q, H, D]
