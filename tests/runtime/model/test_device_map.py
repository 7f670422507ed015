"""Models spread by accelerate's ``device_map``: weights offloaded to the CPU and to disk.

Both models are loaded with the same explicit map (``offload_folder`` in a temp dir), so accelerate's
hooks move inputs and weights at forward time in the reference as in the paged model. On a machine
without GPUs every layer executes on the CPU; ``scripts/gpu_check/`` (mixed/*) runs layers on two
devices at once.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.model.placement import as_device, layer_devices
from hf_paged_attn_tools.testing import (
    compare_greedy,
    left_padded,
    ragged_prompts,
    reference_greedy,
    save_random_model,
    tiny_llama_config,
)

NEW_TOKENS = 10
LAYERS = 4
MAPS = {
    # every other module on disk: the embeddings, lm_head and odd layers load from safetensors each step
    "cpu+disk": {
        "model.embed_tokens": "disk",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "cpu",
        "model.layers.3": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "disk",
    },
    "all-disk": {"model": "disk", "lm_head": "disk"},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # an EOS id makes transformers build its special-token tensors, which must not land on "meta"
    config = tiny_llama_config(num_hidden_layers=LAYERS, eos_token_id=3)
    return save_random_model(config, tmp_path_factory.mktemp("llama4"))


def load(directory: str, attn: str, device_map: dict, offload: str):
    return AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation=attn, device_map=device_map, offload_folder=offload
    ).eval()


@pytest.mark.parametrize("name", list(MAPS))
def test_offloaded_device_map_greedy_parity(model_dir, tmp_path, name):
    device_map = MAPS[name]
    ref = load(model_dir, "sdpa", device_map, str(tmp_path / "sdpa"))
    paged = load(model_dir, "paged", device_map, str(tmp_path / "paged"))
    assert paged.hf_device_map == device_map
    assert any(p.device.type == "meta" for p in paged.parameters()), "nothing was offloaded to disk"

    prompts = ragged_prompts(4, 3, 20, seed=7)
    expected = [reference_greedy(ref, p, NEW_TOKENS) for p in prompts]

    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64))  # sized explicitly: fast
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert compare_greedy(ref, prompts, expected, [o.output_ids for o in outputs]) == []

    # each layer's pages live where accelerate executes that layer
    hooks = [as_device(layer.self_attn._hf_hook.execution_device) for layer in paged.model.layers]
    assert layer_devices(paged) == hooks
    for i, (layer, device) in enumerate(zip(engine.cache.layers, hooks)):
        assert layer.is_initialized, f"layer {i} never wrote its pages"
        assert layer.keys.device == layer.values.device == device, f"layer {i}"

    # and through the public API: padded batch in, transformers' output form back
    ids, mask = left_padded(prompts)
    out = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    rows = out[:, ids.shape[1] :].tolist()
    assert compare_greedy(ref, prompts, expected, [row[: len(e)] for row, e in zip(rows, expected)]) == []
    assert all(set(row[len(e) :]) <= {paged.config.pad_token_id} for row, e in zip(rows, expected))  # after EOS
    assert torch.equal(out[:, : ids.shape[1]], ids)
