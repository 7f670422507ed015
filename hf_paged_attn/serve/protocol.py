"""OpenAI request bodies: what we accept, validated strictly, and the errors we answer with.

Every field OpenAI defines that we cannot honour is refused by name (HTTP 400), never ignored:
unknown fields are rejected by ``extra="forbid"``, and the few we recognise but only accept at
their neutral value (penalties, ``best_of``) are checked in ``unsupported_options``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5, we allow the same 20
MAX_N = 16


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
             429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share. ``None`` means: the model's ``generation_config`` decides."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted only at their neutral value (checked in unsupported_options).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise APIError(400, f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
        if any(s == "" for s in stops):
            raise APIError(400, "stop sequences must not be empty strings", "stop")
        return stops

    def unsupported_options(self) -> list[str]:
        bad = [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name) not in (None, 0, 0.0)]
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        return bad


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported_options(self) -> list[str]:
        bad = super().unsupported_options()
        if self.best_of not in (None, self.n):
            bad.append("best_of")
        bad += [name for name in ("suffix", "logit_bias") if getattr(self, name)]
        if self.echo and self.logprobs is not None:
            bad.append("echo with logprobs (log-probabilities of prompt tokens)")
        return bad


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    logit_bias: dict[str, float] | None = None
    # Accepted only when absent or empty/false: we have no tools, structured output or storage.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    def unsupported_options(self) -> list[str]:
        bad = super().unsupported_options()
        bad += [name for name in ("tools", "logit_bias", "response_format") if getattr(self, name)]
        if self.tool_choice not in (None, "none"):
            bad.append("tool_choice")
        if self.store:
            bad.append("store")
        if self.response_format and self.response_format.get("type") == "text":
            bad.remove("response_format")  # plain text is what we produce anyway
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        return bad

    def token_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens disagree; give one", "max_tokens")
        return self.max_completion_tokens or self.max_tokens


def parse(model: type[_Sampling], body: Any) -> Any:
    """``body`` (parsed JSON) as ``model``; APIError 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise _as_api_error(exc) from None
    bad = request.unsupported_options()
    if bad:
        raise APIError(400, f"unsupported option(s): {', '.join(bad)}", bad[0].split()[0], "unsupported_parameter")
    return request


def _as_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0]
    loc = [str(part) for part in first["loc"] if not isinstance(part, int)]
    param = loc[0] if loc else None
    if first["type"] == "extra_forbidden":
        names = sorted({str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1})
        if names:
            return APIError(400, f"unsupported option(s): {', '.join(names)}", names[0], "unsupported_parameter")
    if first["type"] == "missing":
        return APIError(400, f"missing required field {'.'.join(map(str, first['loc']))!r}", param, "missing_field")
    if param == "prompt":  # a union: pydantic reports every branch; one sentence says it better
        message = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    else:
        where = ".".join(str(part) for part in first["loc"])
        message = f"{where}: {first['msg']} (got {first.get('input')!r})"
    return APIError(400, message, param, "invalid_value")
