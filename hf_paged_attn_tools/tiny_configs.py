"""Tiny random-weight configs for any causal-LM architecture in transformers' auto mapping.

One generic recipe shrinks a model type's default config (small hidden size, few layers, small
vocab, heads that divide evenly) and makes its greedy tokens vary (larger ``initializer_range``).
Only keys the default config already has are set, so no architecture gets options it doesn't know.
``OVERRIDES`` holds the few per-architecture corrections the generic recipe can't guess.
"""

from __future__ import annotations

from typing import Any

from transformers import CONFIG_MAPPING, PreTrainedConfig

VOCAB = 256
NUM_LAYERS = 4
SLIDING_WINDOW = 8  # shorter than the prompts, so a wrong window changes the tokens

# Set on the text config when the default config has the key. head_dim 32 with hidden 64 / 4 heads
# makes head_dim != hidden / heads wherever the architecture lets head_dim be chosen.
TEXT_SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rotary_dim": 8,  # GPT-J / CodeGen partial rotary: must fit in head_dim
    "max_position_embeddings": 256,
    "sliding_window": SLIDING_WINDOW,
    "attention_chunk_size": SLIDING_WINDOW,
    "is_decoder": True,  # BERT-style models: causal self-attention, as their *ForCausalLM expects
    "pad_token_id": 0,
    "bos_token_id": None,
    "eos_token_id": None,  # no early stop: every row generates all its tokens
    # mixture of experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention (DeepSeek family)
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}

# Other sub-configs (vision towers, audio encoders) only need to be small.
OTHER_SIZES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "depth": 1,
}

OVERRIDES: dict[str, dict[str, Any]] = {
    "cohere_compass_text": {  # its default config has no rope parameters; M-RoPE sections sum to head_dim / 2
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]}
        }
    },
    "dbrx": {  # its default config can't run: no attn_config.rope_theta, clip_qkv None (clamp fails)
        "d_model": 64,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 64},
    },
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},  # sum: NUM_LAYERS
    "dots3_note": {  # validated: no GQA, adapters sized to the (tiny) towers
        "text_config": {"num_key_value_heads": 4},
        "vision_config": {"adapter_in_dim": 32, "adapter_out_dim": 64},
        "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 64},
    },
    "dots3_note_text": {"num_key_value_heads": 4},
    # tied embeddings + Gemma's sqrt(hidden) embedding scale: a tiny random model repeats its input
    "gemma2": {"tie_word_embeddings": False},
    "gemma3": {"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": False}},
    "gemma3_text": {"tie_word_embeddings": False},
    "gemma4_assistant": {  # its default config fails its own validation
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
            "num_hidden_layers": NUM_LAYERS,
            "num_kv_shared_layers": NUM_LAYERS,  # an assistant reuses its target model's K/V in every layer
        }
    },
    "helium": {"head_dim": 16},  # its o_proj assumes head_dim == hidden / heads
    # LFM2 defaults to attention-only layers; released checkpoints interleave short convolutions
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # Moshi's window reaches neither its mask nor its attention call: transformers applies it only by
    # truncating DynamicCache, so its own cached generate differs from its full forward past the window.
    # A window longer than these sequences compares what both agree on (a documented limitation).
    "moshi": {"sliding_window": 256},
    "xmod": {"default_language": "en_XX"},  # its language adapters need one
    "zaya": {"num_experts_per_tok": 1},  # validated: top-1 routing only
}


def _shrunk(default: PreTrainedConfig, sizes: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments that rebuild ``default``'s class small (only keys ``default`` has)."""
    values = default.to_dict()
    known = set(values) | set(getattr(default, "attribute_map", {}))  # GPT-2 style aliases: n_embd, ...
    kwargs = {k: v for k, v in sizes.items() if k in known}
    if "kv_lora_rank" in values:  # latent attention: head_dim is derived, K/V have every head
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    kwargs.update(extra)
    old_layers = getattr(default, "num_hidden_layers", None)
    new_layers = kwargs.get("num_hidden_layers", old_layers)
    for key, value in values.items():  # per-layer lists follow the new layer count
        if key in kwargs or not isinstance(value, list) or not old_layers or len(value) != old_layers:
            continue
        kwargs[key] = (value * new_layers)[:new_layers]
    if values.get("num_kv_shared_layers") and "num_kv_shared_layers" not in extra:
        kwargs["num_kv_shared_layers"] = new_layers // 2  # the last layers reuse the first ones' K/V
    types = values.get("layer_types")
    if types and set(types) == {"sliding_attention", "full_attention"} and "layer_types" not in extra:
        # alternate so the tiny model has both kinds whatever the original pattern's period
        kwargs["layer_types"] = ["sliding_attention", "full_attention"] * (new_layers // 2) + (
            ["sliding_attention"] if new_layers % 2 else []
        )
    return kwargs


def tiny_config(model_type: str, initializer_range: float = 0.1) -> PreTrainedConfig:
    """A small config of ``model_type``; a larger ``initializer_range`` makes its greedy tokens vary more."""
    sizes = {**TEXT_SIZES, "initializer_range": initializer_range, "init_std": initializer_range}
    try:
        return _build(model_type, sizes)
    except Exception:  # configs whose validation wants int token ids: an EOS that may stop rows early
        return _build(model_type, {**sizes, "bos_token_id": 1, "eos_token_id": VOCAB - 1})


def _build(model_type: str, text_sizes: dict[str, Any]) -> PreTrainedConfig:
    config_class = CONFIG_MAPPING[model_type]
    extra = dict(OVERRIDES.get(model_type, {}))
    try:
        default = config_class()
    except Exception:  # a few defaults fail their own validation without the overrides
        default = config_class(**extra)
    text = default.get_text_config()
    if text is default:
        return config_class(**_shrunk(default, text_sizes, extra))
    kwargs: dict[str, Any] = {}
    for name in getattr(default, "sub_configs", {}):
        sub = getattr(default, name, None)
        if not isinstance(sub, PreTrainedConfig):
            continue
        sizes = text_sizes if sub is text else OTHER_SIZES
        kwargs[name] = {**_shrunk(sub, sizes, extra.pop(name, {})), "model_type": sub.model_type}
    top = default.to_dict()
    shared = [k for k in text_sizes if k.endswith("token_id") or k in ("initializer_range", "init_std")]
    kwargs.update({k: text_sizes[k] for k in shared if k in top})  # a composite model may init from these
    kwargs.update(extra)
    return config_class(**kwargs)
