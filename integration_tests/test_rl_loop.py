"""A two-step RL loop on the CPU against a real ``hf-paged-attn serve`` process, as a GRPO-style trainer in
server mode runs it: rollouts with ids and logprobs (``return_token_ids``, ``logprobs: 0``) -> a reward (how
often a token appears) -> an optimizer step on a transformers (sdpa) copy of the same weights, whose logprobs of
the sampled tokens equal the server's (the importance ratio is 1 within 2e-3) -> ``save_pretrained`` ->
``POST /update_weights_from_disk`` -> the next rollout's greedy equals sdpa's greedy on the new weights.
Every HTTP call is bounded by TIMEOUT; the server listens on 127.0.0.1 and is stopped by its process id."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import fastapi  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import torch
import uvicorn  # noqa: F401
from transformers import AutoModelForCausalLM

from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn_tools.launch import ServerProcess

NAME = "policy"
TIMEOUT = 60.0
TOLERANCE = 2e-3
PROMPTS = [[3, 17, 250, 91, 40], [3, 812, 5, 77]]
NUM_SAMPLES = 4
MAX_TOKENS = 8
REWARDED = 10  # the token whose count is the reward


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
        return json.loads(answer.read())


def rollout(url: str, seed: int) -> list[dict[str, Any]]:
    """``VLLMClient.generate``'s request: token-id prompts, ``n`` samples each, the sampled tokens' logprobs."""
    body = {"model": NAME, "prompt": PROMPTS, "n": NUM_SAMPLES, "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "logprobs": 0, "seed": seed, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    return post(url + "/v1/completions", body)["choices"]


def greedy(url: str) -> list[list[int]]:
    body = {"model": NAME, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    return [choice["token_ids"] for choice in post(url + "/v1/completions", body)["choices"]]


def sdpa_greedy(model: torch.nn.Module) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]


def sequence_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion[i] | prompt, completion[:i]) under ``model``, with gradients: [len(completion)]."""
    ids = torch.tensor([prompt + completion])
    logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, choices: list[dict[str, Any]]) -> None:
    """One GRPO-like step: group-normalised rewards weight the completions' logprobs."""
    rewards = torch.tensor([float(c["token_ids"].count(REWARDED)) for c in choices]).view(len(PROMPTS), NUM_SAMPLES)
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)).flatten()
    loss = torch.zeros(())
    for choice, advantage in zip(choices, advantages):
        logprobs = sequence_logprobs(model, choice["prompt_token_ids"], choice["token_ids"])
        served = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert torch.allclose(logprobs.detach(), served, atol=TOLERANCE), (logprobs, served)  # ratio 1
        loss = loss - (advantage + 1.0) * logprobs.sum()  # +1: the step moves the weights even when rewards tie
    optimizer.zero_grad()
    (loss / len(choices)).backward()
    optimizer.step()


def test_two_step_rl_loop_follows_the_new_weights(tmp_path: Path):
    policy = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa", dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    args = ["--served-model-name", NAME, "--num-blocks", "64", "--enable-rl-endpoints", "--dtype", "float32"]
    with ServerProcess(DEMO_MODEL, [*args, "--no-compile"], env={"OMP_NUM_THREADS": "1"}) as server:
        policy.eval()
        assert greedy(server.url) == sdpa_greedy(policy)
        for step in range(2):
            choices = rollout(server.url, seed=step)
            assert len(choices) == len(PROMPTS) * NUM_SAMPLES
            assert [c["prompt_token_ids"] for c in choices] == [p for p in PROMPTS for _ in range(NUM_SAMPLES)]
            before = sdpa_greedy(policy)
            policy.train()
            train_step(policy, optimizer, choices)
            policy.eval()
            after = sdpa_greedy(policy)
            assert after != before  # the step changed what the policy does: the check below can fail
            path = tmp_path / f"step-{step}"
            policy.save_pretrained(path)
            answer = post(server.url + "/update_weights_from_disk", {"model_path": str(path)})
            assert answer["success"] is True, answer
            assert greedy(server.url) == after
