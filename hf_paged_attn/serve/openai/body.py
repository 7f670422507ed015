"""A POST body as parsed JSON, refused early and cheaply when it is not one we will serve.

Checks, in order: ``Content-Type: application/json`` (415 otherwise: a web page can send text/plain,
form or multipart bodies to a local server without a CORS preflight, but not JSON), the declared
``Content-Length`` against the limit (413 before reading a byte), the bytes as they arrive (413 as
soon as a chunked body passes the limit), a deadline for the whole body (408), strict UTF-8, then
JSON. Python's ``json`` is guarded where it fails on hostile input: nesting deeper than the
interpreter's recursion limit raises ``RecursionError``, an integer literal of more than 4,300 digits
``ValueError``, and ``NaN``/``Infinity`` are not JSON; each is a 400 here. Integer literals of more
than ``BIG_INT_DIGITS`` digits are read as a huge sentinel (no field accepts them) so the field's
own bound names it. A client that disconnects while its body arrives gets a 499 (nobody reads it), logged
at debug level: its own doing, not a server error.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..errors import BIG_INT_DIGITS, APIError

logger = logging.getLogger("hf_paged_attn.serve")
_HUGE = 10**BIG_INT_DIGITS  # what an integer literal of more digits reads as (with its sign)


def check_content_type(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (``charset=utf-8`` or none)."""
    value = request.headers.get("content-type", "")
    media, _, params = value.partition(";")
    charset = next((p.split("=", 1)[1].strip().strip('"').lower() for p in params.split(";")
                    if p.strip().lower().startswith("charset=")), "utf-8")
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        shown = value[:60] + ("..." if len(value) > 60 else "")
        raise APIError(415, f"the request body must be JSON, sent as 'Content-Type: application/json' "
                       f"(got {shown!r})", None, "unsupported_media_type")


async def read_body(request: Request, max_bytes: int, timeout: float | None) -> bytes:
    """The whole body, at most ``max_bytes`` (413 past it), within ``timeout`` seconds (408)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes, f"Content-Length is {int(declared)}")
    chunks: list[bytes] = []
    size = 0

    async def take() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes, f"more than {max_bytes} bytes arrived")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(take(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", None, "request_timeout",
                       {"Connection": "close"}) from None
    except ClientDisconnect:  # the client's own doing, not the server's: no error, no traceback
        logger.debug("the client disconnected while sending its request body (%d bytes arrived)", size)
        # 499 (nginx's "client closed request"), as for a client gone during generation; the server
        # drops whatever is sent to a closed connection
        raise APIError(499, "client disconnected while sending the request body", None, "client_disconnected") from None
    return b"".join(chunks)


def _too_large(max_bytes: int, detail: str) -> APIError:
    # No Connection: close: closing a socket with unread data in it resets the connection, and a client
    # still sending its body would see the reset, not this answer. uvicorn reads and drops the rest of
    # the body (memory stays flat), then the connection serves the next request.
    return APIError(413, f"the request body is larger than this server accepts ({max_bytes} bytes; {detail})",
                    None, "request_too_large")


def parse_json(data: bytes) -> Any:
    """``data`` as JSON (a 400 naming the problem otherwise); see the module's docstring."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})", None, "invalid_json") from None
    try:
        return json.loads(text, parse_int=_parse_int, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
                       None, "invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", None, "invalid_json") from None
    except ValueError as exc:  # a constant (NaN, Infinity), or anything else json refuses
        raise APIError(400, f"the request body is not valid JSON: {str(exc)[:200]}", None, "invalid_json") from None


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) <= BIG_INT_DIGITS:
        return int(digits)
    return -_HUGE if digits.startswith("-") else _HUGE


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")
