"""Sampling through transformers' own GenerationConfig and logits processors.

Each request carries ``SamplingParams``: its resolved generation config, the processor list that
``generate`` itself would build, and its stop tokens. A step samples all rows at once where it can
(plain greedy rows are one batched argmax) and per request where processors need its history.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.configuration_utils import GenerationMode

from .placement import input_device
from .request import Request

SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)

# Options generate() knows that this engine cannot honour: refused by name, never silently ignored.
UNSUPPORTED_OPTIONS = {
    "stop_strings": None,
    "force_words_ids": None,
    "constraints": None,
    "guidance_scale": (None, 1, 1.0),
    "penalty_alpha": (None, 0, 0.0),
    "dola_layers": None,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
    "encoder_repetition_penalty": (None, 1, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0),
}


@dataclass(slots=True)
class SamplingParams:
    generation_config: GenerationConfig
    processors: LogitsProcessorList
    do_sample: bool
    eos_token_ids: frozenset[int]
    output_scores: bool = False
    output_logits: bool = False

    @property
    def needs_row_work(self) -> bool:
        return bool(self.processors) or self.do_sample or self.output_scores or self.output_logits


def check_supported(config: GenerationConfig) -> None:
    """Raise NotImplementedError naming any option this engine cannot honour."""
    mode = config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        raise NotImplementedError(
            f"generation mode {mode.value!r} (num_beams={config.num_beams}, do_sample={config.do_sample}) is not "
            "supported by the paged engine: only greedy search and sampling are"
        )
    for name, neutral in UNSUPPORTED_OPTIONS.items():
        value = getattr(config, name, None)
        allowed = neutral if isinstance(neutral, tuple) else (neutral,)
        if value not in allowed:
            raise NotImplementedError(f"generation option {name}={value!r} is not supported by the paged engine")


def make_sampling_params(
    model: torch.nn.Module,
    config: GenerationConfig,
    prompt_length: int,
    extra_processors: LogitsProcessorList | None = None,
) -> SamplingParams:
    """Resolve ``config`` as ``generate`` does and build its processors for one request."""
    config = copy.deepcopy(config)
    check_supported(config)
    device = input_device(model)  # where logits arrive; model.device is "meta" when accelerate offloads
    model._prepare_special_tokens(config, True, device=device)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_length,
        logits_processor=extra_processors or LogitsProcessorList(),
        device=device,
        model_kwargs={},
    )
    eos = config._eos_token_tensor
    eos_ids = frozenset(eos.flatten().tolist()) if eos is not None else frozenset()
    return SamplingParams(
        generation_config=config,
        processors=processors,
        do_sample=bool(config.do_sample),
        eos_token_ids=eos_ids,
        output_scores=bool(config.return_dict_in_generate and config.output_scores),
        output_logits=bool(config.return_dict_in_generate and config.output_logits),
    )


def sample_tokens(
    logits: torch.Tensor, requests: list[Request], generator: torch.Generator | None
) -> list[int]:
    """One new token per request. logits: [num_requests, vocab] float32, row i for requests[i]."""
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows need nothing more
    for row, request in enumerate(requests):
        params: SamplingParams = request.sampling
        if not params.needs_row_work:
            continue
        raw = logits[row : row + 1]  # [1, vocab]
        history = torch.tensor([request.all_ids], device=logits.device)  # [1, seq]
        scores = params.processors(history, raw.clone()) if params.processors else raw
        if params.do_sample:
            probs = torch.softmax(scores, dim=-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator))
        else:
            tokens[row] = int(scores.argmax(dim=-1))
        if params.output_scores:
            request.scores = (request.scores or []) + [scores[0].cpu()]
        if params.output_logits:
            request.logits = (request.logits or []) + [raw[0].cpu()]
    return tokens
