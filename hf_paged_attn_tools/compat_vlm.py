"""Measured compatibility matrix of image-text-to-text architectures: every class of transformers'
``AutoModelForImageTextToText`` mapping, with an image in the prompt.

``python -m hf_paged_attn_tools.compat_vlm [--only NAMES] [--out docs/compatibility_vlm.md]`` records one
result per model type:

* ``pass``: a tiny random model of the family (``tiny_vlms``), greedy ``generate`` of a left-padded batch
  mixing a row with one image, a row of text and a row with two images equals ``sdpa``'s, token for token,
  and another image in the first row changes sdpa's tokens there (so the image is not ignored);
* ``refused``: the engine refuses the family's images by name: ``MultimodalInputs.split`` raises
  ``NotImplementedError`` on the family's default config (built without weights), and the note says why
  the family is outside what the engine handles;
* ``fail``: anything else (a checked family whose parity broke, or a family the engine did not refuse).

Text-only prompts of these models are the causal-LM matrix's business (``compat.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from hf_paged_attn import MultimodalInputs
from hf_paged_attn.runtime.multimodal import CHECKED_FAMILIES
from hf_paged_attn_tools.compat import result_table
from hf_paged_attn_tools.tiny_vlms import BUILDERS, random_image

NEW_TOKENS = 8
# Why a family's images are outside what the engine does, where one model type says more than its config.
REASONS = {
    "paligemma": "attends bidirectionally over its image and prompt prefix, which causal paged kernels never show it",
    "gemma3": "attends bidirectionally within each image's tokens, which the causal paged kernels never show it",
    "shieldgemma2": "Gemma 3: attends bidirectionally within each image's tokens",
    "mllama": "its cross-attention layers attend to the image, state the paged KV cache does not hold",
    "llama4": "its text model's chunked attention is refused by the paged engine (text too)",
    "qwen3_vl": "deepstack: visual features are added inside early decoder layers, not only at the input",
    "qwen3_vl_moe": "deepstack: visual features are added inside early decoder layers, not only at the input",
    "llava_next": "any-resolution tiles (image_sizes) are not cut per image yet",
    "llava_onevision": "any-resolution tiles (image_sizes) are not cut per image yet",
    "granite4_vision": "any-resolution tiles (image_sizes) are not cut per image yet",
}
VIDEO_WORDS = ("video", "omni")


@dataclass(slots=True)
class VLMResult:
    model_type: str
    class_name: str
    result: str  # "pass" | "refused" | "fail"
    note: str = ""
    seconds: float = 0.0


def candidates() -> dict[str, str]:
    """model_type -> class name of every image-text-to-text architecture."""
    return dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def check_parity(model_type: str) -> tuple[str, str]:
    """(result, note) of a checked family: mixed image and text rows, paged against sdpa."""
    vlm = BUILDERS[model_type]()
    img = vlm.image_text
    texts = [f"{img} describe this", "a row of text alone", f"{img} and {img} compare them"]
    images = [random_image(1), random_image(2, 16, 16), random_image(3, 24, 16)]
    inputs = vlm.inputs(texts, images)
    want = _greedy(vlm.model, inputs, "sdpa")
    got = _greedy(vlm.model, inputs, "paged")
    if not torch.equal(got, want):
        rows = [i for i in range(want.shape[0]) if not torch.equal(got[i], want[i])]
        return "fail", f"parity vs sdpa: rows {rows} differ"
    other = _greedy(vlm.model, vlm.inputs(texts, [random_image(9), *images[1:]]), "sdpa")
    if torch.equal(other[0], want[0]):
        return "fail", "another image leaves sdpa's tokens unchanged: the check would prove nothing"
    return "pass", f"vs sdpa, rows with 1, 0 and 2 images, {NEW_TOKENS} new tokens"


def _greedy(model: torch.nn.Module, inputs: dict, attn: str) -> torch.Tensor:
    model.set_attn_implementation(attn)
    try:
        return model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        model.set_attn_implementation("paged")


def check_refusal(model_type: str, class_name: str) -> tuple[str, str]:
    """(result, note): whether the engine refuses this family's images by name, and why it is outside."""
    config = AutoConfig.for_model(model_type)
    stub = type(class_name, (), {"config": config})()  # split looks at the config and the class's name only
    token = MultimodalInputs.image_token(stub)
    prompt = [token if token is not None else 0] * 4
    try:
        MultimodalInputs.split(stub, [prompt], {"pixel_values": torch.zeros(1, 3, 16, 16)})
    except NotImplementedError:
        return "refused", reason(model_type, class_name, config)
    except ValueError as exc:
        return "fail", f"not refused by name: {exc}"
    return "fail", "the engine took its images, but no parity check covers the family"


def reason(model_type: str, class_name: str, config: object) -> str:
    """Why the engine refuses this family's images."""
    model_class = getattr(transformers, class_name, None)
    if model_type in REASONS:
        return REASONS[model_type]
    if model_class is not None and not model_class._supports_attention_backend:
        return "its class does not claim transformers' attention interface: the paged engine refuses the model"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder: its decoder cross-attends to the encoder's output, which the paged cache does not hold"
    if MultimodalInputs.image_token(type(class_name, (), {"config": config})()) is None:
        return ("its config names no image token: its images do not enter as placeholder tokens the engine fills "
                "(a prefix, a Q-Former or cross-attention)")  # fmt: skip
    if any(word in model_type for word in VIDEO_WORDS):
        return "video (and audio) inputs beside images; images alone are not checked"
    return "not checked against sdpa with images yet (its processor's layout or positions need their own handling)"


def check_model(model_type: str) -> VLMResult:
    """One architecture's result; never raises."""
    class_name = candidates()[model_type]
    start = time.perf_counter()
    try:
        if model_type in CHECKED_FAMILIES:
            result, note = check_parity(model_type)
        else:
            result, note = check_refusal(model_type, class_name)
    except Exception as exc:  # the matrix records every failure and moves on
        lines = str(exc).strip().splitlines()
        result, note = "fail", f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
    return VLMResult(model_type, class_name, result, note, time.perf_counter() - start)


def render(results: list[VLMResult]) -> str:
    lines = [
        "# Vision-language compatibility",
        "",
        "Generated by `python -m hf_paged_attn_tools.compat_vlm --out docs/compatibility_vlm.md`; do not edit by "
        "hand.",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, float32. Every class of "
        "`AutoModelForImageTextToText`'s mapping, with images: **pass** is greedy `generate` of a left-padded batch "
        "mixing a row with one image, a row of text and a row with two images, equal to `sdpa`'s token for token "
        "on a tiny random model (`hf_paged_attn_tools/tiny_vlms.py`), another image changing sdpa's tokens; "
        "**refused** is the engine refusing the family's images by name (`NotImplementedError`, checked on its "
        "default config), with the reason. Text-only prompts of these models: [the causal-LM "
        "matrix](compatibility.md).",
        "",
        *result_table(results),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged_attn_tools.compat_vlm",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--only", help="comma-separated model types (default: every one)")
    parser.add_argument("--out", help="write the Markdown table here (default: print it)")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(candidates())
    unknown = [n for n in names if n not in candidates()]
    if unknown:
        parser.error(f"not image-text-to-text model types: {', '.join(unknown)}")
    results = []
    for name in names:
        results.append(check_model(name))
        r = results[-1]
        print(f"{r.model_type:28} {r.result:8} {r.seconds:5.1f}s  {r.note[:120]}", file=sys.stderr, flush=True)
    text = render(results)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
