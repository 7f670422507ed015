"""Run a workload on the selected systems in one process, on one model saved once."""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import transformers
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from hf_paged_attn_tools.bench.bound import bound_for, measure_forward
from hf_paged_attn_tools.bench.systems import MODEL_KIND, STATIC, SYSTEMS, RunResult
from hf_paged_attn_tools.bench.workloads import Workload

SWEPT = ("engine", "hf_cb", "hf_padded")  # the plot's systems; the others run at the headline only
ENV_VARS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def environment(threads: int) -> dict[str, Any]:
    from hf_paged_attn import __version__

    return {
        "hf_paged_attn": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "dtype": str(DTYPE["dtype"]).removeprefix("torch."),
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# The dtype every system loads the model in: float32, or the bench's ``--dtype``, set by ``command.run``.
DTYPE: dict[str, torch.dtype] = {"dtype": torch.float32}


def _load(directory: str, kind: str) -> torch.nn.Module:
    attn = "paged" if kind == "paged" else "sdpa"
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn, dtype=DTYPE["dtype"]).eval()


def plan(work: Workload, systems: Iterable[str], concurrency: list[int] | None) -> list[tuple[str, int]]:
    """(system, concurrency) pairs: the sweep for SWEPT systems, the headline for the others. Ordered by
    level, then system, so that runs compared with each other are close in time (load drifts on a shared CPU)."""
    pairs = []
    for system in systems:
        kind = "static" if system in STATIC else "continuous"
        if system in SWEPT:
            levels = concurrency or sorted(set(work.concurrency) | {work.headline[kind]})
        else:
            levels = [work.headline[kind]]
        pairs += [(system, c) for c in levels]
    order = {s: i for i, s in enumerate(systems)}
    return sorted(pairs, key=lambda p: (p[1], order[p[0]]))


def run_workload(
    work: Workload,
    systems: list[str],
    threads: int = 2,
    concurrency: list[int] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[list[RunResult], dict[str, Any], dict[str, Any]]:
    """Save the model, measure the bound, run every (system, concurrency); returns (runs, bound, env)."""
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; choose from {sorted(SYSTEMS)}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(work, systems, threads, concurrency, log)
    finally:
        torch.set_num_threads(previous_threads)


def _run(
    work: Workload, systems: list[str], threads: int, concurrency: list[int] | None, log: Callable[[str], None]
) -> tuple[list[RunResult], dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="hf_paged_attn_bench_") as directory:
        work.model.save(directory)
        models = {"sdpa": _load(directory, "sdpa")}  # the bound and hf_padded
        for system in systems:
            kind = MODEL_KIND[system]
            if kind not in models:
                models[kind] = _load(directory, kind)  # "cb": a separate instance for transformers' CB
    log(f"measuring the forward-only bound ({threads} threads)")
    bound = bound_for(work, measure_forward(models["sdpa"]))
    log(f"  body {bound['best_body_tokens_per_second']:.0f} tok/s, bound {bound['tokens_per_second']:.0f} new tok/s")
    runs = []
    pairs = plan(work, systems, concurrency)
    bar = tqdm(pairs, desc=f"bench {work.name}", unit="run", disable=None, leave=False)  # stderr, a terminal only
    for system, level in bar:
        bar.set_postfix_str(f"{system} @{level}")
        run = SYSTEMS[system](models[MODEL_KIND[system]], work, level)
        runs.append(run)
        log(f"  {system:<14} @{level:<4} {run.tokens_per_second:8.1f} new tok/s  ({run.wall_seconds:.2f} s)")
    return runs, bound, environment(threads)
