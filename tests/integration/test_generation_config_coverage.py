"""No option of ``generate`` is silently ignored: every ``GenerationConfig`` attribute is honoured
(checked here against sdpa, or by the test named for it) or refused by name, with an error that says
how to run it anyway (switch to "sdpa" for the call, then back to "paged": proven below).

Also the left-padded-batch fixes: ``min_new_tokens``, ``min_length`` and ``forced_eos_token_id`` count
the padding as transformers' processors do; ``streamer=`` with more than one sequence is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, WatermarkingConfig

from hf_paged_attn_tools.testing import (
    compare_greedy,
    left_padded,
    load_pair,
    ragged_prompts,
    save_random_model,
    tiny_llama_config,
)

NEW = 24
PROMPTS = ragged_prompts(4, 3, 30, seed=1)
TESTS = Path(__file__).parents[1]  # tests/


@pytest.fixture(scope="module")
def pair_and_eos(tmp_path_factory):
    """A tiny Llama and a token its greedy rows emit now and then (the EOS of these tests)."""
    ref, paged = load_pair(save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("llama")))
    ids, mask = left_padded(PROMPTS)
    out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    counts = torch.bincount(out[:, ids.shape[1] :].flatten(), minlength=256)
    return ref, paged, int(counts.argmax())


# Options honoured here: greedy tokens of a left-padded batch equal sdpa's. "EOS" stands for the fixture's token.
GREEDY_PARITY = {
    "max_length": dict(max_length=40, max_new_tokens=None),
    "max_new_tokens": dict(max_new_tokens=7),
    "min_length": dict(min_length=45, eos_token_id="EOS"),
    "min_new_tokens": dict(min_new_tokens=10, eos_token_id="EOS"),
    "forced_eos_token_id": dict(forced_eos_token_id="EOS", eos_token_id="EOS"),
    "eos_token_id": dict(eos_token_id="EOS"),
    "pad_token_id": dict(eos_token_id="EOS", pad_token_id=3),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[["EOS"]]),
    "renormalize_logits": dict(renormalize_logits=True, repetition_penalty=1.3),
    "forced_bos_token_id": dict(forced_bos_token_id=5),
    "remove_invalid_values": dict(remove_invalid_values=True),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(4, 1.6), eos_token_id="EOS"),
    "suppress_tokens": dict(suppress_tokens=["EOS", 7]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=["EOS"]),
    "sequence_bias": dict(sequence_bias=[[["EOS"], 8.0]]),
    "watermarking_config": dict(watermarking_config=WatermarkingConfig(bias=4.0, context_width=2)),
}
# Sampling warpers: the processed scores of the first sampled token equal sdpa's (the draws differ).
SAMPLING_SCORES = {
    "do_sample": dict(),
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.1),
    "top_h": dict(top_h=0.5),
    "typical_p": dict(typical_p=0.5),
    "epsilon_cutoff": dict(epsilon_cutoff=0.01),
    "eta_cutoff": dict(eta_cutoff=0.01),
}
HONOURED_ELSEWHERE = {  # option -> the test that checks it against transformers
    "num_beams": "test_beam_search.py::test_generate_beam_search_equals_sdpa",
    "length_penalty": "test_beam_search.py::test_generate_beam_search_equals_sdpa",
    "early_stopping": "test_beam_search.py::test_generate_beam_search_equals_sdpa",
    "num_return_sequences": "test_beam_search.py::test_ragged_engine_requests_next_to_greedy_ones",
    "num_assistant_tokens": "test_speculative.py::test_generate_with_assistant_model_equals_sdpa",
    "prompt_lookup_num_tokens": "test_speculative.py::test_generate_prompt_lookup_equals_sdpa_greedy",
    "max_matching_ngram_size": "test_speculative.py::test_generate_prompt_lookup_equals_sdpa_greedy",
    "output_scores": "test_beam_search.py::test_per_step_scores_equal_sdpa",
    "output_logits": "test_beam_search.py::test_per_step_scores_equal_sdpa",
    "return_dict_in_generate": "test_generate_parity.py::test_return_dict_with_scores",
    "max_time": "test_generation_options.py::test_max_time_is_honoured",
    "stop_strings": "test_generation_options.py::test_stop_strings_stop_where_sdpa_stops",
}
# Options with no effect on the tokens of a decoder-only generate from input_ids, in transformers too,
# or that choose how transformers' own loop caches/compiles (the paged cache replaces that loop).
NO_EFFECT_HERE = {
    "bos_token_id": "used only when generate has no input_ids; paged generate needs them",
    "decoder_start_token_id": "encoder-decoder models only",
    "use_cache": "the engine always caches, in its paged cache (same tokens)",
    "cache_implementation": "the paged cache replaces transformers' cache classes",
    "cache_config": "the paged cache replaces transformers' cache classes",
    "max_cache_len": "the paged cache replaces transformers' cache classes",
    "compile_config": "compiles transformers' own decoding loop",
    "disable_compile": "compiles transformers' own decoding loop",
    "prefill_chunk_size": "the engine chunks prefill by PagedConfig.max_batch_tokens",
    "continuous_batching_config": "configures transformers' own continuous batching",
    "is_assistant": "marks transformers' own assistant model; the engine runs a draft itself",
    "num_assistant_tokens_schedule": "how many tokens a draft proposes: the engine's adaptive k (same tokens)",
    "assistant_confidence_threshold": "how many tokens a draft proposes: the engine's adaptive k (same tokens)",
    "assistant_lookbehind": "assisted decoding with another tokenizer (assistant_tokenizer is refused)",
    "target_lookbehind": "assisted decoding with another tokenizer (assistant_tokenizer is refused)",
    "transformers_version": "metadata",
    "_from_model_config": "metadata",
}
REFUSED = {  # option -> value that must be refused, naming the option or the mode it selects
    "penalty_alpha": (dict(penalty_alpha=0.6, top_k=4), "contrastive_search"),
    "dola_layers": (dict(dola_layers="high"), "dola"),
    "assistant_ensemble_weight": (dict(assistant_ensemble_weight=0.5), "assistant_ensemble_weight"),
    "speculation_type": (dict(speculation_type="dflash"), "speculation_type"),
    "assistant_early_exit": (dict(assistant_early_exit=1), "assisted"),
    "use_mtp": (dict(use_mtp=True), "assisted"),
    "guidance_scale": (dict(guidance_scale=1.5), "guidance_scale"),
    "constraints": (dict(force_words_ids=[[5, 6]], num_beams=2), "constrained"),
    "force_words_ids": (dict(force_words_ids=[[5, 6]], num_beams=2), "constrained"),
    "num_beam_groups": (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "group_beam_search"),
    "diversity_penalty": (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "group_beam_search"),
    "encoder_repetition_penalty": (dict(encoder_repetition_penalty=1.3), "encoder_repetition_penalty"),
    "encoder_no_repeat_ngram_size": (dict(encoder_no_repeat_ngram_size=2), "encoder_no_repeat_ngram_size"),
    "low_memory": (dict(low_memory=True), "low_memory"),
    "token_healing": (dict(token_healing=True), "token_healing"),
    "output_attentions": (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    "output_hidden_states": (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
}
CATEGORIES = (GREEDY_PARITY, SAMPLING_SCORES, HONOURED_ELSEWHERE, NO_EFFECT_HERE, REFUSED)


def test_every_generation_config_attribute_is_honoured_or_refused():
    names = set(GenerationConfig().to_dict())
    unclassified = sorted(n for n in names if not any(n in c for c in CATEGORIES))
    assert not unclassified, f"GenerationConfig options nobody checks (honour or refuse them): {unclassified}"
    twice = [n for n in names if sum(n in c for c in CATEGORIES) > 1]
    assert not twice, twice
    for name, where in HONOURED_ELSEWHERE.items():  # the named tests exist
        file, test = where.split("::")
        assert re.search(rf"^def {test}\(", next(TESTS.rglob(file)).read_text(), re.M), f"{name}: {where} not found"


def resolve(options: dict, eos: int) -> dict:
    """Replace the "EOS" placeholder with the fixture's token, at any depth."""
    if isinstance(options, dict):
        return {k: resolve(v, eos) for k, v in options.items()}
    if isinstance(options, (list, tuple)) and not isinstance(options, str):
        return type(options)(resolve(v, eos) for v in options)
    return eos if options == "EOS" else options


@pytest.mark.parametrize("name", list(GREEDY_PARITY))
def test_option_gives_sdpa_tokens_on_a_left_padded_batch(pair_and_eos, name):
    ref, paged, eos = pair_and_eos
    options = {"max_new_tokens": NEW, "do_sample": False, **resolve(GREEDY_PARITY[name], eos)}
    ids, mask = left_padded(PROMPTS)
    expected = ref.generate(input_ids=ids, attention_mask=mask, **options)
    actual = paged.generate(input_ids=ids, attention_mask=mask, **options)
    assert actual.shape == expected.shape
    width = ids.shape[1]
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    problems = compare_greedy(ref, rows, expected[:, width:].tolist(), actual[:, width:].tolist())
    assert not problems, "\n".join(problems)


def test_min_new_tokens_and_forced_eos_count_the_padding_as_transformers_does(pair_and_eos):
    """The issue's case: rows shorter than the batch emitted EOS where sdpa does (not later)."""
    ref, paged, _ = pair_and_eos
    ids, mask = left_padded(PROMPTS)
    free = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)[:, ids.shape[1] :]
    eos = sorted({int(row[15]) for row in free})  # each row's 16th token: rows meet an EOS after 10 tokens
    for options in (dict(min_new_tokens=10), dict(forced_eos_token_id=eos[0], max_new_tokens=12)):
        kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=eos)
        kwargs.update(options)
        expected = ref.generate(input_ids=ids, attention_mask=mask, **kwargs)
        new = expected[:, ids.shape[1] :]
        emitted, padded = torch.isin(new, torch.tensor(eos)).any(dim=1), (mask == 0).any(dim=1)
        assert emitted.sum() >= 2 and emitted[padded].any(), "padded rows must emit EOS for the test to bite"
        assert torch.equal(paged.generate(input_ids=ids, attention_mask=mask, **kwargs), expected), options


@pytest.mark.parametrize("name", list(SAMPLING_SCORES))
def test_sampling_option_processes_scores_as_sdpa(pair_and_eos, name):
    ref, paged, eos = pair_and_eos
    options = dict(do_sample=True, max_new_tokens=1, return_dict_in_generate=True, output_scores=True,
                   **SAMPLING_SCORES[name])  # fmt: skip
    ids, mask = left_padded(PROMPTS)
    expected = ref.generate(input_ids=ids, attention_mask=mask, **options).scores[0]
    actual = paged.generate(input_ids=ids, attention_mask=mask, **options).scores[0]
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "a different set of tokens was filtered out"
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(actual[finite], expected[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(REFUSED))
def test_option_is_refused_by_name_with_the_way_round(pair_and_eos, name):
    _, paged, _ = pair_and_eos
    options, words = REFUSED[name]
    with pytest.raises(NotImplementedError, match=words) as info:
        paged.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, **options)
    assert 'model.set_attn_implementation("sdpa")' in str(info.value)
    assert 'model.set_attn_implementation("paged")' in str(info.value)


def test_the_way_round_works(pair_and_eos):
    """What a refusal suggests: switch to sdpa for the call (classifier-free guidance here, a mode
    transformers runs offline), then back to paged, where generate runs on the engine again."""
    ref, paged, _ = pair_and_eos
    ids = torch.tensor([PROMPTS[1]])
    with pytest.raises(NotImplementedError):
        paged.generate(ids, max_new_tokens=8, guidance_scale=1.5)
    try:
        paged.set_attn_implementation("sdpa")
        guided = paged.generate(ids, max_new_tokens=8, guidance_scale=1.5, do_sample=False)
    finally:
        paged.set_attn_implementation("paged")
    assert torch.equal(guided, ref.generate(ids, max_new_tokens=8, guidance_scale=1.5, do_sample=False))
    greedy = ref.generate(ids, max_new_tokens=8, do_sample=False)
    assert paged.config._attn_implementation == "paged"
    assert torch.equal(paged.generate(ids, max_new_tokens=8, do_sample=False), greedy)
    with pytest.raises(NotImplementedError):  # back on the engine: the refusal is back too
        paged.generate(ids, max_new_tokens=8, guidance_scale=1.5)


def test_streamer_with_more_than_one_sequence_is_refused(pair_and_eos):
    _, paged, _ = pair_and_eos
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match="one sequence"):
        paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, streamer=object())
    with pytest.raises(ValueError, match="one sequence"):
        paged.generate(input_ids=ids[:1], max_new_tokens=2, streamer=object(), do_sample=True, num_return_sequences=2)
