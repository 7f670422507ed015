"""Structured outputs in a request: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` (and
its older top-level ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``), as the
engine's spec: a dict of ``StructuredSpec``'s fields (``{"json": schema}``, ``{"regex": ...}``, ...),
which ``engine.add_request(structured=..., tokenizer=...)`` compiles (llguidance) or refuses with a
``ValueError`` naming what it cannot enforce.

Everything the engine would compile is bounded here first: a schema's nesting and size (llguidance
refuses a deeper one itself, but Python's ``json`` would recurse past its limit first), strings valid
Unicode, lists of choices and the text of a regex or grammar of bounded size. A schema is enforced as
written, whether or not ``strict`` is true (OpenAI enforces only strict schemas; vLLM enforces all).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator
from pydantic_core import PydanticCustomError

from ..errors import APIError
from ..openai.fields import json_bounds, text

MAX_GRAMMAR_CHARS = 100_000  # a regex or a Lark / GBNF grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
MAX_DESCRIPTION_CHARS = 4096
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a schema's or a function's name
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _schema(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PydanticCustomError("schema", "a JSON schema must be an object")
    json_bounds(value)
    return value


def _schema_or_text(value: Any) -> dict[str, Any]:
    """vLLM's ``json``: a schema, or its JSON text."""
    if isinstance(value, str):
        from ..openai.body import parse_json  # guarded like a request body: depth, huge integers, NaN

        if len(value) > MAX_GRAMMAR_CHARS:
            raise PydanticCustomError("too_long", f"a JSON schema's text has more than {MAX_GRAMMAR_CHARS} characters")
        try:
            value = parse_json(value.encode("utf-8", "surrogatepass"))
        except APIError as exc:
            raise PydanticCustomError("schema", "not a JSON schema: {reason}", {"reason": exc.message}) from None
    return _schema(value)


JsonSchema = Annotated[dict[str, Any], PlainValidator(_schema, json_schema_input_type=dict[str, Any])]
JsonSchemaOrText = Annotated[
    dict[str, Any], PlainValidator(_schema_or_text, json_schema_input_type=dict[str, Any] | str)
]


Choices = Annotated[list[text(MAX_CHOICE_CHARS, min_length=1)], Field(min_length=1, max_length=MAX_CHOICES)]
GrammarText = text(MAX_GRAMMAR_CHARS, min_length=1)
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


# ------------------------------------------------------------------------------------ OpenAI: response_format
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """OpenAI's ``json_schema``: the schema the output must match (``strict`` is accepted: every
    schema is enforced as written)."""

    name: Name
    description: text(MAX_DESCRIPTION_CHARS) | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


# ------------------------------------------------------------------------------------ vLLM: structured_outputs
class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: JsonSchemaOrText | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None

    def spec(self) -> dict[str, Any]:
        fields = {"json": self.json_, "json_object": self.json_object or None, "regex": self.regex,
                  "choice": self.choice, "grammar": self.grammar}
        given = {k: v for k, v in fields.items() if v is not None}
        if len(given) != 1:
            names = ", ".join(given) or "none"
            raise APIError(400, f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                           f"got {names}", "structured_outputs", "invalid_value")
        return given


class StructuredFields(BaseModel):
    """The structured-output fields both endpoints share (a mixin of the request models)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchemaOrText | None = None
    guided_regex: GrammarText | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None

    def structured(self) -> tuple[dict[str, Any] | None, str | None]:
        """(the engine's spec, the field that asked for it), or (None, None) for free text; APIError
        400 when more than one field asks."""
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if isinstance(rf, JsonObjectFormat):
            given.append(("response_format", {"json_object": True}))
        elif isinstance(rf, JsonSchemaResponseFormat):
            schema = rf.json_schema.schema_
            given.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs.spec()))
        for name, kind in GUIDED.items():
            if getattr(self, name) is not None:
                given.append((name, {kind: getattr(self, name)}))
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise APIError(400, f"give one way to constrain the output; got {names}", given[1][0], "invalid_value")
        return (given[0][1], given[0][0]) if given else (None, None)
