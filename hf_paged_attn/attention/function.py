"""The attention function registered as ``"paged"``.

Inside an engine step (the ``paged_forward`` forward kwarg, a ``ForwardContext``) it picks the
kernel path from the step: decode (every request feeds one token: the paged decode kernel reads K/V
through the block table and appends the new token in place) or varlen (any prefill: the cache has
written the step's K/V into the pages, the paged prefill kernel reads every key through the block
table). Outside a step, e.g. a plain ``model(input_ids, labels=...)`` forward, it computes exactly
what ``sdpa`` would.

Inside a compiled step (``runtime/cpu/compiled.py``) the ``paged_forward`` kwarg is ``COMPILED`` and the
whole attention call, cache write included, is one opaque custom op, ``hf_paged_attn::step_attention``
(defined with the compile stack, ``runtime/cpu/attention.py``), as vLLM leaves its attention to the
compiler: the graph around it stays whole, and the op runs the eager path below on the step's real rows,
outside the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from ..kernels.base import AttentionOptions
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
    context: ForwardContext | None = kwargs.get("paged_forward")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if context is COMPILED:  # traced by torch.compile: the attention is one opaque op
        window = sliding_window or (attention_mask.size if isinstance(attention_mask, PagedWindow) else 0)
        # The layer's index as a tensor where the compile gave the module one (``LAYER_INDEX``): a graph input,
        # so that every layer's traced graph is the same and dynamo traces the layer once (``compiled.py``).
        layer = getattr(module, LAYER_INDEX, None)
        layer = layer if layer is not None else torch.tensor(module.layer_idx)
        out = torch.ops.hf_paged_attn.step_attention(query, key, value, layer, scale, window, softcap or 0.0, s_aux)
        return out, None
    context = context or ACTIVE_FORWARD.get()
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
    # fp8 pages hold k / k_scale and v / v_scale (cache.py): k_scale joins the softmax scale, v_scale the output
    options = AttentionOptions(
        softmax_scale=scale * layer.k_scale, causal=True, window_size=window, softcap=softcap or 0.0, sinks=s_aux,
        k_scales=layer.k_scales, v_scales=layer.v_scales,
    )
    q = query[0].transpose(0, 1)  # [N, H, D]
    # A sliding group's max_length_k counts the keys its window leaves; the kernels' max_seqlen_k must bound
    # the keys counted from position 0 (kernels/base.py), which the block table's capacity does.
    max_seqlen_k = inputs.block_table.shape[1] * layer.block_size if sliding_window else inputs.max_length_k
    if inputs.is_decode:
        new_k, new_v = layer.descaled(key[0].transpose(0, 1), value[0].transpose(0, 1))  # [B, H_kv, D]
        new_k = pad_head_dim(new_k, layer.width).unsqueeze(1)  # [B, 1, H_kv, D], appended in place
        new_v = pad_head_dim(new_v, layer.width).unsqueeze(1)
        out = context.backend.paged_decode_attention(
            q.unsqueeze(1),  # [B, 1, H, D]: one token per request
            layer.keys,
            layer.values,
            new_k,
            new_v,
            inputs.cache_seqlens,
            inputs.block_table,
            max_seqlen_k,
            options=options,
            memo=inputs.memo,
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
            max_seqlen_k,
            options=options,
            memo=inputs.memo,
        )
    out = out[..., :value_dim].unsqueeze(0)  # [1, N, H, D_v]
    return (out if layer.v_scale == 1.0 else out * layer.v_scale), None


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
        # the dtype's minimum, as eager's additive mask: a left-padding query row masked whole gets
        # finite weights, not 0/0 = NaN that the next layer's 0 * NaN spreads to every row
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
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


# ----------------------------------------------------------------------------- compiled steps
class _Compiled:
    """The ``paged_forward`` kwarg of a compiled step: one constant object, so the graph that
    torch.compile traces never depends on the step (a new ``ForwardContext`` every step would make
    it guard and recompile)."""

    def __repr__(self) -> str:
        return "COMPILED"


COMPILED = _Compiled()

# The buffer (a 0-dim int64 tensor) ``runtime/cpu/compiled.compiled_model`` gives each attention module.
LAYER_INDEX = "hf_paged_layer_idx"
