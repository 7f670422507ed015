"""OpenAI function tools in a chat request: the models that validate them, what the chat template is
given, and the grammar that enforces ``tool_choice="required"`` or a named function.

A forced call is the model's own tool-call format (``tool_parser.ToolCallFormat``), constrained by a
Lark grammar whose calls are JSON schemas (llguidance's ``%json``): each tool's call is
``{"name": <const>, "arguments": <its parameters schema>}`` (Llama 3: ``"parameters"``), in the
engine's JSON conventions (no free whitespace, ``", "`` and ``": "``). ``required`` takes any tool,
a named ``tool_choice`` that one; ``parallel_tool_calls`` (OpenAI's default) allows one or more
calls, else exactly one. The output is then parsed like any other (``tool_parser``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import APIError
from ..openai.fields import MAX_JSON_NODES, json_bounds, text
from .structured import MAX_DESCRIPTION_CHARS, JsonSchema, Name
from .tool_parser import ToolCallFormat

MAX_TOOLS = 128  # OpenAI's limit
MAX_ID_CHARS = 256
MAX_ARGUMENTS_CHARS = 1 << 20  # of one call's arguments in the history
# The engine's JSON conventions (runtime/generation/structured.py), for the JSON inside a Lark grammar.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: Name
    description: text(MAX_DESCRIPTION_CHARS) | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None  # accepted: every schema is enforced as written


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: Name


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Strict):
    name: text(MAX_DESCRIPTION_CHARS, min_length=1)
    arguments: text(MAX_ARGUMENTS_CHARS)


class MessageToolCall(_Strict):
    """A call in an assistant message of the history, as the API returned it."""

    id: text(MAX_ID_CHARS)
    type: Literal["function"]
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """transformers' shape: arguments as a dict (templates write it with ``tojson``), as vLLM passes it."""
        try:
            arguments = json.loads(self.function.arguments)
            json_bounds(arguments, "arguments")  # the template and chat.py walk it
        except (ValueError, RecursionError):  # (PydanticCustomError is a ValueError)
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


Tools = Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)]


def check_tools(tools: list[FunctionTool] | None, choice: ToolChoice | None) -> None:
    """APIError 400 for names given twice, a tool_choice without tools, or a named function not in them."""
    names = [t.function.name for t in tools or []]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise APIError(400, f"tools: function name(s) given more than once: {', '.join(twice)}", "tools",
                       "invalid_value")
    if choice is not None and choice != "none" and not tools:
        raise APIError(400, "tool_choice is only allowed when tools are given", "tool_choice", "invalid_value")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools",
                       "tool_choice", "invalid_value")
    if choice not in (None, "none", "auto"):  # a forced call compiles every (named) tool's parameters
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        chosen = [t for t in tools or [] if named in (None, t.function.name)]
        num_nodes = sum(json_bounds(t.function.parameters) for t in chosen if t.function.parameters is not None)
        if num_nodes > MAX_JSON_NODES:
            raise APIError(400, f"tools: the parameters of the tools a forced call may use have {num_nodes} JSON "
                           f"values together; at most {MAX_JSON_NODES}", "tools", "invalid_value")


def template_tools(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    """The tools as transformers' ``apply_chat_template(tools=...)`` takes them (OpenAI's JSON shape)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def forced_grammar(fmt: ToolCallFormat, tools: list[FunctionTool], name: str | None, parallel: bool,
                   marker_ids: dict[str, int] | None = None) -> str:
    """The Lark grammar of a forced tool call in ``fmt``: any of ``tools`` (or the one called ``name``),
    one call, or one or more when ``parallel``. ``marker_ids``: the tokenizer's added tokens among
    ``fmt``'s markers (Qwen's ``<tool_call>`` is one token): the model may write each as that token,
    as it was trained to, or as text (llguidance matches an added token only by reference)."""
    chosen = [t.function for t in tools if name is None or t.function.name == name]
    assert chosen, "check_tools makes sure a named function is in tools"
    rules = [f"call_{i}: %json {json.dumps(call_schema(fmt, f.name, f.parameters))}" for i, f in enumerate(chosen)]
    block = "call"
    if fmt.start:  # e.g. <tool_call>\n{...}\n</tool_call>; a JSON string literal is a Lark string literal
        start, end = (_marker(m, marker_ids or {}) for m in (fmt.start, fmt.end))
        block = f'{start} "\\n" call "\\n" {end}'
    many = f" ({json.dumps(fmt.separator)} block)*" if parallel and name is None else ""
    lines = [f"start: block{many}", f"block: {block}", "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    return "\n".join(lines + rules)


def _marker(text: str, marker_ids: dict[str, int]) -> str:
    literal = json.dumps(text)
    return f"(<[{marker_ids[text]}]> | {literal})" if text in marker_ids else literal


def call_schema(fmt: ToolCallFormat, name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """``{"name": name, <fmt's arguments key>: <parameters>}`` as one JSON schema (its own root: the
    parameters' local ``$ref``s are rewritten to point inside it)."""
    key = fmt.arguments_key
    arguments = _rebase_refs(parameters, f"#/properties/{key}") if parameters is not None else NO_PARAMETERS
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
        "x-guidance": JSON_OPTIONS,
    }


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` ("#", "#/$defs/x") moved under ``base``. Iterative (a deep schema)."""
    root: list[Any] = [None]
    stack: list[tuple[Any, list[Any] | dict[Any, Any], Any]] = [(schema, root, 0)]
    while stack:
        item, parent, slot = stack.pop()
        if isinstance(item, dict):
            copy: dict[str, Any] = dict.fromkeys(item)  # the keys in their order: a schema's is the output's
            for key, value in item.items():
                if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                    copy[key] = base + value[1:]
                else:
                    stack.append((value, copy, key))
            parent[slot] = copy
        elif isinstance(item, list):
            parent[slot] = copy_list = [None] * len(item)
            stack.extend((value, copy_list, i) for i, value in enumerate(item))
        else:
            parent[slot] = item
    return root[0]
