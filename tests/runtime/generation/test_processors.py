"""Batched logits processors (``runtime/generation/processors/``) against transformers' own.

The reference is what transformers' ``generate`` computes: each processor built as ``generate``
builds it for a batch (left padding, ``prompt_ignore_length`` from the attention mask, the padded
prompt length), run on that batch's ``[batch, len]`` ids. The batched side is what the engine has:
the same rows tracked one by one in a ``TokenHistory`` (several ``generate`` batches at different
steps mixed together, in a shuffled order), each with the processor a single request gets, stacked
and run once. Scores must be bit-identical.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
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
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.runtime.generation.processors import (
    GenerateBatch,
    LogitBias,
    Opaque,
    PresenceFrequencyPenalty,
    RowFree,
    Rows,
    TokenHistory,
    openai_options,
    plan_processors,
    run_plans,
    stacks,
)
from hf_paged_attn.runtime.generation.sampling import make_sampling_params, stacked_scores
from hf_paged_attn_tools.testing import left_padded, tiny_llama_config

PAD = 3  # not 0: a fill with zeros must not pass for padding


@dataclass
class Group:
    """The rows of one ``generate`` call at one step: prompts, then ``len(generated[0])`` tokens each."""

    prompts: list[list[int]]
    generated: list[list[int]]
    max_new_tokens: int

    @property
    def width(self) -> int:  # the padded prompt length: generate's input_ids_seq_length
        return max(map(len, self.prompts))

    def padding(self, row: int) -> int:
        return self.width - len(self.prompts[row])

    def ids(self) -> torch.Tensor:
        """[batch, width + steps]: the input_ids generate's processors see at this step."""
        padded, _ = left_padded(self.prompts, pad=PAD)
        return torch.cat([padded, torch.tensor(self.generated, dtype=torch.long).view(len(self.prompts), -1)], dim=1)


@st.composite
def groups(draw: st.DrawFn, vocab: int) -> list[Group]:
    """1-3 generate batches; tokens from a small alphabet (repeats, n-grams) that reaches past the
    output vocab now and then (embedding vocab > lm_head vocab), as transformers' processors allow."""
    token = st.integers(0, vocab + 1)
    out = []
    for _ in range(draw(st.integers(1, 3))):
        batch = draw(st.integers(1, 4))
        steps = draw(st.integers(0, 6))
        prompts = [draw(st.lists(token, min_size=1, max_size=8)) for _ in range(batch)]
        generated = [draw(st.lists(token, min_size=steps, max_size=steps)) for _ in range(batch)]
        out.append(Group(prompts, generated, steps + draw(st.integers(1, 3))))
    return out


def _batched_scores(
    all_groups: list[Group], row_processors: list[list[LogitsProcessor]], logits: torch.Tensor, seed: int
) -> torch.Tensor:
    """The engine's side, as ``sampling._sample_stack`` runs it: rows tracked one by one in a
    TokenHistory (added, then one append per step), stacked in a shuffled order, one plan per row,
    run once up to its row-free tail, the tail (temperature, top-k, top-p) by the sampler's own
    ``stacked_scores`` (top-p on the top-k candidates alone), scattered back over the vocabulary.
    Returns the scores in the groups' row order."""
    history = TokenHistory(capacity=2, width=4)  # small: the buffer must grow
    keys = [(g, b) for g, group in enumerate(all_groups) for b in range(len(group.prompts))]
    for g, b in keys:
        group = all_groups[g]
        history.add((g, b), [PAD] * group.padding(b) + group.prompts[b], num_prompt=group.width)
    for step in range(max(len(group.generated[0]) for group in all_groups)):
        live = [(g, b) for g, b in keys if step < len(all_groups[g].generated[b])]
        history.append(live, [all_groups[g].generated[b][step] for g, b in live])
    order = list(range(len(keys)))
    random.Random(seed).shuffle(order)
    plans = [plan_processors(row_processors[i]) for i in order]
    assert len({plan.key for plan in plans}) == 1, "per-row values must not split the stack"
    out = run_plans(plans, history.rows([keys[i] for i in order]), logits[order].clone(), tail=False)
    out, candidates = stacked_scores(plans[0].row_free_tail, out)
    if candidates is not None:  # [R, k] scores of each row's candidates: -inf elsewhere, as the warpers leave it
        out = torch.full_like(logits, -math.inf).scatter(1, candidates, out)
    return out[torch.argsort(torch.tensor(order))]


# Each case: settings drawn once per example, then (reference processor for a group, one processor per row)
Case = Callable[[st.DataObject, int], Callable[[Group], tuple[LogitsProcessor, list[LogitsProcessor]]]]


def _eos(data: st.DataObject, vocab: int) -> list[int]:
    return data.draw(st.lists(st.integers(0, vocab + 2), min_size=1, max_size=2, unique=True))


def repetition_case(data: st.DataObject, vocab: int):
    penalty = data.draw(st.sampled_from([0.5, 0.8, 1.2, 1.5, 2.0]))
    mode = data.draw(st.sampled_from(["mask", "none", "int"]))
    fixed = data.draw(st.integers(0, 4))

    def build(group: Group):
        if mode == "mask":  # generate with an attention mask: the padding is ignored, row by row
            pads = [group.padding(b) for b in range(len(group.prompts))]
            return RepetitionPenaltyLogitsProcessor(penalty, torch.tensor(pads)), [
                RepetitionPenaltyLogitsProcessor(penalty, torch.tensor([p])) for p in pads
            ]
        ignore = fixed if mode == "int" else None
        return RepetitionPenaltyLogitsProcessor(penalty, ignore), [
            RepetitionPenaltyLogitsProcessor(penalty, ignore) for _ in group.prompts
        ]

    return build


def ngram_case(data: st.DataObject, vocab: int):
    size = data.draw(st.integers(1, 4))
    return lambda group: (NoRepeatNGramLogitsProcessor(size), [NoRepeatNGramLogitsProcessor(size)] * len(group.prompts))


def min_length_case(data: st.DataObject, vocab: int):
    eos, min_length = _eos(data, vocab), data.draw(st.integers(0, 16))
    return lambda group: (
        MinLengthLogitsProcessor(min_length, eos),
        [MinLengthLogitsProcessor(min_length, eos) for _ in group.prompts],
    )


def min_new_tokens_case(data: st.DataObject, vocab: int):
    eos, min_new = _eos(data, vocab), data.draw(st.integers(0, 8))
    return lambda group: (
        MinNewTokensLengthLogitsProcessor(group.width, min_new, eos),
        [MinNewTokensLengthLogitsProcessor(group.width, min_new, eos) for _ in group.prompts],
    )


def bad_words_case(data: st.DataObject, vocab: int):
    words = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3), min_size=1, max_size=5))
    eos = data.draw(st.sampled_from([None, words[0][0]]))  # a one-token bad word that is EOS is dropped
    return lambda group: (
        NoBadWordsLogitsProcessor(words, eos),
        [NoBadWordsLogitsProcessor(words, eos) for _ in group.prompts],
    )


def sequence_bias_case(data: st.DataObject, vocab: int):
    sequences = data.draw(
        st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3), min_size=1, max_size=5, unique_by=tuple)
    )
    bias = [[seq, data.draw(st.floats(-5, 5, width=32))] for seq in sequences]
    return lambda group: (
        SequenceBiasLogitsProcessor(bias),
        [SequenceBiasLogitsProcessor(bias) for _ in group.prompts],
    )


def forced_bos_case(data: st.DataObject, vocab: int):
    bos = data.draw(st.integers(0, vocab - 1))
    return lambda group: (ForcedBOSTokenLogitsProcessor(bos), [ForcedBOSTokenLogitsProcessor(bos)] * len(group.prompts))


def forced_eos_case(data: st.DataObject, vocab: int):
    eos = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=2, unique=True))

    def build(group: Group):  # generate sets max_length = padded prompt + max_new_tokens
        max_length = group.width + group.max_new_tokens
        return ForcedEOSTokenLogitsProcessor(max_length, eos), [
            ForcedEOSTokenLogitsProcessor(max_length, eos) for _ in group.prompts
        ]

    return build


def suppress_case(data: st.DataObject, vocab: int):
    tokens = data.draw(st.lists(st.integers(0, vocab + 2), max_size=4))
    return lambda group: (
        SuppressTokensLogitsProcessor(tokens),
        [SuppressTokensLogitsProcessor(tokens) for _ in group.prompts],
    )


def suppress_at_begin_case(data: st.DataObject, vocab: int):
    tokens = data.draw(st.lists(st.integers(0, vocab + 2), min_size=1, max_size=4))
    shift = data.draw(st.integers(0, 2))  # generate's begin_index is the padded prompt length (+1 with a forced BOS)

    def build(group: Group):
        begin = group.width + shift
        return SuppressTokensAtBeginLogitsProcessor(tokens, begin), [
            SuppressTokensAtBeginLogitsProcessor(tokens, begin) for _ in group.prompts
        ]

    return build


def row_free_case(data: st.DataObject, vocab: int):
    k, p = data.draw(st.integers(1, vocab)), data.draw(st.floats(0.1, 0.99))
    return lambda group: (
        LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(k), TopPLogitsWarper(p)]),
        [LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(k), TopPLogitsWarper(p)])]
        * len(group.prompts),
    )


CASES = [
    repetition_case,
    ngram_case,
    min_length_case,
    min_new_tokens_case,
    bad_words_case,
    sequence_bias_case,
    forced_bos_case,
    forced_eos_case,
    suppress_case,
    suppress_at_begin_case,
    row_free_case,
]


def _as_list(processor: LogitsProcessor | LogitsProcessorList) -> list[LogitsProcessor]:
    return list(processor) if isinstance(processor, LogitsProcessorList) else [processor]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), vocab=st.integers(4, 24), seed=st.integers(0, 2**16))
def test_batched_equals_transformers_on_the_padded_batch(
    case: Case, data: st.DataObject, vocab: int, seed: int
) -> None:
    _check_cases([case], data, vocab, seed)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), vocab=st.integers(4, 24), seed=st.integers(0, 2**16))
def test_a_whole_list_in_generates_order(data: st.DataObject, vocab: int, seed: int) -> None:
    """Several processors chained, in the order ``_get_logits_processor`` appends them."""
    _check_cases(
        [sequence_bias_case, repetition_case, ngram_case, bad_words_case, min_length_case, min_new_tokens_case,
         forced_eos_case, suppress_case, suppress_at_begin_case, row_free_case],
        data, vocab, seed,
    )  # fmt: skip


def _check_cases(cases: list[Case], data: st.DataObject, vocab: int, seed: int) -> None:
    all_groups = data.draw(groups(vocab))
    builders = [case(data, vocab) for case in cases]
    num_rows = sum(len(g.prompts) for g in all_groups)
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, 0] = logits[:, 1]  # a tie, for the top-k/top-p warpers
    expected, row_processors, start = [], [], 0
    for group in all_groups:
        built = [build(group) for build in builders]
        reference = LogitsProcessorList(p for ref, _ in built for p in _as_list(ref))
        rows = len(group.prompts)
        expected.append(reference(group.ids(), logits[start : start + rows].clone()))
        row_processors += [[p for _, per_row in built for p in _as_list(per_row[b])] for b in range(rows)]
        start += rows
    actual, expected = _batched_scores(all_groups, row_processors, logits, seed), torch.cat(expected)
    # Equal scores at a top-k / top-p cut (tokens 0 and 1 always tie; processors make more ties, e.g. two
    # tokens left at 0.0): which of them is kept depends on how an unstable sort orders equal scores, which
    # differs between the full row and its top-k candidates (and with the row's length in transformers
    # itself). A row may differ only by such a choice: the tokens kept by one side alone carry the same
    # scores as those kept by the other alone, and everything else is equal.
    for row in (actual != expected).any(dim=-1).nonzero().flatten().tolist():
        a, e = actual[row], expected[row]
        only_a, only_e = (a > -math.inf) & (e == -math.inf), (e > -math.inf) & (a == -math.inf)
        same = ~(only_a | only_e)
        assert torch.equal(a[same], e[same]), (row, a, e)
        assert torch.equal(a[only_a].sort().values, e[only_e].sort().values), (row, a, e)


def test_forced_bos_and_min_length_fire_on_their_rows() -> None:
    """Deterministic: rows of 1 id get only BOS; rows below min_length lose EOS; the rest are untouched."""
    rows = Rows.from_lists([[5], [5, 6], [5, 6, 7, 8]])
    logits = torch.randn(3, 10)
    plans = [plan_processors([ForcedBOSTokenLogitsProcessor(3), MinLengthLogitsProcessor(3, [9])])] * 3
    out = run_plans(plans, rows, logits.clone())
    assert out[0, 3] == 0 and torch.isinf(out[0, torch.arange(10) != 3]).all()
    assert out[1, 9] == -math.inf and torch.equal(out[1, :9], logits[1, :9])
    assert torch.equal(out[2], logits[2])


# ------------------------------------------------------------------------------------------ OpenAI extras
def _reference_penalties(row: list[int], start: int, scores: list[float], presence: float, frequency: float):
    counts = Counter(row[start:])
    return [s - frequency * counts[t] - presence * (counts[t] > 0) for t, s in enumerate(scores)]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.integers(0, 12)), min_size=1, max_size=6
    ),
    penalties=st.lists(st.tuples(st.floats(-2, 2), st.floats(-2, 2)), min_size=6, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_presence_and_frequency_penalties_count_generated_tokens_only(rows, penalties, seed) -> None:  # noqa: ANN001
    ids = [r for r, _ in rows]
    starts = [min(s, len(r)) for r, s in rows]
    logits = torch.randn(len(ids), 8, generator=torch.Generator().manual_seed(seed))  # ids 8, 9: past the vocab
    plans = [plan_processors([], presence_penalty=p, frequency_penalty=f) for p, f in penalties[: len(ids)]]
    out = logits.clone()
    for stack in stacks(plans):  # both penalties 0: no processor at all, another key
        rows = Rows.from_lists([ids[i] for i in stack], [starts[i] for i in stack])
        out[torch.tensor(stack)] = run_plans([plans[i] for i in stack], rows, logits[torch.tensor(stack)].clone())
    for i, (row, start) in enumerate(zip(ids, starts)):
        presence, frequency = penalties[i]
        expected = _reference_penalties(row, start, logits[i].tolist(), presence, frequency)
        torch.testing.assert_close(out[i], torch.tensor(expected), atol=1e-5, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    biases=st.lists(
        st.dictionaries(st.integers(0, 15), st.floats(-300, 300, allow_nan=False), max_size=6), min_size=1, max_size=5
    ),
    seed=st.integers(0, 2**16),
)
def test_logit_bias_adds_clamped_biases(biases, seed) -> None:  # noqa: ANN001
    logits = torch.randn(len(biases), 16, generator=torch.Generator().manual_seed(seed))
    plans = [plan_processors([], logit_bias=b) for b in biases]
    out = logits.clone()
    for stack in stacks(plans):  # an empty logit_bias is no processor at all: another key
        index = torch.tensor(stack)
        out[index] = run_plans([plans[i] for i in stack], None, logits[index].clone())
    for i, bias in enumerate(biases):
        expected = logits[i].tolist()
        for token, value in bias.items():
            expected[token] += min(max(value, -100.0), 100.0)
        torch.testing.assert_close(out[i], torch.tensor(expected), atol=1e-5, rtol=1e-6)


def test_openai_extras_validate_and_take_vllms_place() -> None:
    with pytest.raises(ValueError, match="presence_penalty"):
        PresenceFrequencyPenalty(presence=2.5)
    with pytest.raises(ValueError, match="logit_bias keys"):
        LogitBias({-1: 1.0})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run_plans([plan_processors([], logit_bias={40: 1.0})], None, torch.zeros(1, 16))
    assert LogitBias({"7": 1.0}).tokens.tolist() == [7]  # JSON object keys arrive as strings
    repetition, temperature = RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.5)
    no_repeat = NoRepeatNGramLogitsProcessor(2)
    plan = plan_processors([no_repeat, repetition, temperature], presence_penalty=0.5, logit_bias={1: 2.0})
    kinds = [type(s).__name__ for s in plan.steps]
    assert kinds == ["LogitBias", "NoRepeatNGram", "RepetitionPenalty", "PresenceFrequencyPenalty", "RowFree"]
    plan = plan_processors([no_repeat, temperature], frequency_penalty=0.5)
    assert [type(s).__name__ for s in plan.steps] == ["NoRepeatNGram", "PresenceFrequencyPenalty", "RowFree"]
    assert plan.tail_start == 2 and list(plan.row_free_tail) == [temperature]
    options = openai_options(GenerationConfig(presence_penalty=0.5, logit_bias={3: -1.0}))
    assert options == {"presence_penalty": 0.5, "frequency_penalty": 0.0, "logit_bias": {3: -1.0}}
    assert openai_options(GenerationConfig()) == {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None}


# ------------------------------------------------------------------------------------------ stacking keys
class _Shift(LogitsProcessor):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores + input_ids.shape[-1]  # reads the ids: must see its own row's length


def test_keys_group_equal_settings_and_separate_different_ones() -> None:
    def key(*processors: LogitsProcessor, **extras: object) -> tuple:
        return plan_processors(list(processors), **extras).key

    eos = [1]
    same = [
        key(RepetitionPenaltyLogitsProcessor(1.2, torch.tensor([p])), MinNewTokensLengthLogitsProcessor(w, 4, eos),
            ForcedEOSTokenLogitsProcessor(w + 9, eos), TopKLogitsWarper(5), presence_penalty=x, logit_bias={p: x})
        for p, w, x in [(0, 5, 0.1), (3, 9, 0.2), (1, 7, 1.0)]
    ]  # fmt: skip
    assert same[0] == same[1] == same[2]  # padding, prompt lengths, max_length, OpenAI values: per row
    base = key(RepetitionPenaltyLogitsProcessor(1.2), TopKLogitsWarper(5))
    assert base != key(RepetitionPenaltyLogitsProcessor(1.3), TopKLogitsWarper(5))
    assert base != key(RepetitionPenaltyLogitsProcessor(1.2), TopKLogitsWarper(6))
    assert base != key(TopKLogitsWarper(5), RepetitionPenaltyLogitsProcessor(1.2))  # order matters
    assert key(NoRepeatNGramLogitsProcessor(2)) != key(NoRepeatNGramLogitsProcessor(3))
    assert key(MinLengthLogitsProcessor(3, [1])) != key(MinLengthLogitsProcessor(3, [2]))
    assert key(NoBadWordsLogitsProcessor([[3, 4]])) == key(NoBadWordsLogitsProcessor([[3, 4]]))
    assert key(NoBadWordsLogitsProcessor([[3, 4]])) != key(NoBadWordsLogitsProcessor([[3, 5]]))
    shift = _Shift()
    assert key(shift) == key(shift) and key(shift) != key(_Shift())  # a caller's: the same instance only
    assert isinstance(plan_processors([shift]).steps[0], Opaque)


def test_a_callers_processor_runs_per_row_on_its_own_ids() -> None:
    shift = _Shift()
    rows = Rows.from_lists([[1, 2, 3], [4]])
    plans = [plan_processors([shift])] * 2
    out = run_plans(plans, rows, torch.zeros(2, 5))
    assert out[:, 0].tolist() == [3.0, 1.0]


def test_subclasses_and_unmappable_settings_stay_opaque() -> None:
    class MyPenalty(RepetitionPenaltyLogitsProcessor):
        pass

    assert isinstance(plan_processors([MyPenalty(1.2)]).steps[0], Opaque)
    whole_batch = RepetitionPenaltyLogitsProcessor(1.2, torch.tensor([0, 2]))  # a caller's, for a batch of 2
    assert isinstance(plan_processors([whole_batch]).steps[0], Opaque)
    assert isinstance(plan_processors([TemperatureLogitsWarper(0.5)]).steps[0], RowFree)


@pytest.fixture(scope="module")
def demo_model():
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged")


def test_make_sampling_params_lists_map_to_batched_processors(demo_model) -> None:  # noqa: ANN001
    """Every processor a GenerationConfig turns on maps to a batched one; on rows of different
    padding and prompt lengths the stacked plan equals each request's own list on its [1, seq] row."""
    config = demo_model._prepare_generation_config(
        GenerationConfig(
            repetition_penalty=1.3, no_repeat_ngram_size=2, bad_words_ids=[[7, 8], [9]], sequence_bias=[[[5], -1.0]],
            min_length=9, min_new_tokens=3, forced_eos_token_id=1, suppress_tokens=[4], begin_suppress_tokens=[6],
            do_sample=True, temperature=0.7, top_k=50, top_p=0.9,
        )
    )[0]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    requests = []
    for padding, prompt_len, new in [(0, 5, 0), (2, 3, 0), (4, 6, 3), (1, 2, 2)]:
        prefix = [2] * padding
        prompt = torch.randint(3, 40, (prompt_len,), generator=gen).tolist()
        output = torch.randint(3, 40, (new,), generator=gen).tolist()
        params = make_sampling_params(demo_model, config, prompt_len, prefix=prefix, max_new_tokens=4)
        requests.append((params, prefix + prompt + output, padding + prompt_len))
    plans = [plan_processors(params.processors) for params, _, _ in requests]
    assert not any(isinstance(s, Opaque) for plan in plans for s in plan.steps), plans[0].steps
    assert len({plan.key for plan in plans}) == 1
    history = TokenHistory()
    for i, (_, ids, start) in enumerate(requests):
        history.add(i, ids, num_prompt=start)
    logits = torch.randn(len(requests), 4096, generator=gen)
    out = run_plans(plans, history.rows(range(len(requests))), logits.clone())
    for i, (params, ids, _) in enumerate(requests):
        expected = params.processors(torch.tensor([ids]), logits[i : i + 1].clone())
        assert torch.equal(out[i : i + 1], expected), i


# ------------------------------------------------------------------------------------------ token history
def test_history_appends_forks_releases_and_grows() -> None:
    history = TokenHistory(capacity=1, width=2)
    history.add("a", [1, 2, 3], num_prompt=2)
    history.add("b", [4])
    history.append(["b", "a"], torch.tensor([5, 6]))
    history.fork("a", "a#1")
    history.append(["a#1"], [7])
    rows = history.rows(["a", "b", "a#1"])
    assert rows.lengths.tolist() == [4, 2, 5] and rows.starts.tolist() == [2, 1, 2]
    assert rows.ids.tolist() == [[1, 2, 3, 6, -1], [4, 5, -1, -1, -1], [1, 2, 3, 6, 7]]
    assert history.row("a#1").tolist() == [[1, 2, 3, 6, 7]]
    history.release("b")
    history.add("c", [9])
    assert history.rows(["c"]).ids.tolist() == [[9]] and len(history) == 3 and "b" not in history
    with pytest.raises(ValueError, match="already tracked"):
        history.add("c", [1])


# ------------------------------------------------------------------------------------------ generate's batch
class _Recorder(LogitsProcessor):
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.seen.append(input_ids.clone())
        return scores


class _StopRow(StoppingCriteria):
    """Stops batch row ``row`` once the batch is ``length`` wide (a caller's own criterion); records its input."""

    def __init__(self, row: int, length: int) -> None:
        self.row, self.length, self.seen = row, length, []

    def __call__(self, input_ids: torch.LongTensor, scores: object, **kwargs: object) -> torch.BoolTensor:
        self.seen.append(input_ids.clone())
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[self.row] = input_ids.shape[1] >= self.length
        return done


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_llama_config(), attn_implementation="sdpa").eval()


def _replay(model, prompts, eos: int | None, max_new_tokens: int = 6, stop_row: int = 1, stop_at_new: int = 2):  # noqa: ANN001
    """Run sdpa generate with a recording processor and criterion, then rebuild what they saw
    with GenerateBatch from generate's own tokens, step by step, as the engine would."""
    input_ids, mask = left_padded(prompts, pad=PAD)
    width = input_ids.shape[1]
    recorder, criterion = _Recorder(), _StopRow(stop_row, width + stop_at_new)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    sequences = model.generate(input_ids, attention_mask=mask, generation_config=config,
                               logits_processor=LogitsProcessorList([recorder]),
                               stopping_criteria=StoppingCriteriaList([criterion]))  # fmt: skip
    prepared = model._prepare_generation_config(config)[0]
    model._prepare_special_tokens(prepared, True)
    pads = prepared._eos_token_tensor is not None  # generate pads finished rows only with EOS criteria
    batch = GenerateBatch(input_ids, max_new_tokens, int(prepared._pad_token_tensor) if pads else None)
    replay_criteria = StoppingCriteriaList([_StopRow(stop_row, width + stop_at_new)])
    for step, seen in enumerate(recorder.seen):
        assert torch.equal(batch.input_ids, seen), step  # what a caller's processor sees before sampling
        rows = torch.nonzero(batch.unfinished).flatten().tolist()
        tokens = sequences[rows, width + step]  # the engine's samples for its live rows
        batch.append(rows, tokens)
        assert torch.equal(batch.input_ids, criterion.seen[step]), step  # what a criterion sees after
        stop = batch.should_stop(replay_criteria)
        for row in rows:
            if stop[row] or (eos is not None and int(sequences[row, width + step]) == eos):
                batch.finish(row)
    assert torch.equal(batch.input_ids, sequences)
    return sequences, width


def test_generate_batch_matches_what_generates_processors_see(tiny_model) -> None:  # noqa: ANN001
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    input_ids, mask = left_padded(prompts, pad=PAD)
    free = tiny_model.generate(input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    width = input_ids.shape[1]
    eos = int(free[2, width + 1])  # row 2's second token: it finishes early (and any row that meets it)
    sequences, width = _replay(tiny_model, prompts, eos)
    assert (sequences[2, width + 2 :] == PAD).all()  # the test did exercise padding after EOS
    assert (sequences[1, width + 2 :] == PAD).all()  # and after a caller's criterion stopped row 1


def test_generate_batch_runs_a_callers_processor_once_on_the_batch(tiny_model) -> None:  # noqa: ANN001
    recorder = _Recorder()
    batch = GenerateBatch(torch.tensor([[0, 3, 4], [5, 6, 7]]), 2, pad_token_id=0)
    batch.finish(0)
    batch.append([1], [9])
    scores = torch.randn(1, 8)
    out = batch.process(LogitsProcessorList([recorder]), [1], scores.clone())
    assert len(recorder.seen) == 1 and recorder.seen[0].tolist() == [[0, 3, 4, 0], [5, 6, 7, 9]]
    assert torch.equal(out, scores)
    with pytest.raises(ValueError, match="every unfinished row"):
        batch.append([0, 1], [1, 2])
    no_eos = GenerateBatch(torch.tensor([[1], [2]]), 3, pad_token_id=None)
    no_eos.finish(0)
    with pytest.raises(ValueError, match="keep sampling"):
        no_eos.append([1], [3])


def test_without_eos_generate_keeps_sampling_a_stopped_row(tiny_model) -> None:  # noqa: ANN001
    """Why ``GenerateBatch`` refuses a row finished early with ``pad_token_id=None``: without EOS in
    the criteria, transformers' generate keeps sampling a row a caller's criterion stopped."""
    input_ids, mask = left_padded([[5, 6, 7], [8, 9]], pad=PAD)
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    free = tiny_model.generate(input_ids, attention_mask=mask, generation_config=config)
    stopped = tiny_model.generate(
        input_ids, attention_mask=mask, generation_config=config,
        stopping_criteria=StoppingCriteriaList([_StopRow(1, input_ids.shape[1] + 1)]),
    )  # fmt: skip
    assert torch.equal(stopped, free) and not (free[1, input_ids.shape[1] + 1 :] == PAD).all()
