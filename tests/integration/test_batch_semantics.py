"""A caller's processors and stopping criteria see what transformers' ``generate`` shows them: the
whole ``[batch, len]`` batch once per step, padding and finished rows (padded with pad_token_id)
included, and a criterion's one bool stops every row. And the built-in processors that read the ids
(run batched per stack of rows) give sdpa's tokens on a padded batch of the demo model."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_paged_attn import PagedConfig
from hf_paged_attn_tools.testing import left_padded, load_pair, ragged_prompts, save_random_model, tiny_llama_config

PAD = 3
PROMPTS = ragged_prompts(5, 3, 12, seed=4)
TEXTS = ["The for statement", "A list is", "Exceptions are raised when", "The import statement", "Python is"]


class Recorder(LogitsProcessor):
    """Records the ids of every call (and, optionally, pushes a token up: the output depends on it)."""

    def __init__(self, boost: int | None = None) -> None:
        self.seen: list[torch.Tensor] = []
        self.boost = boost

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.seen.append(input_ids.clone().cpu())
        if self.boost is not None:
            scores = scores.clone()
            scores[:, self.boost] += 0.5 * (input_ids.shape[1] % 3)  # a nudge that depends on the step
        return scores


class StopRows(StoppingCriteria):
    """Per-row criterion: row ``row`` stops once the batch holds ``length`` columns; records its calls."""

    def __init__(self, row: int, length: int) -> None:
        self.row, self.length, self.seen = row, length, []

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:  # noqa: ANN001
        self.seen.append(input_ids.clone().cpu())
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[self.row] = input_ids.shape[1] >= self.length
        return done


class MultiTokenEOSCriteria(StoppingCriteria):
    """lm-evaluation-harness' criterion, as it is written there: a stateful *batch* criterion that
    keeps a done flag per row, decodes every row's last tokens and returns one bool for the batch."""

    def __init__(self, sequence: str, tokenizer, initial_decoder_input_length: int, batch_size: int) -> None:  # noqa: ANN001
        self.initial_decoder_input_length = initial_decoder_input_length
        self.done_tracker = [False] * batch_size
        self.sequence = sequence
        self.sequence_ids = tokenizer.encode(sequence, add_special_tokens=False)
        self.sequence_id_len = len(self.sequence_ids) + 2
        self.tokenizer = tokenizer

    def __call__(self, input_ids, scores, **kwargs) -> bool:  # noqa: ANN001
        lookback_ids_batch = input_ids[:, self.initial_decoder_input_length :]
        lookback_ids_batch = lookback_ids_batch[:, -self.sequence_id_len :]
        lookback_tokens_batch = self.tokenizer.batch_decode(lookback_ids_batch)
        for i, done in enumerate(self.done_tracker):
            if not done:
                self.done_tracker[i] = self.sequence in lookback_tokens_batch[i]
        return False not in self.done_tracker


@pytest.fixture(scope="module")
def pair_and_eos(tmp_path_factory):
    """A tiny Llama and a token its greedy rows emit early in some rows (the EOS of these tests)."""
    ref, paged = load_pair(save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("llama")))
    ids, mask = left_padded(PROMPTS, pad=PAD)
    out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    firsts = out[:, ids.shape[1] + 2]  # a token some row emits at its third step
    return ref, paged, int(firsts[1])


def _both(ref, paged, make_extra, **kwargs):  # noqa: ANN001, ANN202
    """generate on sdpa and on paged with fresh processors/criteria from ``make_extra()``: (outputs, extras)."""
    ids, mask = left_padded(PROMPTS, pad=PAD)
    results = []
    kwargs.setdefault("do_sample", False)
    for model in (ref, paged):
        extra = make_extra()
        out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=PAD, **extra, **kwargs)
        results.append((out, extra))
    return results


def test_a_callers_processor_sees_the_batch_sdpa_shows_it(pair_and_eos) -> None:  # noqa: ANN001
    ref, paged, eos = pair_and_eos
    (want, a), (got, b) = _both(
        ref, paged, lambda: dict(logits_processor=LogitsProcessorList([Recorder(boost=eos)])),
        max_new_tokens=10, eos_token_id=eos,
    )  # fmt: skip
    seen_ref, seen_paged = a["logits_processor"][0].seen, b["logits_processor"][0].seen
    width = left_padded(PROMPTS)[0].shape[1]
    assert (want[:, width:] == PAD).any(), "no row finished early: padding of finished rows is untested"
    assert torch.equal(got, want)
    assert len(seen_paged) == len(seen_ref) and all(torch.equal(x, y) for x, y in zip(seen_paged, seen_ref))


def test_a_per_row_criterion_pads_the_row_it_stops(pair_and_eos) -> None:  # noqa: ANN001
    ref, paged, eos = pair_and_eos
    width = left_padded(PROMPTS)[0].shape[1]
    (want, a), (got, b) = _both(
        ref, paged, lambda: dict(stopping_criteria=StoppingCriteriaList([StopRows(2, width + 3)])),
        max_new_tokens=8, eos_token_id=eos,
    )  # fmt: skip
    assert (want[2, width + 3 :] == PAD).all() and torch.equal(got, want)
    seen_ref, seen_paged = a["stopping_criteria"][0].seen, b["stopping_criteria"][0].seen
    assert len(seen_paged) == len(seen_ref) and all(torch.equal(x, y) for x, y in zip(seen_paged, seen_ref))


def test_without_eos_a_stopped_row_goes_on_as_in_generate(pair_and_eos) -> None:  # noqa: ANN001
    ref, paged, _ = pair_and_eos
    width = left_padded(PROMPTS)[0].shape[1]

    def extra() -> dict:
        return dict(stopping_criteria=StoppingCriteriaList([StopRows(1, width + 2), StopRows(3, width + 4)]))

    (want, _), (got, _) = _both(ref, paged, extra, max_new_tokens=8, eos_token_id=None)
    assert want.shape[1] == width + 8 and not (want[1, width + 2 :] == PAD).all()  # row 1 kept being sampled
    assert torch.equal(got, want)


def test_a_one_bool_criterion_stops_every_row(pair_and_eos) -> None:  # noqa: ANN001
    ref, paged, eos = pair_and_eos

    class AtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs) -> bool:  # noqa: ANN001
            return input_ids.shape[1] >= width + 5

    width = left_padded(PROMPTS)[0].shape[1]
    (want, _), (got, _) = _both(
        ref, paged, lambda: dict(stopping_criteria=StoppingCriteriaList([AtLength()])), max_new_tokens=20
    )
    assert want.shape[1] == width + 5 and torch.equal(got, want)


def test_num_return_sequences_rows_are_generates_expanded_batch(pair_and_eos) -> None:  # noqa: ANN001
    ref, paged, eos = pair_and_eos
    (want, a), (got, b) = _both(
        ref, paged, lambda: dict(logits_processor=LogitsProcessorList([Recorder(boost=eos)])),
        max_new_tokens=6, eos_token_id=eos, num_return_sequences=2, do_sample=True, top_k=1,
    )  # fmt: skip  (top_k=1 sampling is greedy: the draws agree)
    assert want.shape[0] == 2 * len(PROMPTS) and torch.equal(got, want)
    seen_ref, seen_paged = a["logits_processor"][0].seen, b["logits_processor"][0].seen
    assert len(seen_paged) == len(seen_ref) and all(torch.equal(x, y) for x, y in zip(seen_paged, seen_ref))


def test_lm_evals_stateful_batch_criterion(demo) -> None:  # noqa: ANN001
    """lm-eval's ``generate_until``: one ``MultiTokenEOSCriteria`` per stop sequence over the whole
    batch; rows keep generating until every row has met a stop sequence, as in generate."""
    tokenizer, paged, ref = demo
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    outs = []
    for model in (ref, paged):
        width, size = batch["input_ids"].shape[1], len(TEXTS)
        criteria = StoppingCriteriaList([MultiTokenEOSCriteria(s, tokenizer, width, size) for s in ("t", "\n\n")])
        out = model.generate(**batch, max_new_tokens=40, do_sample=False, stopping_criteria=criteria,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        outs.append((out, criteria))
    (want, ref_criteria), (got, paged_criteria) = outs
    assert want.shape[1] < batch["input_ids"].shape[1] + 40, "the criterion never stopped the batch"
    assert torch.equal(got, want)
    assert [c.done_tracker for c in paged_criteria] == [c.done_tracker for c in ref_criteria]


def test_a_caller_num_blocks_too_small_for_lockstep_is_refused(pair_and_eos) -> None:  # noqa: ANN001
    _, paged, _ = pair_and_eos
    ids, mask = left_padded(PROMPTS, pad=PAD)
    with pytest.raises(ValueError, match="num_blocks=2 is too small"):
        paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, paged_config=PagedConfig(num_blocks=2),
                       logits_processor=LogitsProcessorList([Recorder()]))  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        dict(min_new_tokens=24),
        dict(repetition_penalty=1.3),
        dict(no_repeat_ngram_size=2),
        dict(repetition_penalty=1.2, min_new_tokens=10, no_repeat_ngram_size=3),
    ],
)
def test_id_reading_processors_batched_give_sdpas_tokens(demo, options) -> None:  # noqa: ANN001
    tokenizer, paged, ref = demo
    batch = tokenizer(TEXTS * 3, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id, **options)
    want = ref.generate(**batch, **kwargs)
    got = paged.generate(**batch, **kwargs)
    assert torch.equal(got, want)


def test_bad_words_batched_give_sdpas_tokens(demo) -> None:  # noqa: ANN001
    tokenizer, paged, ref = demo
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    free = ref.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    bad = [[int(free[0, width + 1])], [int(free[1, width + 2]), int(free[1, width + 3])]]  # words it would say
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id, bad_words_ids=bad)
    want = ref.generate(**batch, **kwargs)
    assert not torch.equal(want, free)
    assert torch.equal(paged.generate(**batch, **kwargs), want)
