"""TRL's ``VLLMClient`` (TRL 1.16, ``trl/generation/vllm_client.py``) against a real ``hf-paged-attn serve``
process, as the requests the client builds: its constructor needs vLLM installed (``trl[vllm]``), whose
PyPI wheel is the CUDA build (a CPU build is compiled from source and pins transformers < 5.20), so the
client itself does not run here. ``TRLClient`` below sends what each of its methods sends, named after the
method it mirrors, and reads the answer as the method does (``parse_logprobs``,
``_format_sequence_logprobs``). Checked against transformers' sdpa on the same weights:

- ``generate`` (its defaults: ``top_k`` 0, ``min_p`` 0, ``repetition_penalty`` 1, ``logprobs`` 0): greedy
  completion ids equal sdpa's; sampled tokens' logprobs equal sdpa's within 2e-3; a regex constrains;
- ``chat``: prompt ids are the chat template's; ``get_sequence_logprobs``: top-5 ids and the actual tokens'
  logprobs equal sdpa's; ``get_world_size``, ``reset_prefix_cache`` answer.

Every HTTP call is bounded by TIMEOUT; the server listens on 127.0.0.1 and is stopped by its process id."""

from __future__ import annotations

import json
import math
import re
import urllib.request
from typing import Any

import fastapi  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import pytest
import torch
import uvicorn  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn_tools.launch import ServerProcess

NAME = "policy"
TIMEOUT = 60.0
TOLERANCE = 2e-3
PROMPTS = [[3, 17, 250, 91, 40], [3, 812, 5, 77]]


class TRLClient:
    """The HTTP requests of TRL 1.16's ``VLLMClient`` methods, without vLLM (see the module's docstring)."""

    def __init__(self, base_url: str) -> None:  # VLLMClient.__init__: check_server, then /v1/models
        self.base_url = base_url
        with urllib.request.urlopen(base_url + "/health", timeout=TIMEOUT) as answer:  # check_server
            assert answer.status == 200
        self.model = self._get("/v1/models")["data"][0]["id"]

    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.base_url + path, timeout=TIMEOUT) as answer:
            return json.loads(answer.read())

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
            return json.loads(answer.read())

    def get_world_size(self) -> int:  # VLLMClient.get_world_size
        return self._get("/get_world_size")["world_size"]

    def reset_prefix_cache(self) -> None:  # VLLMClient.reset_prefix_cache: a POST without a body
        self._post("/reset_prefix_cache")

    def generate(self, prompts: list, n: int = 1, temperature: float = 1.0, max_tokens: int = 16,
                 logprobs: int | None = 0, structured_outputs_regex: str | None = None,
                 generation_kwargs: dict | None = None) -> dict[str, Any]:  # VLLMClient.generate
        params = {"n": n, "repetition_penalty": 1.0, "temperature": temperature, "top_p": 1.0, "top_k": 0,
                  "min_p": 0.0, "max_tokens": max_tokens, "logprobs": logprobs}
        if structured_outputs_regex is not None:
            params["structured_outputs"] = {"regex": structured_outputs_regex}
        params.update(generation_kwargs or {})
        body = {"model": self.model, "prompt": prompts, "return_token_ids": True, "return_tokens_as_token_ids": True,
                **params}
        choices = self._post("/v1/completions", body)["choices"]
        logprobs_, ids = parse_logprobs([c["logprobs"] for c in choices])
        return {"prompt_ids": [c["prompt_token_ids"] for c in choices[::n]],
                "completion_ids": [c["token_ids"] for c in choices], "logprobs": logprobs_, "logprob_token_ids": ids,
                "texts": [c["text"] for c in choices]}

    def chat(self, messages: list[list[dict]], max_tokens: int = 16, logprobs: int | None = 0,
             generation_kwargs: dict | None = None) -> dict[str, Any]:  # VLLMClient.chat, one request each
        body = {"model": self.model, "n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                "min_p": 0.0, "max_tokens": max_tokens, "logprobs": logprobs is not None, "top_logprobs": logprobs,
                "return_token_ids": True, "return_tokens_as_token_ids": True, **(generation_kwargs or {})}
        answers = [self._post("/v1/chat/completions", {**body, "messages": m}) for m in messages]
        choices = [c for a in answers for c in a["choices"]]
        logprobs_, ids = parse_logprobs([c["logprobs"] for c in choices])
        return {"prompt_ids": [a["prompt_token_ids"] for a in answers],
                "completion_ids": [c["token_ids"] for c in choices], "logprobs": logprobs_, "logprob_token_ids": ids}

    def get_sequence_logprobs(self, sequences: list[list[int]], prompt_lengths: list[int], top_logprobs: int = 100,
                              temperature: float = 1.0) -> dict[str, list]:  # VLLMClient.get_sequence_logprobs
        body = {"model": self.model, "prompt": sequences, "max_tokens": 1, "temperature": temperature,
                "prompt_logprobs": top_logprobs}
        choices = self._post("/v1/completions", body)["choices"]
        results = [format_sequence_logprobs(c, s, p, top_logprobs)
                   for c, s, p in zip(choices, sequences, prompt_lengths, strict=True)]
        return {key: [r[key] for r in results] for key in results[0]}


def parse_logprobs(entries: list[dict | None]) -> tuple[list | None, list | None]:
    """``vllm_client.parse_logprobs``: per position, the sampled token first among its alternatives, sorted by
    logprob; completions' ``tokens``/``token_logprobs``/``top_logprobs`` or chat's ``content``."""
    if entries[0] is None:
        return None, None
    all_values, all_ids = [], []
    for entry in entries:
        if "content" in entry:
            positions = [(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
                         for e in entry["content"]]
        else:
            positions = list(zip(entry["tokens"], entry["token_logprobs"], entry["top_logprobs"], strict=True))
        values, ids = [], []
        for token, logprob, top in positions:
            ranked = sorted({token: logprob, **(top or {})}.items(), key=lambda item: -item[1])
            ids.append([int(t.removeprefix("token_id:")) for t, _ in ranked])
            values.append([None if math.isnan(v) else v for _, v in ranked])
        all_values.append(values)
        all_ids.append(ids)
    return all_values, all_ids


def format_sequence_logprobs(choice: dict, sequence: list[int], prompt_length: int, k: int) -> dict[str, list]:
    """``VLLMClient._format_sequence_logprobs``: the completion region of ``prompt_logprobs``, by rank, padded."""
    out: dict[str, list] = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
    for position in range(prompt_length, len(choice["prompt_logprobs"])):
        scored = choice["prompt_logprobs"][position] or {}
        ranked = sorted(scored.items(), key=lambda item: item[1]["rank"])[:k]
        out["logprobs"].append([e["logprob"] for _, e in ranked] + [-math.inf] * (k - len(ranked)))
        out["logprob_token_ids"].append([int(t) for t, _ in ranked] + [0] * (k - len(ranked)))
        actual = scored.get(str(sequence[position]))
        out["actual_logprobs"].append([-math.inf if actual is None else actual["logprob"]])
        out["actual_token_ids"].append([sequence[position]])
    return out


@pytest.fixture(scope="module")
def client():
    args = ["--served-model-name", NAME, "--num-blocks", "128", "--enable-rl-endpoints", "--dtype", "float32"]
    with ServerProcess(DEMO_MODEL, [*args, "--no-compile"], env={"OMP_NUM_THREADS": "1"}) as server:
        yield TRLClient(server.url)


@pytest.fixture(scope="module")
def sdpa():
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa", dtype=torch.float32).eval()


def sdpa_logprobs(sdpa: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(sdpa(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len(ids), vocab]


def test_generate_greedy_ids_and_sampled_logprobs_equal_sdpa(client, sdpa):
    greedy = client.generate(PROMPTS, temperature=0.0, max_tokens=8)
    assert greedy["prompt_ids"] == PROMPTS
    with torch.no_grad():
        for prompt, completion in zip(PROMPTS, greedy["completion_ids"]):
            expected = sdpa.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
            assert completion == expected.tolist()
    sampled = client.generate(PROMPTS, n=3, max_tokens=8, generation_kwargs={"seed": 1})
    assert len(sampled["completion_ids"]) == 6 and sampled["prompt_ids"] == PROMPTS  # prompt-major, n each
    for i, completion in enumerate(sampled["completion_ids"]):
        prompt = PROMPTS[i // 3]
        expected = sdpa_logprobs(sdpa, prompt + completion)
        for j, token in enumerate(completion):
            assert sampled["logprob_token_ids"][i][j] == [token]  # logprobs=0: the sampled token alone
            assert abs(sampled["logprobs"][i][j][0] - expected[len(prompt) + j - 1, token].item()) < TOLERANCE


def test_generate_with_a_regex_matches_it(client):
    out = client.generate(["The for statement"], n=2, max_tokens=12, structured_outputs_regex=r"[0-9]{3}-[a-z]{2}",
                          generation_kwargs={"seed": 2})
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) for text in out["texts"]), out["texts"]


def test_chat_prompt_ids_are_the_chat_templates(client):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    messages = [[{"role": "user", "content": "What is a list?"}], [{"role": "user", "content": "Hi"}]]
    out = client.chat(messages, max_tokens=4, generation_kwargs={"seed": 3})
    for conversation, prompt_ids in zip(messages, out["prompt_ids"]):
        assert prompt_ids == tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    assert [[ids[0] for ids in seq] for seq in out["logprob_token_ids"]] == out["completion_ids"]


def test_sequence_logprobs_top5_equal_sdpa(client, sdpa):
    sequences = [PROMPTS[0] + [361, 587, 14, 267], PROMPTS[1] + [30, 31]]
    lengths = [len(PROMPTS[0]), len(PROMPTS[1])]
    out = client.get_sequence_logprobs(sequences, lengths, top_logprobs=5)
    for s, (sequence, length) in enumerate(zip(sequences, lengths)):
        expected = sdpa_logprobs(sdpa, sequence)
        assert len(out["logprob_token_ids"][s]) == len(sequence) - length
        for i, position in enumerate(range(length, len(sequence))):
            want = expected[position - 1]
            values, ids = want.topk(5)
            assert out["logprob_token_ids"][s][i] == ids.tolist()
            assert out["logprobs"][s][i] == pytest.approx(values.tolist(), abs=TOLERANCE)
            # the sequence's own token is always scored (vLLM adds it beside the top K), so never -inf here
            assert abs(out["actual_logprobs"][s][i][0] - want[sequence[position]].item()) < TOLERANCE


def test_world_size_and_reset_prefix_cache_answer(client):
    assert client.get_world_size() == 1
    client.reset_prefix_cache()
    assert client.generate([PROMPTS[0]], temperature=0.0, max_tokens=2)["completion_ids"][0]
