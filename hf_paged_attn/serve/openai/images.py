"""Images in chat messages: OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
parts, decoded and bounded, then rendered with the model's processor into prompt ids and image inputs.

Only ``data:`` URLs are read: the server fetches nothing (a remote URL would let any client make it
connect anywhere). Each image is checked before its pixels are decoded: its header's size against
``max_image_pixels`` (413; a decompression bomb never expands), a file PIL cannot read is a 400, and so
are more than ``max_images`` images in one request. The request body's own limit (413) bounds the bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

from ..errors import APIError

DEFAULT_MAX_IMAGES = 8  # per request (vLLM's --limit-mm-per-prompt)
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


def decode_image(url: str, max_pixels: int) -> Any:
    """The RGB ``PIL.Image`` of a ``data:image/...;base64,`` URL, or an ``APIError`` saying what is wrong."""
    from PIL import Image

    if not url.startswith("data:"):
        raise APIError(400, "only data: URLs are accepted for images (data:image/png;base64,...): this server "
                       "fetches no remote URL", "messages", "invalid_image_url")  # fmt: skip
    header, comma, payload = url[5:].partition(",")
    if not comma or not header.startswith("image/") or not header.endswith(";base64"):
        raise APIError(400, "an image URL must be data:image/<type>;base64,<data>", "messages", "invalid_image_url")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "an image URL's data is not valid base64", "messages", "invalid_image") from None
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
