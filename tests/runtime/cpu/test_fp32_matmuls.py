"""Half-precision linears in float32 (``hf_paged_attn/runtime/cpu/fp32_matmuls.py``): the rounding of a bf16
matmul (checked against a float64 reference), only under inference mode (training reaches the real
parameter), a changed weight copied again, other forwards left alone, the config switch, and greedy
parity of an engine that uses them with sdpa in bf16."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu import fp32_matmuls
from hf_paged_attn_tools.testing import compare_greedy, load_pair, ragged_prompts, reference_greedy


def same_arithmetic_greedy(ref: nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    """sdpa's greedy tokens with the engine's float32 linears: the same arithmetic up to the order
    of fp32 sums, so greedy parity holds to the usual 1e-4 near-tie."""
    fp32_matmuls.install(ref)
    try:
        with torch.inference_mode():  # where the copies are used
            return [reference_greedy(ref, p, new) for p in prompts]
    finally:
        fp32_matmuls.uninstall(ref)


def fused_bf16_tie(ref: nn.Module, prompts: list[list[int]]) -> float:
    """The near-tie for a compiled bf16 forward against eager sdpa: inductor keeps a fused kernel's
    intermediates (norms, residual adds, activations) in fp32 where eager rounds every op's output
    to bf16 (relative 2^-9 each), and the logits, bf16 themselves, move by that much: two bf16 steps
    of the largest logit. Below 4 here (asserted), a step is 2^-6: the tie is 2^-5 = 0.031."""
    with torch.no_grad():
        top = max(float(ref(torch.tensor([p])).logits.abs().max()) for p in prompts)
    assert top < 4, top
    return 2 * 2.0 ** (math.floor(math.log2(top)) - 7)


CPU = torch.device("cpu")


def layer(bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(96, 48, bias=bias).to(torch.bfloat16)


def reference(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 sums of the bf16 products, rounded to bf16 once: what a bf16 matmul computes."""
    out = x.double() @ lin.weight.double().T
    if lin.bias is not None:
        out = out + lin.bias.double()
    return out.to(torch.bfloat16)


def assert_rounded(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` is at most one bf16 step from ``want`` (the exactly rounded result) everywhere."""
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-3)
    assert ((got.float() - want.float()).abs() <= ulp).all()


@pytest.mark.parametrize("bias", [True, False])
def test_rounding_is_a_bf16_matmuls(bias: bool) -> None:
    lin = layer(bias)
    x = torch.randn(5, 7, 96).to(torch.bfloat16)  # [batch, rows, in]
    assert fp32_matmuls.install(lin) == 1 and fp32_matmuls.installed(lin) == 1
    with torch.inference_mode():
        got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 7, 48)
    want = reference(lin, x)
    assert_rounded(got, want)
    assert (got == want).float().mean() > 0.97  # and exactly rounded nearly everywhere


def test_autograd_reaches_the_parameter_and_grad_mode_runs_the_layers_own_forward() -> None:
    lin = layer()
    fp32_matmuls.install(lin)
    x = torch.randn(3, 96).to(torch.bfloat16)
    lin(x).float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    with torch.no_grad():  # not inference mode: the layer's own (bf16) forward, bit for bit
        assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))


def test_a_changed_weight_is_copied_again() -> None:
    lin = layer()
    fp32_matmuls.install(lin)
    x = torch.randn(4, 96).to(torch.bfloat16)
    with torch.inference_mode():
        before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)  # in place: the version counter moves
    with torch.inference_mode():
        after = lin(x)
    assert not torch.equal(before, after)
    assert_rounded(after, reference(lin, x))
    lin.weight = nn.Parameter(torch.zeros_like(lin.weight))  # replaced: the data pointer moves
    with torch.inference_mode():
        assert torch.equal(lin(x), lin.bias.expand(4, 48))
    with torch.no_grad():
        lin.bias.add_(100)  # the bias alone changes
    with torch.inference_mode():
        assert torch.equal(lin(x), lin.bias.expand(4, 48))


def test_wrong_input_dtype_still_raises_and_uninstall_restores_the_layer() -> None:
    lin = layer()
    fp32_matmuls.install(lin)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        lin(torch.randn(2, 96))  # float32 into a bf16 layer: the layer's own error, as without copies
    assert fp32_matmuls.uninstall(lin) == 1 and fp32_matmuls.installed(lin) == 0
    assert "forward" not in lin.__dict__ and fp32_matmuls.ATTR not in lin.__dict__


def test_a_model_with_copies_pickles() -> None:
    import pickle

    lin = layer()
    fp32_matmuls.install(lin)
    x = torch.randn(3, 96).to(torch.bfloat16)
    back = pickle.loads(pickle.dumps(lin))
    with torch.inference_mode():
        assert torch.equal(back(x), lin(x))
    assert fp32_matmuls.installed(back) == 1


class Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_only_plain_half_precision_cpu_layers_without_a_forward_of_their_own() -> None:
    model = nn.Sequential(layer(), nn.Linear(4, 4), layer(seed=1), Doubled(96, 8).to(torch.bfloat16))
    model[2].forward = lambda x: x  # e.g. accelerate's hook
    assert fp32_matmuls.install(model) == 1  # not the float32 layer, the hooked one, nor the subclass
    assert fp32_matmuls.ATTR in model[0].__dict__ and fp32_matmuls.ATTR not in model[1].__dict__
    assert fp32_matmuls.install(model) == 1  # idempotent


def test_config_switch() -> None:
    with pytest.raises(ValueError, match=r"PagedConfig.fp32_matmuls must be None or a bool, got 'yes'"):
        PagedConfig(fp32_matmuls="yes")
    with pytest.raises(ValueError, match=r"fp32_matmuls=True is for models on the CPU; the model is on cuda"):
        PagedConfig(kernel="torch", fp32_matmuls=True).resolved(torch.device("cuda"), torch.bfloat16)
    assert PagedConfig(kernel="torch").resolved(torch.device("cuda"), torch.bfloat16).fp32_matmuls is False
    assert PagedConfig(fp32_matmuls=True).resolved(CPU, torch.float32).fp32_matmuls is False  # nothing to do
    assert PagedConfig(fp32_matmuls=True).resolved(CPU, torch.bfloat16).fp32_matmuls is True
    assert PagedConfig(fp32_matmuls=False).resolved(CPU, torch.bfloat16).fp32_matmuls is False
    lacks = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert PagedConfig().resolved(CPU, torch.bfloat16).fp32_matmuls is lacks


def test_engine_greedy_equals_sdpa_in_bf16(llama_dir) -> None:
    ref, paged = load_pair(llama_dir, dtype=torch.bfloat16)
    prompts = ragged_prompts(4, 3, 30, seed=5)
    expected = same_arithmetic_greedy(ref, prompts, 10)
    config = PagedConfig(num_blocks=64, compile=False, fp32_matmuls=True)
    with ContinuousBatchingEngine(paged, config) as engine:
        assert engine.config.fp32_matmuls is True
        got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=10)]
        assert fp32_matmuls.installed(paged) > 0
    assert fp32_matmuls.installed(paged) == 0  # the engine's marks: off the model once it is closed
    assert not compare_greedy(ref, prompts, expected, got)


def test_compiled_engine_takes_the_copies_in_one_graph(llama_dir) -> None:
    """The compiled forward traces the float32 linears without a graph break (one graph) and keeps
    greedy parity with sdpa in bf16."""
    from hf_paged_attn.runtime.cpu.compiled import CompiledExecutor

    ref, paged = load_pair(llama_dir, dtype=torch.bfloat16)
    prompts = ragged_prompts(4, 3, 30, seed=6)
    expected = same_arithmetic_greedy(ref, prompts, 10)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, compile=True, fp32_matmuls=True)) as engine:
        inner = getattr(engine.executor, "inner", engine.executor)  # under adaptive threads with >1 thread
        assert isinstance(inner, CompiledExecutor)
        assert engine.executor.wait(timeout=600) and engine.executor.failed is None
        got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=10)]
        assert engine.executor.num_compiled_steps > 5
    # one graph (no break), whatever thread counts the steps run with (``compiled.STEP_THREADS``)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    assert not compare_greedy(ref, prompts, expected, got, tie_tolerance=fused_bf16_tie(ref, prompts))


def test_a_draft_model_follows_its_target(llama_dir) -> None:
    """A draft model of a target with float32 linears gets them too, and speculation keeps the
    engine's own greedy output."""
    from hf_paged_attn import SpeculativeConfig

    _, target = load_pair(llama_dir, dtype=torch.bfloat16)
    _, draft = load_pair(llama_dir, dtype=torch.bfloat16)
    prompts = ragged_prompts(3, 4, 20, seed=7)
    plain = PagedConfig(num_blocks=64, compile=False, fp32_matmuls=True)
    with ContinuousBatchingEngine(target, plain) as engine:
        expected = [o.output_ids for o in engine.generate(prompts, max_new_tokens=8)]
    config = plain.replace(speculative=SpeculativeConfig(draft_model=draft, num_speculative_tokens=2, adaptive=False))
    with ContinuousBatchingEngine(target, config) as engine:
        got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=8)]
        assert fp32_matmuls.installed(draft) == fp32_matmuls.installed(target) > 0
    assert fp32_matmuls.installed(draft) == fp32_matmuls.installed(target) == 0  # both left as found
    assert got == expected
