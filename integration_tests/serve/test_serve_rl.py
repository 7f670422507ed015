"""The rollout fields RL trainers send (TRL's ``VLLMClient``), in process: the real app on the demo engine
through httpx's ASGITransport, checked against transformers' own sdpa forward on the same weights.

- ``return_token_ids``: a greedy choice's ``token_ids`` equal sdpa's greedy ``generate``, its
  ``prompt_token_ids`` the tokenizer's (chat: the chat template's);
- sampled tokens' ``logprobs`` (``return_tokens_as_token_ids``, ``top_k``, ``min_p``, ``top_p``,
  temperature) equal ``log_softmax`` of sdpa's logits processed by transformers' warpers in
  ``generate``'s order, within 2e-3 (float32);
- ``prompt_logprobs``: vLLM's shape, its top ids and values equal sdpa's raw distribution.
"""

from __future__ import annotations

import asyncio
from typing import Any

import fastapi  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import httpx2
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.serve.app import build_app
from hf_paged_attn.serve.openai.handlers import ServeSettings

NAME = "demo"
TIMEOUT = 60.0  # seconds, for any one test's requests together
PROMPTS = ["The for statement", "A list is"]
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def sdpa():
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=torch.float32).eval()
    with ContinuousBatchingEngine(model, PagedConfig(num_blocks=128, compile=False)) as engine:
        yield engine


def post(engine: Any, tokenizer: Any, path: str, body: dict[str, Any], **settings: Any) -> httpx2.Response:
    """``body`` posted to ``path`` of a fresh app on ``engine`` (inside its lifespan), within TIMEOUT."""

    async def main() -> httpx2.Response:
        app = build_app(engine, tokenizer, ServeSettings(model_name=NAME, **settings))
        async with app.router.lifespan_context(app):
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://test", timeout=TIMEOUT) as client:
                return await client.post(path, json=body)

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def sdpa_greedy(sdpa: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = sdpa.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def sdpa_logprobs(sdpa: Any, ids: list[int]) -> torch.Tensor:
    """log_softmax of sdpa's raw logits at every position of ``ids``: [len(ids), vocab] float32."""
    with torch.no_grad():
        return torch.log_softmax(sdpa(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_greedy_token_ids_equal_sdpa_generate(engine, tokenizer, sdpa):
    body = {"model": NAME, "prompt": PROMPTS, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
            "top_k": 0, "min_p": 0.0, "logprobs": 0, "return_tokens_as_token_ids": True}
    answer = post(engine, tokenizer, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    for prompt, choice in zip(PROMPTS, choices):
        ids = tokenizer(prompt)["input_ids"]
        assert choice["prompt_token_ids"] == ids
        assert choice["token_ids"] == sdpa_greedy(sdpa, ids, 12)
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]


def test_sampled_logprobs_equal_processed_sdpa_logits(engine, tokenizer, sdpa):
    settings = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05}
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 10, "n": 2, "seed": 7, "logprobs": 3,
            "return_token_ids": True, "return_tokens_as_token_ids": True, **settings}
    answer = post(engine, tokenizer, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    # generate()'s order of these warpers: temperature, top-k, top-p, min-p
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(20), TopPLogitsWarper(0.9),
                                   MinPLogitsWarper(0.05)])  # fmt: skip
    for choice in answer.json()["choices"]:
        prompt, completion = choice["prompt_token_ids"], choice["token_ids"]
        assert completion and choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in completion]
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = sdpa(ids).logits[0].float()
        for i, token in enumerate(completion):
            position = len(prompt) + i - 1  # the logits that sampled token i
            scores = warpers(ids[:, : position + 1], logits[position : position + 1].clone())
            expected = torch.log_softmax(scores, dim=-1)[0]
            got = choice["logprobs"]["token_logprobs"][i]
            assert abs(got - expected[token].item()) < TOLERANCE, (i, got, expected[token].item())
            # the alternatives the warpers left (a masked one is -inf, sent as vLLM's -9999 and in no set order)
            top = {int(k.removeprefix("token_id:")): v for k, v in choice["logprobs"]["top_logprobs"][i].items()}
            best = [(int(t), v) for v, t in zip(*expected.topk(3)) if v > -float("inf")]
            assert [t for t, _ in best] == list(top)[: len(best)]
            assert all(abs(top[t] - v.item()) < TOLERANCE for t, v in best)


def test_prompt_logprobs_in_vllms_shape_equal_sdpa(engine, tokenizer, sdpa):
    sequence = tokenizer("The with statement is used to open a file")["input_ids"]
    body = {"model": NAME, "prompt": [sequence], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 5}
    answer = post(engine, tokenizer, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    scored = answer.json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(sequence) and scored[0] is None
    expected = sdpa_logprobs(sdpa, sequence)
    for position in range(1, len(sequence)):
        entries = scored[position]
        want = expected[position - 1]
        top = want.topk(5)
        ranked = sorted(entries.items(), key=lambda item: item[1]["rank"])
        mine = [int(k) for k, v in ranked if v["rank"] <= 5]
        assert mine == top.indices.tolist()
        for token_id, entry in entries.items():
            assert abs(entry["logprob"] - want[int(token_id)].item()) < TOLERANCE
            assert entry["decoded_token"] == tokenizer.decode([int(token_id)], skip_special_tokens=True)
        own = entries[str(sequence[position])]  # the prompt's own token is always there, with its true rank
        assert own["rank"] == int((want > want[sequence[position]]).sum()) + 1


def test_chat_prompt_token_ids_are_the_templates(engine, tokenizer, sdpa):
    messages = [{"role": "user", "content": "What is a list?"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True, "top_k": -1, "min_p": 0.0,
            "chat_template_kwargs": {"enable_thinking": False}}
    answer = post(engine, tokenizer, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert data["prompt_token_ids"] == list(prompt)
    choice = data["choices"][0]
    assert choice["token_ids"] == sdpa_greedy(sdpa, list(prompt), 8)
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_a_requests_chat_template_needs_the_rl_endpoints(engine, tokenizer):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ suffix }}"
    body = {"model": NAME, "messages": [{"role": "user", "content": "A list is"}], "max_tokens": 2,
            "temperature": 0, "return_token_ids": True, "chat_template": template,
            "chat_template_kwargs": {"suffix": " a"}}
    refused = post(engine, tokenizer, "/v1/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    answer = post(engine, tokenizer, "/v1/chat/completions", body, rl_endpoints=True)
    assert answer.status_code == 200, answer.text
    assert answer.json()["prompt_token_ids"] == tokenizer("A list is a", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"stream": True, "return_token_ids": True}, "return_token_ids"),
])
def test_bad_rl_fields_are_400s(engine, tokenizer, body, param):
    full = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body}
    answer = post(engine, tokenizer, "/v1/chat/completions", full)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_raw_logprobs_mode_gives_sdpas_unprocessed_distribution(tokenizer, sdpa):
    """``--logprobs-mode raw_logprobs`` (``PagedConfig.logprobs_mode``): the sampled tokens' logprobs and their
    alternatives are ``log_softmax`` of sdpa's raw logits, whatever the temperature and truncation."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=torch.float32).eval()
    config = PagedConfig(num_blocks=64, compile=False, logprobs_mode="raw_logprobs")
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 8, "n": 2, "seed": 3, "logprobs": 3,
            "temperature": 0.5, "top_k": 10, "return_token_ids": True, "return_tokens_as_token_ids": True}
    with ContinuousBatchingEngine(model, config) as raw_engine:
        answer = post(raw_engine, tokenizer, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    for choice in answer.json()["choices"]:
        prompt, completion = choice["prompt_token_ids"], choice["token_ids"]
        expected = sdpa_logprobs(sdpa, prompt + completion)
        for i, token in enumerate(completion):
            want = expected[len(prompt) + i - 1]
            got = choice["logprobs"]["token_logprobs"][i]
            assert abs(got - want[token].item()) < TOLERANCE, (i, got, want[token].item())
            top = {int(k.removeprefix("token_id:")): v for k, v in choice["logprobs"]["top_logprobs"][i].items()}
            assert list(top) == want.topk(3).indices.tolist()  # raw: nothing masked, no -9999
            assert all(abs(top[t] - want[t].item()) < TOLERANCE for t in top)


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_turns_transformers_default_top_k_off(engine, tokenizer, sdpa, top_k):
    """vLLM's ``top_k`` 0 / -1 is no truncation: at temperature 1 the sampled tokens' logprobs are the raw
    distribution's (transformers' generate would otherwise apply its default top-k of 50)."""
    body = {"model": NAME, "prompt": [[3, 17, 250, 91, 40]], "max_tokens": 8, "n": 2, "seed": 0, "logprobs": 0,
            "temperature": 1.0, "top_k": top_k, "return_token_ids": True}
    answer = post(engine, tokenizer, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    for choice in answer.json()["choices"]:
        prompt, completion = choice["prompt_token_ids"], choice["token_ids"]
        expected = sdpa_logprobs(sdpa, prompt + completion)
        want = [expected[len(prompt) + i - 1, t].item() for i, t in enumerate(completion)]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=TOLERANCE)
