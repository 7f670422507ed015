"""The attention of a compiled step, as one opaque op: ``hf_paged_attn::step_attention``.

The registered attention function (``attention/function.py``) calls the op when the forward's
``paged_forward`` kwarg is ``COMPILED``, with the layer's index as a tensor (the ``LAYER_INDEX`` buffer
``compiled.compiled_model`` gives each attention module, a graph input): every layer's traced graph is
then the same, and dynamo traces one. The op runs outside the graph, on the step's real rows, the eager
path (cache write, kernel) or, for a decode step, the backend's calls prepared once for the whole step
(``_lean_decode``). It reaches the step through ``COMPILED_STEP``, set by the compiled executor around the
graph's call (custom ops take tensors and plain numbers).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

from ...attention.cache import PagedAttentionCache
from ...attention.forward import ForwardContext
from ...attention.function import paged_attention_forward


@dataclass(frozen=True, slots=True)
class CompiledStep:
    """What ``step_attention`` needs outside the graph: the step's forward, the cache it writes,
    each layer's attention module (``layer_idx`` -> module) and how many of the graph's packed rows
    are real (the rest are padding rows of the executor's shape bucket)."""

    context: ForwardContext | None  # None (and cache None) in a compile's example step, of padding rows only
    cache: PagedAttentionCache | None
    modules: dict[int, torch.nn.Module]
    num_tokens: int


# The compiled step running in this thread, set by the executor around the compiled call (the op's
# only way to reach the step: custom ops take tensors and plain numbers).
COMPILED_STEP: contextvars.ContextVar[CompiledStep | None] = contextvars.ContextVar("compiled_step", default=None)


def _step_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: torch.Tensor,
    scaling: float,
    sliding_window: int,
    softcap: float,
    s_aux: torch.Tensor | None,
) -> torch.Tensor:
    """One layer's paged attention of a compiled step, opaque to the compiler. query: [1, H, M, D];
    key/value: [1, H_kv, M, D] (``M`` >= the step's real rows; padding rows after them). Runs the
    eager path (cache write, kernel) on the real rows; padding rows come back zero and never touch
    the cache. Returns [1, M, H, D_v], contiguous. ``layer``: the layer's index, a 0-dim tensor (an input
    of the graph, not a constant of it: ``LAYER_INDEX``). ``sliding_window``/``softcap``: 0 for none."""
    step = COMPILED_STEP.get()
    assert step is not None, "hf_paged_attn::step_attention runs only inside a compiled step"
    layer_idx = int(layer)
    n, rows = step.num_tokens, query.shape[2]
    if n == 0:  # a compile's example step: padding rows only
        return query.new_zeros(1, rows, query.shape[1], value.shape[-1])
    if step.context.step.is_decode and not sliding_window and not softcap and s_aux is None:
        out = _lean_decode(step, layer_idx, query, key, value, scaling)
        if out is not None:
            return out
    if n < rows:
        query, key, value = query[:, :, :n], key[:, :, :n], value[:, :, :n]
    key, value = step.cache.update(key, value, layer_idx)
    out, _ = paged_attention_forward(
        step.modules[layer_idx], query, key, value, None, scaling=scaling, sliding_window=sliding_window or None,
        softcap=softcap or None, s_aux=s_aux, paged_forward=step.context,
    )  # fmt: skip
    if n == rows:
        return out.contiguous()
    full = out.new_zeros(1, rows, *out.shape[2:])  # [1, M, H, D_v]
    full[:, :n] = out
    return full


_DECODE_LAYERS = "decode_layers"  # the key of a step's prepared calls in its ``LayerInputs.memo``


def _lean_decode(
    step: CompiledStep, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> torch.Tensor | None:
    """A compiled decode step's layer through the backend's calls prepared for the whole step
    (``AttentionBackend.decode_layers``), without the general path's per-call work (the cache's bookkeeping,
    the identity checks of ``check_attention_call``, views, padding, the backend's planning): [1, M, H, D],
    or None where that does not apply (then the general path runs). The checks it skips guard eager forwards
    of arbitrary models; here the graph itself hands this op the K/V it wrote, for a model whose first step
    (a prefill, always through the general path) passed them."""
    layer = step.cache.layers[layer_idx]
    if not layer.is_initialized or layer.k_scale != 1.0 or layer.v_scale != 1.0 or layer.k_scales is not None:
        return None  # scaled pages (per layer, or int8's per token): the general path
    context = step.context
    inputs = context.inputs(layer.group, query.device)
    calls = inputs.memo.get(_DECODE_LAYERS, False)
    if calls is False:  # the step's first layer of this group: prepare (None: the backend has no lean path)
        calls = inputs.memo[_DECODE_LAYERS] = context.backend.decode_layers(
            query, key, value, layer.keys, inputs.cache_seqlens, inputs.block_table, inputs.max_length_k, scaling
        )
    if calls is None:
        return None
    out = calls(query, key, value, layer.keys, layer.values, scaling)
    if out is not None:
        layer.window = None  # as the general path records it: this layer attended to every key
    return out


def _step_attention_fake(query, key, value, layer, scaling, sliding_window, softcap, s_aux):  # noqa: ANN001, ANN202
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])


# A plain library op, not ``torch.library.custom_op``: that one's dispatch checks the outputs' aliasing at every
# call, 15.9 us a call against 7.4 (warm; more between a step's matmuls), and a step calls it at every layer.
# Functional by its schema (the pages it writes are the cache's, not an argument's); no autograd formula: the
# compiled forward runs under inference mode.
_LIB = torch.library.Library("hf_paged_attn", "FRAGMENT")
_LIB.define(
    "step_attention(Tensor query, Tensor key, Tensor value, Tensor layer, float scaling, int sliding_window, "
    "float softcap, Tensor? s_aux) -> Tensor"
)
_LIB.impl("step_attention", _step_attention, "CompositeExplicitAutograd")
torch.library.register_fake("hf_paged_attn::step_attention", _step_attention_fake, lib=_LIB)
step_attention = torch.ops.hf_paged_attn.step_attention.default
