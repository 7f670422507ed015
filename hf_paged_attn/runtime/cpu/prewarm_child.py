"""The child process of ``prewarm.py``: ``python -c prewarm._BOOTSTRAP JOB.json`` runs this module, which builds the
job's model with random weights and compiles it as an engine with ``compile="startup"`` would, filling inductor's
disk cache for the engine's process. Its exit status says whether it compiled."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from ..config import PagedConfig
from ..engine import ContinuousBatchingEngine
from . import compiled
from .prewarm import IDLE_ONLY_S, Job


def _share_after(seconds: float) -> None:
    """(in the child) After ``seconds``, every thread of this process back to the normal policy, at ``nice``
    19 (what it keeps): ``_BOOTSTRAP``'s SCHED_IDLE gave the compile only idle time until then."""
    time.sleep(seconds)
    with contextlib.suppress(AttributeError, OSError):
        for tid in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))


def _exit_with_parent(parent: int) -> None:
    """(in the child) Exit once the engine's process is gone (killed: its exit would have stopped the child)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(argv: list[str]) -> int:
    """The child: build the job's model with random weights and compile it as an engine would at start-up."""
    job_path = Path(argv[0])
    job = Job(**json.loads(job_path.read_text()))
    threading.Thread(target=_share_after, args=(IDLE_ONLY_S,), daemon=True).start()
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(job.threads)
    cls = getattr(importlib.import_module(job.module), job.qualname)
    config = AutoConfig.from_pretrained(job_path.parent)  # the job's config.json
    model = cls._from_config(config, dtype=getattr(torch, job.dtype), attn_implementation="paged")
    model.train(job.training)
    engine_config = PagedConfig(compile="startup", num_blocks=16, enable_prefix_caching=False, progress_bar=False,
                                fp32_matmuls=job.fp32_matmuls, adaptive_threads=job.adaptive_threads)  # fmt: skip
    ContinuousBatchingEngine(model, engine_config)
    found = compiled.compiled_model_of(model)
    ok = found is not None and found.ready.is_set() and found.failed is None
    print("compiled" if ok else f"not compiled: {found.failed if found is not None else 'no compiled forward'}")
    return 0 if ok else 1


if __name__ == "__main__":  # (``-c _BOOTSTRAP JOB.json``: argv[0] is "-c")
    sys.exit(main(sys.argv[1:]))
