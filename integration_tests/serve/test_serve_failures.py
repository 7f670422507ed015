"""The server's failure paths, in process: the real app (serve/app.py) on the real demo engine, driven
through httpx's ASGITransport, with each failure injected where it happens in production:

- a forward that raises: the engine fails that step's requests; a plain request gets a 500
  ``generation_error``, a stream an error event then ``data: [DONE]``; their blocks are free and the
  next request runs as if nothing had happened;
- an engine step that raises (``EngineLoop._fail_all``, the engine thread's last resort): every open
  request gets its error, none hangs;
- a request arriving while the server shuts down: 503 ``shutting_down``, nothing left running;
- a client gone while its body arrives: not an error in the log, no 500.

Every wait is bounded by ``TIMEOUT``: a path that hangs fails its test instead of the suite.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import fastapi  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import httpx2
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.serve.app import build_app
from hf_paged_attn.serve.openai.handlers import ServeSettings

NAME = "demo"
TIMEOUT = 30.0  # seconds, for any one test's requests together
PROMPT = "The for statement"  # the demo model's greedy completion runs past 8 tokens without EOS
COMPLETION = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "What is a list?"}], "max_tokens": 8,
        "temperature": 0}
FORWARD_ERROR = "injected forward failure"


@pytest.fixture(scope="module")
def engine():
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged").eval()
    with ContinuousBatchingEngine(model, PagedConfig(num_blocks=64, compile=False)) as engine:
        yield engine


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def greedy(engine, tokenizer) -> dict[str, str]:
    """The texts of COMPLETION and CHAT on a server that has seen no failure."""

    async def texts(client: httpx2.AsyncClient) -> dict[str, str]:
        plain = (await client.post("/v1/completions", json=COMPLETION)).json()
        chat = (await client.post("/v1/chat/completions", json=CHAT)).json()
        return {"completion": plain["choices"][0]["text"], "chat": chat["choices"][0]["message"]["content"]}

    out = run(engine, tokenizer, texts)
    assert all(out.values()), out
    return out


def run(engine: Any, tokenizer: Any, scenario: Callable[..., Any], *, app_arg: bool = False) -> Any:
    """``scenario(client)`` (or ``scenario(app, client)``) against a fresh app on ``engine``, inside its
    lifespan (the engine thread runs), within TIMEOUT."""

    async def main() -> Any:
        async with serving(engine, tokenizer) as (app, client):
            return await (scenario(app, client) if app_arg else scenario(client))

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT))


@asynccontextmanager
async def serving(engine: Any, tokenizer: Any) -> AsyncIterator[tuple[Any, httpx2.AsyncClient]]:
    app = build_app(engine, tokenizer, ServeSettings(model_name=NAME))
    async with app.router.lifespan_context(app):
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://test", timeout=TIMEOUT) as client:
            yield app, client


def fail_forward(monkeypatch, engine: Any, at_call: int) -> list[int]:
    """The engine's executor raises on its ``at_call``-th forward from now (0: the next), once.
    Returns the list the forwards are counted in."""
    real = engine.executor.execute
    calls: list[int] = []

    def execute(step: Any) -> Any:
        calls.append(1)
        if len(calls) - 1 == at_call:
            raise RuntimeError(FORWARD_ERROR)
        return real(step)

    monkeypatch.setattr(engine.executor, "execute", execute)
    return calls


def engine_holds(stats: Any) -> bool:
    """Whether the engine's ``stats`` show a request or a block still held."""
    return bool(stats.num_running or stats.num_waiting or stats.num_free_blocks != stats.num_blocks)


def assert_nothing_held(engine: Any) -> None:
    stats = engine.stats
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_blocks, f"{stats.num_blocks - stats.num_free_blocks} blocks held"


def assert_error_body(response: httpx2.Response, status: int, code: str, message: str) -> None:
    """OpenAI's error shape, and a 5xx closes the connection."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("server_error", None, code)
    assert message in error["message"]
    assert response.headers["connection"] == "close"


def sse_events(response: httpx2.Response) -> list[str]:
    """The ``data:`` payloads of a server-sent-events body, in order."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[len("data: "):] for line in lines]


# ------------------------------------------------------------------------------- a failing forward
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_failing_forward_is_a_500_and_the_next_request_runs(engine, tokenizer, greedy, monkeypatch, route):
    body = COMPLETION if route == "completions" else CHAT

    async def scenario(client: httpx2.AsyncClient) -> None:
        calls = fail_forward(monkeypatch, engine, at_call=2)  # mid-generation: blocks are held by then
        response = await client.post(f"/v1/{route}", json=body)
        assert len(calls) == 3
        assert_error_body(response, 500, "generation_error", f"generation failed: RuntimeError: {FORWARD_ERROR}")
        assert_nothing_held(engine)
        monkeypatch.undo()
        again = await client.post(f"/v1/{route}", json=body)
        assert again.status_code == 200, again.text
        choice = again.json()["choices"][0]
        text = choice["text"] if route == "completions" else choice["message"]["content"]
        assert text == greedy["completion" if route == "completions" else "chat"]
        assert_nothing_held(engine)

    run(engine, tokenizer, scenario)


def test_a_stream_whose_forward_fails_ends_with_an_error_event_then_done(engine, tokenizer, greedy, monkeypatch):
    async def scenario(client: httpx2.AsyncClient) -> None:
        fail_forward(monkeypatch, engine, at_call=4)  # after 4 tokens have been sent
        response = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
        events = sse_events(response)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert (error["type"], error["code"]) == ("server_error", "generation_error")
        assert FORWARD_ERROR in error["message"]
        chunks = [json.loads(e) for e in events[:-2]]
        sent = "".join(c["choices"][0]["text"] for c in chunks)
        assert sent and greedy["completion"].startswith(sent)  # the tokens before the failure, as they were
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        assert_nothing_held(engine)
        monkeypatch.undo()
        events = sse_events(await client.post("/v1/completions", json={**COMPLETION, "stream": True}))
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == greedy["completion"]
        assert_nothing_held(engine)

    run(engine, tokenizer, scenario)


# ------------------------------------------------------------------------------- a failing engine step
def test_a_failing_engine_step_fails_every_open_request_and_none_hangs(engine, tokenizer, greedy, monkeypatch):
    """``engine.step()`` itself raising (not the forward, which the engine catches) is the engine
    thread's last resort, ``_fail_all``: every request it holds gets its error at once."""
    num_requests = 4  # engine requests: a completion, a streamed completion, a chat with n=2
    real_step = engine.step
    steps: list[int] = []
    state: dict[str, Any] = {}

    def step() -> Any:
        steps.append(1)
        if len(steps) == 1:  # the failure must find them all open and holding blocks
            deadline = time.monotonic() + TIMEOUT / 2
            while state["loop"].num_unfinished < num_requests and time.monotonic() < deadline:
                time.sleep(0.005)
        if len(steps) == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    async def scenario(app: Any, client: httpx2.AsyncClient) -> None:
        state["loop"] = app.state.engine_loop
        monkeypatch.setattr(engine, "step", step)
        plain, streamed, chat = await asyncio.gather(
            client.post("/v1/completions", json={**COMPLETION, "max_tokens": 64}),
            client.post("/v1/completions", json={**COMPLETION, "max_tokens": 64, "stream": True}),
            client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 64, "n": 2}),
        )
        assert len(steps) >= 3  # the fourth may have run already (below)
        for response in (plain, chat):
            assert_error_body(response, 500, "generation_error", "RuntimeError: injected step failure")
        events = sse_events(streamed)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "generation_error"
        assert state["loop"].num_unfinished == 0
        # The engine thread carries out their aborts at once (one more step), not when a request next comes.
        deadline = time.monotonic() + TIMEOUT / 2
        while engine_holds(state["loop"].stats) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not engine_holds(state["loop"].stats), state["loop"].stats
        assert len(steps) == 4  # one step more carried out the aborts; the thread then sleeps
        registry = app.state.metrics.registry
        counted = {reason: registry.get_sample_value("hf_paged_attn_requests_finished_total", {"finish_reason": reason})
                   for reason in ("error", "abort")}  # fmt: skip
        assert counted == {"error": num_requests, "abort": None}  # each failed request counted once, as an error
        monkeypatch.undo()
        again = await client.post("/v1/completions", json=COMPLETION)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == greedy["completion"]
        assert_nothing_held(engine)

    run(engine, tokenizer, scenario, app_arg=True)


# ------------------------------------------------------------------------------- shutting down
def test_a_request_after_the_drain_deadline_gets_503_shutting_down(engine, tokenizer, greedy):
    """``abort_all`` is what the drain deadline calls (cli.py): the server accepts no new request."""

    async def scenario(app: Any, client: httpx2.AsyncClient) -> None:
        app.state.engine_loop.abort_all()
        for route, body in (("completions", COMPLETION), ("chat/completions", {**CHAT, "stream": True})):
            response = await client.post(f"/v1/{route}", json=body)
            assert_error_body(response, 503, "shutting_down", "shutting down")
        assert not engine.has_unfinished()

    run(engine, tokenizer, scenario, app_arg=True)


def test_a_request_added_while_the_server_begins_stopping_gets_503_and_never_runs(engine, tokenizer, greedy,
                                                                                 monkeypatch):
    """The race ``EngineLoop.submit`` guards: the server closes while the engine is taking the request
    (``add_request`` holds no lock). The request is aborted in the engine, never generated for."""
    real_add = engine.add_request
    added: list[str] = []

    async def scenario(app: Any, client: httpx2.AsyncClient) -> None:
        def add_request(*args: Any, **kwargs: Any) -> str:
            added.append(real_add(*args, **kwargs))
            app.state.engine_loop.abort_all()
            return added[-1]

        monkeypatch.setattr(engine, "add_request", add_request)
        response = await client.post("/v1/completions", json=COMPLETION)
        assert_error_body(response, 503, "shutting_down", "shutting down")

    run(engine, tokenizer, scenario, app_arg=True)
    monkeypatch.undo()
    assert len(added) == 1
    outputs = [out for _ in range(3) if engine.has_unfinished() for out in engine.step()]  # the abort, carried out
    assert [(o.request_id, o.finish_reason, o.output_ids) for o in outputs] == [(added[0], "abort", [])]
    assert not engine.has_unfinished()
    assert_nothing_held(engine)


# ------------------------------------------------------------------------------- a client gone mid-body
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_client_gone_while_its_body_arrives_is_not_an_error(engine, tokenizer, caplog, route):
    """The connection drops after half the body: the server logs no error and answers no 500, but 499
    (nginx's "client closed request", which uvicorn drops for a closed connection; the test sees it)."""
    messages = [{"type": "http.request", "body": b'{"model": "demo", "pro', "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": route, "raw_path": route.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"64")],
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # nothing more ever comes (bounded by TIMEOUT)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def scenario(app: Any, client: httpx2.AsyncClient) -> None:
        await app(scope, receive, send)

    with caplog.at_level(logging.DEBUG):
        run(engine, tokenizer, scenario, app_arg=True)
    assert not messages  # the body was read up to the disconnect
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert statuses == [499]
    mine = [r for r in caplog.records if r.name.startswith("hf_paged_attn")]
    assert all(r.levelno <= logging.INFO and r.exc_info is None for r in mine), [r.getMessage() for r in mine]
