"""The attention function registered as ``"paged"``.

Inside an engine step (the ``paged_forward`` forward kwarg, a ``ForwardContext``) it picks the
kernel path from the step: decode (every request feeds one token: the paged decode kernel reads K/V
through the block table and appends the new token in place) or varlen (any prefill: the cache has
written the step's K/V into the pages, the paged prefill kernel reads every key through the block
table). Outside a step, e.g. a plain ``model(input_ids, labels=...)`` forward, it computes exactly
what ``sdpa`` would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from .cache import ACTIVE_FORWARD, pad_head_dim
from .forward import ForwardContext
from .model_checks import check_attention_call


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
    """transformers' attention signature. query: [1, H, N, D]; key/value: [1, H_kv, N, D] as returned
    by ``PagedAttentionCache.update`` (``check_attention_call`` refuses anything else). The forward
    comes from the ``paged_forward`` kwarg, or from ``ACTIVE_FORWARD`` for models whose decoder layers
    drop kwargs. Returns ([1, N, H, D_v], None)."""
    context: ForwardContext | None = kwargs.get("paged_forward") or ACTIVE_FORWARD.get()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if context is None:
        return plain_attention(module, query, key, value, attention_mask, dropout, scale, softcap, s_aux, **kwargs)
    if isinstance(attention_mask, PagedWindow):
        sliding_window, attention_mask = sliding_window or attention_mask.size, None
    layer = check_attention_call(module, key, value, attention_mask, context)
    inputs = context.inputs(layer.group, query.device)  # this layer's group's tables, where it runs
    layer.window = sliding_window  # what this layer really sees: lets the engine free older blocks
    value_dim = value.shape[-1]
    query = pad_head_dim(query, layer.width)  # K and V head dims differ (latent attention): pages are wider
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    options = dict(
        softmax_scale=scale, causal=True, window_size=window, softcap=softcap or 0.0, sinks=s_aux, memo=inputs.memo
    )
    q = query[0].transpose(0, 1)  # [N, H, D]
    if inputs.is_decode:
        out = context.backend.paged_decode_attention(
            q.unsqueeze(1),  # [B, 1, H, D]: one token per request
            layer.keys,
            layer.values,
            pad_head_dim(key[0].transpose(0, 1), layer.width).unsqueeze(1),  # [B, 1, H_kv, D], appended in place
            pad_head_dim(value[0].transpose(0, 1), layer.width).unsqueeze(1),
            inputs.cache_seqlens,
            inputs.block_table,
            inputs.max_length_k,
            **options,
        ).squeeze(1)  # [N, H, D]
    else:
        out = context.backend.paged_prefill_attention(
            q,
            layer.keys,
            layer.values,
            inputs.cu_seq_lens_q,
            inputs.seqused_k,
            inputs.block_table,
            inputs.max_length_q,
            inputs.max_length_k,
            **options,
        )
    return out[..., :value_dim].unsqueeze(0), None  # [1, N, H, D_v]


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
