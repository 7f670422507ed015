"""Images in requests: a vision-language model's prompt holds placeholder tokens (the image token id,
one per image feature), and its request carries the images whose encoder output replaces them.

- ``split_images``: a processor's batch outputs (``pixel_values``, ``image_grid_thw``, ``image_sizes``,
  ``pixel_attention_mask``) cut into each prompt's images, each with its placeholder count and a digest
  of its content (the prefix cache keys blocks by it: ``Request.block_extra``).
- ``MultimodalInputs``: one request's images, where their tokens sit, its M-RoPE positions (Qwen-VL) and,
  between the first prefill chunk that reaches an image token and the one that feeds the last, the
  encoder's output (computed once per request, sliced per chunk; a preempted request computes it again).
- ``MultimodalSteps.prepare``: a step's ``inputs_embeds`` (the token embeddings with each image token's
  row replaced by its feature) and its 3-D positions, for the steps where some request has images.

The vision tower runs outside any paged forward, so the registered attention function sends its
(non-causal, uncached) attention to sdpa (``attention/function.py``, ``plain_attention``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..attention.step import StepMetadata
from ..core.scheduler import ScheduledRequest
from .model.placement import input_device

# The processor outputs that describe images, each with one entry (or, ``pixel_values`` of a grid model,
# one run of patches) per image, in prompt order.
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask")
# Per-token outputs the engine derives from the prompt itself (which tokens are images).
DERIVED_INPUTS = ("mm_token_type_ids", "token_type_ids")
# The families whose images match sdpa's greedy tokens (tests/runtime/test_multimodal.py); images for any
# other are refused by name: some attend bidirectionally over an image's tokens (PaliGemma, Gemma 3),
# which the causal paged kernels never show them, others cut their inputs in ways not handled here.
CHECKED_FAMILIES = ("llava", "vipllava", "qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm", "internvl", "aya_vision",
                    "cohere2_vision")


@dataclass(frozen=True, slots=True, eq=False)
class Image:
    """One image: the encoder's inputs for it alone (each tensor's first axis is this image's),
    how many placeholder tokens it fills, and a digest of its content."""

    inputs: dict[str, torch.Tensor]
    num_tokens: int
    digest: bytes


def image_token_id(config: object) -> int | None:
    """The placeholder token id of a vision-language config, or None (a text model)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def split_images(model: torch.nn.Module, prompts: Sequence[Sequence[int]], inputs: Mapping) -> list[list[Image]]:
    """Each prompt's images out of a processor's batch outputs ``inputs`` (images in prompt order,
    the batch's rows one after the other). ValueError when they do not match the prompts' image tokens."""
    unknown = sorted(set(inputs) - set(IMAGE_INPUTS) - set(DERIVED_INPUTS))
    if unknown:
        raise NotImplementedError(f"model inputs {unknown} are not supported by the paged engine (images: "
                                  f"{', '.join(IMAGE_INPUTS)})")  # fmt: skip
    tensors = {k: torch.as_tensor(v) for k, v in inputs.items() if k in IMAGE_INPUTS and v is not None}
    token_id = image_token_id(model.config)
    counts = [sum(1 for t in p if t == token_id) for p in prompts] if token_id is not None else [0] * len(prompts)
    if "pixel_values" not in tensors:
        if any(counts) or tensors:
            raise ValueError(f"the prompts hold {sum(counts)} image tokens but no pixel_values were given")
        return [[] for _ in prompts]
    if token_id is None:
        raise NotImplementedError(f"{type(model).__name__} takes no images (its config names no image token id)")
    if model.config.model_type not in CHECKED_FAMILIES:
        raise NotImplementedError(
            f"images for {type(model).__name__} (model_type {model.config.model_type!r}) are not supported by the "
            f"paged engine: the families checked against sdpa are {', '.join(CHECKED_FAMILIES)} (text-only prompts run)"
        )
    pixels = tensors["pixel_values"]
    if pixels.dim() == 5:  # [rows, images, C, H, W] (Idefics3): each row's images, all-zero ones padding
        return _split_rows(tensors, counts)
    if "image_grid_thw" in tensors:  # dynamic resolution: one run of patches per image, tokens by its grid
        grid = tensors["image_grid_thw"].long()
        merge = getattr(model.config.vision_config, "spatial_merge_size", 1)
        patches = grid.prod(-1).tolist()
        tokens = [n // merge**2 for n in patches]
        if sum(patches) != pixels.shape[0]:
            raise ValueError(f"pixel_values has {pixels.shape[0]} patches; image_grid_thw describes {sum(patches)}")
        offsets = [sum(patches[:i]) for i in range(len(patches) + 1)]
        per_image = [{"pixel_values": pixels[a:b], "image_grid_thw": grid[i : i + 1]}
                     for i, (a, b) in enumerate(zip(offsets, offsets[1:]))]  # fmt: skip
    else:  # one fixed-size entry per image: its tokens are the batch's image tokens shared evenly
        num_images = pixels.shape[0]
        if num_images == 0 or sum(counts) % num_images:
            raise ValueError(f"{sum(counts)} image tokens in the prompts do not divide among {num_images} images")
        tokens = [sum(counts) // num_images] * num_images
        per_image = [{k: v[i : i + 1] for k, v in tensors.items()} for i in range(num_images)]
    images = [Image(d, n, _digest(d)) for d, n in zip(per_image, tokens)]
    out, next_image = [], 0
    for row, count in enumerate(counts):
        mine = []
        while sum(i.num_tokens for i in mine) < count and next_image < len(images):
            mine.append(images[next_image])
            next_image += 1
        if sum(i.num_tokens for i in mine) != count:
            raise ValueError(f"prompt {row} holds {count} image tokens; its images fill "
                             f"{sum(i.num_tokens for i in mine)}")  # fmt: skip
        out.append(mine)
    if next_image != len(images):
        raise ValueError(f"{len(images)} images were given for {next_image} images' worth of image tokens")
    return out


def _split_rows(tensors: dict[str, torch.Tensor], counts: list[int]) -> list[list[Image]]:
    """Images laid out per row ([rows, images, ...], padded with all-zero images, as Idefics3's processor
    pads them): row ``r``'s real images share its image tokens evenly."""
    pixels = tensors["pixel_values"]
    if pixels.shape[0] != len(counts):
        raise ValueError(f"pixel_values holds {pixels.shape[0]} rows of images for {len(counts)} prompts")
    out = []
    for row, count in enumerate(counts):
        real = [j for j in range(pixels.shape[1]) if bool(pixels[row, j].any())]
        if count and (not real or count % len(real)):
            raise ValueError(f"prompt {row} holds {count} image tokens, which do not divide among its "
                             f"{len(real)} images")  # fmt: skip
        if not count:
            real = []
        per_image = [{k: v[row, j][None, None] for k, v in tensors.items()} for j in real]  # [1, 1, ...] each
        out.append([Image(d, count // len(real), _digest(d)) for d in per_image])
    return out


def _digest(inputs: Mapping[str, torch.Tensor]) -> bytes:
    """SHA-256 of an image's inputs: names, dtypes, shapes and bytes (the same pixels give the same digest)."""
    h = hashlib.sha256()
    for name in sorted(inputs):
        t = inputs[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


@dataclass(slots=True, eq=False)
class MultimodalInputs:
    """One request's images, as ``ContinuousBatchingEngine.add_request(multimodal=)`` takes them: built by
    ``MultimodalInputs.build(model, prompt, images)`` from ``split_images``' cut of a processor's outputs
    (``add_request(**processor_outputs)`` builds it itself).

    ``positions``: the prompt positions of the image tokens, in order ([num_image_tokens] int64; image ``j``
    fills the ``images[j].num_tokens`` after those of the images before it). ``rope_positions``
    ([3, prompt_len]) and ``rope_delta``: M-RoPE models' (Qwen-VL) prompt positions, and what a position
    after the prompt adds to its index. ``embeds``: the encoder's output, [num_image_tokens, hidden], while
    the prefill still has image tokens to feed."""

    images: list[Image]
    positions: torch.Tensor
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    embeds: torch.Tensor | None = None
    num_encodes: int = 0  # how many times the encoder ran for it (once, unless preempted mid-prefill)
    end: int = dataclasses.field(init=False)  # the position after its last image token
    # the processor outputs ``add_request`` takes as a prompt's images (the server passes these on)
    INPUT_NAMES: ClassVar[tuple[str, ...]] = IMAGE_INPUTS + DERIVED_INPUTS

    def __post_init__(self) -> None:
        self.end = int(self.positions[-1]) + 1 if self.positions.numel() else 0

    @staticmethod
    def takes_images(model: torch.nn.Module) -> bool:
        """Whether ``model``'s config names an image token (a vision-language model)."""
        return image_token_id(model.config) is not None

    @staticmethod
    def image_token(model: torch.nn.Module) -> int | None:
        """The placeholder token id of ``model``'s images, or None (a text model)."""
        return image_token_id(model.config)

    @staticmethod
    def split(model: torch.nn.Module, prompts: Sequence[Sequence[int]], inputs: Mapping) -> list[list[Image]]:
        """``split_images``: each prompt's images out of a processor's batch outputs."""
        return split_images(model, prompts, inputs)

    @classmethod
    def build(cls, model: torch.nn.Module, prompt: Sequence[int], images: list[Image]) -> MultimodalInputs:
        ids = torch.tensor(prompt)
        positions = (ids == image_token_id(model.config)).nonzero().flatten()
        assert positions.numel() == sum(i.num_tokens for i in images), "split_images matched them"
        out = cls(images, positions)
        rope_index = _rope_index(model)
        if rope_index is not None:
            grid = torch.cat([i.inputs["image_grid_thw"] for i in images]) if images else None
            kinds = (ids == image_token_id(model.config)).int()
            rope, delta = rope_index(ids[None], mm_token_type_ids=kinds[None], image_grid_thw=grid)
            out.rope_positions, out.rope_delta = rope[:, 0].cpu(), int(delta.flatten()[0])
        return out

    @property
    def spans(self) -> tuple[tuple[int, int, bytes], ...]:
        """Each image's (first position, number of positions up to its last token, digest)."""
        out, k = [], 0
        for image in self.images:
            first, last = int(self.positions[k]), int(self.positions[k + image.num_tokens - 1])
            out.append((first, last - first + 1, image.digest))
            k += image.num_tokens
        return tuple(out)

    def encoder_inputs(self) -> dict[str, torch.Tensor]:
        names = self.images[0].inputs
        return {name: torch.cat([i.inputs[name] for i in self.images]) for name in names}


def _rope_index(model: torch.nn.Module):  # noqa: ANN202 - the model's own bound method
    """The model's M-RoPE position function (Qwen-VL: ``get_rope_index``), or None."""
    for owner in (model, getattr(model, "model", None)):
        if owner is not None and hasattr(owner, "get_rope_index"):
            return owner.get_rope_index
    return None


def encode(model: torch.nn.Module, mms: Sequence[MultimodalInputs]) -> None:
    """Sets each request's ``embeds`` ([num_image_tokens, hidden]) from the model's own ``get_image_features``
    (vision tower and projector), in one call for all of ``mms`` where their inputs stack (the requests a step
    admits: one batched tower run instead of one per request, as sdpa's padded ``generate`` runs it)."""
    if len(mms) > 1:
        try:
            inputs = {k: torch.cat([mm.encoder_inputs()[k] for mm in mms]) for k in mms[0].images[0].inputs}
        except (RuntimeError, KeyError):  # other shapes or other inputs: one request at a time
            inputs = None
        if inputs is not None:
            features = _image_features(model, inputs)
            sizes = [mm.positions.numel() for mm in mms]
            if features.shape[0] == sum(sizes):
                for mm, part in zip(mms, features.split(sizes)):
                    mm.embeds, mm.num_encodes = part, mm.num_encodes + 1
                return
    for mm in mms:
        features = _image_features(model, mm.encoder_inputs())
        if features.shape[0] != mm.positions.numel():
            raise ValueError(f"the encoder gave {features.shape[0]} image features for {mm.positions.numel()} image "
                             "tokens")  # fmt: skip
        mm.embeds, mm.num_encodes = features, mm.num_encodes + 1


def _image_features(model: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``get_image_features`` of ``inputs`` (one or more images), [num_image_tokens, hidden]."""
    device, dtype = input_device(model), next(model.parameters()).dtype
    inputs = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()}
    out = model.get_image_features(**inputs, return_dict=True)
    features = getattr(out, "pooler_output", out)
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


class MultimodalSteps:
    """Turns a step whose requests have images into what the model takes for them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.is_mrope = self.is_mrope_model(model)

    @staticmethod
    def is_mrope_model(model: torch.nn.Module) -> bool:
        """Whether ``model`` places its tokens by M-RoPE (Qwen-VL): steps with its images take [3, 1, N] positions."""
        return _rope_index(model) is not None

    def prepare(self, step: StepMetadata, scheduled: list[ScheduledRequest]) -> StepMetadata:
        """``step`` with ``inputs_embeds`` where a chunk feeds image tokens and 3-D positions where an
        M-RoPE request runs. Read before the step is committed (``num_computed_tokens``: each chunk's start)."""
        rows = []  # (row, scheduled) of the requests whose chunk needs more than its ids and 1-D positions
        for i, s in enumerate(scheduled):
            mm = s.request.multimodal
            if mm is not None and (self.is_mrope or s.request.num_computed_tokens < mm.end):
                rows.append((i, s))  # (a prefill past its last image token is text: the common decode step)
        if not rows:
            return step
        feeding = {id(s): self._inside(s) for _, s in rows}
        encode(self.model, [s.request.multimodal for _, s in rows
                            if s.request.multimodal.embeds is None and feeding[id(s)].any()])  # fmt: skip
        embeds, positions = None, step.position_ids
        if self.is_mrope:
            positions = positions.unsqueeze(0).expand(3, -1, -1).clone()  # [3, 1, N]
        row_starts = step.cu_seq_lens_q.tolist()
        for i, s in rows:
            mm: MultimodalInputs = s.request.multimodal
            start, n, first_row = s.request.num_computed_tokens, s.num_new_tokens, row_starts[i]
            if self.is_mrope:
                positions[:, 0, first_row : first_row + n] = _mrope_positions(mm, start, n).to(positions.device)
            inside = feeding[id(s)]
            if not inside.any():
                continue
            if embeds is None:
                embeds = self.model.get_input_embeddings()(step.input_ids)  # [1, N, hidden]
            at = (mm.positions[inside] - start + first_row).to(embeds.device)
            embeds[0, at] = mm.embeds[inside.to(mm.embeds.device)].to(embeds.dtype)
            if mm.end <= start + n:  # the last image token is fed: the features are consumed
                mm.embeds = None
        return dataclasses.replace(step, inputs_embeds=embeds, position_ids=positions)

    @staticmethod
    def _inside(s: ScheduledRequest) -> torch.Tensor:
        """Which of the request's image tokens its chunk feeds: [num_image_tokens] bool."""
        positions, start = s.request.multimodal.positions, s.request.num_computed_tokens
        return (positions >= start) & (positions < start + s.num_new_tokens)


def _mrope_positions(mm: MultimodalInputs, start: int, n: int) -> torch.Tensor:
    """The M-RoPE positions of a request's tokens ``start .. start + n - 1``: [3, n]."""
    index = torch.arange(start, start + n)
    out = (index + mm.rope_delta).unsqueeze(0).expand(3, -1).clone()
    prompt_len = mm.rope_positions.shape[1]
    in_prompt = index < prompt_len
    out[:, in_prompt] = mm.rope_positions[:, index[in_prompt]]
    return out
