"""``SamplingParams``: add_request's typed options. Each field is checked where it is made, and the typed
form generates what the keyword form does."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig, SamplingParams


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"generation_config": {"do_sample": True}}, "generation_config"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": False}, "prompt_logprobs"),
        ({"logprobs_mode": "softmax"}, "logprobs_mode"),
        ({"seed": "s"}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"ignore_eos": True, "structured": {"json_object": True}}, "ignore_eos"),
    ],
)
def test_a_bad_field_raises_value_error_naming_it(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**options)


def test_good_fields_are_kept() -> None:
    params = SamplingParams(max_new_tokens=4, logprobs=0, prompt_logprobs=2, seed=0, logprobs_mode="raw_logprobs")
    assert (params.max_new_tokens, params.logprobs, params.prompt_logprobs, params.seed) == (4, 0, 2, 0)
    assert SamplingParams().ignore_eos is False and not hasattr(params, "__dict__")  # slotted


def test_split_keeps_what_is_not_a_field() -> None:
    pixels = torch.zeros(1)
    params, rest = SamplingParams.split({"max_new_tokens": 3, "seed": 1, "pixel_values": pixels})
    assert params == SamplingParams(max_new_tokens=3, seed=1) and rest == {"pixel_values": pixels}


def test_typed_and_keyword_forms_generate_the_same(llama_pair) -> None:
    _, paged = llama_pair
    sampled = GenerationConfig(do_sample=True, temperature=0.8, top_k=20)
    options = [
        {"max_new_tokens": 6},
        {"max_new_tokens": 5, "generation_config": sampled, "seed": 3, "logprobs": 2},
        {"max_new_tokens": 4, "prompt_logprobs": 1, "logprobs_mode": "raw_logprobs", "logprobs": 0},
    ]
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]

    def run(typed: bool) -> list:
        # one thread count for both runs: the tuner's choices, kept per model, differ between them (and so
        # the last bits of the logprobs) where torch runs more than one thread
        config = PagedConfig(block_size=4, num_blocks=64, seed=0, adaptive_threads=False)
        with ContinuousBatchingEngine(paged, config) as engine:
            ids = [
                engine.add_request(p, SamplingParams(**o), request_id=f"r{i}") if typed
                else engine.add_request(p, request_id=f"r{i}", **o)
                for i, (p, o) in enumerate(zip(prompts, options))
            ]  # fmt: skip
            finals = {o.request_id: o for o in engine.stream() if o.finished}
        return [(finals[i].output_ids, finals[i].logprobs, finals[i].prompt_logprobs) for i in ids]

    assert run(typed=True) == run(typed=False)


def test_params_and_its_keywords_are_not_mixed(llama_pair) -> None:
    _, paged = llama_pair
    with ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32)) as engine:
        with pytest.raises(TypeError, match="max_new_tokens"):
            engine.add_request([1, 2], SamplingParams(seed=1), max_new_tokens=3)
        with pytest.raises(TypeError, match="by keyword"):
            engine.add_request([1, 2], GenerationConfig(max_new_tokens=3))  # generation_config is keyword-only now
        with pytest.raises(TypeError, match="max_new_token"):
            engine.add_request([1, 2], max_new_token=3)  # a misspelt keyword, named as Python would
        assert engine.intake.num_incoming == 0
        engine.add_request([1, 2], 3, request_id="positional")  # the positional max_new_tokens of before
        finals = [o for o in engine.stream() if o.finished]
        assert [(o.request_id, len(o.output_ids)) for o in finals] == [("positional", 3)]
