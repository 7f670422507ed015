"""vLLM's ``features`` (serve/openai/features.py): rendered from a processor's outputs and read back, every
image layout the engine takes (fixed-size, dynamic-resolution grids, Idefics3's images per row) gives the
processor's tensors again; what does not fit the model is a 400."""

from __future__ import annotations

import json

import pytest
import torch

from hf_paged_attn.runtime.multimodal import split_images
from hf_paged_attn.serve.errors import APIError
from hf_paged_attn.serve.openai.features import Features, generate_inputs, render_features
from hf_paged_attn_tools.tiny_vlms import BUILDERS, random_image

MAX_PIXELS = 4096 * 4096


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_features_round_trip(family):
    vlm = BUILDERS[family]()
    inputs = vlm.inputs([f"{vlm.image_text} and {vlm.image_text} compare them"], [random_image(1), random_image(2)])
    ids = inputs.pop("input_ids")[0].tolist()
    inputs = {k: v for k, v in inputs.items() if k not in ("attention_mask", "mm_token_type_ids", "token_type_ids")}
    features = Features.model_validate(json.loads(json.dumps(render_features(vlm.model, ids, inputs))))
    probe = split_images(vlm.model, [ids], inputs)[0][0].inputs
    back = generate_inputs(vlm.model, ids, features, probe, max_images=8, max_image_pixels=MAX_PIXELS)
    assert back.keys() == inputs.keys()
    for name, tensor in inputs.items():
        assert torch.equal(back[name], tensor), name
    with pytest.raises(APIError, match="at most 1 images"):
        generate_inputs(vlm.model, ids, features, probe, max_images=1, max_image_pixels=MAX_PIXELS)
    if "image_grid_thw" in inputs:  # a grid past the pixel limit: refused before the tower sees it
        with pytest.raises(APIError, match="image_grid_thw"):
            generate_inputs(vlm.model, ids, features, probe, max_images=8, max_image_pixels=64)
