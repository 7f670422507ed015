"""The user's model is a guest's house: an engine closed (``shutdown``, its context manager, or the end of a
``generate`` call) leaves the model with the modules, ``forward``s, buffers and parameters it had, whatever
the engine put on it meanwhile (``runtime/model/marks.py``): the compiled forward's layer-index buffers and region
forwards, the float32 copies of a bfloat16 model's linears. And a model whose parameters are replaced after
generating computes with the new ones, in every later forward of its own.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.attention.function import LAYER_INDEX
from hf_paged_attn.runtime.cpu import fp32_matmuls
from hf_paged_attn_tools.testing import ragged_prompts, save_random_model, tiny_llama_config

PROMPTS = ragged_prompts(3, 3, 20, seed=9)
IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    return save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("left-as-found"))


def load(directory: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged", dtype=dtype).eval()


def snapshot(model: torch.nn.Module) -> dict[str, object]:
    """What a guest must leave as found: each module (identity) and its instance attributes (a ``forward`` of
    its own among them), each buffer and parameter (identity, version counter, data pointer)."""
    return {
        "modules": [(name, id(m), sorted(m.__dict__)) for name, m in model.named_modules()],
        "forwards": [name for name, m in model.named_modules() if "forward" in m.__dict__],
        "buffers": [(name, id(b), b._version, b.data_ptr()) for name, b in model.named_buffers()],
        "parameters": [(name, id(p), p._version, p.data_ptr()) for name, p in model.named_parameters()],
    }


def generate(engine: ContinuousBatchingEngine) -> list[list[int]]:
    return [o.output_ids for o in engine.generate(PROMPTS, max_new_tokens=6)]


def test_an_eager_engine_and_generate_leave_the_model_as_found(weights) -> None:
    model = load(weights)
    before = snapshot(model)
    with ContinuousBatchingEngine(model, PagedConfig(compile=False)) as engine:
        generate(engine)
    assert snapshot(model) == before
    model.generate(IDS, max_new_tokens=4, do_sample=False, paged_config=PagedConfig(compile=False))
    assert snapshot(model) == before


def test_a_compiled_engine_leaves_the_model_as_found_and_the_next_one_reuses_its_graph(weights) -> None:
    """The marks are on the model while an engine runs (the graph reads them) and off it after; a second
    engine puts the very same ones back, so dynamo's guards pass and nothing compiles again."""
    model = load(weights)
    before = snapshot(model)
    attention = [layer.self_attn for layer in model.model.layers]
    config = PagedConfig(num_blocks=64, compile=True)
    with ContinuousBatchingEngine(model, config) as engine:
        assert engine.executor.wait(timeout=600) and engine.executor.failed is None
        first = generate(engine)
        assert all(LAYER_INDEX in m._buffers for m in attention)
        assert engine.executor.num_compiled_steps > 0
    assert snapshot(model) == before
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with ContinuousBatchingEngine(model, config) as second:
        assert second.executor.wait(timeout=0)
        assert generate(second) == first
        assert second.executor.num_compiled_steps > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile
    assert snapshot(model) == before


def test_a_bf16_engine_with_float32_matmuls_leaves_the_model_as_found(weights) -> None:
    model = load(weights, torch.bfloat16)
    before = snapshot(model)
    with ContinuousBatchingEngine(model, PagedConfig(compile=False, fp32_matmuls=True)) as engine:
        generate(engine)
        assert fp32_matmuls.installed(model) > 0
    assert snapshot(model) == before and fp32_matmuls.installed(model) == 0
    model.generate(IDS, max_new_tokens=4, do_sample=False, paged_config=PagedConfig(compile=False, fp32_matmuls=True))
    assert snapshot(model) == before


def test_a_compiled_bf16_engine_with_float32_matmuls_leaves_the_model_as_found(weights) -> None:
    model = load(weights, torch.bfloat16)
    before = snapshot(model)
    with ContinuousBatchingEngine(model, PagedConfig(num_blocks=64, compile=True, fp32_matmuls=True)) as engine:
        assert engine.executor.wait(timeout=600) and engine.executor.failed is None
        generate(engine)
        assert engine.executor.num_compiled_steps > 0
    assert snapshot(model) == before


def replace_in_place_of(p: torch.nn.Parameter, values: torch.Tensor) -> None:
    """``p.data = new`` where the new tensor sits where the old one did (an allocator that reuses the freed
    block, as a ZeRO-3 gather may): the data pointer and the parameter's version counter say nothing changed."""
    new = torch.empty(0, dtype=p.dtype).set_(p.untyped_storage(), p.storage_offset(), p.shape, p.stride())
    with torch.no_grad():
        new.copy_(values)
    p.data = new


def logits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A plain forward's logits, under ``no_grad`` and ``inference_mode``, then through sdpa."""
    out = {}
    with torch.no_grad():
        out["no_grad"] = model(IDS).logits
    with torch.inference_mode():
        out["inference_mode"] = model(IDS).logits.clone()
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        out["sdpa"] = model(IDS).logits.clone()
    return out


@pytest.mark.parametrize("change", ["to_float32", "replaced_data"])
def test_replaced_parameters_after_a_bf16_generate_are_the_ones_computed_with(weights, change) -> None:
    """A bfloat16 generate with float32 matmuls, then the parameters replaced rather than changed in place:
    every later forward of the model equals a freshly loaded model's with the same weights. The float32
    copies left on the model computed with the old weight (3.6 off in the logits)."""
    model, fresh = load(weights, torch.bfloat16), load(weights, torch.bfloat16)
    model.generate(IDS, max_new_tokens=4, do_sample=False, paged_config=PagedConfig(compile=False, fp32_matmuls=True))
    for m in (model, fresh):
        if change == "to_float32":
            m.to(torch.float32)
        weight = m.model.layers[0].mlp.down_proj.weight
        replace_in_place_of(weight, torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
    got, expected = logits(model), logits(fresh)
    for mode in expected:
        assert torch.equal(got[mode], expected[mode]), (mode, (got[mode] - expected[mode]).abs().max().item())
    assert not any("forward" in m.__dict__ for m in model.modules())
