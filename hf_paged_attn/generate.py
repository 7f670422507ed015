"""``model.generate`` on a "paged" model: a padded batch in, the same tensor (or
``GenerateDecoderOnlyOutput``) that transformers' ``generate`` returns, continuous batching inside.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .config import PagedConfig
from .engine import ContinuousBatchingEngine
from .kv_manager import blocks_at_peak
from .layers import LayerKinds
from .placement import input_device
from .request import RequestOutput

_REFUSED = {  # generate() arguments with no meaning here, refused by name rather than ignored
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn",
    "assistant_model": "assisted decoding (assistant_model)",
    "negative_prompt_ids": "negative prompts (classifier-free guidance)",
    "negative_prompt_attention_mask": "negative prompts (classifier-free guidance)",
    "custom_generate": "custom_generate",
    "inputs_embeds": "inputs_embeds (the engine needs token ids)",
}


def paged_generate(
    model: torch.nn.Module,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    streamer=None,
    paged_config: PagedConfig | None = None,
    tokenizer=None,
    **kwargs,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """Continuous-batching ``generate``: rows of the padded batch become requests."""
    for name, what in _REFUSED.items():
        if kwargs.pop(name, None) is not None:
            raise NotImplementedError(f"{what} is not supported by the paged engine's generate")
    if kwargs.pop("synced_gpus", None):
        raise NotImplementedError("synced_gpus is not supported by the paged engine's generate")
    has_default_max_length = kwargs.get("max_length") is None and (
        generation_config is None or generation_config.max_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("paged generate needs input_ids (a [batch, seq] tensor of token ids)")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    attention_mask = model_kwargs.pop("attention_mask", None)
    model_kwargs.pop("use_cache", None)  # the engine always caches, in its own PagedAttentionCache
    for name in ("cache", "past_key_values"):
        if model_kwargs.pop(name, None) is not None:
            raise NotImplementedError(f"{name}= is not supported: the paged engine builds its own cache")
    if model_kwargs:
        raise NotImplementedError(f"model inputs {sorted(model_kwargs)} are not supported by the paged engine")
    num_sequences = int(config.num_return_sequences or 1)
    if streamer is not None and input_ids.shape[0] * num_sequences != 1:
        raise ValueError(
            "streamer= works with one sequence only, as in transformers' generate: got a batch of "
            f"{input_ids.shape[0]} with num_return_sequences={num_sequences}"
        )

    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length and model.generation_config.max_length is None,
        has_default_min_length=True,
        model_input_name="input_ids",
        inputs_tensor=input_ids,
        input_ids_length=input_ids.shape[1],
    )
    model._prepare_special_tokens(config, attention_mask is not None, device=input_device(model))
    max_new_tokens = config.max_length - input_ids.shape[1]
    if max_new_tokens <= 0:
        raise ValueError(
            f"max_length={config.max_length} leaves no room after the {input_ids.shape[1]}-token input; "
            "set max_new_tokens"
        )
    prompts = _unpad(input_ids, attention_mask)
    paged_config = paged_config or getattr(model, "paged_config", None) or PagedConfig()
    paged_config = paged_config.for_model(model)  # the engine's kernel and block size
    groups = LayerKinds.from_config(model.config, paged_config.hybrid_kv).groups
    size, budget = paged_config.block_size, paged_config.max_batch_tokens
    exact_fit = sum(blocks_at_peak(len(p) + max_new_tokens, size, groups, budget) for p in prompts) * num_sequences
    engine = ContinuousBatchingEngine(
        model, paged_config, config, num_blocks=paged_config.num_blocks or exact_fit
    )
    common = dict(max_new_tokens=max_new_tokens, generation_config=config, logits_processor=logits_processor,
                  stopping_criteria=stopping_criteria, tokenizer=tokenizer)  # fmt: skip
    ids = engine.add_all([dict(input_ids=p, **common) for p in prompts])
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def on_output(out: RequestOutput) -> None:
        if out.finish_reason == "error":
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        if streamer is not None and out.new_ids:
            streamer.put(torch.tensor(out.new_ids))

    ordered = engine.collect(ids, on_output=on_output)
    if streamer is not None:
        streamer.end()
    return _pack(model, config, input_ids.repeat_interleave(num_sequences, dim=0), ordered)


def _unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's real tokens (left or right padding removed by the attention mask)."""
    if attention_mask is None:
        return input_ids.tolist()
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu())]


def _pack(
    model: torch.nn.Module, config: GenerationConfig, input_ids: torch.Tensor, outputs: list[RequestOutput]
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """Lay results out as generate does: [batch, input_len + longest output], pad after EOS."""
    pad = config._pad_token_tensor
    pad_id = int(pad) if pad is not None else 0
    width = max(len(o.output_ids) for o in outputs)
    new = torch.full((len(outputs), width), pad_id, dtype=input_ids.dtype)
    for row, out in enumerate(outputs):
        new[row, : len(out.output_ids)] = torch.tensor(out.output_ids, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids.cpu(), new], dim=1).to(input_ids.device)
    if not config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=_per_step(outputs, "scores", width) if config.output_scores else None,
        logits=_per_step(outputs, "logits", width) if config.output_logits else None,
    )


def _per_step(outputs: list[RequestOutput], field: str, width: int) -> tuple[torch.Tensor, ...]:
    """generate's layout: one [batch, vocab] tensor per step. Rows that had already finished hold
    zeros (the engine stops computing a finished request; generate keeps padding it)."""
    first = next(getattr(o, field)[0] for o in outputs if getattr(o, field))
    steps = []
    for t in range(width):
        rows = [getattr(o, field)[t] if t < len(getattr(o, field) or []) else torch.zeros_like(first) for o in outputs]
        steps.append(torch.stack(rows))
    return tuple(steps)
