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

While the engine's eager steps run during the child's first minute, the child and the compilers it started (its
own process group) are stopped, and continued once no step has run for ``RESUME_AFTER_S`` (``holding``): an eager
step leaves a core idle while its Python runs on the other, and a child running there, even at ``SCHED_IDLE``,
slowed the steps to about 0.6 of eager's speed (they share the caches and memory: docs/performance.md). So the
first requests run at eager's speed, and the child compiles while the engine waits for work; an engine busy for
a whole minute then shares the CPU with it at ``nice`` 19.

The child: ``python -c _BOOTSTRAP JOB.json``, which runs ``prewarm_child.py`` on the ``Job``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import signal
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
try:  # killed with the engine's process, even while held (stopped): its polling thread would not see it go
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except (AttributeError, OSError):
    pass
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
_CHILDREN: dict[subprocess.Popen, float] = {}  # children running (-> when they started), killed at exit (``stop_all``)
_LOCK = threading.Lock()
_STOPPED = threading.Event()  # ``stop_all`` ran: no child is wanted any more
# The hold (``holding``): a child is stopped while steps run during its first ``IDLE_ONLY_S`` seconds, and continued
# once no step has run for ``RESUME_AFTER_S`` (between two steps of a run the engine's Python takes ~1 ms). It needs
# the child in a process group of its own (``Popen(process_group=0)``, Python 3.11): its compilers are stopped with it.
RESUME_AFTER_S = 0.05
_GROUPS = sys.version_info >= (3, 11)
_BUSY = [0, 0.0]  # steps running now (engines may step in several threads), when the last one ended
_HELD: set[int] = set()  # the process groups stopped now
_WATCH: list[threading.Thread] = []  # the thread that continues them (one at most)


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
                group = {"process_group": 0} if _GROUPS else {}
                child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, **group)  # fmt: skip
                with _LOCK:
                    _CHILDREN[child] = time.monotonic()
                try:
                    code = child.wait(timeout)
                    if _STOPPED.is_set():
                        logger.debug("hf_paged_attn: the compile in a child process was stopped at exit")
                        return False
                except subprocess.TimeoutExpired:
                    _kill(child)
                    code = child.wait()
                    logger.warning("hf_paged_attn: the compile in a child process ran past %.0f s: stopped", timeout)
                finally:
                    with _LOCK:
                        _CHILDREN.pop(child, None)
                        _continue(child.pid)
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
        _kill(child)
    return len(children)


def _kill(child: subprocess.Popen) -> None:
    """Kill ``child`` with the compilers it started (its process group), held or not."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if _GROUPS:
            os.killpg(child.pid, signal.SIGKILL)
            return
    child.kill()


@contextlib.contextmanager
def holding():  # noqa: ANN201  (a context manager of None)
    """Around an engine's eager step: every child in its first ``IDLE_ONLY_S`` seconds is stopped (with its
    process group) while the step runs and until no step has run for ``RESUME_AFTER_S``. Nothing without a
    child."""
    if not _CHILDREN or not _GROUPS:
        yield
        return
    with _LOCK:
        _BUSY[0] += 1
        now = time.monotonic()
        for child, started in _CHILDREN.items():
            if child.pid not in _HELD and now - started < IDLE_ONLY_S and child.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGSTOP)
                    _HELD.add(child.pid)
        if _HELD and not _WATCH:
            _WATCH.append(threading.Thread(target=_watch, name="hf_paged_attn-prewarm-hold", daemon=True))
            _WATCH[0].start()
    try:
        yield
    finally:
        with _LOCK:
            _BUSY[0] -= 1
            _BUSY[1] = time.monotonic()


def _watch() -> None:
    """Continue the held children once the steps pause for ``RESUME_AFTER_S`` (or a child's first ``IDLE_ONLY_S``
    seconds are over); ends when none is held."""
    while True:
        time.sleep(RESUME_AFTER_S / 2)
        with _LOCK:
            now = time.monotonic()
            idle = _BUSY[0] == 0 and now - _BUSY[1] >= RESUME_AFTER_S
            for child, started in _CHILDREN.items():
                if child.pid in _HELD and (idle or now - started >= IDLE_ONLY_S):
                    _continue(child.pid)
            if not _HELD:
                _WATCH.clear()
                return


def _continue(group: int) -> None:
    """(under ``_LOCK``) Continue a held process group."""
    if group in _HELD:
        _HELD.discard(group)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGCONT)
