"""The worker half of ``vs_vllm.py``: one system's fresh process, run as a script under either interpreter
(ours, or vLLM's own venv), so it imports only the standard library at the top and what its system needs
inside.

    python vs_vllm_worker.py SYSTEM JOB.json RESULT.json      # SYSTEM: vllm, or ours (and its variants)

Ours measures two phases in one process, as a user meets them:

- ``start``: the engine made with the job's ``PagedConfig`` (by default the compile runs in the background
  once the model has run 64 steps), a warm-up pass, then ``reps`` timed passes: what a job timed right after
  its start sees while the compile shares the cores;
- ``compiled``: then the compile waited for (``CompiledExecutor.wait``, as ``wait_compiled``), a warm-up
  pass and ``reps`` timed passes: the speed after the compile (as ``compile="startup"`` gives from the first
  request).

vLLM compiles during its start-up (``LLM(...)``), then a warm-up pass and ``reps`` timed passes (its
``compiled`` phase; it has no other).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

Tokens = list[list[int]]


def cpu_seconds() -> float:
    """CPU time of this process and its live descendants (vLLM's engine core is one), or of this
    process alone without psutil."""
    try:
        import psutil
    except ImportError:
        return time.process_time()
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


# Where the CPU time goes (``--perf``): perf's shared objects grouped by what they do.
PERF_GROUPS = (
    ("matmul (oneDNN JIT, MKL)", ("[JIT]", "libmkl", "libdnnl")),
    ("attention kernel", ("cpu_attention", "_C.abi3.so")),  # ours; vLLM's _C also holds its other ops
    ("OpenMP", ("libgomp", "libiomp")),
    ("inductor kernels", (".main.so",)),
    ("torch (eager ops)", ("libtorch_cpu", "libc10")),
    ("Python", ("libpython", "libtorch_python")),
    ("idle", ("[kernel.kallsyms]",)),  # with -a, mostly the halted idle core
)


def perf_split(data: str, runs: int) -> dict[str, float]:
    """CPU seconds a run per ``PERF_GROUPS`` entry (and "other") from ``perf record -a`` samples at 4 kHz."""
    report = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", "dso", "-n"], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    split: dict[str, float] = {}
    for line in report.splitlines():
        fields = line.split(None, 2)
        if line.startswith("#") or len(fields) < 3 or not fields[0].endswith("%"):
            continue
        group = next((g for g, keys in PERF_GROUPS if any(k in fields[2] for k in keys)), "other")
        split[group] = split.get(group, 0.0) + int(fields[1]) / 4000 / runs
    return split


def timed_passes(once: Callable[[], Tokens], reps: int, perf: bool = False) -> dict:
    """A warm-up pass of ``once`` (first-call paths; ours: its compile starts in it), then ``reps`` timed
    passes: {"times": wall s, "cpu": CPU s, "tokens": the last pass's, "perf": ``perf_split`` or {}};
    ``perf``: the timed passes under ``perf record -a`` (the whole machine: keep it otherwise quiet)."""
    once()
    walls, cpus, tokens = [], [], []
    recorder, data = None, os.path.abspath("perf.data")
    if perf:
        recorder = subprocess.Popen(["perf", "record", "-q", "-a", "-F", "4000", "-o", data])
        time.sleep(1.0)  # perf attaches
    for _ in range(reps):
        t, c = time.perf_counter(), cpu_seconds()
        tokens = once()
        walls.append(time.perf_counter() - t)
        cpus.append(cpu_seconds() - c)
    split = {}
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=120)
        split = perf_split(data, reps)
    return {"times": walls, "cpu": cpus, "tokens": tokens, "perf": split}


def ours_engine(job: dict, wait: bool = True):  # noqa: ANN201  (a ContinuousBatchingEngine, imported here)
    """The row's model loaded with ``attn_implementation="paged"`` in the job's dtype and an engine on it
    (``wait``: its compiled forward ready, as the benchmarks that take this engine want it): as
    vLLM is run, prefix caching off (every timed pass recomputes every prompt), greedy, EOS off, a cache that
    holds the whole workload at once (vLLM's 2 GiB holds more); ``PagedConfig`` defaults otherwise (the
    background compile) unless the job's ``ours_config`` says otherwise."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import hf_paged_attn  # noqa: F401  registers "paged"
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn.core.blocks import blocks_for

    dtype = getattr(torch, job["dtype"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], attn_implementation="paged", dtype=dtype).eval()
    config = PagedConfig(**{"enable_prefix_caching": False, **job.get("ours_config", {})})
    num_blocks = sum(blocks_for(len(p) + n, config.resolved(torch.device("cpu")).block_size)
                     for p, n in zip(job["prompts"], job["max_new_tokens"]))  # fmt: skip
    greedy = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    engine = ContinuousBatchingEngine(model, config, generation_config=greedy, num_blocks=num_blocks)
    if wait and hasattr(engine.executor, "wait"):
        engine.executor.wait()
    return engine


def run_ours(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    engine = ours_engine(job, wait=False)  # one engine kept across passes
    ready = time.perf_counter() - start  # the first request could start

    def once() -> Tokens:
        outs = engine.generate(job["prompts"], max_new_tokens=job["max_new_tokens"], progress_bar=False)
        return [list(o.output_ids) for o in outs]

    executor = engine.executor
    result: dict = {"ready": ready}
    if job.get("start_passes", True):
        result["start"] = timed_passes(once, job["reps"])
    wait = getattr(executor, "wait", None)  # a CompiledExecutor: starts the compile if it has not, and waits
    result["compiled_ok"] = bool(wait and wait())
    result["compiled_at"] = time.perf_counter() - start
    compiled = getattr(executor, "compiled", None)
    result["compile_seconds"] = compiled.compile_seconds if compiled is not None else 0.0
    result["compiled"] = timed_passes(once, job["reps"], job.get("perf", False))
    if job.get("compile_times"):
        result["compile_times"] = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
    tuner = getattr(executor, "tuner", None)  # the adaptive threads' choices: step-size bucket -> count
    result["threads"] = tuner.choices() if tuner else {}
    return result


def run_vllm(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, max_model_len=job["max_model_len"],
              seed=0, disable_log_stats=True, enable_prefix_caching=False)  # fmt: skip
    ready = time.perf_counter() - start  # its compile and profiling run here
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
              for n in job["max_new_tokens"]]  # fmt: skip

    def once() -> Tokens:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return {"ready": ready, "compiled_at": ready, "compiled": timed_passes(once, job["reps"], job.get("perf", False))}


SETTINGS_ENV = "HF_PAGED_ATTN_BENCH_SET"


def apply_settings(spec: str) -> None:
    """``MODULE.NAME=VALUE[;MODULE.NAME=VALUE]``: module constants set before ours runs, each VALUE a Python
    literal: a variant's code path forced (``--variant chunks:HF_PAGED_ATTN_BENCH_SET=hf_paged_attn.runtime.
    generation.argmax.NUMPY_MAX=0``). A name the module lacks is an error, not a silent no-op."""
    import ast
    import importlib

    for item in filter(None, (part.strip() for part in spec.split(";"))):
        target, value = item.split("=", 1)
        module_name, name = target.rsplit(".", 1)
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise AttributeError(f"{SETTINGS_ENV}: {module_name} has no {name!r}")
        setattr(module, name, ast.literal_eval(value))


def main(argv: list[str]) -> None:
    system, job_file, result_file = argv
    if system != "vllm" and os.environ.get(SETTINGS_ENV):
        apply_settings(os.environ[SETTINGS_ENV])
    with open(job_file) as f:
        job = json.load(f)
    result = (run_vllm if system == "vllm" else run_ours)(job)
    with open(result_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    # Run as a script, its folder heads sys.path: bench/profile.py would shadow the standard library's profile
    # (cProfile imports it, and torch.distributed imports cProfile).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    main(sys.argv[1:])
