"""The errors the server answers with, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error stays small whatever the client sent: a bad value is echoed as at most ``ECHO_CHARS``
characters (with its full length named), and a message is cut at ``MAX_MESSAGE_CHARS``. Bodies are
JSON with ASCII escapes, so a lone surrogate in an echoed value still makes valid UTF-8. A 5xx
carries ``Connection: close``: after a failure the server does not trust the connection's state,
and a client must not be surprised by a reset on its next request.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any

from fastapi.responses import Response

ECHO_CHARS = 100  # of a bad value, in an error message
MAX_MESSAGE_CHARS = 1000
BIG_INT_DIGITS = 40  # an integer literal longer than this is never a valid value of any field

_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlevel = ECHO_CHARS, ECHO_CHARS, BIG_INT_DIGITS, 3
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 8


class APIError(Exception):
    """An error answered in OpenAI's shape. ``param`` names the request field at fault, if any."""

    TYPES = {401: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_exceeded"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} characters)"
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        if self.status in self.TYPES:
            return self.TYPES[self.status]
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def short(value: Any) -> str:
    """``repr(value)`` cut to about ``ECHO_CHARS`` characters, for an error message: never the whole of
    a 10 MB string or a long list, nor the digits of a huge integer."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**BIG_INT_DIGITS:
        return f"an integer of more than {BIG_INT_DIGITS} digits"
    text = _REPR.repr(value)
    if len(text) > ECHO_CHARS:
        text = text[:ECHO_CHARS] + "..."
    if isinstance(value, (str, list, dict)) and len(value) > 8:
        text += f" ({len(value)} {'characters' if isinstance(value, str) else 'items'})"
    return text


def dumps(obj: Any) -> str:
    """JSON text with ASCII escapes; finite numbers only (``ValueError`` on inf/nan, which JSON lacks)."""
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers, media_type="application/json")


def error_response(exc: APIError) -> Response:
    headers = dict(exc.headers)
    if exc.status >= 500:
        headers["Connection"] = "close"
    return json_response(exc.body(), exc.status, headers)
