"""Images in chat messages: OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
parts, decoded and bounded, then rendered with the model's processor into prompt ids and image inputs.

``data:`` URLs are read as they are. An ``http(s)://`` URL is fetched only from a host the operator allowed
(``--allowed-media-domains``, vLLM's flag; none by default, so a client cannot make the server connect
anywhere): no redirects (one could lead off the allowed hosts), within ``fetch_timeout`` seconds in all
(a server dripping bytes is cut off too) and ``max_bytes`` bytes (413). Each image is checked before its
pixels are decoded: its header's size against ``max_pixels`` (413; a decompression bomb never expands), a
file PIL cannot read is a 400, and so are more than ``max_images`` images in one request. The request
body's own limit (413) bounds a data URL's bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import APIError

DEFAULT_MAX_IMAGES = 8  # per request (vLLM's --limit-mm-per-prompt)
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_IMAGE_BYTES = 16 << 20  # of a fetched image
READ_CHUNK = 64 << 10


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What the server accepts of an image URL; ``allowed_domains``: the hosts it may fetch from (none: only
    ``data:`` URLs)."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allowed_domains: tuple[str, ...] = ()
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES


def decode_image(url: str, limits: MediaLimits) -> Any:
    """The RGB ``PIL.Image`` of a ``data:image/...;base64,`` URL or, from an allowed host, an ``http(s)://`` one,
    or an ``APIError`` saying what is wrong."""
    if url.startswith(("http://", "https://")):
        return _read_image(fetch(url, limits), limits.max_pixels)
    if not url.startswith("data:"):
        raise APIError(400, "an image URL must be data:image/<type>;base64,<data> (or http(s):// from a host the "
                       "server allows: --allowed-media-domains)", "messages", "invalid_image_url")  # fmt: skip
    header, comma, payload = url[5:].partition(",")
    if not comma or not header.startswith("image/") or not header.endswith(";base64"):
        raise APIError(400, "an image URL must be data:image/<type>;base64,<data>", "messages", "invalid_image_url")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "an image URL's data is not valid base64", "messages", "invalid_image") from None
    return _read_image(raw, limits.max_pixels)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


def fetch(url: str, limits: MediaLimits) -> bytes:
    """The bytes at ``url`` (http or https) from an allowed host, within the time and size limits."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host.lower() not in limits.allowed_domains:
        why = (f"{host!r} is not among them" if limits.allowed_domains
               else "this server fetches none: start it with --allowed-media-domains HOST to allow some")
        raise APIError(400, f"remote image URLs are read only from the hosts of --allowed-media-domains; {why}",
                       "messages", "invalid_image_url")  # fmt: skip
    deadline = time.monotonic() + limits.fetch_timeout
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(urllib.request.Request(url, headers={"Accept": "image/*"}),
                         timeout=limits.fetch_timeout) as answer:  # fmt: skip
            size = answer.headers.get("Content-Length")
            if size is not None and size.isdigit() and int(size) > limits.max_bytes:
                raise _too_large(limits.max_bytes)
            chunks, num_bytes = [], 0
            while chunk := answer.read1(READ_CHUNK):  # what has arrived: the deadline is checked between
                num_bytes += len(chunk)
                if num_bytes > limits.max_bytes:
                    raise _too_large(limits.max_bytes)
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunks.append(chunk)
            return b"".join(chunks)
    except APIError:
        raise
    except urllib.error.HTTPError as exc:
        raise APIError(400, f"fetching an image URL answered HTTP {exc.code} (redirects are not followed)",
                       "messages", "image_fetch_failed") from None  # fmt: skip
    except (TimeoutError, OSError, ValueError) as exc:  # URLError is an OSError; a socket timeout too
        reason = "timed out" if isinstance(exc, TimeoutError) or "timed out" in str(exc) else type(exc).__name__
        raise APIError(400, f"fetching an image URL failed ({reason}; limit {limits.fetch_timeout:g} s)", "messages",
                       "image_fetch_failed") from None  # fmt: skip


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"an image URL's data is larger than this server fetches ({max_bytes} bytes)", "messages",
                    "image_too_large")


def _read_image(raw: bytes, max_pixels: int) -> Any:
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))  # reads the header only
            width, height = image.size
            if width * height > max_pixels:
                raise APIError(413, f"an image of {width}x{height} pixels is larger than this server accepts "
                               f"({max_pixels} pixels)", "messages", "image_too_large")  # fmt: skip
            return image.convert("RGB")
    except APIError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise APIError(413, "an image is larger than this server accepts", "messages", "image_too_large") from None
    except Exception as exc:  # PIL raises many kinds on a file it cannot read
        raise APIError(400, f"an image could not be read ({type(exc).__name__})", "messages", "invalid_image") from None


def image_prompt(processor: Any, template: str, messages: list[dict[str, Any]], images: list[Any],
                 controls: list[str]) -> tuple[list[int], dict[str, Any]]:
    """The prompt ids and the image inputs (``pixel_values``, ...) of a chat with ``images``, as the
    processor makes them from the rendered template. The processor tokenizes the whole rendering, so text
    in a message that spells a control token (``controls``) would become that token: such a chat is refused."""
    from ... import MultimodalInputs

    for message in messages:
        parts = message["content"] if isinstance(message["content"], list) else [{"text": message["content"]}]
        if any(c in (p.get("text") or "") for p in parts for c in controls):
            raise APIError(400, "a message with images may not contain the text of a control token", "messages",
                           "invalid_messages")  # fmt: skip
    try:
        text = processor.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    except Exception as exc:
        raise APIError(400, f"the chat template refused the messages: {exc}", "messages", "invalid_messages") from None
    try:
        out = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    except Exception as exc:  # e.g. a template that writes no image token for an image
        raise APIError(400, f"the processor refused the chat: {exc}", "messages", "invalid_messages") from None
    inputs = {k: v for k, v in out.items() if k in MultimodalInputs.INPUT_NAMES}
    return out["input_ids"][0].tolist(), inputs
