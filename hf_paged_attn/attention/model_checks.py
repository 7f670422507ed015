"""Which architectures the paged engine can run: refused up front, guarded at every step.

``check_model_supported`` runs when an engine is built (so at every paged ``generate``): a model the
engine can't run correctly is refused with ``UnsupportedModelError`` naming the architecture and
the reason, rather than generating wrong tokens. ``check_attention_call`` is the safety net for
what can't be seen before running: it turns a model that bypasses the paged cache into the same
error at its first step instead of silently wrong output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedConfig

if TYPE_CHECKING:
    from .cache import PagedLayer
    from .forward import ForwardContext

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}

# Architectures whose attention passes every generic check but still computes something the paged
# kernels don't (found by ``python -m hf_paged_attn_tools.compat``).
KNOWN_UNSUPPORTED: dict[str, str] = {
    "diffllama": "its differential attention splits and repeats V after cache.update, so the paged "
    "decode kernel would read other values than the model's",
    "doge": "its attention adds a learned dynamic mask bias, which the paged kernels can't apply",
    "jetmoe": "its mixture-of-attention repeats K/V across experts after cache.update (not grouped-query order)",
}


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's positions cover (its text config's ``max_position_embeddings``),
    None when the config does not say. The one place that reads it: each caller chooses what None means
    (no limit on a prompt, a sizing guess, the tokenizer's limit)."""
    value = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return int(value) if value else None


class UnsupportedModelError(NotImplementedError):
    """The model's architecture can't run on the paged engine (the message says why)."""


def unsupported(config: object, class_name: str, reason: str) -> UnsupportedModelError:
    model_type = getattr(config, "model_type", "?")
    return UnsupportedModelError(
        f"{class_name} (model_type {model_type!r}) is not supported by the paged engine: {reason}"
    )


def check_paged_model(model: torch.nn.Module, attn_implementation: str | None, role: str = "model") -> None:
    """What an engine checks of a model it is given (``role``: "model", "draft model"): loaded with
    ``attn_implementation="paged"`` (ValueError naming what it was) and one the paged engine can run."""
    if attn_implementation != "paged":
        raise ValueError(
            f"the {role}'s attention implementation is {attn_implementation!r}; load it with "
            'from_pretrained(..., attn_implementation="paged") (after `import hf_paged_attn`)'
        )
    check_model_supported(model)


def check_model_supported(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` if the paged engine can't run ``model`` correctly."""
    check_config_supported(model.config, type(model))
    for module in model.modules():
        # decoder attention modules carry layer_idx; a non-causal one attends to later tokens,
        # which the paged kernels (always causal) never show it
        if getattr(module, "layer_idx", None) is not None and getattr(module, "is_causal", True) is False:
            reason = f"{type(module).__name__} is bidirectional (is_causal=False)"
            raise unsupported(model.config, type(model).__name__, reason)


def check_config_supported(config: PreTrainedConfig, model_class: type) -> None:
    """The checks that need only the config and the class (``compat`` runs them before building)."""
    name = model_class.__name__
    if not getattr(model_class, "_supports_attention_backend", False):
        reason = "its attention does not go through transformers' attention interface, so the paged kernels never run"
        raise unsupported(config, name, reason)
    text = config.get_text_config()
    known = KNOWN_UNSUPPORTED.get(text.model_type) or KNOWN_UNSUPPORTED.get(config.model_type)
    if known:
        raise unsupported(config, name, known)
    if _get(config, "is_encoder_decoder") or _get(text, "add_cross_attention"):
        raise unsupported(config, name, "cross-attention to an encoder is not supported")
    other = sorted(set(_get(text, "layer_types") or []) - SUPPORTED_LAYER_TYPES)
    if "chunked_attention" in other:
        raise unsupported(config, name, "chunked attention (attention_chunk_size) is not implemented by the kernels")
    if other:
        reason = f"it has {', '.join(other)} layers, whose state (recurrent, convolution, compressed or indexed "
        raise unsupported(config, name, reason + "K/V) the paged KV cache does not hold")
    shared = _get(text, "num_kv_shared_layers")
    if shared:
        raise unsupported(config, name, f"{shared} of its layers reuse other layers' K/V (num_kv_shared_layers)")
    if _get(text, "kv_lora_rank") is not None:
        reason = "its multi-head latent attention caches the compressed latent (kv_lora_rank) and expands K/V "
        raise unsupported(config, name, reason + "after cache.update, but the paged kernels attend over the cache")


def _get(config: PreTrainedConfig, key: str) -> object:
    """``config.key`` or None. Per-layer (heterogeneous) configs raise on global access to some keys:
    those fall back to the serialised value (the attribute comes first: some keys are properties)."""
    try:
        return getattr(config, key, None)
    except Exception:
        return config.to_dict().get(key)


def check_attention_call(
    module: torch.nn.Module,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: ForwardContext,
) -> PagedLayer:
    """Guards of one paged attention call (identity checks, no device sync); returns the cache layer
    whose K/V the call attends over: the one ``PagedAttentionCache.update`` wrote last."""
    config = getattr(module, "config", None)
    if attention_mask is not None:
        # inside a step the "paged" mask function returns None, so this mask was built by the model
        reason = "it passes its own attention mask or bias, which the paged kernels can't apply"
        raise unsupported(config, type(module).__name__, reason)
    layer = context.last_layer
    returned = layer.returned if layer is not None else None
    if returned is None or key is not returned[0]() or value is not returned[1]():
        reason = "its attention does not use the K/V that PagedAttentionCache.update returned (it skips the cache "
        reason += "or changes K/V after it), so the paged kernels would attend over other K/V than the model's"
        raise unsupported(config, type(module).__name__, reason)
    return layer
