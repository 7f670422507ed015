"""The compiled forward (``hf_paged_attn/runtime/cpu/compiled.py``): greedy parity with sdpa ``generate``,
one compile per model across engines, eager steps while it compiles, eager fallback on a failed
compile, harmless padding rows and the ``PagedConfig.compile`` switch.

Compiling is slow on a small CPU (~15-40 s for the tiny Llama), so one module-scoped model compiles
once and the tests that need a compiled graph share it; the demo model's parity is ``slow``.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.attention.function import LAYER_INDEX
from hf_paged_attn.integration.register import patch
from hf_paged_attn.runtime.cpu import attention as cpu_attention
from hf_paged_attn.runtime.cpu import compiled as compiled_module
from hf_paged_attn.runtime.cpu.compiled import CompiledExecutor
from hf_paged_attn.runtime.executor import LocalExecutor
from hf_paged_attn_tools.testing import (
    compare_greedy,
    load_pair,
    ragged_prompts,
    reference_greedy,
    save_random_model,
    tiny_llama_config,
)

CPU = torch.device("cpu")
ON = PagedConfig(num_blocks=64, compile=True)


@pytest.fixture(scope="module")
def pair(llama_dir):
    """(sdpa model, paged model) of the tiny Llama; the paged one compiles once for the module."""
    return load_pair(llama_dir)


def greedy(ref: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [reference_greedy(ref, p, new) for p in prompts]


def run(engine: ContinuousBatchingEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [o.output_ids for o in engine.generate(prompts, max_new_tokens=new)]


def test_config_switch_validates(monkeypatch) -> None:
    for bad in ("yes", 1, "Startup"):
        with pytest.raises(ValueError, match=r"PagedConfig.compile must be None, a bool or 'startup'"):
            PagedConfig(compile=bad)
    with pytest.raises(ValueError, match=r"compile=True is for models on the CPU"):
        PagedConfig(kernel="torch", compile=True).resolved(torch.device("cuda"))
    with pytest.raises(ValueError, match=r"compile='startup' is for models on the CPU"):
        PagedConfig(kernel="torch", compile="startup").resolved(torch.device("cuda"))
    assert PagedConfig(compile="startup").resolved(CPU).compile == "startup"
    assert PagedConfig(kernel="torch").resolved(torch.device("cuda")).compile is False
    assert PagedConfig(compile=False).resolved(CPU).compile is False
    assert PagedConfig(compile=True).resolved(CPU).compile is True
    monkeypatch.setattr("hf_paged_attn.runtime.config.COMPILE_BY_DEFAULT", False)
    assert PagedConfig().resolved(CPU).compile is False
    monkeypatch.setattr("hf_paged_attn.runtime.config.COMPILE_BY_DEFAULT", True)
    monkeypatch.setattr("hf_paged_attn.runtime.config.cpp_compiler", lambda: "/usr/bin/c++")
    assert PagedConfig().resolved(CPU).compile is True
    monkeypatch.setattr("hf_paged_attn.runtime.config.cpp_compiler", lambda: None)
    assert PagedConfig().resolved(CPU).compile is False  # no C++ compiler: inductor can't build


def test_launcher_chooses_the_compiled_executor(pair) -> None:
    _, paged = pair
    assert ON.for_model(paged).compile
    assert not ON.replace(compile=False).for_model(paged).compile
    with pytest.MonkeyPatch.context() as m:
        m.setattr(paged, "hf_device_map", {"model": "cpu", "lm_head": "disk"}, raising=False)
        assert not ON.for_model(paged).compile  # weights on disk: eager
    with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, compile=False, adaptive_threads=False)) as engine:
        assert type(engine.executor) is LocalExecutor


def test_compiled_greedy_equals_sdpa_and_a_second_engine_does_not_recompile(pair) -> None:
    """Ragged prompts (prefill, mixed and decode steps of many sizes) through the one dynamic graph,
    eagerly until it is ready; a second engine on the model reuses it."""
    ref, paged = pair
    prompts = ragged_prompts(5, 3, 40, seed=3)
    expected = greedy(ref, prompts, 12)
    with ContinuousBatchingEngine(paged, ON) as engine:
        executor = getattr(engine.executor, "inner", engine.executor)  # under adaptive threads with >1 thread
        assert isinstance(executor, CompiledExecutor)
        early = run(engine, prompts[:2], 3)  # the compile starts in the background: these run eagerly meanwhile
        assert executor.wait(timeout=600) and executor.failed is None
        got = run(engine, prompts, 12)
        assert executor.compiled.num_compiles == 1 and executor.num_compiled_steps > 5
    assert not compare_greedy(ref, prompts, expected, got)
    assert early == [e[:3] for e in expected[:2]]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with ContinuousBatchingEngine(paged, ON) as second:
        assert second.executor.compiled is executor.compiled and second.executor.wait(timeout=0)
        more = run(second, prompts, 12)
        assert second.executor.num_compiled_steps > 10
    assert executor.compiled.num_compiles == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no new graph anywhere
    assert not compare_greedy(ref, prompts, expected, more)


def test_padding_rows_never_change_real_rows(pair) -> None:
    """One request: every decode step is one token, padded to the graph's two rows. The padding row
    runs the whole model, yet the real row's tokens are sdpa's."""
    ref, paged = pair
    prompts = ragged_prompts(2, 5, 30, seed=5)
    expected = greedy(ref, prompts, 10)
    with ContinuousBatchingEngine(paged, ON) as engine:
        assert engine.executor.wait(timeout=600)
        got = [run(engine, [p], 10)[0] for p in prompts]
        assert engine.executor.num_padded_steps >= 18
    assert not compare_greedy(ref, prompts, expected, got)


def test_decode_steps_take_the_lean_path_and_equal_the_general_one(pair, monkeypatch) -> None:
    """A compiled decode step's layers run the native calls prepared once per step (``cpu_attention._lean_decode``),
    padded single-request steps included, and give sdpa's tokens, as the general path does with it off."""
    ref, paged = pair
    prompts = ragged_prompts(4, 3, 30, seed=7)
    expected = greedy(ref, prompts, 10)
    outs: list[torch.Tensor | None] = []
    real = cpu_attention._lean_decode
    monkeypatch.setattr(cpu_attention, "_lean_decode", lambda *args: outs.append(real(*args)) or outs[-1])
    with ContinuousBatchingEngine(paged, ON) as engine:
        assert engine.executor.wait(timeout=600)
        lean = run(engine, prompts, 10)
        single = run(engine, prompts[:1], 10)  # one request: every decode step padded to the graph's two rows
        taken = len(outs)
        monkeypatch.setattr(cpu_attention, "_lean_decode", lambda *args: None)  # every layer through the general path
        general = run(engine, prompts, 10)
    layers = paged.config.num_hidden_layers
    assert taken >= layers * (9 + 9) and all(out is not None for out in outs) and len(outs) == taken
    assert not compare_greedy(ref, prompts, expected, lean)
    assert general == lean and single == lean[:1]


def test_a_failed_compile_falls_back_to_eager(llama_dir, monkeypatch, caplog) -> None:
    ref, paged = load_pair(llama_dir)  # a fresh model: nothing compiled for it yet

    def broken(fn, **kwargs):
        def fail(*args, **kw):
            raise RuntimeError("injected compile failure")

        return fail

    monkeypatch.setattr(compiled_module.torch, "compile", broken)
    prompts = ragged_prompts(3, 3, 20, seed=7)
    expected = greedy(ref, prompts, 8)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        with ContinuousBatchingEngine(paged, ON) as engine:
            assert not engine.executor.wait(timeout=60)
            got = run(engine, prompts, 8)
            assert "injected compile failure" in engine.executor.failed
            assert engine.executor.num_compiled_steps == 0
    assert "steps run eagerly" in caplog.text
    assert not compare_greedy(ref, prompts, expected, got)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def test_decoder_layers_are_traced_once_and_stamped_out(tmp_path) -> None:
    """A model of a shape no other test compiles (so dynamo traces it here): its three decoder layers go
    through one nested compile region, traced for the first layer and stamped out for the other two
    (dynamo's own timings count each), the attention op takes each layer's index as a tensor (each layer
    reads its own cache), and the tokens equal sdpa's. Eagerly, the layers run their own forward."""
    directory = save_random_model(tiny_llama_config(num_hidden_layers=3, intermediate_size=96),
                                  tmp_path / "three-layers")  # fmt: skip
    ref, paged = load_pair(directory)
    prompts = ragged_prompts(4, 3, 24, seed=21)
    expected = greedy(ref, prompts, 10)
    metrics = torch._dynamo.utils.compilation_time_metrics
    traced = len(metrics.get("invoke_subgraph_trace", []))
    stamped = len(metrics.get("invoke_subgraph_reuse_stamp_out", []))
    with ContinuousBatchingEngine(paged, ON) as engine:
        compiled = getattr(engine.executor, "inner", engine.executor).compiled
        assert compiled.regions == _layers(paged)
        assert all("forward" in layer.__dict__ for layer in _layers(paged))
        assert [int(getattr(layer.self_attn, LAYER_INDEX)) for layer in _layers(paged)] == [0, 1, 2]
        assert engine.executor.wait(timeout=600) and engine.executor.failed is None
        got = run(engine, prompts, 10)
        assert engine.executor.num_compiled_steps > 5
    assert len(metrics.get("invoke_subgraph_trace", [])) - traced == 1
    assert len(metrics.get("invoke_subgraph_reuse_stamp_out", [])) - stamped == 2
    assert LAYER_INDEX not in paged.state_dict()  # not saved with the model
    assert not compare_greedy(ref, prompts, expected, got)


def test_a_compile_that_fails_with_regions_retries_without(tmp_path, monkeypatch, caplog) -> None:
    """A region dynamo can't take (here one with a graph break: the whole layer would run eagerly) costs the
    regions, not the compile: the layers get their own forwards back and the graph traces them whole."""

    def breaks(layer, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        torch._dynamo.graph_break()
        return compiled_module._region_body(layer, *args, **kwargs)

    monkeypatch.setattr(compiled_module, "_REGION", torch.compiler.nested_compile_region(breaks))
    directory = save_random_model(tiny_llama_config(intermediate_size=72),
                                  tmp_path / "refused")  # fmt: skip
    ref, paged = load_pair(directory)
    prompts = ragged_prompts(3, 3, 20, seed=22)
    expected = greedy(ref, prompts, 8)
    with caplog.at_level(logging.WARNING, logger=compiled_module.__name__):
        with ContinuousBatchingEngine(paged, ON) as engine:
            assert engine.executor.wait(timeout=600) and engine.executor.failed is None
            got = run(engine, prompts, 8)
            assert engine.executor.num_compiled_steps > 3
            assert getattr(engine.executor, "inner", engine.executor).compiled.regions == []
    assert "regions failed" in caplog.text and "compiling without" in caplog.text
    assert not any("forward" in layer.__dict__ for layer in _layers(paged))
    assert not compare_greedy(ref, prompts, expected, got)


def test_weights_changed_after_the_compile_run_eagerly(llama_dir) -> None:
    """An in-place weight update (as an optimizer step) after the compile: the frozen graph would
    use the old values, so the engine notices and runs eagerly, with the new weights."""
    ref, paged = load_pair(llama_dir)  # its own model: this one's compiled forward ends up retired
    prompts = ragged_prompts(3, 3, 20, seed=11)
    with ContinuousBatchingEngine(paged, ON) as engine:
        assert engine.executor.wait(timeout=600)
        before = run(engine, prompts, 8)
        assert engine.executor.num_compiled_steps > 0 and engine.executor.failed is None
    with torch.no_grad():
        for model in (paged, ref):
            model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    expected = greedy(ref, prompts, 8)
    with ContinuousBatchingEngine(paged, ON) as engine:  # a new engine: its prefix cache is empty
        got = run(engine, prompts, 8)
        assert "weights changed" in engine.executor.failed
    assert not compare_greedy(ref, prompts, expected, got)
    assert got != before  # the change is visible in the tokens, so the test can tell stale weights


@pytest.mark.slow
def test_compiled_demo_model_equals_sdpa(demo) -> None:
    tokenizer, paged, ref = demo
    prompts = [tokenizer(t)["input_ids"] for t in ("The cat sat on the", "Once upon a time, there", "A")]
    expected = greedy(ref, prompts, 16)
    with ContinuousBatchingEngine(paged, PagedConfig(compile=True)) as engine:
        assert engine.executor.wait(timeout=900)
        got = run(engine, prompts, 16)
        assert engine.executor.num_compiled_steps > 10
    assert not compare_greedy(ref, prompts, expected, got)


def test_eager_steps_wait_for_an_fx_trace_in_another_thread(llama_dir, monkeypatch) -> None:
    """torch.fx's tracer patches ``torch.nn.Module.__call__`` for the whole process while it traces
    (the background compile traces with it): an eager step in another thread then went through the
    tracer and failed its requests (``NameError: module is not installed as a submodule``, found by
    the soak). With the tracer holding the compile's lock (``register.py``'s ``fx_trace_lock`` patch,
``compiled.locked_trace``) the step waits for the trace and is correct."""
    import threading

    ref, paged = load_pair(llama_dir)
    monkeypatch.setattr(compiled_module.CompiledModel, "start", lambda self, *args: None)  # no real compile
    patch("fx_trace_lock")
    tracing, release = threading.Event(), threading.Event()

    class Traced(torch.nn.Module):  # a module whose trace lasts until the engine has tried a step
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

        def forward(self, x):  # noqa: ANN001, ANN201
            tracing.set()
            release.wait(timeout=2.0)
            return self.inner(x)

    prompts = ragged_prompts(3, 3, 20, seed=9)
    expected = greedy(ref, prompts, 6)
    with ContinuousBatchingEngine(paged, ON) as engine:
        engine.add_request(prompts[0], max_new_tokens=1)
        list(engine.stream())  # the first step (eager, observes the windows) before any trace
        tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(Traced(),), daemon=True)
        tracer.start()
        assert tracing.wait(timeout=10)
        threading.Timer(0.3, release.set).start()  # the step below must wait for the trace, not fail
        got = run(engine, prompts, 6)
        tracer.join(timeout=10)
    assert not compare_greedy(ref, prompts, expected, got)


def test_a_short_run_does_not_compile(llama_dir) -> None:
    _, paged = load_pair(llama_dir)  # a fresh model
    with ContinuousBatchingEngine(paged, ON) as engine:
        run(engine, ragged_prompts(2, 3, 9, seed=2), 8)  # 8 steps: fewer than COMPILE_AFTER_STEPS
        assert engine.executor.compiled.thread is None
        assert 0 < engine.executor.compiled.num_eager_steps < compiled_module.COMPILE_AFTER_STEPS


def test_compile_at_startup_serves_the_first_request_compiled(llama_dir) -> None:
    """``compile="startup"``: the engine compiles while it is made, its warm-up out of the statistics, so every
    step of its first request runs through the graph; tokens equal sdpa's."""
    ref, paged = load_pair(llama_dir)  # a fresh model: nothing compiled for it yet
    prompts = ragged_prompts(3, 3, 30, seed=5)
    expected = greedy(ref, prompts, 6)
    with ContinuousBatchingEngine(paged, ON.replace(compile="startup")) as engine:
        executor = getattr(engine.executor, "inner", engine.executor)
        assert executor.graph_ready and executor.compiled.num_compiles == 1
        assert engine.stats.num_steps == 0 and executor.num_compiled_steps == 0
        got = run(engine, prompts, 6)
        assert executor.num_compiled_steps == engine.stats.num_steps > 0  # the first step included
    assert not compare_greedy(ref, prompts, expected, got)


EXIT_SCRIPT = """
import sys, torch, hf_paged_attn
from transformers import AutoModelForCausalLM
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu.compiled import wait_compiled
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="paged").eval()
engine = ContinuousBatchingEngine(model, PagedConfig(num_blocks=32, compile=True))
engine.add_request([1, 2, 3], max_new_tokens=3)
print(len([o for o in engine.stream() if o.finished]))
assert not wait_compiled(model, timeout=2.0)  # the compile has started and runs (into inductor: ~10 s here)
"""


def test_exiting_while_the_compile_runs_exits_cleanly(llama_dir) -> None:
    """A process that ends while its model compiles in the background: exit status 0 (it was 134,
    'terminate called without an active exception', torch torn down under the compiling thread)."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, llama_dir], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "1"
    assert "for the model's background compile to end before exiting" in done.stderr
    assert "terminate called" not in done.stderr


def test_weights_stay_graph_inputs() -> None:
    """Unfrozen (``packed_linear`` packs them), so that inductor's disk cache can serve later processes; the
    graph pass computes only the sampled rows after the last attention, then groups the projections that share
    an input; the kernels read the thread count at run time; a half-precision graph calls them from C++; the
    generated Python checks no sizes at each call."""
    from torch._inductor.utils import run_and_get_code

    from hf_paged_attn.runtime.cpu import compiled, sampled_rows

    assert compiled.inductor_options() == {"freezing": False, "post_grad_custom_pre_pass": sampled_rows.SAMPLED_ROWS,
                                           "cpp.dynamic_threads": True, "cpp_wrapper": False,
                                           "size_asserts": False}  # fmt: skip
    assert compiled.inductor_options(torch.float32)["cpp_wrapper"] is False
    assert compiled.inductor_options(torch.bfloat16)["cpp_wrapper"] is True
    assert compiled.inductor_options(torch.float16)["cpp_wrapper"] is True

    def ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w).relu()

    def inductors(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # another code object: compiled on its own
        return torch.nn.functional.linear(x, w).relu()

    x, w = torch.randn(4, 8), torch.randn(6, 8)
    for f, options, asserts in ((ours, compiled.inductor_options(), False), (inductors, {}, True)):
        with torch._inductor.config.patch(options):
            out, (code, *_) = run_and_get_code(torch.compile(f), x, w)
        torch.testing.assert_close(out, f(x, w))
        assert ("assert_size_stride(" in code) is asserts


def test_compile_settings_only_where_a_call_may_compile(monkeypatch) -> None:
    """``run_graph`` patches the compile settings (inductor's options) around calls that may compile: before the
    graph is ready, and the retry of a step whose guards the ready graphs reject; not around a step that runs
    a graph that exists (the patch costs ~55 us a step)."""
    import contextlib
    import threading
    from types import SimpleNamespace

    active: list[bool] = [False]
    seen: list[bool] = []

    @contextlib.contextmanager
    def settings(options):  # noqa: ANN001, ANN202
        active[0] = True
        try:
            yield
        finally:
            active[0] = False

    monkeypatch.setattr(compiled_module.torch_private, "compile_settings", settings)
    rejects = [0]

    def forward(*args):  # noqa: ANN002, ANN202
        seen.append(active[0])
        if rejects[0]:
            rejects[0] -= 1
            raise RuntimeError("no graph matched (skip_guard_eval_unsafe)")
        return torch.zeros(2, 3)

    compiled = SimpleNamespace(ready=threading.Event(), options={}, threads=None, forward=forward)
    args = (compiled, None, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(2, dtype=torch.long))  # fmt: skip
    compiled_module.run_graph(*args)  # not ready: the call may compile
    compiled.ready.set()
    compiled_module.run_graph(*args)  # ready: a graph that exists
    rejects[0] = 1
    compiled_module.run_graph(*args)  # ready, guards reject: the retry compiles under the settings
    assert seen == [True, False, False, True]
