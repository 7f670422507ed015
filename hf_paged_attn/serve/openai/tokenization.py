"""``POST /tokenize`` and ``POST /detokenize`` bodies and answers, in vLLM's shapes.

``/tokenize`` takes a prompt (``{"model"?, "prompt", "add_special_tokens"?}``, special tokens added by
default) or a chat (``{"model"?, "messages", "add_generation_prompt"?, "tools"?, "add_special_tokens"?}``,
none added by default: the template writes its own) and answers ``{"count", "max_model_len", "tokens",
"token_strs"}``; the chat's ids are exactly those ``/v1/chat/completions`` gives the engine.
``/detokenize`` takes ``{"model"?, "tokens"}`` and answers ``{"prompt"}``, special tokens kept (vLLM's
``tokenizer.decode``). As in vLLM, ``model`` may be left out; given, it must be the served name.
Bounded and validated like the completion bodies (``protocol``): valid Unicode, token ids in the
vocabulary, prompt characters, and the body's size (``--max-body-bytes``) before any of it is parsed.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import APIError
from ..limits import RequestLimits
from ..outputs.tools import Tools, check_tools
from .fields import text
from .protocol import (
    MAX_MESSAGES,
    MAX_MODEL_CHARS,
    MAX_PROMPT_TOKENS,
    ChatMessage,
    TokenId,
    check_in_vocabulary,
    check_messages_length,
    parse,
)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: text(MAX_MODEL_CHARS) | None = None

    def unsupported_options(self) -> list[str]:
        return []

    def check_fields(self) -> None:
        """Checks across fields (none here; ``protocol.parse`` calls it)."""

    def check(self, limits: RequestLimits) -> None:
        """The bounds that depend on the model and the server (APIError 400 naming the field)."""


class TokenizeCompletionRequest(_Request):
    prompt: text()
    add_special_tokens: bool = True  # the tokenizer's BOS (and EOS, where it adds one), as /v1/completions does
    return_token_strs: bool = False

    def check(self, limits: RequestLimits) -> None:
        if len(self.prompt) > limits.max_prompt_chars:
            raise APIError(400, f"a prompt of {len(self.prompt)} characters is longer than this server accepts "
                           f"({limits.max_prompt_chars})", "prompt", "prompt_too_long")


class TokenizeChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template writes its own (vLLM's default)
    tools: Tools | None = None
    return_token_strs: bool = False

    def check_fields(self) -> None:
        check_tools(self.tools, None)

    def check(self, limits: RequestLimits) -> None:
        check_messages_length(self.messages, self.tools, limits)


class DetokenizeRequest(_Request):
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]

    def check(self, limits: RequestLimits) -> None:
        check_in_vocabulary(self.tokens, limits, "tokens")


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def parse_tokenize(body: Any, limits: RequestLimits) -> TokenizeRequest:
    """A chat form if the body has ``messages``, else a prompt form; APIError 400 naming a bad field."""
    kind = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
    return parse(kind, body, limits)


def special_tokens_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(prefix, suffix): the ids ``add_special_tokens=True`` puts around a text (BOS, EOS, ...)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []  # a tokenizer whose special tokens change the text's own ids: add none


def tokenize_answer(tokenizer: Any, ids: list[int], max_model_len: int, token_strs: bool) -> dict[str, Any]:
    strs = tokenizer.convert_ids_to_tokens(ids) if token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}
