"""Projections that share an input as one matmul (``hf_paged_attn/runtime/cpu/linear_groups.py``): the group op
equals its members' ``F.linear``, never computes with a stale copy, the pass groups exactly the packed
linears that share an input, and a compiled engine with groups keeps greedy parity with sdpa."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu import compiled, linear_groups, packed_linear
from hf_paged_attn.runtime.cpu.compiled import CompiledExecutor
from hf_paged_attn_tools.testing import compare_greedy, load_pair, ragged_prompts, reference_greedy

PACKED = packed_linear.DTYPES  # the dtypes this CPU packs (float32 except on Intel, bf16 with oneDNN's bf16)
needs_packing = pytest.mark.skipif(not PACKED, reason="this CPU packs no dtype")


def members(dtype: torch.dtype, biases: tuple[bool, ...] = (False, False, True)) -> list[nn.Linear]:
    torch.manual_seed(0)
    sizes = (64, 16, 24)
    return [nn.Linear(32, size, bias=bias).to(dtype) for size, bias in zip(sizes, biases)]


def run_group(layers: list[nn.Linear], x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return linear_groups.packed_linear_group(x, [m.weight for m in layers], [m.bias for m in layers])


def want(layers: list[nn.Linear], x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([F.linear(x, m.weight, m.bias) for m in layers], dim=-1)


def assert_matmul_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """One matmul against one per member: fp32 sums of 32 products of order-1 terms, reordered,
    differ by ~1e-6, so fp32 is held to 1e-5; in bf16 those sums are each rounded once to bf16
    (8 significant bits) and may land one bf16 step apart: relative 2^-7."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-5)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def group_hits(monkeypatch) -> list[bool]:
    """Records, for every call of the group op, whether it ran on a group copy."""
    hits: list[bool] = []
    real = linear_groups._group_copy

    def group_copy(weights, biases):  # noqa: ANN001, ANN202
        found = real(weights, biases)
        hits.append(found is not None)
        return found

    monkeypatch.setattr(linear_groups, "_group_copy", group_copy)
    return hits


@needs_packing
@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.parametrize("biases", [(False, False, False), (False, False, True), (True, True, True)])
def test_the_group_op_equals_its_members_f_linear(dtype, biases, group_hits) -> None:
    layers = members(dtype, biases)
    for layer in layers:
        packed_linear.pack(layer)
    x = torch.randn(1, 5, 32, dtype=dtype)
    got = run_group(layers, x)
    assert got.shape == (1, 5, 64 + 16 + 24)
    assert_matmul_close(got, want(layers, x))
    assert group_hits == [True]
    # the graph multiplies by the group's copy from now on: the members' single copies are gone
    assert not any(id(m.weight) in packed_linear._PACKED for m in layers)


@needs_packing
def test_a_changed_member_never_uses_the_group_copy(group_hits) -> None:
    layers = members(PACKED[0])
    for layer in layers:
        packed_linear.pack(layer)
    x = torch.randn(3, 32, dtype=PACKED[0])
    run_group(layers, x)
    with torch.no_grad():
        layers[1].weight.mul_(3.0)  # in place, as an optimizer step: the group copy is stale
    assert_matmul_close(run_group(layers, x), want(layers, x))
    layers[2].bias = nn.Parameter(torch.ones_like(layers[2].bias))  # a replaced bias, likewise
    assert_matmul_close(run_group(layers, x), want(layers, x))
    assert group_hits == [True, False, False]


@needs_packing
def test_the_quick_path_serves_only_the_very_weights_grouped_unchanged(group_hits) -> None:
    """Members without biases: after the first call finds their group, later calls with the same weight objects
    skip ``_group_copy`` (``_quick``); a member changed in place or replaced goes back to it and to F.linear."""
    layers = members(PACKED[0], (False, False, False))
    for layer in layers:
        packed_linear.pack(layer)
    x = torch.randn(3, 32, dtype=PACKED[0])
    first = run_group(layers, x)
    assert group_hits == [True] and linear_groups._BY_FIRST[id(layers[0].weight)] is not None
    assert torch.equal(run_group(layers, x), first) and group_hits == [True]  # served without _group_copy
    with torch.no_grad():
        layers[2].weight.mul_(3.0)  # in place: its version moves
    assert_matmul_close(run_group(layers, x), want(layers, x))
    assert group_hits == [True, False]
    layers = members(PACKED[0], (False, False, False))
    for layer in layers:
        packed_linear.pack(layer)
    run_group(layers, x)
    entry = linear_groups._BY_FIRST[id(layers[0].weight)]
    layers[1].weight = nn.Parameter(layers[1].weight.detach() * 2)  # replaced: another object
    assert_matmul_close(run_group(layers, x), want(layers, x))
    assert group_hits == [True, False, True, False]
    del layers
    gc.collect()  # a freed member drops its group, from both tables
    assert all(found is not entry for found in linear_groups._BY_FIRST.values())


@needs_packing
def test_unpacked_members_are_not_grouped_and_a_freed_weight_drops_its_group(group_hits) -> None:
    layers = members(PACKED[0])
    x = torch.randn(3, 32, dtype=PACKED[0])
    assert_matmul_close(run_group(layers, x), want(layers, x))
    key = tuple(id(m.weight) for m in layers)
    # packing did not take them: no copy made here (an earlier test's model may still hold its groups)
    assert group_hits == [False] and key not in linear_groups._GROUPS
    for layer in layers:
        packed_linear.pack(layer)
    run_group(layers, x)
    assert key in linear_groups._GROUPS
    del layers
    gc.collect()
    assert key not in linear_groups._GROUPS


class Block(nn.Module):
    """Three projections of one input (one of them viewed as heads), and one of another."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.q, self.k, self.v = members(dtype)
        self.o = nn.Linear(104, 32).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(*x.shape[:-1], 4, 16)
        return self.o(torch.cat([q.flatten(-2) * 2, self.k(x), self.v(x).relu()], -1))


@needs_packing
def test_the_pass_groups_the_packed_linears_that_share_an_input(group_hits) -> None:
    torch._dynamo.reset()
    model = Block(PACKED[0]).eval()
    assert packed_linear.pack(model) == 4

    def forward(x: torch.Tensor) -> torch.Tensor:
        with packed_linear.RoutePackedLinears():
            return model(x)

    graph = torch.compile(forward, dynamic=True)
    with torch.inference_mode(), torch._inductor.config.patch(compiled.inductor_options()):
        for rows in (5, 9):
            x = torch.randn(1, rows, 32, dtype=PACKED[0])
            assert_matmul_close(graph(x), model(x))
    # q, k and v share x: one group op a call; o reads another input and stays alone
    assert group_hits == [True, True]


@needs_packing
@pytest.mark.parametrize("dtype", PACKED)
def test_compiled_engine_with_groups_equals_sdpa(llama_dir, dtype, monkeypatch) -> None:
    ref, paged = load_pair(llama_dir, dtype=dtype)
    prompts = ragged_prompts(4, 3, 30, seed=9)
    expected = [reference_greedy(ref, p, 10) for p in prompts]
    with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, compile=True, fp32_matmuls=False)) as engine:
        inner = getattr(engine.executor, "inner", engine.executor)  # under adaptive threads with >1 thread
        assert isinstance(inner, CompiledExecutor) and inner.compiled.pack
        assert engine.executor.wait(timeout=600) and engine.executor.failed is None
        got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=10)]
        assert engine.executor.num_compiled_steps > 5
    # q/k/v and gate/up of every layer run as groups
    weights = {id(w) for w in packed_linear._weights(paged)}
    groups = [key for key in linear_groups._GROUPS if set(key) <= weights]
    assert sorted(map(len, groups)) == [2] * paged.config.num_hidden_layers + [3] * paged.config.num_hidden_layers
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert not compare_greedy(ref, prompts, expected, got, tie_tolerance=tolerance)
