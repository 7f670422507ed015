"""``model.generate`` on a "paged" model: a padded batch in, the same tensor (or
``GenerateDecoderOnlyOutput``) that transformers' ``generate`` returns, continuous batching inside.

A call that carries the caller's ``logits_processor`` or ``stopping_criteria`` runs its rows in
lockstep (``runtime/generation/lockstep.py``): those run once per step on the whole ``[batch, len]`` ids, as in
``generate``. Every other call samples each row as it comes, the built-in processors batched per
stack of rows (``runtime/generation/processors/``).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

from .. import transformers_private as hf
from ..core.request import RequestOutput
from ..parallel.tensor_parallel import is_driver, on_driver
from ..runtime.config import PagedConfig
from ..runtime.engine import ContinuousBatchingEngine
from ..runtime.generation.lockstep import Lockstep
from ..runtime.generation.sampling import RUN_ANYWAY, make_stopping_criteria
from ..runtime.model.lora import generate_adapters
from ..runtime.model.memory import blocks_for_batch
from ..runtime.model.placement import input_device, layer_kinds
from ..runtime.multimodal import DERIVED_INPUTS, IMAGE_INPUTS, MultimodalInputs, split_images
from ..runtime.speculative.config import with_draft
from ..runtime.speculative.draft import paged_attention
from .modes import generation_mode

_REFUSED = {  # generate() arguments with no meaning here, refused by name rather than ignored
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn",
    "assistant_tokenizer": "assisted decoding with another tokenizer (assistant_tokenizer)",
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
    structured=None,
    **kwargs,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """Continuous-batching ``generate``: rows of the padded batch become requests. ``assistant_model``
    and ``prompt_lookup_num_tokens`` speculate on every row (``runtime/speculative``)."""
    assistant = kwargs.pop("assistant_model", None)
    for name, what in _REFUSED.items():
        if kwargs.pop(name, None) is not None:
            raise NotImplementedError(f"{what} is not supported by the paged engine's generate; {RUN_ANYWAY}")
    if kwargs.pop("synced_gpus", None):
        raise NotImplementedError("synced_gpus is not supported by the paged engine's generate")
    has_default_max_length = kwargs.get("max_length") is None and (
        generation_config is None or generation_config.max_length is None
    )
    config, model_kwargs = hf.prepare_generation_config(model, generation_config, **kwargs)
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
    image_inputs = {k: model_kwargs.pop(k) for k in (*IMAGE_INPUTS, *DERIVED_INPUTS) if k in model_kwargs}
    if model_kwargs:
        raise NotImplementedError(
            f"model inputs {sorted(model_kwargs)} are not supported by the paged engine; {RUN_ANYWAY}"
        )
    num_sequences = int(config.num_return_sequences or 1)
    num_beams = int(config.num_beams or 1)
    if streamer is not None and num_beams > 1:
        raise ValueError("streamer= cannot be used with beam search, as in transformers' generate: set num_beams=1")
    if streamer is not None and input_ids.shape[0] * num_sequences != 1:
        raise ValueError(
            "streamer= works with one sequence only, as in transformers' generate: got a batch of "
            f"{input_ids.shape[0]} with num_return_sequences={num_sequences}"
        )

    default_max_length = has_default_max_length and model.generation_config.max_length is None
    config = hf.prepare_generated_length(model, config, default_max_length, input_ids)
    # One prompt needs no mask (nothing is padded): transformers' warning about a missing mask is for batches.
    has_mask = attention_mask is not None or input_ids.shape[0] == 1
    hf.prepare_special_tokens(model, config, has_mask, input_device(model))
    max_new_tokens = config.max_length - input_ids.shape[1]
    if max_new_tokens <= 0:
        raise ValueError(
            f"max_length={config.max_length} leaves no room after the {input_ids.shape[1]}-token input; "
            "set max_new_tokens"
        )
    prompts, paddings = _unpad(input_ids, attention_mask)
    images = split_images(model, prompts, image_inputs)  # each row's, [] for a row of text
    multimodal = [MultimodalInputs.build(model, p, i) if i else None for p, i in zip(prompts, images)]
    paged_config = paged_config or getattr(model, "paged_config", None) or PagedConfig()
    paged_config = paged_config.for_model(model)  # the engine's kernel and block size
    if assistant is not None:  # k: num_assistant_tokens where the caller set it (its config default, 20, is not ours)
        if num_beams > 1:
            raise NotImplementedError(f"assistant_model with num_beams={num_beams}: beam search does not speculate")
        k = kwargs.get("num_assistant_tokens") or getattr(generation_config, "num_assistant_tokens", None)
        paged_config = paged_config.replace(speculative=with_draft(paged_config.speculative, assistant, k))
    # PEFT's generate(adapter_names=) or its active adapter, per row (None: the model has no LoRA layer)
    adapters = generate_adapters(model, input_ids.shape[0], num_beams) or [None] * input_ids.shape[0]
    lengths = [len(p) for p in prompts]
    layers = layer_kinds(model, paged_config.hybrid_kv)  # the engine's groups
    exact_fit = blocks_for_batch(lengths, max_new_tokens, paged_config, layers.groups, max(num_sequences, num_beams))
    exact_fit = -(-exact_fit // layers.pool_blocks(1))  # in blocks of every layer, as PagedConfig.num_blocks
    lockstep = None
    if (logits_processor or stopping_criteria) and num_beams == 1:
        if structured is not None:
            raise NotImplementedError(
                "structured= together with a caller's logits_processor or stopping_criteria is not supported"
            )
        lockstep = _lockstep(model, config, input_ids, attention_mask, max_new_tokens, logits_processor,
                             stopping_criteria, tokenizer)  # fmt: skip
        paged_config = _lockstep_config(paged_config, input_ids.shape[0] * num_sequences, exact_fit)
        logits_processor = stopping_criteria = None  # the batch runs them
    # ``config`` is the engine's own (below): already prepared, so add_request does not prepare it again per prompt
    common = dict(max_new_tokens=max_new_tokens, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                  tokenizer=tokenizer, structured=structured, lockstep=lockstep)  # fmt: skip

    def on_output(out: RequestOutput) -> None:
        if out.finish_reason == "error":  # what raised is raised as is, as transformers' generate does
            if out.exception is not None:
                raise out.exception
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        if streamer is not None and out.new_ids:
            streamer.put(torch.tensor(out.new_ids))

    engines: list[ContinuousBatchingEngine] = []

    def run() -> list[RequestOutput]:
        engine = ContinuousBatchingEngine(model, paged_config, config, num_blocks=paged_config.num_blocks or exact_fit)
        engines.append(engine)
        requests = [dict(input_ids=p, padding=pad, adapter_name=adapter, multimodal=mm, **common)
                    for p, pad, adapter, mm in zip(prompts, paddings, adapters, multimodal)]  # fmt: skip
        # a streamer takes every step's new tokens; without one, only the finished outputs are wanted
        ids = engine.add_all(requests, final_only=streamer is None)
        if lockstep is not None:
            live = engine.intake.live
            lockstep.bind([[live[rid], *live[rid].children] for rid in ids])
        if streamer is not None:
            streamer.put(input_ids.cpu())
        return engine.collect(ids, on_output=on_output)

    # Tensor-parallel model: rank 0 runs the engine, the other ranks its forwards; all get the outputs.
    draft_attention = paged_attention(assistant) if assistant is not None else contextlib.nullcontext()
    # The engine closes after: closing it inside would end the other ranks' loop before the outputs reach them.
    try:
        with generation_mode(model), draft_attention:
            ordered = on_driver(model, run)
    finally:
        for engine in engines:
            engine.shutdown()  # the model is left as it was found (``runtime/model/marks.py``)
    if streamer is not None:
        if not is_driver(model):  # the other ranks' streamers get the prompt and the output at the end
            streamer.put(input_ids.cpu())
            streamer.put(torch.tensor(ordered[0].output_ids))
        streamer.end()
    return _pack(model, config, input_ids.repeat_interleave(num_sequences, dim=0), ordered)


def _lockstep(
    model: torch.nn.Module,
    config: GenerationConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria: StoppingCriteriaList | None,
    tokenizer: object | None,
) -> Lockstep:
    """The batch a caller's processors and criteria see, built as ``generate`` builds them: the
    input expanded by ``num_return_sequences``, the processor list for that batch (its attention
    mask sets the repetition penalty's padding), the criteria beyond EOS and length."""
    n = int(config.num_return_sequences or 1)
    batch = input_ids.repeat_interleave(n, dim=0)  # [batch * n, width]
    mask = attention_mask.repeat_interleave(n, dim=0) if attention_mask is not None else torch.ones_like(batch)
    device = input_device(model)
    processors = hf.logits_processors(
        model, config, batch.shape[1], logits_processor, device, {"attention_mask": mask.to(device)}
    )
    eos, pad = hf.eos_token_tensor(config), hf.pad_token_tensor(config)
    return Lockstep(
        batch,
        max_new_tokens,
        processors,
        make_stopping_criteria(config, stopping_criteria, tokenizer),
        pad_token_id=int(pad) if eos is not None and pad is not None else None,
        eos_token_ids=frozenset(eos.flatten().tolist()) if eos is not None else frozenset(),
        do_sample=bool(config.do_sample),
        output_scores=bool(config.return_dict_in_generate and config.output_scores),
        output_logits=bool(config.return_dict_in_generate and config.output_logits),
    )


def _lockstep_config(paged_config: PagedConfig, num_rows: int, exact_fit: int) -> PagedConfig:
    """Rows in lockstep wait for each other: they must all run at once (no row may wait for a slot
    or blocks that a waiting row holds), so the cache holds the whole batch at its peak."""
    if paged_config.num_blocks is not None and paged_config.num_blocks < exact_fit:
        raise ValueError(
            f"PagedConfig.num_blocks={paged_config.num_blocks} is too small for this call: its caller's processors or "
            f"stopping criteria see the whole batch at every step, so all {num_rows} rows run at once and need "
            f"{exact_fit} blocks (leave num_blocks=None to size the cache for the batch)"
        )
    return paged_config.replace(max_num_seqs=max(paged_config.max_num_seqs, num_rows))


def _unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's real tokens (left or right padding removed by the attention mask), and the left
    padding before them: generate's processors see it (min_length, forced EOS, n-grams count it)."""
    if attention_mask is None:
        return input_ids.tolist(), [[] for _ in range(input_ids.shape[0])]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    prompts, paddings = [], []
    for row, mask in zip(input_ids.cpu().tolist(), attention_mask.cpu().bool().tolist()):
        prompts.append([t for t, m in zip(row, mask) if m])
        first = mask.index(True) if True in mask else len(mask)
        left_padded = all(mask[first:])  # right or inner padding: no prefix reproduces what generate saw
        paddings.append(row[:first] if left_padded else [])
    return prompts, paddings


def _pack(
    model: torch.nn.Module, config: GenerationConfig, input_ids: torch.Tensor, outputs: list[RequestOutput]
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """Lay results out as generate does: [batch, input_len + longest output], pad after EOS."""
    if (config.num_beams or 1) > 1:
        return _pack_beams(config, input_ids, outputs)
    pad = hf.pad_token_tensor(config)
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


def _pack_beams(
    config: GenerationConfig, input_ids: torch.Tensor, outputs: list[RequestOutput]
) -> torch.Tensor | GenerateBeamDecoderOnlyOutput:
    """Beam search's layout: hypotheses filled with pad (or, where pad is 0 or unset, the first EOS)
    as transformers fills them; ``beam_indices`` count beams across the batch (row b's beams are
    ``b * num_beams + k``), -1 past each hypothesis' end."""
    pad, eos = hf.pad_token_tensor(config), hf.eos_token_tensor(config)
    fill = (int(pad) if pad is not None and int(pad) else int(eos.flatten()[0])) if eos is not None else -1
    width = max(len(o.output_ids) for o in outputs)
    new = torch.full((len(outputs), width), fill, dtype=input_ids.dtype)
    indices = torch.full((len(outputs), width), -1, dtype=torch.int64)
    per_prompt = int(config.num_return_sequences or 1)
    for row, out in enumerate(outputs):
        new[row, : len(out.output_ids)] = torch.tensor(out.output_ids, dtype=input_ids.dtype)
        offset = (row // per_prompt) * config.num_beams
        indices[row, : len(out.beam_indices)] = torch.tensor(out.beam_indices, dtype=torch.int64) + offset
    sequences = torch.cat([input_ids.cpu(), new], dim=1).to(input_ids.device)
    if not config.return_dict_in_generate:
        return sequences
    heads = outputs[::per_prompt]  # a search's per-step scores ride on its first sequence
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=torch.tensor([o.score for o in outputs]) if config.output_scores else None,
        scores=_per_beam_step(heads, "scores") if config.output_scores else None,
        logits=_per_beam_step(heads, "logits") if config.output_logits else None,
        beam_indices=indices.to(input_ids.device),
    )


def _per_beam_step(heads: list[RequestOutput], field: str) -> tuple[torch.Tensor, ...]:
    """One [batch * num_beams, vocab] tensor per step; a search that ended before the longest one
    holds zeros there (transformers keeps computing every search until all have ended)."""
    steps = [getattr(o, field) or [] for o in heads]
    first = next(s[0] for s in steps if s)
    return tuple(
        torch.cat([s[t] if t < len(s) else torch.zeros_like(first) for s in steps]) for t in range(max(map(len, steps)))
    )
