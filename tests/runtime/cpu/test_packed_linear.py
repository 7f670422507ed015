"""bf16 linears on oneDNN-packed weights in the compiled forward (``hf_paged_attn/runtime/cpu/packed_linear.py``):
the op equals ``F.linear``, never computes with a stale copy, the mode routes a compiled forward's linears
to it (and only a compiled one's), and the compiled bf16 engine keeps greedy parity with sdpa."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu import linear_groups, packed_linear
from hf_paged_attn.runtime.cpu.compiled import CompiledExecutor
from hf_paged_attn_tools.testing import compare_greedy, load_pair, ragged_prompts, reference_greedy

from .test_fp32_matmuls import fused_bf16_tie

BF16 = torch.bfloat16
needs_onednn_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 matmul on this CPU"
)


def linear(out_features: int = 48, in_features: int = 64, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(BF16)


@pytest.fixture
def counted(monkeypatch) -> list[bool]:
    """Records, for every call of the op, whether it found a packed copy."""
    hits: list[bool] = []
    real = packed_linear._lookup

    def lookup(weight: torch.Tensor) -> torch.Tensor | None:
        found = real(weight)
        hits.append(found is not None)
        return found

    monkeypatch.setattr(packed_linear, "_lookup", lookup)
    return hits


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (1, 7, 64)])
def test_the_op_equals_f_linear(shape, bias, counted) -> None:
    layer = linear(bias=bias)
    assert packed_linear.pack(layer) == 1
    x = torch.randn(*shape, dtype=BF16)
    with torch.inference_mode():
        got = packed_linear.packed_linear(x, layer.weight, layer.bias)
        want = F.linear(x, layer.weight, layer.bias)
    assert counted == [True]  # the packed copy ran
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


@needs_onednn_bf16
def test_a_changed_or_other_weight_never_uses_the_copy(counted) -> None:
    square = linear(64, 64)
    assert packed_linear.pack(square) == 1
    x = torch.randn(3, 64, dtype=BF16)
    with torch.inference_mode():
        # the transpose shares the pointer and the shape of the packed weight: only its strides differ
        torch.testing.assert_close(packed_linear.packed_linear(x, square.weight.t(), None), x @ square.weight)
        other = linear(64, 64, seed=1)
        torch.testing.assert_close(packed_linear.packed_linear(x, other.weight, None), F.linear(x, other.weight))
    with torch.no_grad():
        square.weight.mul_(3.0)  # in place, as an optimizer step: the copy is stale
    with torch.inference_mode():
        got = packed_linear.packed_linear(x, square.weight, square.bias)
        torch.testing.assert_close(got, F.linear(x, square.weight, square.bias))
    assert counted == [False, False, False]
    assert packed_linear.pack(square) == 1  # packed again, from the new values
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear.packed_linear(x, square.weight, square.bias),
                                   F.linear(x, square.weight, square.bias))  # fmt: skip
    assert counted[-1] is True


@pytest.mark.skipif(not packed_linear.DTYPES, reason="this CPU packs no dtype")
def test_the_quick_check_takes_only_the_very_tensor_packed_unchanged(monkeypatch) -> None:
    """The op's usual call (the weight object packed, at its version then) skips ``_holds``; a view sharing its
    pointer, a weight changed in place or one replaced goes through ``_holds`` and never uses the copy."""
    dtype = packed_linear.DTYPES[0]  # float32 on this project's AMD machines, bf16 on Intel ones with AMX
    torch.manual_seed(0)
    square = nn.Linear(64, 64, bias=False).to(dtype)
    assert packed_linear.pack(square) == 1
    checked: list[bool] = []
    real = packed_linear._holds
    monkeypatch.setattr(packed_linear, "_holds", lambda entry, w: checked.append(real(entry, w)) or checked[-1])
    x = torch.randn(3, 64, dtype=dtype)
    with torch.inference_mode():
        assert packed_linear._lookup(square.weight) is not None and checked == []  # quick: no _holds
        assert packed_linear._lookup(square.weight.t()) is None and checked == [False]  # same pointer, a view
        torch.testing.assert_close(packed_linear.packed_linear(x, square.weight, None), F.linear(x, square.weight))
    with torch.no_grad():
        square.weight.mul_(3.0)  # in place: the version moves, the copy is stale
    with torch.inference_mode():
        assert packed_linear._lookup(square.weight) is None and checked == [False, False]
        torch.testing.assert_close(packed_linear.packed_linear(x, square.weight, None), F.linear(x, square.weight))



@pytest.mark.skipif(not packed_linear.DTYPES, reason="this CPU packs no dtype")
def test_a_parameter_given_new_data_never_uses_the_old_copy() -> None:
    """``p.data = new`` (DeepSpeed's gathers, ``load_state_dict(assign=True)`` do it) keeps the parameter
    object and its version counter's reading, and moves its storage: the copy of the old storage is stale."""
    dtype = packed_linear.DTYPES[0]
    layer = nn.Linear(64, 64).to(dtype)
    assert packed_linear.pack(layer) == 1
    old = layer.weight.detach().clone()
    with torch.no_grad():
        layer.weight.data = torch.randn_like(old)
    x = torch.randn(3, 64, dtype=dtype)
    with torch.inference_mode():
        assert packed_linear._lookup(layer.weight) is None
        torch.testing.assert_close(packed_linear.packed_linear(x, layer.weight, None), F.linear(x, layer.weight))

@needs_onednn_bf16
def test_a_freed_weight_drops_its_copy() -> None:
    layer = linear()
    packed_linear.pack(layer)
    ptr = id(layer.weight)
    assert ptr in packed_linear._PACKED
    del layer
    gc.collect()
    assert ptr not in packed_linear._PACKED


@needs_onednn_bf16
def test_the_mode_routes_only_a_compiled_forwards_bf16_linears(counted, monkeypatch) -> None:
    monkeypatch.setattr(packed_linear, "DTYPES", (BF16,))  # as on an Intel CPU
    model = nn.Sequential(linear(96, 64), nn.SiLU(), linear(64, 96, bias=False, seed=2)).eval()
    fp32 = nn.Linear(64, 8)  # not a packed dtype: never routed
    assert packed_linear.pack(model) == 2

    def forward(x: torch.Tensor) -> torch.Tensor:
        with packed_linear.RoutePackedLinears():
            return model(x), fp32(x.float())

    compiled = torch.compile(forward)
    with torch.inference_mode():
        x = torch.randn(6, 64, dtype=BF16)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        got, small = compiled(x)
        want = model(x)  # eager, outside the mode: F.linear as ever
    assert counted == [True, True]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(small, fp32(x.float()))
    with torch.inference_mode():
        compiled(torch.randn(9, 64, dtype=BF16))  # another size: the same dynamic graph, the copies again
    assert counted == [True] * 4


def test_wanted_follows_the_hardware_and_the_freezing() -> None:
    model = nn.Sequential(linear())
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packed_linear.wanted(model, freezing=False) is supported
    assert packed_linear.wanted(model, freezing=True) is False  # inductor packs frozen weights itself
    fp32 = nn.Sequential(nn.Linear(4, 4))  # packed except on Intel CPUs
    assert packed_linear.wanted(fp32, freezing=False) is (torch.float32 in packed_linear.DTYPES)
    assert packed_linear.wanted(nn.Sequential(nn.ReLU()), freezing=False) is False  # no linear: nothing to pack


def test_float32_is_packed_except_on_intel_cpus() -> None:
    bf16 = () if fp32_matmuls_lack_bf16() else (BF16,)
    assert packed_linear.packed_dtypes("GenuineIntel") == bf16
    assert packed_linear.packed_dtypes("AuthenticAMD") == (torch.float32, *bf16)
    assert packed_linear.packed_dtypes("") == (torch.float32, *bf16)


def fp32_matmuls_lack_bf16() -> bool:
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


@needs_onednn_bf16
def test_layers_with_float32_copies_pack_their_copies(monkeypatch, counted) -> None:
    from hf_paged_attn.runtime.cpu import fp32_matmuls

    model = nn.Sequential(linear(), linear(seed=1))
    fp32_matmuls.install(model[0])  # multiplies by its float32 copies: a packed bf16 copy would go unused
    copy = model[0].__dict__[fp32_matmuls.ATTR].weight
    monkeypatch.setattr(packed_linear, "DTYPES", (BF16,))  # as on an Intel CPU: float32 is not packed
    assert packed_linear._weights(model) == [model[1].weight]
    monkeypatch.setattr(packed_linear, "DTYPES", (torch.float32, BF16))  # elsewhere: the copy is
    assert packed_linear._weights(model) == [copy, model[1].weight]
    assert packed_linear.pack(model) == 2
    x = torch.randn(3, 64, dtype=BF16)
    with torch.inference_mode(), packed_linear.RoutePackedLinears():  # the copies' F.linear, routed
        got = model[0](x)
    assert counted == [True]
    torch.testing.assert_close(got, F.linear(x.float(), copy, model[0].__dict__[fp32_matmuls.ATTR].bias).to(BF16))


@needs_onednn_bf16
def test_copies_that_would_not_fit_are_not_made(monkeypatch, caplog) -> None:
    layer = linear()
    bytes_needed = layer.weight.numel() * 2
    monkeypatch.setattr(packed_linear, "_available_bytes", lambda: 4 * bytes_needed - 1)
    assert not packed_linear._fits([layer.weight])
    assert packed_linear.pack(layer) == 0
    assert "quarter of the available memory" in caplog.text
    monkeypatch.setattr(packed_linear, "_available_bytes", lambda: 4 * bytes_needed)
    assert packed_linear.pack(layer) == 1


@needs_onednn_bf16
def test_compiled_bf16_engine_runs_packed_linears_and_equals_sdpa(llama_dir, counted, monkeypatch) -> None:
    ref, paged = load_pair(llama_dir, dtype=BF16)
    prompts = ragged_prompts(4, 3, 30, seed=8)
    expected = [reference_greedy(ref, p, 10) for p in prompts]
    config = PagedConfig(num_blocks=64, compile=True, fp32_matmuls=False)
    with ContinuousBatchingEngine(paged, config) as engine:
        inner = getattr(engine.executor, "inner", engine.executor)  # under adaptive threads with >1 thread
        assert isinstance(inner, CompiledExecutor) and inner.compiled.pack
        assert inner.compiled.options["cpp_wrapper"]  # a half-precision graph calls its kernels from C++
        assert engine.executor.wait(timeout=600) and engine.executor.failed is None
        counted.clear()
        got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=10)]
        assert engine.executor.num_compiled_steps > 5
    # o_proj and down_proj of every layer and the LM head on their packed copies (q/k/v and gate/up run as
    # groups: tests/runtime/cpu/test_linear_groups.py)
    per_step = 2 * paged.config.num_hidden_layers + 1
    assert sum(counted) >= per_step * engine.executor.num_compiled_steps and all(counted)
    assert not compare_greedy(ref, prompts, expected, got, tie_tolerance=fused_bf16_tie(ref, prompts))
    with torch.no_grad():
        paged.lm_head.weight.mul_(2.0)  # training between generations: the graph retires, the copies go
    with ContinuousBatchingEngine(paged, config) as engine:
        engine.generate(prompts[:1], max_new_tokens=2)
        assert "weights changed" in engine.executor.failed
    ptrs = {id(w) for w in packed_linear._weights(paged)}
    assert not ptrs.intersection(packed_linear._PACKED)
    assert not any(ptrs.intersection(key) for key in linear_groups._GROUPS)


def test_eager_steps_before_the_graph_run_on_the_compiles_copies(llama_dir, counted, monkeypatch) -> None:
    """Until the graph is ready an engine steps eagerly; once the compile has made packed float32 copies
    (``CompiledModel.packed``) those steps multiply by them too (``EAGER_DTYPES``), and their tokens stay sdpa's."""
    from hf_paged_attn.runtime.cpu import compiled as compiled_module

    monkeypatch.setattr(packed_linear, "DTYPES", (torch.float32,))  # as on the AMD CPUs it packs float32 on
    monkeypatch.setattr(compiled_module, "COMPILE_AFTER_STEPS", 10**9)  # no compile: the steps stay eager
    ref, paged = load_pair(llama_dir)
    prompts = ragged_prompts(4, 3, 30, seed=9)
    expected = [reference_greedy(ref, p, 8) for p in prompts]
    with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, compile=True, adaptive_threads=False)) as engine:
        inner = engine.executor
        assert isinstance(inner, CompiledExecutor) and inner.compiled.pack
        engine.generate(prompts[:1], max_new_tokens=2)  # no copies yet: F.linear, not the op
        assert counted == []
        assert packed_linear.pack(paged) > 0  # what the compile's start does, then
        assert packed_linear.holds_copies(paged, packed_linear.EAGER_DTYPES)
        inner.compiled.packed.set()
        got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=8)]
        assert not inner.graph_ready and inner.num_compiled_steps == 0
    # every linear of every eager step: q/k/v/o, gate/up/down of each layer and the LM head, all on their copies
    per_step = 7 * paged.config.num_hidden_layers + 1
    assert len(counted) >= per_step * 8 and all(counted)
    assert not compare_greedy(ref, prompts, expected, got)
    packed_linear.unpack(paged)


@needs_onednn_bf16
def test_an_eager_route_of_float32_leaves_bf16_linears_to_f_linear(counted, monkeypatch) -> None:
    monkeypatch.setattr(packed_linear, "DTYPES", (torch.float32, BF16))
    half, full = linear(32, 64), nn.Linear(64, 16)
    assert packed_linear.pack(nn.Sequential(half, full)) == 2
    x = torch.randn(3, 64)
    with torch.inference_mode(), packed_linear.RoutePackedLinears(packed_linear.EAGER_DTYPES):
        half(x.to(BF16))  # bf16: F.linear itself, not the op
        full(x)
    assert counted == [True]  # one call of the op: the float32 layer's, on its copy
