"""Tiny random vision-language models and their inputs, built offline (tests, docs, benchmarks).

Each builder returns a ``TinyVLM``: the model (fp32, eval, random weights, attn_implementation
"paged"), and ``inputs(texts, images)``, which makes what the family's processor makes for a
left-padded batch. The tokenizer is
the bundled demo model's, with the family's image tokens added. Qwen2-VL's inputs come from
``Qwen2VLImageProcessorPil`` and the tokenizer (its processor needs torchvision's video processor).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from hf_paged_attn.demo import DEMO_MODEL


@dataclass
class TinyVLM:
    model: torch.nn.Module
    tokenizer: object
    image_text: str  # what a text writes where an image goes
    inputs: Callable[[Sequence[str], Sequence[Image.Image]], dict[str, torch.Tensor]]
    processor: object | None = None  # the family's processor, where it builds without torchvision


def random_image(seed: int, height: int = 20, width: int = 24) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _tokenizer(tokens: list[str]):
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.padding_side = "left"
    return tok


def tiny_llava(seed: int = 0, family: str = "llava") -> TinyVLM:
    """LLaVA: a CLIP vision tower (16x16 images, 4x4 patches: 16 image tokens each) and a Llama.
    ``family="vipllava"``: VipLLaVA, its features from two of the tower's layers, the same inputs."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        VipLlavaConfig,
        VipLlavaForConditionalGeneration,
    )

    tok = _tokenizer(["<image>"])
    image_processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=4,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)  # fmt: skip
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=4, projection_dim=32)  # fmt: skip
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                       initializer_range=0.1)  # fmt: skip
    common = dict(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                  initializer_range=0.1)  # fmt: skip
    torch.manual_seed(seed)
    if family == "vipllava":
        model = VipLlavaForConditionalGeneration(VipLlavaConfig(**common, vision_feature_layers=[-2, -1])).eval()
    else:
        config = LlavaConfig(**common, vision_feature_layer=-1, vision_feature_select_strategy="default")
        model = LlavaForConditionalGeneration(config).eval()
    model.set_attn_implementation("paged")

    def inputs(texts: Sequence[str], images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        return dict(processor(images=list(images) or None, text=list(texts), return_tensors="pt", padding=True))

    return TinyVLM(model, tok, "<image>", inputs, processor)


def tiny_qwen2_vl(seed: int = 0, family: str = "qwen2_vl") -> TinyVLM:
    """Qwen2-VL: M-RoPE, dynamic resolution (4x4 patches merged 2x2: a 16x24 image is 6 tokens).
    ``family="qwen2_5_vl"``: Qwen2.5-VL (windowed vision attention, a SwiGLU tower), the same inputs."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    start, pad, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    image_processor = Qwen2VLImageProcessorPil(min_pixels=8 * 8 * 4, max_pixels=32 * 32 * 4, patch_size=4,
                                               merge_size=2, temporal_patch_size=2)  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}  # head_dim 16
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, initializer_range=0.1)  # fmt: skip
    config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    if family == "qwen2_5_vl":  # its tower: hidden_size is the tower's width, out_hidden_size the text model's
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=4, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                      initializer_range=0.1)  # fmt: skip
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    config = config_class(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                         rope_parameters=rope, initializer_range=0.1, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=vision,
        image_token_id=pad, vision_start_token_id=start, vision_end_token_id=end, video_token_id=end + 1,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.set_attn_implementation("paged")

    def inputs(texts: Sequence[str], images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        pixels = dict(image_processor(images=list(images), return_tensors="pt")) if images else {}
        counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist() if images else [])
        expanded = []
        for text in texts:  # each image's one pad token becomes one per merged patch, as the processor does
            first, *rest = text.split("<|image_pad|>")
            expanded.append(first + "".join("<|image_pad|>" * next(counts) + part for part in rest))
        batch = dict(tok(expanded, return_tensors="pt", padding=True))
        batch["mm_token_type_ids"] = (batch["input_ids"] == pad).int()
        return {**batch, **pixels}

    return TinyVLM(model, tok, "<|vision_start|><|image_pad|><|vision_end|>", inputs)


def tiny_idefics3(seed: int = 0, family: str = "idefics3") -> TinyVLM:
    """Idefics3: a SigLIP-like tower, pixel shuffle (scale 2), a Llama; images per row, 16x16 without
    splitting: 4 image tokens each. ``family="smolvlm"``: SmolVLM, the same layout (its own processor needs
    torchvision's video processor: Idefics3's makes the same inputs)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"])
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 16},
                                                max_image_size={"longest_edge": 16})  # fmt: skip
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4)
    config_class, model_class = (SmolVLMConfig, SmolVLMForConditionalGeneration) if family == "smolvlm" else (
        Idefics3Config, Idefics3ForConditionalGeneration)  # fmt: skip
    config = config_class(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4, initializer_range=0.1),
        text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                         max_position_embeddings=512, initializer_range=0.1),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.set_attn_implementation("paged")

    def inputs(texts: Sequence[str], images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        rows, it = [], iter(images)  # the processor takes each row's images as a list
        for text in texts:
            rows.append([next(it) for _ in range(text.count("<image>"))])
        if not any(rows):
            return dict(tok(list(texts), return_tensors="pt", padding=True))
        return dict(processor(images=rows, text=list(texts), return_tensors="pt", padding=True))

    return TinyVLM(model, tok, "<image>", inputs)


def tiny_internvl(seed: int = 0) -> TinyVLM:
    """InternVL: an InternViT-like tower (one 16x16 tile per image, 4x4 patches, pixel shuffle 0.5: 4 image
    tokens) and a Qwen2. Its inputs are built by hand as its processor lays them out without tiling: the
    image's ``<img><IMG_CONTEXT>*4</img>`` and one normalized tile per image."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    tok = _tokenizer(["<img>", "<IMG_CONTEXT>", "</img>"])
    config = InternVLConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=[16, 16], patch_size=[4, 4], initializer_range=0.2),
        text_config=dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                         max_position_embeddings=512, initializer_range=0.2),
        downsample_ratio=0.5, image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).eval()
    model.set_attn_implementation("paged")

    def inputs(texts: Sequence[str], images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        expanded = [t.replace("<image>", "<img>" + "<IMG_CONTEXT>" * 4 + "</img>") for t in texts]
        batch = dict(tok(expanded, return_tensors="pt", padding=True))
        if images:
            tiles = [torch.from_numpy(np.array(i.convert("RGB").resize((16, 16)))).permute(2, 0, 1) for i in images]
            batch["pixel_values"] = torch.stack(tiles).float() / 127.5 - 1.0  # [num_images, 3, 16, 16]
        return batch

    return TinyVLM(model, tok, "<image>", inputs)


def tiny_aya_vision(seed: int = 0, family: str = "aya_vision") -> TinyVLM:
    """Aya Vision: a SigLIP tower (one 16x16 tile per image, 4x4 patches), pixel shuffle (2: 4 image tokens) and
    a Cohere2 (a sliding layer and a full one). Its inputs are built by hand, one normalized tile per image (its
    processor tiles an image and adds a thumbnail and tile markers). ``family="cohere2_vision"``: Command A
    Vision, the same tower, shuffle and text model."""
    tok = _tokenizer(["<image>"])
    image_id = tok.convert_tokens_to_ids("<image>")
    common = dict(
        text_config=dict(model_type="cohere2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention"], initializer_range=0.1,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=16, patch_size=4),
        downsample_factor=2,
    )  # fmt: skip
    if family == "cohere2_vision":
        config = AutoConfig.for_model(family, **common, image_token_id=image_id, alignment_intermediate_size=64)
    else:
        config = AutoConfig.for_model(family, **common, image_token_index=image_id, vision_feature_layer=-1,
                                      vision_feature_select_strategy="full")  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # the tower's default init (zero biases, unit norms) plus these: greedy tokens that vary
        for param in model.parameters():
            if param.dim() > 1:
                torch.nn.init.normal_(param, std=0.1)
    model.set_attn_implementation("paged")

    def inputs(texts: Sequence[str], images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
        batch = dict(tok([t.replace("<image>", "<image>" * 4) for t in texts], return_tensors="pt", padding=True))
        if images:
            tiles = [torch.from_numpy(np.array(i.convert("RGB").resize((16, 16)))).permute(2, 0, 1) for i in images]
            batch["pixel_values"] = torch.stack(tiles).float() / 127.5 - 1.0  # [num_images, 3, 16, 16]
        return batch

    return TinyVLM(model, tok, "<image>", inputs)


def small_llava(seed: int = 0, image_size: int = 224, patch_size: int = 14) -> torch.nn.Module:
    """A LLaVA of benchmark size (fp32, eval, random weights, attn_implementation "paged"): the text model is
    the text benchmarks' 30M Llama (``bench.workloads.FULL_MODEL``: hidden 512, 8 layers, vocab 8,192; the
    image token is one more id, 8,192), the tower a small CLIP (hidden 256, 4 layers; ``image_size`` /
    ``patch_size`` squared image tokens per image, 256 at the defaults). ``initializer_range`` 0.1 so greedy
    tokens vary. Its inputs are token ids and ``pixel_values`` [num_images, 3, image_size, image_size]."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from hf_paged_attn_tools.bench.workloads import FULL_MODEL

    text = FULL_MODEL.config()
    text.vocab_size = FULL_MODEL.vocab_size + 1  # the image token, outside the workloads' token range
    vision = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                              image_size=image_size, patch_size=patch_size, projection_dim=256,
                              initializer_range=0.1)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=FULL_MODEL.vocab_size,
                         vision_feature_layer=-1, vision_feature_select_strategy="default",
                         initializer_range=0.1)  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.set_attn_implementation("paged")
    return model


BUILDERS = {
    "llava": tiny_llava,
    "vipllava": functools.partial(tiny_llava, family="vipllava"),
    "qwen2_vl": tiny_qwen2_vl,
    "qwen2_5_vl": functools.partial(tiny_qwen2_vl, family="qwen2_5_vl"),
    "idefics3": tiny_idefics3,
    "smolvlm": functools.partial(tiny_idefics3, family="smolvlm"),
    "internvl": tiny_internvl,
    "aya_vision": tiny_aya_vision,
    "cohere2_vision": functools.partial(tiny_aya_vision, family="cohere2_vision"),
}
