"""OpenAI request bodies: what we accept, validated strictly and completely before any tokenizer or
engine call, and documented by the same models in ``/openapi.json``.

Every field OpenAI defines that we cannot honour is refused by name (HTTP 400), never ignored:
unknown fields are rejected by ``extra="forbid"``, and the few we recognise but only accept at
their neutral value (``best_of``, ``suffix``, ``store``) are checked in
``unsupported_options``.

Every value is bounded: integers by range, floats finite, strings valid Unicode (no lone surrogates,
which the tokenizer cannot take) and of bounded length, lists and maps of bounded size. The bounds
that depend on the served model or the server's settings (token ids below the vocabulary size,
prompt characters, prompts x ``n`` against the queue) are checked by ``check(limits)`` right after.
A new field is one more annotated attribute here (and, if the engine cannot honour it yet, one more
name in ``unsupported_options``). Checks across fields (one way to constrain the output, a
``tool_choice`` that fits the ``tools``) are ``check_fields``. The structured-output fields are
``structured.StructuredFields``; the tool models are in ``tools``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..errors import APIError, short
from ..limits import RequestLimits
from ..outputs.structured import StructuredFields
from ..outputs.tools import MAX_ID_CHARS, MAX_TOOLS, MessageToolCall, ToolChoice, Tools, check_tools, template_tools
from .fields import json_bounds, max_items, text, valid_unicode

__all__ = [
    "APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart", "RequestLimits",
    "StreamOptions", "parse",
]

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 4096  # per stop sequence; the stop matcher's table is this many ints
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5, we allow the same 20
MAX_N = 16
MAX_PROMPTS = 2048  # strings or token-id lists in one completions request (and --max-queue bounds prompts x n)
MAX_PROMPT_TOKENS = 1 << 20  # ids in one token-id prompt (the model's context bounds it further)
MAX_TOKEN_ID = (1 << 31) - 1  # the vocabulary bounds it further
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_MODEL_CHARS = 4096  # a served name may be a local path
MAX_NAME_CHARS = 256  # ``user``, a message's ``name``
MAX_TOKENS = (1 << 31) - 1  # the model's context bounds it further
# prompt_logprobs' alternatives per position: TRL's teacher scoring asks for 100 by default. The answer holds
# positions x this many entries, so it is bounded well below a vocabulary.
MAX_PROMPT_LOGPROBS = 256
MAX_TEMPLATE_CHARS = 1 << 16  # a chat_template sent with the request
# chat_template_kwargs that would change what the server asked the template for, not the template's own options
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
INT64 = 1 << 63  # OpenAI's (and vLLM's) range of ``seed``: a signed 64-bit integer


# ------------------------------------------------------------------------------------ field types
_valid_unicode, _text, _max_items = valid_unicode, text, max_items
_FLOAT = {"allow_inf_nan": False}
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
_TOKEN_IDS = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
_PROMPT_SCHEMA = (  # what the prompt validator accepts, as OpenAPI shows it
    _text(min_length=1)
    | Annotated[list[_text(min_length=1)], Field(min_length=1, max_length=MAX_PROMPTS)]
    | _TOKEN_IDS
    | Annotated[list[_TOKEN_IDS], Field(min_length=1, max_length=MAX_PROMPTS)]
)
PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """The prompt in one of its four forms. Checked by hand, in one pass: pydantic's union would try
    each form on every item of a long list and build an error per item and form."""

    def fail(message: str, **ctx: Any) -> PydanticCustomError:
        return PydanticCustomError("prompt", message, ctx)

    if isinstance(value, str):
        if not value:
            raise fail("prompt is empty")
        return _valid_unicode(value)
    if not isinstance(value, list):
        raise fail(f"prompt must be {PROMPT_FORMS}")
    if not value:
        raise fail("prompt is empty")
    if type(value[0]) is int:
        return _token_ids(value, fail)
    if len(value) > MAX_PROMPTS:
        raise fail("prompt has {count} items; at most {limit} prompts per request", count=len(value), limit=MAX_PROMPTS)
    if all(isinstance(p, str) for p in value):
        for p in value:
            if not p:
                raise fail("prompt is empty")
            _valid_unicode(p)
        return value
    if all(isinstance(p, list) for p in value):
        for p in value:
            if not p:
                raise fail("prompt is empty")
            _token_ids(p, fail)
        return value
    raise fail(f"prompt must be {PROMPT_FORMS}")


def _token_ids(ids: list[Any], fail: Any) -> list[int]:
    if len(ids) > MAX_PROMPT_TOKENS:
        raise fail("a token-id prompt has {count} ids; at most {limit}", count=len(ids), limit=MAX_PROMPT_TOKENS)
    if not all(type(t) is int for t in ids):  # bool is an int subclass: not a token id
        raise fail(f"prompt must be {PROMPT_FORMS}; a token-id list holds integers only")
    if ids and not (0 <= min(ids) and max(ids) <= MAX_TOKEN_ID):
        bad = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        raise fail("token id {id} is not in [0, {limit}]", id=short(bad), limit=MAX_TOKEN_ID)
    return ids


Prompt = Annotated[Any, PlainValidator(_prompt, json_schema_input_type=_PROMPT_SCHEMA)]
StopSequences = (
    _text(MAX_STOP_CHARS, min_length=1)
    | Annotated[list[_text(MAX_STOP_CHARS, min_length=1)], Field(max_length=MAX_STOP_SEQUENCES)]
)


def _token_keys(value: dict[str, float]) -> dict[str, float]:
    """``logit_bias``' keys are token ids written as JSON strings: decimal digits, no sign, no leading zero."""
    for key in value:
        if not (key.isascii() and key.isdigit() and str(int(key)) == key and int(key) <= MAX_TOKEN_ID):
            raise PydanticCustomError("token_id", "logit_bias keys must be token ids written as decimal strings "
                                      "(like \"50256\"), got {key}", {"key": short(key)})
    return value


MAX_LOGIT_BIAS = 300  # entries: OpenAI's bound
LogitBias = Annotated[
    dict[_text(64), Annotated[float, Field(ge=-100.0, le=100.0, **_FLOAT)]],
    AfterValidator(_max_items(MAX_LOGIT_BIAS)), AfterValidator(_token_keys),
]


# ------------------------------------------------------------------------------------ the models
class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the request's ``usage`` (OpenAI's). ``continuous_usage_stats``
    (vLLM's): every chunk carries the usage so far (vLLM also wants ``include_usage`` for it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(StructuredFields):
    """Fields both endpoints share. ``None`` means: the model's ``generation_config`` decides.
    (Structured outputs, ``response_format`` and vLLM's fields: ``structured.StructuredFields``.)"""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: _text(MAX_MODEL_CHARS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, **_FLOAT)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, **_FLOAT)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: StopSequences | None = Field(default=None, description=(
        f"up to {MAX_STOP_SEQUENCES} sequences of 1 to {MAX_STOP_CHARS} characters; the text ends before the first"))
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: _text(MAX_NAME_CHARS) | None = None
    # vLLM's: EOS does not end the output (a benchmark's fixed output length); max_tokens and stop still do.
    ignore_eos: bool = False
    # vLLM's: EOS is suppressed, and stop sequences may not end, within the first min_tokens tokens.
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    logit_bias: LogitBias | None = Field(default=None, description=(
        "{token id (a decimal string): bias in [-100, 100]} added to the logits; ids below the vocabulary size"))
    # OpenAI's penalties over the generated tokens; vLLM's repetition_penalty (transformers'): over prompt and output.
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, **_FLOAT)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, **_FLOAT)
    repetition_penalty: float | None = Field(default=None, gt=0.0, **_FLOAT)
    # vLLM's sampling fields: top_k (0 or -1: off), min_p (0: off), as transformers' TopK/MinP processors.
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOKEN_ID)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, **_FLOAT)
    # vLLM's: each choice's generated token_ids and its prompt's prompt_token_ids (chat: the response's).
    return_token_ids: bool | None = None
    # vLLM's: tokens in logprobs named "token_id:<id>" rather than decoded (TRL reads the ids back from them).
    return_tokens_as_token_ids: bool | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported_options(self) -> list[str]:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if self.stream and self.return_token_ids:
            raise APIError(400, "return_token_ids is not supported with stream (ask for the whole answer)",
                           "return_token_ids", "unsupported_parameter")
        return []

    def check_fields(self) -> None:
        """Checks across fields (APIError 400 naming one)."""
        self.structured()

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` as the engine takes it (``GenerationConfig.logit_bias``), or None."""
        return {int(key): bias for key, bias in self.logit_bias.items()} if self.logit_bias else None

    def check(self, limits: RequestLimits) -> None:
        """The bounds that depend on the model and the server (APIError 400 naming the field)."""
        bad = [key for key in self.logit_bias or {} if int(key) >= limits.vocab_size]
        if bad:
            raise APIError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})",
                           "logit_bias", "invalid_token_id")


class CompletionRequest(_Sampling):
    prompt: Prompt = Field(description=f"{PROMPT_FORMS}; token ids below the vocabulary size")
    max_tokens: int | None = Field(default=16, ge=0, le=MAX_TOKENS, description=(
        "OpenAI's default 16; 0 only with echo: the prompt (with logprobs, its log-probabilities), nothing generated"))
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "the k best alternatives of each token; with echo, of each prompt token too (the first has null)"))
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS, description=(
        "vLLM's: each choice's prompt_logprobs, per prompt position {token_id: {logprob, rank, decoded_token}} for "
        "the k likeliest tokens and the prompt's own (the first position null), under the model's raw distribution"))
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: _text(MAX_NAME_CHARS) | None = None

    def unsupported_options(self) -> list[str]:
        bad = super().unsupported_options()
        if self.best_of not in (None, self.n):
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported with stream (ask for the whole answer)",
                           "prompt_logprobs", "unsupported_parameter")
        return bad

    def check_fields(self) -> None:
        super().check_fields()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens=0 asks for nothing: it is only allowed with echo (the prompt and, with "
                           "logprobs, its log-probabilities)", "max_tokens", "invalid_value")
        if self.max_tokens == 0 and self.structured()[0] is not None:
            raise APIError(400, f"max_tokens=0 generates nothing for {self.structured()[1]} to constrain",
                           "max_tokens", "invalid_value")

    def num_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt token's log-probability comes with (echo with logprobs,
        prompt_logprobs: the larger), or None when the prompt is not scored."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of prompts (strings or token-id lists)."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and type(p[0]) is int) else p

    def check(self, limits: RequestLimits) -> None:
        super().check(limits)
        prompts = self.prompts()
        if len(prompts) * self.n > limits.max_choices:
            param, total = "prompt" if len(prompts) > 1 else "n", len(prompts) * self.n
            raise APIError(400, f"this request asks for {len(prompts)} prompt(s) x n={self.n} = {total} "
                           f"generations; this server runs at most {limits.max_choices} at once (--max-queue), so it "
                           "could never be admitted: split it", param, "too_many_choices")
        for p in prompts:
            if isinstance(p, str):
                if len(p) > limits.max_prompt_chars:
                    raise APIError(400, f"a prompt of {len(p)} characters is longer than this server accepts "
                                   f"({limits.max_prompt_chars})", "prompt", "prompt_too_long")
            else:
                check_in_vocabulary(p, limits, "prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: _text()


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: _text(min_length=1)  # a data: URL (serve/openai/images.py); the body's size bounds it
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the processor decides the resolution


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[ContentPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _text() | Annotated[list[Part], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: _text(MAX_NAME_CHARS) | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: _text(MAX_ID_CHARS) | None = None  # tool: the call this answers

    @model_validator(mode="after")
    def _fits_its_role(self) -> ChatMessage:
        def fail(message: str) -> PydanticCustomError:
            return PydanticCustomError("invalid_message", message)

        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise fail("content is required (null only in an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise fail("only an assistant message has tool_calls")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise fail("a tool message needs tool_call_id (the call it answers), and only a tool message has one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, ContentPart))

    def image_urls(self) -> list[str]:
        """The message's image URLs, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' shape: a call's arguments as a dict; a message
        with images as the parts processors' templates take, ``{"type": "image"}`` where each image goes)."""
        content: Any = self.text()
        if self.image_urls():
            content = [{"type": "text", "text": p.text} if isinstance(p, ContentPart) else {"type": "image"}
                       for p in self.content]  # fmt: skip
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                message["name"] = self.name
        return message

    def num_chars(self) -> int:
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or [])
        return len(self.text()) + len(self.name or "") + calls


def _template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs``: identifiers, none that would change what the server asks of the template,
    values JSON of bounded size."""
    for key in value:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            raise PydanticCustomError("template_kwargs", "{key} cannot be a chat_template_kwargs key (the server "
                                      "sets it, or it is not a name)", {"key": short(key)})
    json_bounds(value, "chat_template_kwargs")
    return value


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: OpenAI's default, true
    # Accepted only when absent or false: we have no storage.
    store: bool | None = None
    metadata: Annotated[dict[_text(64), _text(512)], AfterValidator(_max_items(16))] | None = None  # OpenAI's bounds
    # vLLM's: a Jinja template for this request (only where the server trusts them: --enable-rl-endpoints), and
    # extra variables for the template (``enable_thinking``, ...)
    chat_template: _text(MAX_TEMPLATE_CHARS, min_length=1) | None = None
    chat_template_kwargs: Annotated[dict[_text(64), Any], AfterValidator(_template_kwargs)] | None = None

    def unsupported_options(self) -> list[str]:
        bad = super().unsupported_options()
        if self.store:
            bad.append("store")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        return bad

    def check_fields(self) -> None:
        super().check_fields()
        check_tools(self.tools, self.tool_choice)
        if self.forced_tool_call() and self.structured()[0] is not None:
            raise APIError(400, f"tool_choice={self.tool_choice_name()} already constrains the output; it cannot "
                           f"be combined with {self.structured()[1]}", "tool_choice", "invalid_value")

    def forced_tool_call(self) -> bool:
        """True if the output must be a tool call (``required`` or a named function)."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def tool_choice_name(self) -> str:
        choice = self.tool_choice
        return choice if isinstance(choice, str) or choice is None else f"function {choice.function.name!r}"

    def token_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens disagree; give one", "max_tokens")
        return self.max_completion_tokens or self.max_tokens

    def check(self, limits: RequestLimits) -> None:
        super().check(limits)
        if self.n > limits.max_choices:
            raise APIError(400, f"n={self.n} is more generations than this server runs at once "
                           f"({limits.max_choices}, --max-queue)", "n", "too_many_choices")
        check_messages_length(self.messages, self.tools, limits)


def check_in_vocabulary(ids: list[int], limits: RequestLimits, param: str) -> None:
    """APIError 400 naming ``param`` when an id of ``ids`` is not below the vocabulary size."""
    if ids and max(ids) >= limits.vocab_size:
        bad = next(t for t in ids if t >= limits.vocab_size)
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})", param,
                       "invalid_token_id")


def check_messages_length(messages: list[ChatMessage], tools: Any, limits: RequestLimits) -> None:
    """APIError 400 naming ``messages`` when they (and the tools' JSON) exceed the prompt characters."""
    num_chars = sum(m.num_chars() for m in messages)
    if tools:
        num_chars += len(json.dumps(template_tools(tools)))
    if num_chars > limits.max_prompt_chars:
        raise APIError(400, f"the messages have {num_chars} characters; this server accepts at most "
                       f"{limits.max_prompt_chars}", "messages", "prompt_too_long")


# ------------------------------------------------------------------------------------ parsing
def parse(model: type[BaseModel], body: Any, limits: RequestLimits | None = None) -> Any:
    """``body`` (parsed JSON) as ``model`` (a request model: ``unsupported_options``, ``check_fields``,
    ``check``); APIError 400 naming the first bad field otherwise. With ``limits``, the model- and
    server-dependent bounds are checked too."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    for key in body:  # pydantic cannot name a field whose name it cannot read
        if not key.isascii() and _name(key) != key[:64] + ("..." if len(key) > 64 else ""):
            raise APIError(400, f"field name {short(key)} is not valid Unicode", _name(key), "invalid_value")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise _as_api_error(exc) from None
    bad = request.unsupported_options()
    if bad:
        raise APIError(400, f"unsupported option(s): {', '.join(bad)}", bad[0].split()[0], "unsupported_parameter")
    request.check_fields()
    if limits is not None:
        request.check(limits)
    return request


def _as_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False, include_context=False)
    # Of a union's errors (one per form tried), the one that got furthest into the value says most.
    first = max(errors, key=lambda e: len([p for p in e["loc"] if not _is_union_tag(p)]))
    loc = [_name(part) for part in first["loc"] if not isinstance(part, int) and not _is_union_tag(part)]
    param = loc[0] if loc else None
    if first["type"] == "extra_forbidden":
        names = sorted({_name(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1})
        if names:
            more = f" (and {len(names) - 8} more)" if len(names) > 8 else ""
            message = f"unsupported option(s): {', '.join(names[:8])}{more}"
            return APIError(400, message, names[0], "unsupported_parameter")
    where = ".".join(_name(part) for part in first["loc"] if not _is_union_tag(part))
    if first["type"] == "missing":
        return APIError(400, f"missing required field {where!r}", param, "missing_field")
    if first["type"] == "prompt":  # our own validator's message says it all
        return APIError(400, first["msg"], param, "invalid_value")
    return APIError(400, f"{where}: {first['msg']} (got {short(first.get('input'))})", param, "invalid_value")


_TAGS = {"str", "int", "float", "bool", "none", "constrained-str", "constrained-int", "constrained-float"}


def _is_union_tag(part: Any) -> bool:
    """pydantic's name for a union member in an error location ('str', 'list[str]', ...): no field's name."""
    return isinstance(part, str) and (part in _TAGS or "[" in part)


def _name(part: Any) -> str:
    """A location part (a field name, a list index, a map key the client chose) for a message."""
    text = str(part)
    text = text if len(text) <= 64 else text[:64] + "..."
    return text.encode("utf-8", "backslashreplace").decode()  # a lone surrogate as its escape
