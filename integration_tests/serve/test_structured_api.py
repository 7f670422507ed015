"""Structured outputs and tool calls over HTTP, driven by the official ``openai`` client against a real
uvicorn serving the bundled demo model with a Hermes-style chat template that renders tools
(``hf_paged_attn_tools/hermes_tools_template.jinja``).

The demo model knows nothing of JSON or tools: every valid output here is the grammar's doing.
Sampled requests (temperature 1) must each parse and validate with ``jsonschema``; greedy ones are
compared across streamed / whole answers and with free requests run alone.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import fastapi  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import jsonschema
import llguidance  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import openai
import pytest
from pydantic import BaseModel, Field

import hf_paged_attn_tools
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn_tools.launch import ServerProcess

from .test_serve import metrics, raw

NAME = "demo"
TIMEOUT = 120.0
TEMPLATE = Path(hf_paged_attn_tools.__file__).parent / "hermes_tools_template.jinja"
SAMPLED = {"temperature": 1.0, "top_p": 1.0}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "temperature": {"type": "integer", "minimum": -40, "maximum": 50},
        "sky": {"enum": ["clear", "cloudy", "rain"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["city", "temperature", "sky", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD, "strict": True}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", NAME, "--num-blocks", "512", "--max-num-seqs", "64",
            "--chat-template", str(TEMPLATE)]
    with ServerProcess(DEMO_MODEL, [*args, "--no-compile"], env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def json_schema_format(schema: dict, name: str = "weather") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# ------------------------------------------------------------------------------- response_format
def test_sampled_json_schema_outputs_all_validate(client):
    out = client.chat.completions.create(model=NAME, messages=ASK, n=6, max_tokens=200, seed=11,
                                         response_format=json_schema_format(SCHEMA), **SAMPLED)
    assert len(out.choices) == 6
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        valid(choice.message.content, SCHEMA)
    assert len({c.message.content for c in out.choices}) > 1  # sampled, not one answer six times


def test_json_schema_on_completions(client):
    out = client.completions.create(model=NAME, prompt="Weather report as JSON:", n=4, max_tokens=200, seed=3,
                                    extra_body={"response_format": json_schema_format(SCHEMA)}, **SAMPLED)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        valid(choice.text, SCHEMA)


class Weather(BaseModel):
    city: str = Field(max_length=12)
    temperature: int = Field(ge=-40, le=50)
    raining: bool


def test_the_parse_helper_with_a_pydantic_model(client):
    out = client.chat.completions.parse(model=NAME, messages=ASK, response_format=Weather, max_tokens=120, **SAMPLED)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Weather) and out.choices[0].finish_reason == "stop"
    assert parsed == Weather.model_validate_json(out.choices[0].message.content)


def test_json_object(client):
    out = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=300, n=3, seed=5,
                                         response_format={"type": "json_object"}, **SAMPLED)
    for choice in out.choices:
        if choice.finish_reason == "stop":  # free JSON may run to max_tokens; what stopped is a whole object
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


def test_vllm_structured_outputs_and_guided_fields(client):
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        out = client.completions.create(model=NAME, prompt="A code:", max_tokens=30, n=3, extra_body=body, **SAMPLED)
        assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in out.choices), out
    choices = ["list", "tuple", "dict"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        out = client.chat.completions.create(model=NAME, messages=ASK, n=4, extra_body=body, **SAMPLED)
        assert all(c.message.content in choices for c in out.choices)
    out = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=200,
                                         extra_body={"guided_json": json.dumps(SCHEMA)}, **SAMPLED)
    valid(out.choices[0].message.content, SCHEMA)
    grammar = 'start: "x = " num\nnum: /[1-9][0-9]?/'
    out = client.completions.create(model=NAME, prompt="Code:", max_tokens=10,
                                    extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"x = [1-9][0-9]?", out.choices[0].text)


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("chat/completions", {"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
     "response_format", ["uniqueItems"]),
    ("completions", {"structured_outputs": {"json": {"type": "object", "not": {"required": ["a"]}}}},
     "structured_outputs", ["not"]),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools", ["uniqueItems"]),
    ("completions", {"guided_regex": "(?<=a)b"}, "guided_regex", ["regex"]),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ["exactly one"]),
    ("completions", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", ["one way"]),
    ("chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", ["response_format"]),
    ("chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", ["nope"]),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice", ["tools"]),
    ("chat/completions", {"tools": TOOLS + TOOLS[:1]}, "tools", ["get_weather"]),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format", []),
    ("completions", {"guided_json": '{"type": "object"'}, "guided_json", ["JSON"]),
    ("completions", {"guided_json": {"type": "object", "x": json.loads("[" * 80 + "]" * 80)}}, "guided_json",
     ["deeper"]),
])
def test_what_cannot_be_enforced_is_a_400_naming_the_field_and_nothing_is_queued(server, path, body, param, words):
    base = {"model": NAME, "max_tokens": 4}
    base |= {"prompt": "x"} if path == "completions" else {"messages": ASK}
    status, payload = raw(server, "POST", f"/v1/{path}", base | body)
    assert status == 400, payload
    error = payload["error"]
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error
    assert metrics(server)["hf_paged_attn_kv_blocks_used"] == 0


def test_constrained_and_free_requests_share_a_batch(server, client):
    prompts = [f"Question {i}: what does the with statement do?" for i in range(8)]
    alone = [client.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0).choices[0].text
             for p in prompts[:3]]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c:
            free = [c.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0) for p in prompts]
            constrained = [c.completions.create(model=NAME, prompt=p, max_tokens=200, seed=i, **SAMPLED,
                                                extra_body={"response_format": json_schema_format(SCHEMA)})
                           for i, p in enumerate(prompts)]
            return await asyncio.gather(*free, *constrained)

    results = asyncio.run(run())
    free, constrained = results[:8], results[8:]
    assert [r.choices[0].text for r in free[:3]] == alone  # free rows are untouched by their constrained neighbours
    for r in constrained:
        valid(r.choices[0].text, SCHEMA)


def test_streaming_with_response_format(client):
    kwargs = {"model": NAME, "messages": ASK, "max_tokens": 200, "response_format": json_schema_format(SCHEMA)}
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content and chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # it streamed
    valid(text, SCHEMA)


# ------------------------------------------------------------------------------- tools
def fold(chunks) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish reason) of a streamed chat, checking OpenAI's tool-call delta shape."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index == len(calls):  # a call's first delta: id, type and name
                assert d.id and d.type == "function" and d.function.name
                calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""})
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def tool_calls_of(client, stream: bool, **kwargs) -> tuple[list[dict], str]:
    if stream:
        content, calls, finish = fold(client.chat.completions.create(stream=True, **kwargs))
        assert not content
        return calls, finish
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content is None
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    assert all(c.type == "function" for c in choice.message.tool_calls or [])
    return calls, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_tool_choice_required_gives_valid_calls(client, stream, parallel):
    for seed in range(3):
        calls, finish = tool_calls_of(client, stream, model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=parallel, max_tokens=300, seed=seed, **SAMPLED)
        assert finish == "tool_calls" and calls
        assert parallel or len(calls) == 1
        assert len({c["id"] for c in calls}) == len(calls)
        for call in calls:
            valid(call["arguments"], PARAMETERS[call["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_is_the_one_called(client, stream):
    choice = {"type": "function", "function": {"name": "add"}}
    for seed in range(3):
        calls, finish = tool_calls_of(client, stream, model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                      max_tokens=200, seed=seed, **SAMPLED)
        assert finish == "tool_calls" and [c["name"] for c in calls] == ["add"]
        valid(calls[0]["arguments"], ADD)


def test_auto_passes_text_without_calls_through(client):
    kwargs = {"model": NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 40}
    plain = client.chat.completions.create(tool_choice="none", **kwargs).choices[0]
    auto = client.chat.completions.create(**kwargs).choices[0]  # tools without tool_choice: auto
    assert auto.message.content == plain.message.content and not auto.message.tool_calls
    assert auto.finish_reason == plain.finish_reason in ("stop", "length")
    content, calls, finish = fold(client.chat.completions.create(stream=True, **kwargs))
    assert (content, calls, finish) == (plain.message.content, [], plain.finish_reason)


def test_a_tool_round_trip(client):
    from transformers import AutoTokenizer

    from hf_paged_attn.serve.openai.chat import chat_prompt_ids

    first = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=20)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and isinstance(answer.message.content, str)
    assert not answer.message.tool_calls
    # the template saw the call (its arguments as a dict) and the tool's answer
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    rendered = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    ids = chat_prompt_ids(tokenizer, rendered, TEMPLATE.read_text(), TOOLS)
    assert second.usage.prompt_tokens == len(ids)
    text = tokenizer.decode(ids)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
