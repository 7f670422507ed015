"""A first compile in the background runs first in a child process at the lowest priority
(``hf_paged_attn/runtime/cpu/prewarm.py``): its graphs are the ones this process then loads from inductor's disk
cache (no graph compiled twice), the child gets only idle CPU, a model it can't rebuild compiles here as before,
a child that fails is logged and the compile still runs, and a process that exits stops its child."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu import compile_record, prewarm
from hf_paged_attn.runtime.cpu import compiled as compiled_module
from hf_paged_attn_tools.testing import compare_greedy, load_pair, ragged_prompts, reference_greedy


@pytest.fixture
def fresh_caches(tmp_path, monkeypatch):
    """An empty inductor cache and compile record of the test's own (the child inherits both through the
    environment); the child on, as outside the test suite."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("HF_PAGED_ATTN_CACHE", str(tmp_path / "records"))
    monkeypatch.setattr(prewarm, "ENABLED", True)
    return tmp_path


def test_the_background_compile_loads_the_graphs_its_child_compiled(fresh_caches, llama_dir, monkeypatch, caplog):
    """The engine's first compile: the child compiles the model rebuilt from its config, and the compile in this
    process finds every graph in inductor's cache (hits, no miss); the tokens after it equal sdpa's."""
    monkeypatch.setattr(compiled_module, "COMPILE_AFTER_STEPS", 2)
    ref, paged = load_pair(llama_dir)
    assert not compile_record.recorded(paged)
    prompts = ragged_prompts(3, 3, 20, seed=7)
    expected = [reference_greedy(ref, p, 6) for p in prompts]
    config = PagedConfig(num_blocks=64, compile=True)  # adaptive threads: steps at 1 and 2
    with ContinuousBatchingEngine(paged, config) as engine, caplog.at_level(logging.INFO, logger=prewarm.__name__):
        executor = getattr(engine.executor, "inner", engine.executor)  # under adaptive threads: the tuner's
        job = executor.child()
        assert job.qualname == "LlamaForCausalLM" and job.threads == torch.get_num_threads()
        torch._dynamo.utils.counters.clear()
        engine.generate(prompts, max_new_tokens=6)  # eager; the compile starts after its second step
        assert executor.compiled.ready.wait(timeout=600) and executor.compiled.failed is None
        assert "compiled in a child process" in caplog.text
        inductor = torch._dynamo.utils.counters["inductor"]
        assert inductor["fxgraph_cache_hit"] >= 1 and inductor["fxgraph_cache_miss"] == 0, dict(inductor)
        got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=6)]
        assert executor.num_compiled_steps > 0
    assert not compare_greedy(ref, prompts, expected, got)


def test_no_child_for_a_compile_at_start_up_or_a_model_it_cannot_rebuild(fresh_caches, llama_dir, monkeypatch):
    _, paged = load_pair(llama_dir)
    assert prewarm.job_for(paged, False, False, 2) is not None
    with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=16, compile="startup", adaptive_threads=False)) as e:
        assert e.executor.child is None  # it waits for its compile: nothing runs beside it
    monkeypatch.setattr(prewarm, "ENABLED", False)
    assert prewarm.job_for(paged, False, False, 2) is None
    monkeypatch.setattr(prewarm, "ENABLED", True)
    with torch._inductor.config.patch(force_disable_caches=True):  # the child's graphs would be lost
        assert prewarm.job_for(paged, False, False, 2) is None
    monkeypatch.setattr(prewarm, "MEMORY_SHARE", 1e-12)  # no room for a second copy
    assert prewarm.job_for(paged, False, False, 2) is None
    monkeypatch.setattr(prewarm, "MEMORY_SHARE", 0.25)
    paged.config.quantization_config = {"quant_method": "bitsandbytes"}
    assert prewarm.job_for(paged, False, False, 2) is None
    del paged.config.quantization_config

    class Local(type(paged)):  # a class the child can't import by name
        pass

    paged.__class__ = Local
    assert prewarm.job_for(paged, False, False, 2) is None


def test_a_failing_child_is_logged_and_run_says_so(fresh_caches, caplog) -> None:
    job = prewarm.Job("no_such_module_here", "Model", "{}", "float32", False, 1, False, False)
    with caplog.at_level(logging.WARNING, logger=prewarm.__name__):
        assert job.run(timeout=120) is False
    assert "failed (exit status 1)" in caplog.text and "no_such_module_here" in caplog.text


def test_the_child_runs_on_idle_time_only_then_at_nice_19() -> None:
    """``_LOWEST_PRIORITY`` (the child's first lines): SCHED_IDLE at nice 19; ``prewarm_child._share_after``: the
    normal policy, nice 19 kept."""
    probe = prewarm._LOWEST_PRIORITY + (
        "print(os.sched_getscheduler(0) == os.SCHED_IDLE, os.getpriority(os.PRIO_PROCESS, 0))\n"
        "from hf_paged_attn.runtime.cpu.prewarm_child import _share_after\n"
        "_share_after(0.0)\n"
        "print(os.sched_getscheduler(0) == os.SCHED_OTHER, os.getpriority(os.PRIO_PROCESS, 0))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # as ``Job.run`` passes it
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env,
                         check=True)  # fmt: skip
    assert out.stdout.split() == ["True", "19", "True", "19"], out.stdout + out.stderr


def test_stop_all_ends_a_running_child_at_once(fresh_caches, monkeypatch) -> None:
    monkeypatch.setattr(prewarm, "_BOOTSTRAP", "import time; time.sleep(120)")
    monkeypatch.setattr(prewarm, "_STOPPED", threading.Event())
    job = prewarm.Job("m", "M", "{}", "float32", False, 1, False, False)
    result: list[bool] = []
    runner = threading.Thread(target=lambda: result.append(job.run()))
    runner.start()
    deadline = time.monotonic() + 30
    while not prewarm._CHILDREN and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prewarm._CHILDREN
    start = time.monotonic()
    prewarm.stop_all()
    runner.join(timeout=30)
    assert not runner.is_alive() and result == [False] and time.monotonic() - start < 10
    assert not prewarm._CHILDREN


EXIT_SCRIPT = """
import sys, time, torch, hf_paged_attn
from transformers import AutoModelForCausalLM
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu import compiled, prewarm
compiled.COMPILE_AFTER_STEPS = 2
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="paged").eval()
engine = ContinuousBatchingEngine(model, PagedConfig(num_blocks=32, compile=True))
engine.generate([[1, 2, 3]], max_new_tokens=4)
deadline = time.monotonic() + 60
while not prewarm._CHILDREN and time.monotonic() < deadline:
    time.sleep(0.05)
print(*[child.pid for child in prewarm._CHILDREN])
"""


def test_a_process_that_exits_while_its_child_compiles_stops_the_child_at_once(fresh_caches, llama_dir) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, llama_dir], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 1, done.stdout + done.stderr[-2000:]
    assert time.monotonic() - start < 60  # not the child's compile (nor a wait for it) at exit
    assert "waiting" not in done.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # killed and reaped, not left running
