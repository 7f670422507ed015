"""vLLM's ``features`` of a prompt with images: what ``/v1/chat/completions/render`` returns beside the prompt's
token ids, and ``/inference/v1/generate`` takes back (TRL's and other RL rollout clients render a chat once,
then generate from its tokens).

The shape is vLLM's (``MultiModalFeatures``): ``mm_hashes`` (one hex digest per image), ``mm_placeholders``
(each image's ``{"offset", "length"}`` in the token ids: its first image token, and the positions up to its
last) and ``kwargs_data`` (each image's processor outputs). A client carries ``kwargs_data`` back without
reading it; vLLM packs it as its own msgpack, ours is a base64 safetensors file of the image's tensors
(``pixel_values``, ``image_grid_thw``, ...). Safetensors holds tensors only: decoding runs no code.

What comes back is checked before anything is queued, as a client may send anything: only names the
engine takes, each image's tensors shaped and typed as the processor makes them (a probe image's, with
only the patch count free for a dynamic-resolution model, and that bounded by ``max_image_pixels``), the
digests and placeholders equal to those of the decoded tensors in these token ids.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import APIError
from .fields import text

MODALITY = "image"  # the one modality the engine takes
MAX_IMAGE_ITEMS = 256  # per list in a body; the server's --limit-mm-per-prompt bounds them further


class Placeholder(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    offset: int = Field(ge=0)
    length: int = Field(ge=1)


def _per_modality(item: Any) -> Any:
    return dict[Literal["image"], Annotated[list[item], Field(max_length=MAX_IMAGE_ITEMS)]]


class Features(BaseModel):
    """vLLM's ``MultiModalFeatures``; ``kwargs_data`` null (vLLM: every item in its encoder cache) is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mm_hashes: _per_modality(text(128))
    mm_placeholders: _per_modality(Placeholder)
    kwargs_data: _per_modality(text() | None) | None = None  # the body limit bounds them


def pack(tensors: Mapping[str, torch.Tensor]) -> str:
    """One image's tensors as a base64 safetensors file."""
    from safetensors.torch import save

    return base64.b64encode(save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})).decode("ascii")


def unpack(data: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        raise APIError(400, "features.kwargs_data: an item is not base64", "features", "invalid_features") from None
    except Exception as exc:  # safetensors raises its own error on a file it cannot read
        raise APIError(400, f"features.kwargs_data: an item is not a safetensors file ({type(exc).__name__})",
                       "features", "invalid_features") from None


def render_features(model: torch.nn.Module, prompt: list[int], inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``features`` of ``prompt`` and its processor outputs ``inputs`` (None without images)."""
    from ... import MultimodalInputs

    images = MultimodalInputs.split(model, [prompt], inputs)[0]
    if not images:
        return None
    spans = MultimodalInputs.build(model, prompt, images).spans
    return {
        "mm_hashes": {MODALITY: [digest.hex() for _, _, digest in spans]},
        "mm_placeholders": {MODALITY: [{"offset": first, "length": n} for first, n, _ in spans]},
        "kwargs_data": {MODALITY: [pack(image.inputs) for image in images]},
    }


def generate_inputs(model: torch.nn.Module, prompt: list[int], features: Features, probe: Mapping[str, torch.Tensor],
                    max_images: int, max_image_pixels: int) -> dict[str, torch.Tensor]:
    """The image inputs ``add_request`` takes for ``prompt`` from the ``features`` a client sent back, checked
    against ``probe`` (one image's tensors as the processor makes them); APIError 400 naming what is wrong."""
    from ... import MultimodalInputs

    hashes = features.mm_hashes.get(MODALITY, [])
    places = features.mm_placeholders.get(MODALITY, [])
    if features.kwargs_data is None:
        raise APIError(400, "features.kwargs_data is required: this server keeps no encoder cache to find images "
                       "by their hashes", "features", "invalid_features")  # fmt: skip
    items = features.kwargs_data.get(MODALITY, [])
    if not len(hashes) == len(places) == len(items):
        raise APIError(400, f"features: {len(hashes)} mm_hashes, {len(places)} mm_placeholders and {len(items)} "
                       "kwargs_data items; one of each per image", "features", "invalid_features")  # fmt: skip
    if len(items) > max_images:
        raise APIError(400, f"a request may hold at most {max_images} images; this one has {len(items)}", "features",
                       "too_many_images")  # fmt: skip
    if any(item is None for item in items):
        raise APIError(400, "features.kwargs_data: every image's data is required (this server keeps no encoder "
                       "cache)", "features", "invalid_features")  # fmt: skip
    per_image = [unpack(item) for item in items]
    for tensors in per_image:
        _check_like(tensors, probe, model, max_image_pixels)
    inputs = _join(per_image) if per_image else {}
    try:
        images = MultimodalInputs.split(model, [prompt], inputs)[0]
        spans = MultimodalInputs.build(model, prompt, images).spans if images else ()
    except (ValueError, NotImplementedError) as exc:
        raise APIError(400, f"features do not fit token_ids: {exc}", "features", "invalid_features") from None
    if [(p.offset, p.length) for p in places] != [(first, n) for first, n, _ in spans]:
        raise APIError(400, "features.mm_placeholders do not match the image tokens of token_ids "
                       f"(they are at {[(first, n) for first, n, _ in spans]})", "features", "invalid_features")
    if hashes != [digest.hex() for _, _, digest in spans]:
        raise APIError(400, "features.mm_hashes are not the digests of kwargs_data", "features", "invalid_features")
    return inputs


def _check_like(tensors: Mapping[str, torch.Tensor], probe: Mapping[str, torch.Tensor], model: torch.nn.Module,
                max_image_pixels: int) -> None:
    """APIError 400 unless ``tensors`` are one image's inputs as the processor makes them (like ``probe``)."""

    def fail(message: str) -> APIError:
        return APIError(400, f"features.kwargs_data: {message}", "features", "invalid_features")

    if set(tensors) != set(probe):
        raise fail(f"an image holds {sorted(tensors)}; this model's images hold {sorted(probe)}")
    grid = tensors.get("image_grid_thw")
    for name, want in probe.items():
        got = tensors[name]
        if got.dtype != want.dtype or got.dim() != want.dim():
            raise fail(f"{name} is {got.dtype} of {got.dim()} dimensions; this model takes {want.dtype} of "
                       f"{want.dim()}")  # fmt: skip
        free = 1 if grid is not None and name == "pixel_values" else 0  # a grid model's patch count varies
        if got.shape[free:] != want.shape[free:]:
            raise fail(f"{name} has shape {tuple(got.shape)}; this model takes {tuple(want.shape)}")
    if grid is not None:
        patch = getattr(getattr(model.config, "vision_config", None), "patch_size", 14)
        patch = patch[0] if isinstance(patch, (list, tuple)) else int(patch)
        if bool((grid < 1).any()) or math.prod(grid[0].tolist()) * patch * patch > max_image_pixels:
            raise fail(f"image_grid_thw {grid[0].tolist()} is not a grid of an image of at most {max_image_pixels} "
                       "pixels")  # fmt: skip
        if math.prod(grid[0].tolist()) != tensors["pixel_values"].shape[0]:
            raise fail("pixel_values' patches are not those image_grid_thw describes")


def _join(per_image: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Images' tensors as the processor lays out one prompt's: one after the other (``[rows, images, ...]``
    models, such as Idefics3: the images of one row)."""
    axis = 1 if per_image[0]["pixel_values"].dim() == 5 else 0
    return {name: torch.cat([t[name] for t in per_image], dim=axis) for name in per_image[0]}
