"""The RL control routes (``--enable-rl-endpoints``), in process: the real app on the demo engine through
httpx's ASGITransport. New weights from disk (SGLang's and prime-rl's routes) give sdpa's greedy on them,
also for a prompt cached before; pause(keep) -> update -> resume finishes the paused requests, their
tokens after the update sdpa's greedy on the new weights; the routes are absent without the flag.
Every wait is bounded by TIMEOUT."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import fastapi  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import httpx2
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.demo import DEMO_MODEL
from integration_tests.serve.asgi import run_in_app

NAME = "demo"
TIMEOUT = 60.0
PROMPT_IDS = list(range(3, 3 + 40))  # two full blocks of 16: cached after its first request


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture
def engine():
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=torch.float32).eval()
    config = PagedConfig(num_blocks=128, block_size=16, compile=False, enable_prefix_caching=True)
    with ContinuousBatchingEngine(model, config) as engine:
        yield engine


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A save_pretrained directory of the demo model with other weights, and those weights."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    weights = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    model.load_state_dict(weights, strict=False)
    path = tmp_path_factory.mktemp("new-weights")
    model.save_pretrained(path)
    return path, weights


def sdpa_greedy(weights: dict[str, torch.Tensor] | None, ids: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa", dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def run(engine: Any, tokenizer: Any, scenario: Any, **settings: Any) -> Any:
    return run_in_app(engine, tokenizer, scenario, NAME, TIMEOUT, **settings)


async def greedy_ids(client: httpx2.AsyncClient, ids: list[int], n: int) -> list[int]:
    answer = await client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": n,
                                                        "temperature": 0, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def test_trainer_info_routes_and_no_control_routes_without_the_flag(engine, tokenizer):
    async def scenario(client: httpx2.AsyncClient) -> None:
        assert (await client.get("/get_world_size")).json() == {"world_size": 1}
        config = (await client.get("/server_info", params={"config_format": "json"})).json()["vllm_config"]
        assert config["model"] == NAME and config["block_size"] == 16 and config["dtype"] == "float32"
        for method, path in [("post", "/pause"), ("post", "/resume"), ("get", "/is_paused"),
                             ("post", "/reset_prefix_cache"), ("post", "/update_weights_from_disk"),
                             ("post", "/update_weights")]:
            assert (await getattr(client, method)(path)).status_code == 404, path

    run(engine, tokenizer, scenario)


def test_control_routes_need_the_api_key(engine, tokenizer):
    async def scenario(client: httpx2.AsyncClient) -> None:
        assert (await client.post("/pause")).status_code == 401
        assert (await client.get("/is_paused")).status_code == 401
        ok = await client.get("/is_paused", headers={"Authorization": "Bearer k"})
        assert ok.json() == {"is_paused": False}

    run(engine, tokenizer, scenario, rl_endpoints=True, api_key="k")


def test_update_weights_from_disk_follows_the_new_weights_also_for_a_cached_prompt(engine, tokenizer, new_weights):
    path, weights = new_weights
    original = sdpa_greedy(None, PROMPT_IDS, 8)
    updated = sdpa_greedy(weights, PROMPT_IDS, 8)
    assert original != updated  # the check can fail

    async def scenario(client: httpx2.AsyncClient) -> None:
        assert await greedy_ids(client, PROMPT_IDS, 8) == original
        assert engine.allocator.num_cached_blocks >= 2
        answer = await client.post("/update_weights_from_disk", json={"model_path": str(path)})
        assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
        assert await greedy_ids(client, PROMPT_IDS, 8) == updated
        reset = await client.post("/reset_prefix_cache")  # TRL sends no body
        assert reset.status_code == 200 and reset.json()["success"] is True
        assert engine.allocator.num_cached_blocks == 0
        bad = await client.post("/update_weights", json={"weight_dir": str(path / "nowhere")})
        assert bad.status_code == 400, bad.text
        assert await greedy_ids(client, PROMPT_IDS, 8) == updated  # a failed load changes nothing
        nccl = await client.post("/update_weights", json={"update_info": {"names": []}})
        assert nccl.status_code == 400 and nccl.json()["error"]["param"] == "update_info"

    run(engine, tokenizer, scenario, rl_endpoints=True)


def test_pause_keep_update_resume_finishes_the_paused_requests_on_the_new_weights(engine, tokenizer, new_weights):
    path, weights = new_weights
    num_tokens = 60

    async def scenario(client: httpx2.AsyncClient) -> tuple[list[int], list[int], str, list[int]]:
        paused_one = asyncio.ensure_future(client.post("/v1/completions", json={
            "model": NAME, "prompt": PROMPT_IDS, "max_tokens": num_tokens, "temperature": 0,
            "return_token_ids": True}))
        while not any(r.output_ids for r in engine.intake.live.values()):  # bounded by TIMEOUT
            await asyncio.sleep(0.001)
        answer = await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert answer.status_code == 200 and answer.json()["mode"] == "keep", answer.text
        assert (await client.get("/is_paused")).json() == {"is_paused": True}
        (live,) = [r for r in engine.intake.live.values() if not r.finished]
        at_update = list(live.output_ids)  # what it had generated when the engine stopped stepping
        late = asyncio.ensure_future(greedy_ids(client, PROMPT_IDS, 4))  # waits for the resume
        await asyncio.sleep(0.3)
        assert not late.done() and not paused_one.done()
        update = await client.post("/update_weights_from_disk", json={"model_path": str(path)})
        assert update.status_code == 200, update.text
        assert (await client.post("/resume")).json() == {"is_paused": False}
        choice = (await paused_one).json()["choices"][0]
        return at_update, choice["token_ids"], choice["finish_reason"], await late

    at_update, ids, finish, late = run(engine, tokenizer, scenario, rl_endpoints=True)
    assert 0 < len(at_update) < num_tokens, at_update
    assert finish == "length" and len(ids) == num_tokens and ids[: len(at_update)] == at_update
    assert ids[len(at_update):] == sdpa_greedy(weights, PROMPT_IDS + at_update, num_tokens - len(at_update))
    assert late == sdpa_greedy(weights, PROMPT_IDS, 4)


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_pause_wait_and_abort(engine, tokenizer, mode):
    async def scenario(client: httpx2.AsyncClient) -> tuple[int, Any]:
        request = asyncio.ensure_future(client.post("/v1/completions", json={
            "model": NAME, "prompt": PROMPT_IDS, "max_tokens": 30, "temperature": 0}))
        while not engine.intake.live:
            await asyncio.sleep(0.01)
        paused = await client.post("/pause", params={"mode": mode})
        assert paused.status_code == 200, paused.text
        assert engine.stats.num_running == 0  # nothing in flight: done (wait) or aborted
        answer = await request
        assert (await client.post("/resume")).status_code == 200
        return answer.status_code, answer.json()

    status, answer = run(engine, tokenizer, scenario, rl_endpoints=True)
    if mode == "wait":
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    else:
        assert status == 503 and answer["error"]["code"] == "aborted"


def test_bad_pause_mode_is_a_400(engine, tokenizer):
    async def scenario(client: httpx2.AsyncClient) -> None:
        answer = await client.post("/pause", params={"mode": "sleep"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "mode"
        assert (await client.get("/is_paused")).json() == {"is_paused": False}

    run(engine, tokenizer, scenario, rl_endpoints=True)
