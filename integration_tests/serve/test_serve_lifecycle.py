"""The server's edges: API key, a full queue, a drained shutdown on SIGTERM, the command line."""

from __future__ import annotations

import http.client
import json
import re
import signal
import time
import urllib.parse

import fastapi  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import openai
import pytest
import uvicorn  # noqa: F401  (a [dev] dependency: its absence fails the suite)

from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.serve.cli import paged_config, parse_args
from hf_paged_attn_tools.launch import ServerProcess

KEY = "sk-test-123"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def server():
    # The key comes from the environment, as documented; the queue holds 2 requests.
    args = ["--max-queue", "2", "--num-blocks", "256", "--drain-timeout", "20", "--no-compile"]
    proc = ServerProcess(DEMO_MODEL, args, env={"HF_PAGED_API_KEY": KEY, "OMP_NUM_THREADS": "1"}).start()
    yield proc
    proc.stop(10)


def make_client(server, key: str):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def test_the_served_name_defaults_to_the_model_argument(server):
    assert [m.id for m in make_client(server, KEY).models.list().data] == [str(DEMO_MODEL)]


def test_a_missing_key_gets_401(server):
    url = urllib.parse.urlsplit(server.url)
    for headers in ({}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT)
        conn.request("GET", "/v1/models", headers=headers)
        response = conn.getresponse()
        assert response.status == 401
        assert json.loads(response.read())["error"]["code"] == "invalid_api_key"
        conn.close()
    for path in ("/tokenize", "/detokenize"):  # behind the key like the other POST routes
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT)
        conn.request("POST", path, body=json.dumps({"prompt": "x", "tokens": [1]}),
                     headers={"Content-Type": "application/json", "Authorization": "Bearer sk-wrong"})
        response = conn.getresponse()
        assert response.status == 401 and json.loads(response.read())["error"]["code"] == "invalid_api_key"
        conn.close()
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT)
        conn.request("POST", path, body=json.dumps({"prompt": "x"} if path == "/tokenize" else {"tokens": [1]}),
                     headers={"Content-Type": "application/json", "Authorization": "Bearer " + KEY})
        assert conn.getresponse().status == 200
        conn.close()


@pytest.mark.parametrize("key", ["sk-wrong", KEY + "x"])
def test_a_wrong_key_gets_401(server, key):
    client = make_client(server, key)
    with pytest.raises(openai.AuthenticationError) as info:
        client.completions.create(model=str(DEMO_MODEL), prompt="A list is", max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_health_and_metrics_need_no_key(server):
    url = urllib.parse.urlsplit(server.url)
    for path in ("/health", "/metrics"):
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT)
        conn.request("GET", path)
        assert conn.getresponse().status == 200
        conn.close()


def test_a_full_queue_gets_429(server):
    client = make_client(server, KEY)
    busy = client.completions.create(model=str(DEMO_MODEL), prompt="A list is", max_tokens=600, n=2, stream=True)
    chunks = iter(busy)
    next(chunks)  # both choices are in the engine: the queue of 2 is full
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=str(DEMO_MODEL), prompt="A list is", max_tokens=2)
    assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
    busy.close()  # hang up: both choices are aborted
    deadline = time.monotonic() + 20
    while True:
        try:
            out = client.completions.create(model=str(DEMO_MODEL), prompt="A list is", max_tokens=2, n=2)
            break
        except openai.RateLimitError:  # the aborts reach the engine at its next step
            assert time.monotonic() < deadline, "the queue leaked"
            time.sleep(0.05)
    assert len(out.choices) == 2  # the queue did not leak


def test_a_request_larger_than_the_queue_gets_400_not_429(server):
    client = make_client(server, KEY)
    for kwargs in ({"n": 3}, {"prompt": ["a", "b", "c"]}):  # 3 generations can never fit a queue of 2
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{"model": str(DEMO_MODEL), "prompt": "A list is", "max_tokens": 2, **kwargs})
        body = info.value.body
        assert body["code"] == "too_many_choices" and "at most 2" in body["message"]
        assert body["param"] == ("n" if "n" in kwargs else "prompt")


def test_sigterm_drains_running_requests_and_exits_0(server):
    client = make_client(server, KEY)
    stream = client.completions.create(
        model=str(DEMO_MODEL), prompt="A dictionary", max_tokens=120, temperature=0, stream=True
    )
    chunks = iter(stream)
    first = next(chunks)
    server.signal(signal.SIGTERM)
    start = time.monotonic()
    rest = list(chunks)  # the stream goes on to its end after the signal
    assert first.choices[0].text and rest
    assert rest[-1].choices[0].finish_reason in ("length", "stop")
    assert server.process.wait(30) == 0
    assert time.monotonic() - start < 30
    assert "stopped" in "".join(server.log)
    assert re.search(r"froze the \d{5,} objects of start-up", "".join(server.log))  # before it listened
    with pytest.raises(openai.APIConnectionError):  # no longer listening
        client.models.list()


def test_paged_flags_become_a_paged_config():
    args = parse_args(["m", "--block-size", "16", "--num-blocks", "64", "--max-num-seqs", "8", "--kernel", "torch",
                       "--no-prefix-caching", "--max-batch-tokens", "256", "--memory-fraction", "0.3"])
    config = paged_config(args)
    assert (config.block_size, config.num_blocks, config.max_num_seqs, config.kernel) == (16, 64, 8, "torch")
    assert (config.enable_prefix_caching, config.max_batch_tokens, config.memory_fraction) == (False, 256, 0.3)
    assert paged_config(parse_args(["m"])).enable_prefix_caching is True
    with pytest.raises(ValueError, match="max_num_seqs"):
        paged_config(parse_args(["m", "--max-num-seqs", "0"]))
    with pytest.raises(SystemExit):
        parse_args(["m", "--max-queue", "0"])
