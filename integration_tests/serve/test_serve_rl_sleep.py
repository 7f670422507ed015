"""vLLM's sleep routes (``--enable-rl-endpoints``), in process: the real app on the demo engine through httpx's
ASGITransport. After ``/sleep?level=1`` the process's RSS has dropped by most of the KV pool, ``/is_sleeping``
is true and a completion gets a 503; after ``/wake_up`` greedy is what it was. Tags wake one part at a time;
the routes need the API key and the flag. Every wait is bounded by TIMEOUT."""

from __future__ import annotations

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
PROMPT_IDS = list(range(3, 3 + 40))
# 4 layers x (K, V) x [5120 blocks, 16, 2 heads, 64] float32: 320 MiB, each page tensor 40 MiB (mmap-ed, so
# freeing it gives the memory back to the OS).
BIG_POOL = 5120


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


def make_engine(num_blocks: int) -> ContinuousBatchingEngine:
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=torch.float32).eval()
    return ContinuousBatchingEngine(model, PagedConfig(num_blocks=num_blocks, block_size=16, compile=False))


def run(engine: Any, tokenizer: Any, scenario: Any, **settings: Any) -> Any:
    return run_in_app(engine, tokenizer, scenario, NAME, TIMEOUT, **settings)


async def completion(client: httpx2.AsyncClient, n: int = 8) -> httpx2.Response:
    return await client.post("/v1/completions", json={"model": NAME, "prompt": PROMPT_IDS, "max_tokens": n,
                                                      "temperature": 0, "return_token_ids": True})


def test_sleep_frees_the_kv_pool_refuses_requests_and_wakes_to_the_same_greedy(tokenizer):
    with make_engine(BIG_POOL) as engine:
        async def scenario(client: httpx2.AsyncClient) -> None:
            first = await completion(client)
            assert first.status_code == 200, first.text
            before = first.json()["choices"][0]["token_ids"]
            pool = sum(layer.keys.nbytes + layer.values.nbytes for layer in engine.cache.layers)
            rss = rss_bytes()
            answer = await client.post("/sleep", params={"level": "1"})
            assert answer.status_code == 200 and answer.json()["kv_cache_bytes_freed"] == pool, answer.text
            dropped = rss - rss_bytes()
            assert dropped >= 0.6 * pool, f"RSS dropped {dropped / 2**20:.0f} MiB of a {pool / 2**20:.0f} MiB pool"
            assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
            refused = await completion(client)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "sleeping", refused.text
            chat = await client.post("/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert chat.status_code == 503
            assert (await client.post("/tokenize", json={"model": NAME, "prompt": "hi"})).status_code == 200
            assert (await client.post("/resume")).status_code == 200  # not paused: asleep still
            assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
            woken = await client.post("/wake_up")
            assert woken.status_code == 200 and woken.json() == {"is_sleeping": False}, woken.text
            again = await completion(client)
            assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == before, again.text

        run(engine, tokenizer, scenario, rl_endpoints=True)


def test_wake_up_by_tags_level_2_and_bad_arguments(tokenizer):
    with make_engine(64) as engine:
        async def scenario(client: httpx2.AsyncClient) -> None:
            before = (await completion(client)).json()["choices"][0]["token_ids"]
            assert (await client.post("/sleep", params={"level": "3"})).status_code == 400
            assert (await client.post("/sleep", params={"level": "2"})).status_code == 200
            assert engine.is_sleeping
            bad = await client.post("/wake_up", params={"tags": "gpu"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags", bad.text
            weights = await client.post("/wake_up", params={"tags": "weights"})
            assert weights.json() == {"is_sleeping": True}  # the KV pool sleeps on
            assert (await completion(client)).status_code == 503
            kv = await client.post("/wake_up", params={"tags": "kv_cache"})
            assert kv.json() == {"is_sleeping": False}
            assert (await completion(client)).json()["choices"][0]["token_ids"] == before

        run(engine, tokenizer, scenario, rl_endpoints=True)


def test_sleep_routes_need_the_key_and_the_flag(tokenizer):
    with make_engine(64) as engine:
        async def keyed(client: httpx2.AsyncClient) -> None:
            for method, path in [("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping")]:
                assert (await getattr(client, method)(path)).status_code == 401, path
            ok = await client.get("/is_sleeping", headers={"Authorization": "Bearer k"})
            assert ok.json() == {"is_sleeping": False}

        async def flagless(client: httpx2.AsyncClient) -> None:
            for method, path in [("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping")]:
                assert (await getattr(client, method)(path)).status_code == 404, path

        run(engine, tokenizer, keyed, rl_endpoints=True, api_key="k")
        run(engine, tokenizer, flagless)
