"""Sampling through transformers' own GenerationConfig, logits processors and stopping criteria.

Each request carries ``SamplingParams``: its resolved generation config, the processor list that
``generate`` itself would build, its stop tokens and stopping criteria. A step samples all rows at
once where it can (plain greedy rows are one batched argmax) and per request where processors need
its history. ``sample_tokens`` changes no request: it returns what to record, and the engine
records it only once the whole step's sampling has succeeded.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import MaxTimeCriteria, StopStringCriteria

from .placement import input_device
from .request import Request, TokenLogprob

SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)

# Options generate() knows that this engine cannot honour: refused by name, never silently ignored.
UNSUPPORTED_OPTIONS = {
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
    stopping: StoppingCriteriaList | None = None  # stop strings, max_time, the caller's criteria
    generator: torch.Generator | None = None  # the request's own (``seed=``); else the engine's
    num_logprobs: int | None = None  # record log-probs with this many alternatives
    output_scores: bool = False
    output_logits: bool = False

    @property
    def needs_row_work(self) -> bool:
        return (
            bool(self.processors)
            or self.do_sample
            or self.output_scores
            or self.output_logits
            or self.num_logprobs is not None
        )


@dataclass(slots=True)
class Sample:
    """One request's draw: its token and what the request records with it."""

    token: int
    scores: torch.Tensor | None = None  # [vocab] processed scores, when output_scores
    logits: torch.Tensor | None = None  # [vocab] raw logits, when output_logits
    logprob: TokenLogprob | None = None


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
    *,
    stopping_criteria: StoppingCriteriaList | None = None,
    tokenizer: object | None = None,
    seed: int | None = None,
    logprobs: int | None = None,
) -> SamplingParams:
    """Resolve ``config`` as ``generate`` does and build its processors and criteria for one request."""
    config = copy.deepcopy(config)
    check_supported(config)
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ValueError(f"logprobs must be None or an int >= 0, got {logprobs!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be None or an int, got {seed!r}")
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
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return SamplingParams(
        generation_config=config,
        processors=processors,
        do_sample=bool(config.do_sample),
        eos_token_ids=eos_ids,
        stopping=make_stopping_criteria(config, stopping_criteria, tokenizer),
        generator=generator,
        num_logprobs=logprobs,
        output_scores=bool(config.return_dict_in_generate and config.output_scores),
        output_logits=bool(config.return_dict_in_generate and config.output_logits),
    )


def make_stopping_criteria(
    config: GenerationConfig, extra: StoppingCriteriaList | None, tokenizer: object | None
) -> StoppingCriteriaList | None:
    """The criteria ``generate`` would add beyond length and EOS (which the engine checks itself):
    ``max_time``, ``stop_strings`` (they need the tokenizer) and the caller's own."""
    criteria = StoppingCriteriaList()
    if config.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=config.max_time))
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError(
                f"stop_strings={config.stop_strings!r} needs the tokenizer: pass tokenizer= as with generate"
            )
        criteria.append(StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer))
    if extra:
        criteria.extend(extra)
    return criteria or None


def should_stop(request: Request, scores: torch.Tensor | None) -> bool:
    """Whether the request's stopping criteria say stop, after its newest token. Criteria see the
    request's ids as a ``[1, seq]`` batch, as in ``generate`` with one prompt."""
    stopping = request.sampling.stopping
    if not stopping:
        return False
    history = torch.tensor([request.all_ids])  # [1, seq]
    return bool(stopping(history, scores).any())


def sample_tokens(logits: torch.Tensor, requests: list[Request], generator: torch.Generator | None) -> list[Sample]:
    """One sample per request. logits: [num_requests, vocab] float32, row i for requests[i]."""
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows need nothing more
    samples = []
    for row, request in enumerate(requests):
        params: SamplingParams = request.sampling
        if not params.needs_row_work:
            samples.append(Sample(tokens[row]))
            continue
        raw = logits[row : row + 1]  # [1, vocab]
        if params.processors:
            history = torch.tensor([request.all_ids], device=logits.device)  # [1, seq]
            scores = params.processors(history, raw.clone())
        else:
            scores = raw
        if params.do_sample:
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=params.generator or generator))
        else:
            token = int(scores.argmax(dim=-1))
        samples.append(
            Sample(
                token,
                scores=scores[0].cpu() if params.output_scores else None,
                logits=raw[0].cpu() if params.output_logits else None,
                logprob=token_logprob(scores[0], token, params.num_logprobs),
            )
        )
    return samples


def token_logprob(scores: torch.Tensor, token: int, k: int | None) -> TokenLogprob | None:
    """``token``'s log-probability under ``scores`` [vocab] and the ``k`` best alternatives."""
    if k is None:
        return None
    logprobs = torch.log_softmax(scores.float(), dim=-1)  # [vocab]; -inf where processors masked
    top = []
    if k:
        values, ids = logprobs.topk(min(k, logprobs.numel()))
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)
