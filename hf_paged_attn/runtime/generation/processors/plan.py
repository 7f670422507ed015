"""A request's processor list as a ``ProcessorPlan`` of batched processors; plans with equal keys
run together (``run_plans``)."""


from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from .batched import (
    ROW_FREE_PROCESSORS,
    BatchedProcessor,
    ForcedBOS,
    ForcedEOS,
    LogitBias,
    MinLength,
    MinNewTokens,
    NoRepeatNGram,
    Opaque,
    PresenceFrequencyPenalty,
    RepetitionPenalty,
    RowFree,
    SequenceBias,
    SuppressTokens,
    SuppressTokensAtBegin,
)
from .history import Rows


# ------------------------------------------------------------------------------------------ plans
@dataclass(frozen=True, slots=True)
class ProcessorPlan:
    """A request's processors, batched. Requests with equal ``key`` run their plans together
    (``run_plans``) on stacked rows. ``tail_start``: where the trailing row-free processors begin
    (temperature, top-k, ...): ``row_free_tail`` is them as transformers' list, for a sampler
    that runs them its own way (``sampling.stacked_scores``)."""

    steps: tuple[BatchedProcessor, ...]
    key: tuple
    tail_start: int

    @classmethod
    def of(cls, steps: Sequence[BatchedProcessor]) -> ProcessorPlan:
        tail_start = len(steps)
        while tail_start and isinstance(steps[tail_start - 1], RowFree):
            tail_start -= 1
        return cls(tuple(steps), tuple(step.key for step in steps), tail_start)

    @property
    def needs_rows(self) -> bool:
        """Whether running the plan reads the rows' ids or lengths (a ``TokenHistory`` must track them)."""
        return any(step.reads_rows for step in self.steps)

    @property
    def row_free_tail(self) -> LogitsProcessorList:
        return LogitsProcessorList(step.processor for step in self.steps[self.tail_start :])  # type: ignore[attr-defined]


def run_plans(
    plans: Sequence[ProcessorPlan], rows: Rows | None, scores: torch.Tensor, *, tail: bool = True
) -> torch.Tensor:
    """Run ``plans`` (one per row, all with one key) once on the stacked ``scores`` [R, vocab]
    float; ``rows``: the same rows' ids (None if no plan ``needs_rows``). ``tail=False`` stops
    before the row-free tail. ``scores`` may be changed in place; returns the processed scores."""
    first = plans[0]
    assert len(plans) == scores.shape[0] and (rows is None or len(rows) == len(plans))
    for j, step in enumerate(first.steps[: None if tail else first.tail_start]):
        scores = step(rows, scores, [plan.steps[j] for plan in plans])
    return scores


def stacks(plans: Sequence[ProcessorPlan]) -> list[list[int]]:
    """The indices of ``plans`` grouped by key, in first-seen order: each group runs as one stack."""
    groups: dict[tuple, list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(plan.key, []).append(i)
    return list(groups.values())


def plan_processors(
    processors: Sequence[LogitsProcessor],
    *,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
) -> ProcessorPlan:
    """The batched plan of ``processors`` (the list ``model._get_logits_processor`` built for one
    request, in its order), with OpenAI's extras: ``logit_bias`` first and the presence/frequency
    penalties right after the repetition penalty, else before the row-free tail (vLLM's order:
    logit bias, then repetition, frequency and presence penalties, then temperature and the rest).
    A processor of a type we batch is matched by exact type (a subclass may change ``__call__``)."""
    steps: list[BatchedProcessor] = [_batched(p) for p in processors]
    if presence_penalty or frequency_penalty:
        penalties = PresenceFrequencyPenalty(presence_penalty, frequency_penalty)
        after = [i for i, s in enumerate(steps) if isinstance(s, RepetitionPenalty)]
        steps.insert(after[0] + 1 if after else ProcessorPlan.of(steps).tail_start, penalties)
    if logit_bias:
        steps.insert(0, LogitBias(logit_bias))
    return ProcessorPlan.of(steps)


def openai_options(config: GenerationConfig) -> dict[str, object]:
    """``plan_processors``' OpenAI keywords from a GenerationConfig: ``GenerationConfig(presence_penalty=0.5,
    frequency_penalty=0.2, logit_bias={50256: -100})`` keeps them as plain attributes (transformers
    ignores them), so they travel with the request's config like its other options."""
    return {
        "presence_penalty": getattr(config, "presence_penalty", None) or 0.0,
        "frequency_penalty": getattr(config, "frequency_penalty", None) or 0.0,
        "logit_bias": getattr(config, "logit_bias", None) or None,
    }


def _batched(p: LogitsProcessor) -> BatchedProcessor:
    kind = type(p)
    if kind in ROW_FREE_PROCESSORS:
        plain = all(isinstance(v, (bool, int, float, str, type(None))) for v in vars(p).values())
        return RowFree(p) if plain else Opaque(p)
    if kind is RepetitionPenaltyLogitsProcessor:
        ignore = _ignore_length(p)
        return RepetitionPenalty(p.penalty, ignore) if ignore is not None else Opaque(p)
    if kind is NoRepeatNGramLogitsProcessor:
        return NoRepeatNGram(p.ngram_size)
    if kind is MinLengthLogitsProcessor:
        return MinLength(p.min_length, _ids(p.eos_token_id))
    if kind is MinNewTokensLengthLogitsProcessor:
        return MinNewTokens(p.prompt_length_to_skip, p.min_new_tokens, _ids(p.eos_token_id))
    if kind in (SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor) and isinstance(p.sequence_bias, dict):
        return SequenceBias(p.sequence_bias)
    if kind is ForcedBOSTokenLogitsProcessor:
        return ForcedBOS(p.bos_token_id)
    if kind is ForcedEOSTokenLogitsProcessor:
        return ForcedEOS(p.max_length, _ids(p.eos_token_id))
    if kind is SuppressTokensLogitsProcessor:
        return SuppressTokens(_ids(p.suppress_tokens))
    if kind is SuppressTokensAtBeginLogitsProcessor:
        return SuppressTokensAtBegin(_ids(p.begin_suppress_tokens), p.begin_index)
    return Opaque(p)


def _ids(value: int | Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(value, torch.Tensor):
        return tuple(value.flatten().tolist())
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _ignore_length(p: RepetitionPenaltyLogitsProcessor) -> int | None:
    """The row's ``prompt_ignore_length`` as one int (None: it cannot be one row's, e.g. a tensor
    over a caller's whole batch, or continuous-batching's 3-D mode is set up)."""
    if getattr(p, "logits_indices", None) is not None or getattr(p, "cu_seq_lens_q", None) is not None:
        return None
    value = p.prompt_ignore_length
    if value is None or isinstance(value, int):
        return value or 0
    values = value.flatten().tolist()  # one row, or a beam group's rows, all with the same padding
    return int(values[0]) if values and len(set(values)) == 1 else None


