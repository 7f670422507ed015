"""The OpenAI-compatible server, driven by the official ``openai`` client against a real uvicorn.

One server (the bundled demo model) serves the whole module. Greedy texts are checked against
transformers' own ``sdpa`` generate on the same token ids.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.parse

import fastapi  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import openai
import pytest
import torch
import uvicorn  # noqa: F401  (a [dev] dependency: its absence fails the suite)
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged_attn.demo import DEMO_MODEL, PROMPTS

NAME = "demo"
TIMEOUT = 60.0  # per HTTP call: a loaded CI machine is slow, a hang must still fail


@pytest.fixture(scope="module")
def server(demo_server):  # conftest.py: one server for the session (NAME is its served name)
    return demo_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def reference():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa").eval()

    def greedy(ids: list[int], max_new_tokens: int) -> str:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    return tokenizer, model, greedy


def raw(server, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
    """One HTTP call with full control of the body; (status, parsed JSON or {})."""
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, json.loads(payload) if payload.startswith(b"{") else {}


def metrics(server) -> dict[str, float]:
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


# ------------------------------------------------------------------------------- basics
def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert raw(server, "GET", "/health")[0] == 200
    m = metrics(server)
    assert m["hf_paged_attn_kv_blocks_total"] == 512
    assert m["hf_paged_attn_kv_blocks_used"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completion_equals_generate(client, reference, stream):
    tokenizer, _, greedy = reference
    prompt = "The with statement is used to"
    want = greedy(tokenizer(prompt)["input_ids"], 24)
    if stream:
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert out.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert text == want
    assert finish in ("length", "stop")


def test_token_prompts_several_prompts_and_echo(client, reference):
    tokenizer, _, greedy = reference
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [greedy(i, 12) for i in ids]
    assert out.usage.prompt_tokens == sum(map(len, ids))
    default = client.completions.create(model=NAME, prompt=ids[0], max_tokens=None, temperature=0)
    assert default.usage.completion_tokens <= 16  # OpenAI's default for completions
    echoed = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + out.choices[0].text


def test_chat_goes_through_the_template(client, reference):
    tokenizer, _, greedy = reference
    messages = [{"role": "system", "content": "You explain Python."}, {"role": "user", "content": "What is a list?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("User: What is a list?\nAssistant:")
    want = greedy(tokenizer(text, add_special_tokens=False)["input_ids"], 20)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want
    assert out.usage.completion_tokens <= 20


def test_chat_streams_asynchronously_with_usage(server, reference):
    tokenizer, _, greedy = reference
    messages = [{"role": "user", "content": "What does the for statement do?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = greedy(tokenizer(text, add_special_tokens=False)["input_ids"], 16)

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c:
            stream = await c.chat.completions.create(
                model=NAME, messages=messages, max_completion_tokens=16, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_n_choices(client, reference):
    tokenizer, _, greedy = reference
    out = client.completions.create(model=NAME, prompt="A dictionary maps", max_tokens=10, temperature=0, n=2)
    want = greedy(tokenizer("A dictionary maps")["input_ids"], 10)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [want, want]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=1.0, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert 2 <= chat.usage.completion_tokens <= 16


def test_stop_sequences_are_cut_from_the_text(client, reference):
    tokenizer, _, greedy = reference
    prompt = "A list is"
    full = greedy(tokenizer(prompt)["input_ids"], 20)  # " a tuple (a string, string, string, string)"
    stop = "string"
    assert stop in full
    want = full[: full.index(stop)]
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(client):
    out = client.completions.create(model=NAME, prompt="The for statement", max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy takes the best
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return client.completions.create(
            model=NAME, prompt="Strings are", max_tokens=16, temperature=1.0, seed=seed, n=2
        ).choices

    first, again = sample(7), sample(7)
    assert [c.text for c in first] == [c.text for c in again]
    assert first[0].text != first[1].text  # n seeded choices still differ


def test_32_concurrent_streaming_clients(server, reference):
    tokenizer, model, _ = reference
    prompts = PROMPTS[:32]
    batch = AutoTokenizer.from_pretrained(DEMO_MODEL, padding_side="left")(prompts, padding=True, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=16, do_sample=False)
    want = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)

    async def one(c, prompt):
        stream = await c.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(run())
    assert got == want
    assert metrics(server)["hf_paged_attn_kv_blocks_used"] == 0


def test_a_client_that_disconnects_frees_its_blocks(server):
    url = urllib.parse.urlsplit(server.url)
    aborted = metrics(server).get('hf_paged_attn_requests_finished_total{finish_reason="abort"}', 0)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT)
    body = {"model": NAME, "prompt": "The try statement specifies", "max_tokens": 900, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # it is generating
    assert metrics(server)["hf_paged_attn_kv_blocks_used"] > 0
    conn.sock.close()  # hang up mid-stream
    conn.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["hf_paged_attn_kv_blocks_used"] == 0 and m["hf_paged_attn_num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert m["hf_paged_attn_kv_blocks_used"] == 0
    assert m['hf_paged_attn_requests_finished_total{finish_reason="abort"}'] == aborted + 1
    assert m["hf_paged_attn_generation_tokens_total"] < 10_000  # it did not run to 900 tokens


# ------------------------------------------------------------------------------- bad input
GOOD = {"model": NAME, "prompt": "A list is", "max_tokens": 4}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD = [
    ("completions", {**GOOD, "prompt": ""}, "prompt"),
    ("completions", {**GOOD, "prompt": []}, "prompt"),
    ("completions", {**GOOD, "prompt": [[]]}, "prompt"),
    ("completions", {**GOOD, "prompt": [1, "a"]}, "prompt"),
    ("completions", {**GOOD, "prompt": [5_000_000]}, None),  # outside the vocabulary: the engine refuses it
    ("completions", {**GOOD, "max_tokens": 1021}, "max_tokens"),  # 4 prompt tokens + 1021 > 1024 positions
    ("completions", {**GOOD, "max_tokens": "4"}, "max_tokens"),
    ("completions", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("completions", {**GOOD, "n": 0}, "n"),
    ("completions", {**GOOD, "temperature": "hot"}, "temperature"),
    ("completions", {**GOOD, "temperature": 3}, "temperature"),
    ("completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {**GOOD, "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {**GOOD, "frequency_penalty": -3}, "frequency_penalty"),
    ("chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {**GOOD, "best_of": 3}, "best_of"),
    ("completions", {**GOOD, "logit_bias": {"5000": 1}}, "logit_bias"),  # outside the vocabulary
    ("chat/completions", {**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {**GOOD, "no_such_option": 1}, "no_such_option"),
    ("completions", {**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "x"}, "model"),
    ("completions", "not json", None),
    ("completions", [1, 2], None),
    ("chat/completions", {**CHAT, "messages": []}, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),
    ("chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {**CHAT, "max_tokens": 2000}, "max_tokens"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD, ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(BAD)])
def test_bad_input_gets_an_openai_400(server, endpoint, body, param):
    status, payload = raw(server, "POST", f"/v1/{endpoint}", body)
    assert status == 400, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(("endpoint", "body"), [("completions", {**GOOD, "model": "gpt-4"}),
                                               ("chat/completions", {**CHAT, "model": "demo2"})])
def test_a_model_not_served_is_a_404(server, endpoint, body):
    """As vLLM and OpenAI answer: 404 ``model_not_found`` naming what is served."""
    status, payload = raw(server, "POST", f"/v1/{endpoint}", body)
    assert status == 404, payload
    error = payload["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and error["type"] == "not_found_error"
    assert body["model"] in error["message"] and "demo" in error["message"]


def test_unknown_route_and_client_errors(server, client):
    status, payload = raw(server, "GET", "/v1/nothing")
    assert status == 404 and payload["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, presence_penalty=3.0)


def test_bad_requests_do_not_harm_a_running_one(server, reference):
    tokenizer, _, greedy = reference
    want = greedy(tokenizer("The import statement")["input_ids"], 40)

    async def good(c):
        stream = await c.completions.create(
            model=NAME, prompt="The import statement", max_tokens=40, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def bad(c, body):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)):  # a model not served: 404
            await c.completions.create(**body)

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c:
            bodies = [{**GOOD, "prompt": [9_999_999]}, {**GOOD, "max_tokens": 5000}, {**GOOD, "model": "x"}] * 3
            results = await asyncio.gather(good(c), *(bad(c, b) for b in bodies))
            return results[0]

    assert asyncio.run(run()) == want
