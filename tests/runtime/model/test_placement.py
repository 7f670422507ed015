"""Layer placement under accelerate's hooks, memory sizing per device, step metadata per device.

The models here are built on the ``meta`` device with hand-attached hooks (objects carrying an
``execution_device``, as accelerate's ``AlignDevicesHook`` does), so no GPU is needed to see where
layers would run on one."""

from types import SimpleNamespace

import torch
from transformers import LlamaForCausalLM

from hf_paged_attn.attention.forward import ForwardContext
from hf_paged_attn.attention.step import build_step
from hf_paged_attn.core.request import Request
from hf_paged_attn.core.scheduler import ScheduledRequest
from hf_paged_attn.kernels.torch_backend import TorchBackend
from hf_paged_attn.runtime.model.memory import blocks_from_memory, bytes_per_block
from hf_paged_attn.runtime.model.placement import as_device, input_device, kernel_device, layer_devices
from hf_paged_attn_tools.testing import tiny_llama_config

CPU, META = torch.device("cpu"), torch.device("meta")
GPU0, GPU1 = torch.device("cuda:0"), torch.device("cuda:1")


def hook(device) -> SimpleNamespace:
    return SimpleNamespace(execution_device=device)


def dispatched(layer_map: list, embed=None, on_ancestor: bool = False) -> LlamaForCausalLM:
    """A 4-layer tiny Llama on ``meta`` whose decoder layer i is hooked to ``layer_map[i]``."""
    with META:
        model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=len(layer_map)))
    for layer, device in zip(model.model.layers, layer_map):
        target = layer if on_ancestor else layer.self_attn
        target._hf_hook = hook(device)
    if embed is not None:
        model.model.embed_tokens._hf_hook = hook(embed)
    model.hf_device_map = {"": "meta"}  # marks the model as dispatched, as from_pretrained does
    return model


def test_as_device_names():
    assert as_device("cpu:0") == CPU  # PartialState's name for the CPU; CPU tensors report "cpu"
    assert as_device(torch.device("cuda", 1)) == GPU1
    assert as_device(1).index == 1  # an int is an accelerator index


def test_layer_devices_read_the_hooks():
    model = dispatched(["cuda:0", "cuda:0", "cuda:1", "cpu"], embed="cuda:0")
    assert layer_devices(model) == [GPU0, GPU0, GPU1, CPU]
    assert input_device(model) == GPU0  # its parameters are on meta: only the hook knows
    assert kernel_device(model) == CPU  # mixed device types: the torch backend's choice


def test_hooks_on_ancestor_blocks_count():
    # accelerate may hook a whole decoder layer and none of its children
    model = dispatched(["cuda:1", "cuda:1", "cuda:0", "cuda:0"], on_ancestor=True)
    model.model._hf_hook = SimpleNamespace(hooks=[SimpleNamespace(), hook("cuda:1")])  # a SequentialHook
    assert layer_devices(model) == [GPU1, GPU1, GPU0, GPU0]
    assert input_device(model) == GPU1  # the embeddings inherit model.model's hook
    assert kernel_device(model) == GPU0  # one device type: resolved for it


def test_blocks_from_memory_takes_the_tightest_device():
    model = dispatched(["cuda:0", "cuda:0", "cuda:1", "cpu"], embed="cuda:0")
    config = model.config
    per_layer = bytes_per_block(config, 8, torch.float32) // config.num_hidden_layers
    assert per_layer == 2 * 8 * 2 * 16 * 4  # K and V, block of 8, 2 KV heads of dim 16, fp32
    free = {GPU0: 10 << 20, GPU1: 3 << 20, CPU: 1 << 30}
    asked = []

    def free_bytes(device: torch.device) -> int:
        asked.append(device)
        return free[device]

    got = blocks_from_memory(model, 8, 0.5, free_bytes=free_bytes)
    # cuda:0 holds two layers: (10 MiB / 2) // (2 * per_layer) = 1280; cuda:1 one: 1.5 MiB // per_layer = 768
    assert got == 768
    assert sorted(asked, key=str) == [CPU, GPU0, GPU1]  # each device asked once
    free[GPU1] = 1 << 30
    assert blocks_from_memory(model, 8, 0.5, free_bytes=free.__getitem__) == 1280


def test_single_device_sizing_is_unchanged():
    """Without hooks every layer is on the model's device and the old whole-model formula holds."""
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3))
    assert layer_devices(model) == [CPU] * 3 and input_device(model) == CPU == kernel_device(model)
    free = 123_456_789
    old = int(free * 0.9) // bytes_per_block(model.config, 16, torch.float32)
    assert blocks_from_memory(model, 16, 0.9, free_bytes=lambda d: free) == old


def _step(prompt_lens: list[int]):
    requests = []
    for n in prompt_lens:
        r = Request("r", list(range(1, n + 1)), max_new_tokens=4, sampling=None, arrival=0)
        r.block_ids = list(range(len(requests) * 4, len(requests) * 4 + 4))
        requests.append(ScheduledRequest(r, n))
    return build_step(requests, 4, CPU)


def test_a_forward_moves_the_step_once_per_device_and_group():
    step = _step([5, 3])
    context = ForwardContext(step, TorchBackend())
    here = context.inputs(0, CPU)
    assert here.block_table is step.block_table and here.cu_seq_lens_q is step.cu_seq_lens_q  # no copy at all
    moved = context.inputs(0, META)
    assert context.inputs(0, META) is moved and moved is not here  # one copy per device, reused by every layer
    for name in ("cu_seq_lens_q", "cache_seqlens", "seqused_k", "block_table", "slot_mapping"):
        assert getattr(moved, name).device == META, name
        assert getattr(here, name).device == CPU, name
    assert (moved.max_length_q, moved.max_length_k, moved.is_decode) == (5, 5, False)
    assert moved.memo is not here.memo  # the kernels' plans differ per device
    assert not any(t.device == META for t in (step.input_ids, step.block_table))  # the step itself never moves
