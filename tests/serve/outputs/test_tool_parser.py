"""Tool calls in model output (``serve/outputs/tool_parser.py``) and the grammar that forces one
(``serve/outputs/tools.py``).

The parser is checked on constructed outputs of each format (Hermes / Qwen and Llama 3 JSON), on
outputs that only look like calls, and for every way a text can be split into stream deltas (the
folded deltas equal the whole-text parse). The forced-call grammar is checked by walking it with
random allowed tokens of the demo tokenizer: every output it allows parses into calls whose
arguments validate against their tool's parameters.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_attn.serve.outputs.tool_parser import HERMES, LLAMA3, ToolCallStream, detect_format, parse_tool_calls
from hf_paged_attn.serve.outputs.tools import FunctionTool, call_schema, forced_grammar


def calls_of(text: str, fmt=HERMES) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(fmt, text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def fold(fmt, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The deltas of a stream fed ``pieces``, folded as a client folds them."""
    stream = ToolCallStream(fmt)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta.content
        for d in delta.tool_calls:
            if "id" in d:
                assert d["type"] == "function" and d["id"].startswith("call_") and d["index"] == len(calls)
                calls.append([d["function"]["name"], d["function"]["arguments"]])
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    return (content or None) if calls else content, [tuple(c) for c in calls]


# ------------------------------------------------------------------------------- Hermes / Qwen
def test_hermes_calls_with_content_before():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    content, calls = calls_of(text)
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"tz": "CET"}')]
    assert json.loads(calls[0][1]) == {"city": "Paris", "days": [1, 2]}


def test_hermes_arguments_in_any_order_as_a_string_or_missing():
    assert calls_of('<tool_call>{"arguments": {"x": "}{"}, "name": "f"}</tool_call>')[1] == [("f", '{"x": "}{"}')]
    assert calls_of('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1] == [("f", '{"x": 1}')]
    assert calls_of('<tool_call>{"name": "f"}</tool_call>')[1] == [("f", "{}")]
    assert calls_of('<tool_call>{"name": "f", "parameters": {"y": null}}</tool_call>')[1] == [("f", '{"y": null}')]


@pytest.mark.parametrize("text", [
    "No calls here: <tool and <tool_call is not closed",
    'x <tool_call>{"name": 3, "arguments": {}}</tool_call>',  # the name is no string
    "<tool_call>not json</tool_call> after",
    "  leading and trailing whitespace kept \n",
    "",
])
def test_hermes_text_without_a_call_is_the_content_as_it_is(text):
    assert calls_of(text) == (text, [])


def test_hermes_call_cut_short_keeps_what_was_written():
    content, calls = calls_of('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert content is None and calls == [("f", '{"city": "Par')]
    assert calls_of('<tool_call>\n{"na') == ('<tool_call>\n{"na', [])  # no name yet: content after all


# ------------------------------------------------------------------------------- Llama 3 JSON
def test_llama3_calls():
    assert calls_of('{"name": "f", "parameters": {"x": 1}}', LLAMA3) == (None, [("f", '{"x": 1}')])
    text = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}'
    assert calls_of(text, LLAMA3) == (None, [("f", '{"x": 1}'), ("g", "{}")])


@pytest.mark.parametrize("text", ['{"answer": 42, "name": "f"}', 'The call {"name": "f", "parameters": {}}', "plain"])
def test_llama3_json_that_is_not_a_call_is_content(text):
    assert calls_of(text, LLAMA3) == (text, [])


def test_detect_format_from_the_template():
    assert detect_format("... <tool_call> ...") is HERMES
    assert detect_format("{{ '<|python_tag|>' }} ...") is LLAMA3
    assert detect_format(None) is HERMES and detect_format("x", "llama3") is LLAMA3
    with pytest.raises(ValueError, match="mistral"):
        detect_format("x", "mistral")


# ------------------------------------------------------------------------------- streaming
SAMPLES = [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"s": "<tool_call>\\"}"}}\n</tool_call>\n'
             '<tool_call>\n{"arguments": {"n": [1, {"k": []}]}, "name": "b"}\n</tool_call>\nDone.'),
    (HERMES, 'text < <tool_call>{"name": "x"'),
    (HERMES, "just text\n\n"),
    (LLAMA3, '  {"name": "f", "parameters": {"q": "a;b"}} ; {"name": "g", "parameters": {"r": 2.5e3}}'),
    (LLAMA3, '{"not": "a call"} more'),
]


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(sample=st.sampled_from(SAMPLES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_deltas_fold_to_the_whole_parse_however_the_text_is_split(sample, cuts):
    fmt, text = sample
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    assert fold(fmt, pieces) == calls_of(text, fmt)


def test_a_stream_announces_the_name_then_sends_arguments_as_they_grow():
    stream = ToolCallStream(HERMES)
    assert stream.feed("Hi <tool").content == "Hi"  # "<tool" may open a call: held back
    first = stream.feed('_call>\n{"name": "f", "arguments": {"a"')
    assert first.content == "" and len(first.tool_calls) == 2
    assert first.tool_calls[0]["function"] == {"name": "f", "arguments": ""}  # the first delta: id, type, name
    assert first.tool_calls[1] == {"index": 0, "function": {"arguments": '{"a"'}}
    assert stream.feed(": 1}}\n</tool_call>").tool_calls == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert stream.feed("", final=True).tool_calls == [] and stream.num_calls == 1


# ------------------------------------------------------------------------------- the forced-call grammar
TOOLS = [
    FunctionTool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}),
    FunctionTool.model_validate({"type": "function", "function": {"name": "route", "parameters": {
        "$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["x"], "additionalProperties": False}},
        "type": "object", "properties": {"stops": {"type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 2}},
        "required": ["stops"], "additionalProperties": False}}}),
    FunctionTool.model_validate({"type": "function", "function": {"name": "now"}}),  # no parameters
]


def test_call_schema_moves_local_refs_inside_it():
    schema = call_schema(HERMES, "route", TOOLS[1].function.parameters)
    assert schema["properties"]["name"] == {"const": "route"}
    items = schema["properties"]["arguments"]["properties"]["stops"]["items"]
    assert items == {"$ref": "#/properties/arguments/$defs/p"}
    assert list(schema["properties"]["arguments"]) == list(TOOLS[1].function.parameters)  # order kept
    assert call_schema(LLAMA3, "now", None)["required"] == ["name", "parameters"]


@pytest.fixture(scope="module")
def compiler():
    import llguidance  # noqa: F401
    from transformers import AutoTokenizer

    from hf_paged_attn.demo import DEMO_MODEL
    from hf_paged_attn.runtime.generation.structured import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    return tokenizer, GrammarCompiler(tokenizer, 4096)


def walk(tokenizer, compiler, grammar: str, rng: random.Random, max_tokens: int = 400) -> str:
    """An output the grammar allows: random allowed tokens until it must (or, by chance, may) end."""
    import torch

    from hf_paged_attn.runtime.generation.structured import StructuredSpec

    matcher = compiler.matcher(StructuredSpec(grammar=grammar))
    bitmask = compiler.allocate_bitmask(1)
    ids = []
    for _ in range(max_tokens):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask)
        allowed = (((bitmask[0].unsqueeze(-1) >> torch.arange(32)) & 1).flatten()[:4096]).nonzero().flatten().tolist()
        if tokenizer.eos_token_id in allowed and rng.random() < 0.5:
            break
        token = rng.choice([t for t in allowed if t != tokenizer.eos_token_id])
        assert matcher.accept(token)
        ids.append(token)
    assert matcher.is_accepting(), tokenizer.decode(ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3], ids=lambda f: f.name)
@pytest.mark.parametrize(("name", "parallel"), [(None, False), (None, True), ("route", True)])
def test_every_output_of_the_forced_grammar_is_a_valid_call(compiler, fmt, name, parallel):
    import jsonschema
    tokenizer, grammars = compiler
    grammar = forced_grammar(fmt, TOOLS, name, parallel)
    rng = random.Random(0)
    params = {t.function.name: t.function.parameters or {"type": "object", "maxProperties": 0} for t in TOOLS}
    seen = set()
    for _ in range(8):
        text = walk(tokenizer, grammars, grammar, rng)
        content, calls = parse_tool_calls(fmt, text)
        assert content is None and calls, text
        assert parallel or len(calls) == 1, text
        for call in calls:
            assert name is None or call["function"]["name"] == name
            jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])
            seen.add(call["function"]["name"])
    assert name is None or seen == {name}


def test_markers_that_are_added_tokens_may_be_written_as_those_tokens(compiler):
    """Qwen's <tool_call> is one added token: the forced grammar must let the model write it so, as it
    was trained to (llguidance matches an added token only by reference, not by its text)."""
    from transformers import AutoTokenizer

    from hf_paged_attn.demo import DEMO_MODEL
    from hf_paged_attn.runtime.generation.structured import GrammarCompiler, StructuredSpec
    from hf_paged_attn.serve.openai.text import make_decoder

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special: kept by skip_special_tokens
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    grammars = GrammarCompiler(tokenizer, len(tokenizer))
    body = tokenizer('\n{"name": "now", "arguments": {}}\n', add_special_tokens=False)["input_ids"]
    markers = {"<tool_call>": start, "</tool_call>": end}
    for marker_ids, accepted in ((markers, True), ({}, False)):
        matcher = grammars.matcher(StructuredSpec(grammar=forced_grammar(HERMES, TOOLS, "now", False, marker_ids)))
        assert matcher.accept(start) is accepted
        if accepted:
            assert matcher.accept_tokens(body) == len(body) and matcher.accept(end) and matcher.is_terminated()
    text = make_decoder(tokenizer)([start, *body, end])
    assert calls_of(text) == (None, [("now", "{}")])
    spelled = grammars.matcher(StructuredSpec(grammar=forced_grammar(HERMES, TOOLS, "now", False, markers)))
    pieces = [t for c in "<tool_call>" for t in tokenizer(c, add_special_tokens=False)["input_ids"]]
    assert spelled.accept_tokens(pieces) == len(pieces)  # the text form is allowed too
