"""Fuzzing the server: hypothesis builds request bodies (valid ones, valid ones with one field made
hostile, unknown fields, raw bytes, deep nesting, wrong content types) and sends them to a real
uvicorn on 127.0.0.1 serving the bundled model, over one keep-alive connection.

What must hold for every one: no 5xx and no reset connection; a 200 is strict JSON (no NaN or
Infinity) or a stream of strict-JSON events ending with ``data: [DONE]``; an error is OpenAI's
shape, small, and names the field that was made bad (``param``). After all of them the server is
healthy: ``/health`` answers, a normal completion works, and every KV block is free again.

Bounded for CI (derandomized, ~150 examples, a few tens of seconds); ``HF_PAGED_FUZZ_EXAMPLES=N``
runs N random (not derandomized) examples per test instead.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.parse

import fastapi  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import pytest
import uvicorn  # noqa: F401  (a [dev] dependency: its absence fails the suite)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn_tools.launch import ServerProcess

NAME = "demo"
VOCAB = 4096  # the demo model's
TIMEOUT = 60.0
EXAMPLES = int(os.environ.get("HF_PAGED_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=EXAMPLES or 50, deadline=None, derandomize=not EXAMPLES, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
# A bad value of one field may be reported on a field it depends on (or that depends on it).
RELATED = {"prompt": {"max_tokens"}, "messages": {"max_tokens"}, "logprobs": {"top_logprobs"},
           "stream": {"stream_options"}, "max_completion_tokens": {"max_tokens", "min_tokens"}, "n": {"best_of"},
           "max_tokens": {"min_tokens"}}
# A constrained output (a structured-output field, a forced tool call) refuses the body's ignore_eos.
RELATED.update({name: {"ignore_eos"} for name in ("response_format", "structured_outputs", "guided_json",
                                                  "guided_regex", "guided_choice", "guided_grammar", "tool_choice")})


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", NAME, "--num-blocks", "256", "--max-num-seqs", "32"]
    with ServerProcess(DEMO_MODEL, [*args, "--no-compile"], env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc


class Client:
    """One keep-alive connection; a response that says ``Connection: close`` gets a fresh one."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)

    def send(self, method: str, path: str, body: bytes, content_type: str | None) -> tuple[int, dict, bytes]:
        headers = {"Content-Type": content_type} if content_type is not None else {}
        self.conn.request(method, path, body=body, headers=headers)
        response = self.conn.getresponse()
        payload = response.read()
        if response.getheader("connection", "").lower() == "close":
            self.conn.close()
        return response.status, dict(response.getheaders()), payload


@pytest.fixture(scope="module")
def client(server):
    c = Client(server.url)
    yield c
    c.conn.close()


# --------------------------------------------------------------------------------- strategies
safe_text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=24)
surrogate = st.text(st.characters(categories=("Cs",)), min_size=1, max_size=2).map(lambda s: "a" + s)
huge_int = st.integers(min_value=10**20, max_value=10**60) | st.integers(max_value=-(10**20), min_value=-(10**60))
scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), huge_int,
                   st.floats(allow_nan=True, allow_infinity=True), safe_text, surrogate, st.just("x" * 5000))
hostile = st.recursive(
    scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(safe_text, inner, max_size=3), max_leaves=8
)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16)
stops = st.none() | safe_text.map(lambda s: s[:8]) | st.lists(safe_text, max_size=4)
sampling = {
    "temperature": st.none() | st.floats(0.0, 2.0), "top_p": st.none() | st.floats(0.01, 1.0), "n": st.integers(1, 2),
    "stop": stops, "seed": st.none() | st.integers(-(2**63), 2**63 - 1), "stream": st.booleans(), "user": safe_text,
    "presence_penalty": st.none() | st.floats(-2.0, 2.0), "frequency_penalty": st.none() | st.floats(-2.0, 2.0),
    "repetition_penalty": st.none() | st.floats(0.01, 10.0), "ignore_eos": st.booleans(),
    "min_tokens": st.none() | st.integers(0, 6),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100.0, 100.0), max_size=3),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
}


def consistent(body: dict) -> dict:
    """A valid body's fields that depend on others: stream_options only where stream is true, min_tokens at
    most max_tokens (a 400 otherwise, which the valid bodies must not get)."""
    if not body.get("stream"):
        body.pop("stream_options", None)
    if body.get("min_tokens") is not None:
        body["min_tokens"] = min(body["min_tokens"], body.get("max_tokens", 1))
    return body

completion = st.fixed_dictionaries(
    {"model": st.just(NAME), "prompt": safe_text | st.lists(safe_text, min_size=1, max_size=3) | token_ids
     | st.lists(token_ids, min_size=1, max_size=3)},
    optional={**sampling, "max_tokens": st.integers(1, 6), "logprobs": st.none() | st.integers(0, 5)},
).filter(lambda b: b.get("max_tokens") is not None).map(consistent)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": safe_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": safe_text}), max_size=2)},
    optional={"name": safe_text.map(lambda s: s[:16])},
)
chat = st.fixed_dictionaries(
    {"model": st.just(NAME), "messages": st.lists(message, min_size=1, max_size=3),
     "max_tokens": st.integers(1, 6)},
    optional={**sampling, "logprobs": st.booleans()},
).map(consistent)
STRUCTURED_FIELDS = ["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"]
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix",
                     *sampling, *STRUCTURED_FIELDS]
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
               "tools", "tool_choice", "parallel_tool_calls", "metadata", "store", *sampling,
               *STRUCTURED_FIELDS]


TOKENIZE_OPTIONS = {"model": st.just(NAME), "add_special_tokens": st.booleans(), "return_token_strs": st.booleans()}
tokenize_bodies = {
    "/tokenize": st.fixed_dictionaries({"prompt": safe_text}, optional=TOKENIZE_OPTIONS)
    | st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)},
                            optional={**TOKENIZE_OPTIONS, "add_generation_prompt": st.booleans()}),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(0, VOCAB - 1), max_size=16)},
                                         optional={"model": st.just(NAME)}),
}
TOKENIZE_FIELDS = {"/tokenize": ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                                 "return_token_strs", "tools"],
                   "/detokenize": ["model", "tokens"]}
TOKENIZE_RELATED = {"messages": {"prompt"}, "prompt": {"messages"}}  # the field that says which form a body is


def encode(body) -> bytes:
    """Python's json: NaN and Infinity come out as the non-JSON words the server must refuse."""
    return json.dumps(body).encode()


def strict(data: bytes):
    def refuse(name):
        raise AssertionError(f"{name} in a response: {data[:200]!r}")
    return json.loads(data, parse_constant=refuse)


# --------------------------------------------------------------------------------- checks
def check_response(status: int, headers: dict, payload: bytes, bad_field: str | None = None) -> None:
    assert status < 500, (status, payload[:500])
    lower = {k.lower(): v for k, v in headers.items()}
    if status == 200:
        if lower.get("content-type", "").startswith("text/event-stream"):
            lines = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
            assert lines and lines[-1] == "[DONE]", lines[-3:]
            events = [strict(line.encode()) for line in lines[:-1]]
            assert not any("error" in e for e in events), events[-1]
        else:
            assert "choices" in strict(payload)
        return
    assert len(payload) < 2000, payload[:300]
    error = strict(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == ("rate_limit_exceeded" if status == 429 else "invalid_request_error"), error
    if bad_field is not None and status == 400 and error["code"] != "invalid_json":
        bad_field = json.loads(json.dumps(bad_field))  # what the server reads: a surrogate pair is one character
        shown = bad_field[:64] + ("..." if len(bad_field) > 64 else "")
        shown = shown.encode("utf-8", "backslashreplace").decode()  # a lone surrogate as its escape
        assert error["param"] in {shown} | RELATED.get(bad_field, set()), (bad_field, error)


def post_json(client: Client, path: str, body, bad_field: str | None = None) -> None:
    status, headers, payload = client.send("POST", path, encode(body), "application/json")
    check_response(status, headers, payload, bad_field)


# --------------------------------------------------------------------------------- the fuzz tests
@pytest.mark.parametrize(("path", "bodies"), [("/v1/completions", completion), ("/v1/chat/completions", chat)],
                         ids=["completions", "chat"])  # fmt: skip
@FUZZ
@given(data=st.data())
def test_valid_requests_are_served(client, path, bodies, data):
    body = data.draw(bodies)
    status, headers, payload = client.send("POST", path, encode(body), "application/json")
    assert status == 200, payload[:500]
    check_response(status, headers, payload)


@FUZZ
@given(data=st.data(), chat_endpoint=st.booleans())
def test_one_hostile_field_is_a_400_naming_it(client, data, chat_endpoint):
    body = data.draw(chat if chat_endpoint else completion)
    fields = CHAT_FIELDS if chat_endpoint else COMPLETION_FIELDS
    field = data.draw(st.sampled_from(fields) | safe_text | surrogate)  # a known field, or most likely an unknown one
    value = data.draw(hostile)
    if chat_endpoint and data.draw(st.booleans()):  # inside a message instead: param is still "messages"
        field = "messages"
        key = data.draw(st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id"]) | safe_text)
        body["messages"][-1][key] = value
    else:
        body[field] = value
    path = "/v1/chat/completions" if chat_endpoint else "/v1/completions"
    post_json(client, path, body, field)


@FUZZ
@given(data=st.data(), path=st.sampled_from(sorted(tokenize_bodies)))
def test_tokenize_and_detokenize(client, data, path):
    """Valid bodies are answered in vLLM's shape; one hostile field is a 400 naming it."""
    body = data.draw(tokenize_bodies[path])
    status, headers, payload = client.send("POST", path, encode(body), "application/json")
    assert status == 200, payload[:500]
    answer = strict(payload)
    if path == "/tokenize":
        assert answer["count"] == len(answer["tokens"]) and all(0 <= t < VOCAB for t in answer["tokens"])
    else:
        assert isinstance(answer["prompt"], str)
    field = data.draw(st.sampled_from(TOKENIZE_FIELDS[path]) | safe_text | surrogate)
    body[field] = data.draw(hostile)
    status, headers, payload = client.send("POST", path, encode(body), "application/json")
    if status == 400 and field in TOKENIZE_RELATED and strict(payload)["error"]["param"] in TOKENIZE_RELATED[field]:
        return
    if status != 200:
        check_response(status, headers, payload, field)


@FUZZ
@given(raw=st.one_of(
    st.binary(max_size=64),
    st.integers(1, 60_000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(1, 60_000).map(lambda d: b'{"model": "demo", "prompt": "x", "tools": ' + b"[" * d + b"]" * d + b"}"),
    st.integers(4301, 20_000).map(lambda d: b'{"model": "demo", "prompt": "x", "max_tokens": ' + b"7" * d + b"}"),
    st.sampled_from([b"", b"null", b"[]", b'"x"', b"1e999", b'{"model": NaN}', b'{"model": "demo"']),
    hostile.map(encode),
), content_type=st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=b", None]),
   path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
def test_raw_bodies_and_content_types(client, raw, content_type, path):
    status, headers, payload = client.send("POST", path, raw, content_type)
    if status == 200 and path in tokenize_bodies:  # a random object may be a valid body: {"prompt": "x"}
        strict(payload)
        return
    check_response(status, headers, payload)
    if content_type is None or not content_type.startswith("application/json"):
        assert status == 415
    else:
        assert status == 400


def test_the_server_is_healthy_afterwards(server, client):
    status, _, _ = client.send("GET", "/health", b"", None)
    assert status == 200
    body = {"model": NAME, "prompt": "A list is", "max_tokens": 8, "temperature": 0}
    status, headers, payload = client.send("POST", "/v1/completions", encode(body), "application/json")
    assert status == 200 and strict(payload)["choices"][0]["text"]
    deadline = time.monotonic() + 20
    while True:  # streams that were cut by a stop sequence are aborted at the engine's next step
        _, _, text = client.send("GET", "/metrics", b"", None)
        values = dict(line.rsplit(" ", 1) for line in text.decode().splitlines() if line and line[0] != "#")
        used = float(values["hf_paged_attn_kv_blocks_used"])
        running = float(values["hf_paged_attn_num_requests_running"])
        if (used, running) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert used == 0 and running == 0
    assert float(values.get('hf_paged_attn_requests_finished_total{finish_reason="error"}', 0)) == 0
