"""A model's first compile in a child process, so that it takes from the steps it would speed up neither the GIL
nor more of the CPU than they leave idle.

A compile in the background of the engine's process (``compiled.CompiledModel.start``) is mostly Python (dynamo's
trace, AOT autograd, inductor's lowering), which holds the GIL every eager step needs between its kernels, and
its C++ builds take the cores: on the bundled model's 64 requests the passes while a first-ever compile ran
measured 903-1,149 tok/s against eager's ~4,000 (docs/performance.md). So a model this machine has not
compiled (``compile_record``) is first compiled by a child process at the lowest priority (``_BOOTSTRAP``: for
its first minute only on CPU time the steps leave idle, then at ``nice`` 19), built from the model's config with
random weights: the graph takes the weights as inputs, their values are not in it. The child fills inductor's
disk cache; the compile in this process then finds its graphs there and takes seconds, not a minute.

It runs where a second copy of the model fits easily (its weights under a quarter of the memory available),
the model has no LoRA layers (their graph follows the adapters, which a config does not hold), no hooks of
accelerate, no quantization, and inductor's disk cache is on (and ``HF_PAGED_ATTN_COMPILE_CHILD`` is not 0).
Otherwise, or when the child fails or runs past ``TIMEOUT_S``, the compile runs in this process as before.

The child: ``python -c _BOOTSTRAP JOB.json``, which runs ``prewarm_child.py`` on the ``Job``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import torch_private

logger = logging.getLogger(__name__)

# The child's first lines, before it imports anything (torch's import alone takes seconds of CPU): it runs, and
# the compilers it starts, only on CPU time no other process wants (Linux's ``SCHED_IDLE``: any other task that
# wakes takes the core at once), for its first ``IDLE_ONLY_S`` seconds; then (and where there is no SCHED_IDLE)
# at ``nice`` 19, which takes a small share of a busy core, so that an engine that never idles still gets its
# compile. On the bundled model's 64 requests, passes beside the child ran at eager's speed under SCHED_IDLE
# (4,000-4,900 tok/s; its cold compile never ended in 55 s of back-to-back passes) and at 0.55-0.85 of it at
# ``nice`` 19 (2,300-3,600 tok/s; compiled in 34 s): an OpenMP thread of a step preempted for a slice stalls the
# step's other threads at their barrier.
IDLE_ONLY_S = 60.0
NICE = 19  # the child's priority: the lowest
_LOWEST_PRIORITY = f"""
import os
os.nice({NICE})
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError) as exc:
    print("SCHED_IDLE refused:", exc, flush=True)
"""
# then it registers "paged" (``import hf_paged_attn``) and runs ``prewarm_child``
_BOOTSTRAP = _LOWEST_PRIORITY + (
    "import hf_paged_attn, runpy\n"
    f"runpy.run_module({__name__ + '_child'!r}, run_name='__main__')\n"
)
# ``HF_PAGED_ATTN_COMPILE_CHILD=0`` compiles in the process only; a process that wants that (a test suite) may also
# set it to False once.
ENABLED = os.environ.get("HF_PAGED_ATTN_COMPILE_CHILD", "1") != "0"
TIMEOUT_S = 900.0  # the child's longest run (under full load: idle CPU, then a small share)
MEMORY_SHARE = 0.25  # the model's weights at most this share of the memory available, for the child's copy
_CHILDREN: set[subprocess.Popen] = set()  # children running, stopped at exit (``stop_all``)
_LOCK = threading.Lock()
_STOPPED = threading.Event()  # ``stop_all`` ran: no child is wanted any more


@dataclass(frozen=True, slots=True)
class Job:
    """What the child needs to compile the graphs the engine's process will: the model's class, config (as
    ``config.json`` holds it), dtype and mode, torch's thread count and the engine's choices that change the
    graph."""

    module: str
    qualname: str
    config: str
    dtype: str
    training: bool
    threads: int
    fp32_matmuls: bool
    adaptive_threads: bool

    def run(self, timeout: float = TIMEOUT_S) -> bool:
        """Run the child to its end (at most ``timeout`` seconds; killed past it, or at exit); True if it
        compiled. Its output goes to a log file whose tail is logged when it fails."""
        with tempfile.TemporaryDirectory(prefix="hf_paged_attn-prewarm-") as tmp:
            job_path, log_path = Path(tmp) / "job.json", Path(tmp) / "child.log"
            job_path.write_text(json.dumps(dataclasses.asdict(self)))  # the child reads config.json beside it
            (Path(tmp) / "config.json").write_text(self.config)
            env = {
                **os.environ,
                "TORCHINDUCTOR_COMPILE_THREADS": "1",  # its C++ builds one at a time
                # this process's imports: a source tree on sys.path, remote code's modules (transformers_modules)
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            }
            start = time.perf_counter()
            with open(log_path, "wb") as log:
                command = [sys.executable, "-c", _BOOTSTRAP, str(job_path)]
                child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env)  # fmt: skip
                with _LOCK:
                    _CHILDREN.add(child)
                try:
                    code = child.wait(timeout)
                    if _STOPPED.is_set():
                        logger.debug("hf_paged_attn: the compile in a child process was stopped at exit")
                        return False
                except subprocess.TimeoutExpired:
                    child.kill()
                    code = child.wait()
                    logger.warning("hf_paged_attn: the compile in a child process ran past %.0f s: stopped", timeout)
                finally:
                    with _LOCK:
                        _CHILDREN.discard(child)
            if code == 0:
                logger.info("hf_paged_attn: compiled in a child process in %.1f s", time.perf_counter() - start)
                return True
            tail = log_path.read_text(errors="replace")[-2000:]
            logger.warning("hf_paged_attn: the compile in a child process failed (exit status %s); compiling here. "
                           "Its output ended:\n%s", code, tail)  # fmt: skip
            return False


def job_for(model: torch.nn.Module, fp32_matmuls: bool, adaptive_threads: bool, threads: int) -> Job | None:
    """The child's job for ``model``, the engine's choices and torch's thread count when the engine was made,
    or None where the child can't help: see the module's docstring."""
    if not ENABLED or not torch_private.inductor_disk_cache_on() or not _rebuildable(model) or not _fits(model):
        return None
    cls = type(model)
    return Job(cls.__module__, cls.__qualname__, model.config.to_json_string(use_diff=False),
               str(model.dtype).removeprefix("torch."), model.training, threads, fp32_matmuls,
               adaptive_threads)  # fmt: skip


def _rebuildable(model: torch.nn.Module) -> bool:
    """Whether a model of ``model``'s class built from its config has its graph: no LoRA layers, accelerate
    hooks or quantization, a class importable by name."""
    from ..model import lora

    if lora.attached(model) is not None or getattr(model.config, "quantization_config", None) is not None:
        return False
    if any(hasattr(m, "_hf_hook") or "peft" in type(m).__module__ for m in model.modules()):
        return False
    cls = type(model)
    try:
        return getattr(importlib.import_module(cls.__module__), cls.__qualname__) is cls
    except (ImportError, AttributeError):
        return False


def _fits(model: torch.nn.Module) -> bool:
    """Whether a second copy of ``model``'s weights takes at most ``MEMORY_SHARE`` of the memory available."""
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return False
    return size <= MEMORY_SHARE * available


def stop_all() -> int:
    """Kill every child still running (the process exits: its compile is no longer wanted); how many."""
    _STOPPED.set()
    with _LOCK:
        children = list(_CHILDREN)
    for child in children:
        child.kill()
    return len(children)
