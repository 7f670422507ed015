"""The eager LoRA router's Triton path (``runtime/model/lora_kernels.py``), forced on the CPU: the kernels run
under ``TRITON_INTERPRET=1`` (the root conftest sets it) with PEFT's tokens on sdpa; each layer's stacks are
rebuilt when its adapters, their scalings or their weights change, and only then."""

from __future__ import annotations

import importlib

import pytest
import torch
import triton

peft = pytest.importorskip("peft")

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn.kernels import lora_triton  # noqa: E402
from hf_paged_attn.runtime.model import lora, lora_kernels  # noqa: E402
from hf_paged_attn_tools.testing import left_padded  # noqa: E402

from . import test_lora  # noqa: E402
from .test_lora import NAMES, NEW, PROMPTS, ROW_ADAPTERS, check  # noqa: E402

# test_lora's fixtures: PEFT on sdpa and on paged, holding the same two random adapters (ranks 8 and 4, scalings
# and target modules differing)
adapter_dirs = test_lora.adapter_dirs
models = test_lora.models


@pytest.fixture
def triton_path(monkeypatch) -> dict[str, int]:
    """The router takes the Triton path on the CPU; returns the count of kernel pairs run."""
    ops = lora_triton
    if not isinstance(ops._shrink_kernel, triton.runtime.interpreter.InterpretedFunction):
        ops = importlib.reload(ops)  # imported before TRITON_INTERPRET was set: rebuild it interpreted
    calls = {"expand": 0}
    expand = ops.lora_expand

    def counted(*args, **kwargs) -> None:
        calls["expand"] += 1
        expand(*args, **kwargs)

    monkeypatch.setattr(lora_kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(ops, "lora_expand", counted)
    return calls


def test_engine_on_the_triton_path_matches_peft_mixed_batch_on_sdpa(models, triton_path):
    ref, paged = models
    ids, mask = left_padded(PROMPTS)
    out = ref.generate(input_ids=ids, attention_mask=mask, adapter_names=NAMES, max_new_tokens=NEW, do_sample=False)
    want = out[:, ids.shape[1] :].tolist()
    with ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=128)) as engine:
        ids = engine.add_all([dict(input_ids=p, max_new_tokens=NEW, adapter_name=a) for p, a in zip(PROMPTS, NAMES)])
        got = [o.output_ids for o in engine.collect(ids)]
    assert triton_path["expand"] > 0
    check(ref, PROMPTS, ROW_ADAPTERS, want, got)


def first_layer(model, adapter: str) -> torch.nn.Module:
    return next(layer for layer in lora.lora_layers(model.get_base_model()) if adapter in layer.lora_A)


def test_stacks_are_rebuilt_when_adapters_scalings_or_weights_change(models):
    _, paged = models
    layer = first_layer(paged, "a")  # a q_proj: adapter "a" only ("b" targets k, o and up)
    adapters = ["a", "b"]
    kernels = lora_kernels.LoraKernels(lambda: adapters)
    stacks = kernels.stacks(layer)
    assert stacks.lora_ids.tolist() == [0, -1]  # slot 0 is "a", slot 1 ("b") is not on this layer
    assert torch.equal(stacks.a[0], layer.lora_A["a"].weight)
    assert kernels.stacks(layer) is stacks  # nothing changed: the same stacks
    with torch.no_grad():
        layer.lora_B["a"].weight.mul_(2.0)  # in place: its version counter moves
    try:
        rebuilt = kernels.stacks(layer)
        assert rebuilt is not stacks and torch.equal(rebuilt.b[0, :, : layer.r["a"]], layer.lora_B["a"].weight)
    finally:
        with torch.no_grad():
            layer.lora_B["a"].weight.mul_(0.5)
    scaling = layer.scaling["a"]
    layer.scaling["a"] = scaling * 3
    try:
        assert kernels.stacks(layer).scalings.tolist() == [pytest.approx(scaling * 3)]
    finally:
        layer.scaling["a"] = scaling
    adapters.append("c")  # another adapter loaded: the slots are renumbered at the next step
    assert kernels.stacks(layer) is kernels.stacks(layer)
    kernels.new_step()
    assert kernels.stacks(layer).lora_ids.tolist() == [0, -1, -1]
    adapters[:] = ["0", "a"]
    kernels.new_step()
    assert kernels.stacks(layer).lora_ids.tolist() == [-1, 0]


def test_tensor_parallel_lora_bias_and_offloaded_layers_take_the_torch_loop(models, monkeypatch):
    _, paged = models
    layer = first_layer(paged, "a")
    cpu = torch.device("cpu")
    assert lora_kernels.suits(layer, cpu)
    assert not lora_kernels.suits(layer, torch.device("meta"))  # the rows elsewhere than the adapter's weights
    with monkeypatch.context() as patch:
        patch.setattr(layer.get_base_layer(), "_hf_device_mesh", object(), raising=False)
        assert not lora_kernels.suits(layer, cpu)
    bias = torch.nn.Parameter(torch.zeros(layer.lora_B["a"].out_features))  # PEFT's lora_bias=True
    monkeypatch.setattr(layer.lora_B["a"], "bias", bias)
    assert not lora_kernels.suits(layer, cpu)


def test_use_triton_only_on_cuda():
    assert not lora_kernels.use_triton(torch.device("cpu"))
