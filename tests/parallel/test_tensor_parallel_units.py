"""The single-process side of ``parallel/tensor_parallel.py``: the step message, and that a model in
one process never takes the tensor-parallel path. The ranks themselves: ``test_tensor_parallel.py``."""

import dataclasses
import pickle

import pytest
import torch

from hf_paged_attn.attention.step import build_step
from hf_paged_attn.core.layers import LayerKinds
from hf_paged_attn.core.request import Request
from hf_paged_attn.core.scheduler import ScheduledRequest
from hf_paged_attn.parallel.tensor_parallel import claim, is_driver, is_tensor_parallel, kv_heads, moved, on_driver
from hf_paged_attn.runtime.launcher import LocalLauncher, choose_launcher

CPU = torch.device("cpu")


def request(prompt, computed=0, blocks=()):
    r = Request("r", list(prompt), max_new_tokens=10, sampling=None, arrival=0)
    r.num_computed_tokens = computed
    r.block_ids = list(blocks)
    return r


def same(sent, received, name: str) -> None:
    if isinstance(sent, torch.Tensor):
        assert torch.equal(sent, received) and sent.dtype == received.dtype, name
    elif isinstance(sent, (list, tuple)):
        assert len(sent) == len(received), name
        for i, (a, b) in enumerate(zip(sent, received)):
            same(a, b, f"{name}[{i}]")
    elif dataclasses.is_dataclass(sent):
        assert type(sent) is type(received), name
        for field in dataclasses.fields(sent):
            same(getattr(sent, field.name), getattr(received, field.name), f"{name}.{field.name}")
    else:
        assert sent == received, name


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("hybrid", [False, True])
def test_a_step_travels_whole(decode, hybrid):
    a = request([1, 2, 3, 4, 5], computed=4 if decode else 0, blocks=[3, 1])
    b = request([6, 7, 8], computed=2 if decode else 0, blocks=[0])
    layers = None
    if hybrid:  # a sliding and a full group, each with its own block tables
        layers = LayerKinds([4, None], share_pages=True)
        a.extra_block_ids, b.extra_block_ids = [[5, 6]], [[2]]
    scheduled = [ScheduledRequest(a, 1 if decode else 5), ScheduledRequest(b, 1 if decode else 3)]
    meta = build_step(scheduled, 4, CPU, layers, block_copies=[(3, 7)])
    assert len(meta.groups) == 1 + int(hybrid)
    got = moved(pickle.loads(pickle.dumps(moved(meta, CPU))), CPU)  # the message, every field of the step
    same(meta, got, "step")


class FakeModel(torch.nn.Module):
    tp_size = 2

    def __init__(self, heads, kv_heads):
        super().__init__()
        text = type("Text", (), {"num_attention_heads": heads, "num_key_value_heads": kv_heads})()
        self.config = type("Config", (), {"get_text_config": lambda self: text})()


def test_one_process_never_takes_the_tensor_parallel_path():
    model = FakeModel(4, 2)  # tp_size 2, but no process group
    assert not is_tensor_parallel(model) and is_driver(model)
    assert claim(model) is None and isinstance(choose_launcher(model), LocalLauncher)
    assert on_driver(model, lambda: 42) == 42


@pytest.mark.parametrize(("heads", "kv", "local"), [(4, 2, 1), (8, 4, 2), (4, 1, 1), (8, 8, 4)])
def test_each_rank_holds_its_share_of_kv_heads_or_one(heads, kv, local):
    assert kv_heads(FakeModel(heads, kv)) == (kv, local)
