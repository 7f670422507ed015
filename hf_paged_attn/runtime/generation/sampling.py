"""Sampling through transformers' own GenerationConfig, logits processors and stopping criteria.

Each request carries ``RequestSampling``: its resolved generation config, the processor list that
``generate`` itself would build and its batched plan (``processors.plan_processors``), its stop
tokens and stopping criteria. A step samples all rows at once where it can: plain greedy rows are
one batched argmax, and requests whose plans share a key (the same processors with the same
settings: temperature, top-k, top-p, but also repetition penalty, n-grams, min length, ... whose
per-row lengths and thresholds may differ) run them once on their stacked rows, reading the rows'
ids from the engine's ``TokenHistory``, and draw together; a request that has its own seed or
records scores or log-probs samples alone. ``sample_tokens`` changes no request: it returns what
to record, and the engine records it only once the whole step's sampling has succeeded.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import (
    LogitNormalization,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.stopping_criteria import MaxTimeCriteria, StopStringCriteria

from ... import transformers_private as hf
from ...core.request import Request, TokenLogprob
from ..model.placement import input_device
from ..speculative.config import check_generation_options
from .argmax import row_argmax
from .processors import ProcessorPlan, Rows, TokenHistory, openai_options, plan_processors, run_plans

SUPPORTED_MODES = (
    GenerationMode.GREEDY_SEARCH,
    GenerationMode.SAMPLE,
    GenerationMode.BEAM_SEARCH,
    GenerationMode.BEAM_SAMPLE,
)
RUN_ANYWAY = (
    "to run it anyway, switch to transformers' own attention for that call: "
    'model.set_attn_implementation("sdpa"), generate, then model.set_attn_implementation("paged")'
)

# Options generate() knows that this engine cannot honour: refused by name, never silently ignored.
UNSUPPORTED_OPTIONS = {
    "force_words_ids": None,
    "constraints": None,
    "guidance_scale": (None, 1, 1.0),
    "penalty_alpha": (None, 0, 0.0),
    "dola_layers": None,
    "assistant_early_exit": None,
    "assistant_ensemble_weight": None,  # speculative decoding here is lossless only (speculative/verify.py)
    "speculation_type": None,
    "encoder_repetition_penalty": (None, 1, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "diversity_penalty": (None, 0, 0.0),
    "token_healing": (None, False),
    "low_memory": (None, False),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "use_mtp": (None, False),
}


@dataclass(slots=True)
class RequestSampling:
    generation_config: GenerationConfig
    processors: LogitsProcessorList
    do_sample: bool
    eos_token_ids: frozenset[int]
    stopping: StoppingCriteriaList | None = None  # stop strings, max_time, the caller's criteria
    generator: torch.Generator | None = None  # the request's own (``seed=``); else the engine's
    seed: int | None = None  # the request's ``seed=``: each sequence of ``num_return_sequences`` derives its own
    num_logprobs: int | None = None  # record log-probs with this many alternatives
    raw_logprobs: bool = False  # of the raw logits, not the processed scores (logprobs_mode "raw_logprobs")
    output_scores: bool = False
    output_logits: bool = False
    prefix: list[int] = field(default_factory=list)  # generate's left padding: what processors see first
    # ``processors`` batched (plus OpenAI's penalties and logit bias from the config): what rows run
    plan: ProcessorPlan = field(default_factory=lambda: ProcessorPlan.of(()))
    # Requests with equal keys are sampled together, their rows stacked (see ``batch_key``)
    batch_key: tuple | None = None
    # A ``lockstep.Lockstep``: the request is a row of a ``model.generate`` batch whose caller's
    # processors and criteria run on the whole batch; it samples with the batch, not here
    lockstep: Any = None

    def for_sequence(self, index: int) -> RequestSampling:
        """The params of sibling ``index`` of ``num_return_sequences``: with a ``seed``, a generator of
        its own (from the seed and the index), so each sequence's draws depend on nothing but its own
        tokens, not on which siblings the scheduler ran beside it (a preemption reorders them)."""
        if self.generator is None:
            return self
        child_seed = (self.seed * 1_000_003 + index) % (2**63)
        generator = torch.Generator(device=self.generator.device).manual_seed(child_seed)
        return dataclasses.replace(self, generator=generator)

    @property
    def needs_row_work(self) -> bool:
        return (
            bool(self.plan.steps)
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
    if mode is GenerationMode.ASSISTED_GENERATION and config.prompt_lookup_num_tokens is not None:
        mode = GenerationMode.SAMPLE if config.do_sample else GenerationMode.GREEDY_SEARCH  # speculative/
    check_generation_options(config)
    if mode not in SUPPORTED_MODES:
        raise NotImplementedError(
            f"generation mode {mode.value!r} (num_beams={config.num_beams}, do_sample={config.do_sample}) is not "
            f"supported by the paged engine: greedy search, sampling, beam search and beam sampling are; {RUN_ANYWAY}"
        )
    for name, neutral in UNSUPPORTED_OPTIONS.items():
        value = getattr(config, name, None)
        allowed = neutral if isinstance(neutral, tuple) else (neutral,)
        if value not in allowed:
            raise NotImplementedError(
                f"generation option {name}={value!r} is not supported by the paged engine; {RUN_ANYWAY}"
            )


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
    max_new_tokens: int | None = None,
    prefix: list[int] | None = None,
    lockstep: Any = None,
    ignore_eos: bool = False,
    raw_logprobs: bool = False,
) -> RequestSampling:
    """Resolve ``config`` as ``generate`` does and build its processors and criteria for one request.

    ``prefix``: the left padding ``generate``'s batch put before this prompt; processors and
    criteria see it, as they see the padded row in transformers (``min_length``, ``max_length``,
    ``forced_eos_token_id``, n-gram and repetition processors count it). ``lockstep``: the
    ``lockstep.Lockstep`` batch the request is a row of (its processors and criteria run there).
    ``ignore_eos``: EOS does not stop the request (vLLM's ``ignore_eos``): its ``eos_token_ids``, the
    set every stop check reads, is empty, while the processors still see the config's EOS
    (``min_new_tokens`` suppresses it, ``forced_eos_token_id`` forces it).
    """
    config = copy.copy(config)  # its attributes are replaced below, never changed in place
    check_supported(config)
    prefix = list(prefix or [])
    prompt_length += len(prefix)
    if max_new_tokens is not None:  # the length limit processors such as forced_eos_token_id see
        config.max_length = prompt_length + max_new_tokens
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ValueError(f"logprobs must be None or an int >= 0, got {logprobs!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be None or an int, got {seed!r}")
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a bool, got {ignore_eos!r}")
    device = input_device(model)  # where logits arrive; model.device is "meta" when accelerate offloads
    hf.prepare_special_tokens(model, config, True, device)
    model_kwargs = {"attention_mask": padding_mask(len(prefix), prompt_length, config)} if prefix else {}
    processors = hf.logits_processors(model, config, prompt_length, extra_processors, device, model_kwargs)
    eos = hf.eos_token_tensor(config)
    eos_ids = frozenset(eos.flatten().tolist()) if eos is not None and not ignore_eos else frozenset()
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    params = RequestSampling(
        generation_config=config,
        processors=processors,
        do_sample=bool(config.do_sample),
        eos_token_ids=eos_ids,
        stopping=make_stopping_criteria(config, stopping_criteria, tokenizer),
        generator=generator,
        seed=seed,
        num_logprobs=logprobs,
        raw_logprobs=raw_logprobs,
        output_scores=bool(config.return_dict_in_generate and config.output_scores),
        output_logits=bool(config.return_dict_in_generate and config.output_logits),
        prefix=prefix,
        plan=plan_processors(processors, **openai_options(config)),
        lockstep=lockstep,
    )
    params.batch_key = batch_key(params)
    return params


def batch_key(params: RequestSampling) -> tuple | None:
    """What a request's sampling must share with others to be done on stacked rows: sampling or
    not, and its plan's key (its processors' types and the settings their arithmetic depends on).
    None when its row needs its own work: its own generator (``seed=``), or scores, logits or
    log-probs to record."""
    if params.generator is not None or params.output_scores or params.output_logits or params.num_logprobs is not None:
        return None
    return (params.do_sample, params.plan.key)


def padding_mask(num_padding: int, length: int, config: GenerationConfig) -> torch.Tensor:
    """The attention mask the repetition penalty reads to skip generate's padding: one row per
    sequence the processors see at once (a beam group's beams, else one). [rows, length]"""
    rows = config.num_beams if (config.num_beams or 1) > 1 else 1
    return torch.tensor([[0] * num_padding + [1] * (length - num_padding)] * rows)


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
    history = torch.tensor([request.sampling.prefix + request.all_ids])  # [1, seq]
    return bool(stopping(history, scores).any())


def sample_rows(
    logits: torch.Tensor, requests: list[Request], generator: torch.Generator, history: TokenHistory | None = None
) -> list[Sample | Exception]:
    """``sample_tokens``, where a request whose sampling raises (e.g. a custom logits processor) gets
    the exception instead and the others go on. A failure costs its neighbours nothing: each row of
    its own is sampled once (a seeded request's generator is never drawn twice), and only a stack
    that raised is sampled again, row by row."""
    return sample_tokens(logits, requests, generator, history, isolate=True)


def sample_one(
    logits: torch.Tensor, request: Request, generator: torch.Generator, history: TokenHistory | None = None
) -> Sample | Exception:
    try:
        return sample_tokens(logits, [request], generator, history)[0]
    except Exception as exc:
        return exc


def sample_tokens(
    logits: torch.Tensor,
    requests: list[Request],
    generator: torch.Generator | None,
    history: TokenHistory | None = None,
    isolate: bool = False,
) -> list[Sample | Exception]:
    """One sample per request. logits: [num_requests, vocab] float32, row i for requests[i].

    Greedy rows are one batched argmax; rows whose plans share a key (``batch_key``: e.g. every
    request at temperature 0.8 and top-p 0.9, or every row of a ``generate(min_new_tokens=...)``
    call) run their processors once on their stacked rows and draw together; the others (their own
    generator, scores or log-probs to record) one by one. ``history``: the engine's ids of each
    request whose plan reads them (a request is added at its first sample); None reads them from
    the requests themselves (tests). ``isolate``: a row's exception is returned as its sample
    (``sample_rows``) rather than raised.
    """
    greedy = any(not request.sampling.needs_row_work for request in requests)
    tokens = row_argmax(logits).tolist() if greedy else []  # greedy rows need nothing more
    samples: list[Sample | None] = [None] * len(requests)
    together: dict[tuple, list[int]] = {}
    for row, request in enumerate(requests):
        params: RequestSampling = request.sampling
        if not params.needs_row_work:
            samples[row] = Sample(tokens[row])
        elif params.batch_key is not None:
            together.setdefault(params.batch_key, []).append(row)
        else:
            try:
                samples[row] = _sample_row(logits[row : row + 1], request, generator, history)
            except Exception as exc:
                if not isolate:
                    raise
                samples[row] = exc
    for rows in together.values():
        try:
            _sample_stack(logits, [requests[row] for row in rows], rows, generator, history, samples)
        except Exception:
            if not isolate:
                raise
            for row in rows:  # which row raised: each alone
                samples[row] = sample_one(logits[row : row + 1], requests[row], generator, history)
    return samples


def _sample_stack(
    logits: torch.Tensor,
    stack: list[Request],
    rows: list[int],
    generator: torch.Generator | None,
    history: TokenHistory | None,
    samples: list[Sample | Exception | None],
) -> None:
    """Requests of one ``batch_key``: their processors once on their stacked rows, one draw."""
    plan, do_sample = stack[0].sampling.plan, stack[0].sampling.do_sample
    raw = logits[torch.tensor(rows, device=logits.device)]  # [R, vocab], a copy the plan may change
    ids = _rows(stack, history, logits.device) if plan.needs_rows else None
    scores = run_plans([r.sampling.plan for r in stack], ids, raw, tail=False)
    scores, candidates = stacked_scores(plan.row_free_tail, scores)
    drawn = draw(torch.softmax(scores, dim=-1), generator) if do_sample else scores.argmax(dim=-1)
    if candidates is not None:  # positions among each row's top-k candidates -> token ids
        drawn = candidates.gather(1, drawn.view(-1, 1)).view(-1)
    for row, token in zip(rows, drawn.tolist()):
        samples[row] = Sample(token)


def _rows(requests: list[Request], history: TokenHistory | None, device: torch.device) -> Rows:
    """The stacked ids processors read for ``requests``: generate's left padding, prompt, generated
    tokens. From ``history`` (adding the requests it does not track yet), else from the requests."""
    if history is None:
        return Rows.from_lists(
            [r.sampling.prefix + r.all_ids for r in requests],
            [len(r.sampling.prefix) + len(r.prompt_ids) for r in requests],
            device,
        )
    for r in requests:
        if r not in history:
            history.add(r, r.sampling.prefix + r.all_ids, num_prompt=len(r.sampling.prefix) + len(r.prompt_ids))
    return history.rows(requests)


# After a top-k (filter -inf), these only ever look at the kept candidates' probabilities
_MASS_ONLY = (TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper, LogitNormalization)


def stacked_scores(processors: LogitsProcessorList, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row-free processors on stacked rows raw [R, vocab] -> (scores, ids). With a top-k whose
    filter is -inf, preceded only by a temperature and followed only by processors that read the
    kept candidates' probabilities (top-p, min-p, typical-p), everything outside each row's top k is
    -inf whatever follows, so the processors after it run on the k candidates alone (top-p sorts k
    scores instead of the vocabulary): scores [R, k] and ids [R, k] their token ids. Otherwise,
    or if a row ties at its k-th score (top-k keeps every tie), scores [R, vocab] and ids None."""
    cut = next((i for i, p in enumerate(processors) if isinstance(p, TopKLogitsWarper)), None)
    ids = torch.empty(raw.shape[0], 0, dtype=torch.long, device=raw.device)  # the processors ignore the ids
    if (
        cut is None
        or processors[cut].filter_value != float("-inf")
        or not all(isinstance(p, TemperatureLogitsWarper) for p in processors[:cut])
        or not all(isinstance(p, _MASS_ONLY) for p in processors[cut + 1 :])
    ):
        return processors(ids, raw), None
    scores = raw
    for processor in processors[:cut]:
        scores = processor(ids, scores)
    top_k = processors[cut]
    k = min(max(top_k.top_k, top_k.min_tokens_to_keep), scores.shape[-1])
    values, candidates = torch.topk(scores, k, dim=-1)  # [R, k] each
    if bool(((scores >= values[:, -1:]).sum(dim=-1) > k).any()):  # a tie at the k-th score
        return LogitsProcessorList(processors[cut:])(ids, scores), None
    for processor in processors[cut + 1 :]:
        values = processor(ids, values)
    return values, candidates


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``probs`` [R, vocab], by inverse CDF: distributed as
    ``torch.multinomial(probs, 1)``, which took 5.6 ms for 64 rows of 4,096 on CPU against ~0.5 ms.
    A zero-probability token is never drawn (its step of the CDF is empty). Returns [R] int64."""
    cdf = probs.cumsum(dim=-1)  # [R, vocab]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_max(probs.shape[-1] - 1).view(-1)


def _sample_row(
    raw: torch.Tensor, request: Request, generator: torch.Generator | None, history: TokenHistory | None = None
) -> Sample:
    """One request's sample from its raw logits [1, vocab], through its own plan and history."""
    params: RequestSampling = request.sampling
    if params.plan.steps:
        ids = _rows([request], history, raw.device) if params.plan.needs_rows else None
        scores = run_plans([params.plan], ids, raw.clone())
    else:
        scores = raw
    if params.do_sample:
        token = int(draw(torch.softmax(scores, dim=-1), params.generator or generator))
    else:
        token = int(scores.argmax(dim=-1))
    return Sample(
        token,
        scores=scores[0].cpu() if params.output_scores else None,
        logits=raw[0].cpu() if params.output_logits else None,
        logprob=token_logprob((raw if params.raw_logprobs else scores)[0], token, params.num_logprobs),
    )


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


def prompt_token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Prompt log-probabilities: ``tokens[i]``'s under the raw ``logits[i]`` [P, vocab] (the
    model's distribution after the tokens before it) and its ``k`` best alternatives, in one pass."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [P, vocab]
    index = torch.tensor(tokens, device=logits.device).unsqueeze(1)  # [P, 1]
    chosen_t = logprobs.gather(1, index)  # [P, 1]
    ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()  # [P]
    chosen = chosen_t.squeeze(1).tolist()  # [P]
    if not k:
        return [TokenLogprob(t, lp, rank=r) for t, lp, r in zip(tokens, chosen, ranks)]
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [P, k]
    return [TokenLogprob(t, lp, list(zip(i, v)), r)
            for t, lp, i, v, r in zip(tokens, chosen, ids.tolist(), values.tolist(), ranks)]


def resolve_max_new_tokens(config: GenerationConfig, prompt_length: int, value: int | None) -> int:
    """``value``, else the config's ``max_new_tokens``, else what its ``max_length`` leaves (20 as
    transformers' default); ValueError unless it is a positive int."""
    if value is None:
        value = config.max_new_tokens
        if value is None:
            value = max(config.max_length - prompt_length, 0) if config.max_length else 20
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {value!r}")
    return value
