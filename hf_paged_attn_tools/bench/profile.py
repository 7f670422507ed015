"""Where a step's time goes: engine host work, attention, linear layers, the rest of the forward.

    python -m hf_paged_attn_tools.bench --profile [--workload uniform] [--concurrency 64] [--profile-ops 15]

``StepProfile`` times a paged model with plain hooks (no profiler overhead on every op), so it works
on anything that drives the model through steps, the engine or ``model.generate`` alike:

* a step is one top-level forward of the model; its host time is the wall time since the previous
  forward ended (scheduling, building the step's tensors, sampling, output bookkeeping);
* attention is the model's attention function (the ``"paged"`` kernels, or ``"sdpa"``...) plus the
  cache's ``update`` (the varlen path's K/V write and gather; ``torch.cat`` for transformers'
  ``DynamicCache``), so padded ``generate`` on an sdpa model can be profiled the same way;
* linear is every ``nn.Linear`` (projections, MLP, LM head), through forward hooks;
* other is the rest of the forward: embeddings, norms, rotary, activations, residuals, Python.

Timings are wall clock on the host (``clock=time.thread_time`` with one thread gives CPU time,
which other processes on a shared machine do not inflate). On CUDA, kernels run asynchronously, so the split would only
show launch time; the breakdown is meant for CPU (the GPU needs ``torch.profiler`` with CUDA
activities). ``--profile-ops N`` adds ``torch.profiler``'s N most expensive ops of a second run.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_paged_attn.attention.cache import ACTIVE_FORWARD, PagedAttentionCache
from hf_paged_attn.integration.register import NAME
from hf_paged_attn.runtime.config import PagedConfig
from hf_paged_attn.runtime.engine import ContinuousBatchingEngine
from hf_paged_attn_tools.bench.systems import WARMUP_PROMPT, greedy_config
from hf_paged_attn_tools.bench.workloads import BLOCK_SIZE, MAX_BATCH_TOKENS, Workload

PARTS = ("host", "attention", "linear", "other")


@dataclass
class Step:
    """One step's seconds by part; ``kind`` is "decode" (the paged decode path ran) or "mixed"."""

    kind: str = "mixed"
    total: float = 0.0
    forward: float = 0.0
    attention: float = 0.0
    linear: float = 0.0

    @property
    def host(self) -> float:
        return self.total - self.forward

    @property
    def other(self) -> float:
        return self.forward - self.attention - self.linear


class StepProfile:
    """Records a :class:`Step` for every top-level forward of ``model`` inside ``record()``."""

    def __init__(self, model: torch.nn.Module, clock: Callable[[], float] = time.perf_counter) -> None:
        self.model = model
        self.clock = clock  # time.thread_time with one thread: CPU time, steady on a loaded machine
        self.steps: list[Step] = []
        self._current = Step()
        self._mark = 0.0  # end of the previous forward (or the start of recording)
        self._forward_start = 0.0
        self._depth = 0  # nested top-level calls (a model calling itself) count once

    @contextlib.contextmanager
    def record(self) -> Iterator[StepProfile]:
        with contextlib.ExitStack() as stack:
            self._install(stack)
            self._mark = self.clock()
            yield self

    # ---------------------------------------------------------------------------------- hooks
    def _install(self, stack: contextlib.ExitStack) -> None:
        attention = getattr(self.model.config, "_attn_implementation", None) or NAME
        stack.enter_context(self._patched(ALL_ATTENTION_FUNCTIONS, attention, "attention", item=True))
        stack.enter_context(self._patched(PagedAttentionCache, "update", "attention"))
        stack.enter_context(self._patched(Cache, "update", "attention"))  # DynamicCache and the others
        clock = self.clock
        started: list[float] = []

        def linear_pre(module: torch.nn.Module, args: Any) -> None:
            started.append(clock())

        def linear_post(module: torch.nn.Module, args: Any, out: Any) -> None:
            self._current.linear += clock() - started.pop()

        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                stack.callback(module.register_forward_pre_hook(linear_pre).remove)
                stack.callback(module.register_forward_hook(linear_post).remove)
        stack.callback(self.model.register_forward_pre_hook(self._forward_pre).remove)
        stack.callback(self.model.register_forward_hook(self._forward_post).remove)

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self._forward_start = self.clock()

    def _forward_post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self._depth -= 1
        if self._depth:
            return
        now = self.clock()
        step = self._current
        step.forward, step.total = now - self._forward_start, now - self._mark
        self.steps.append(step)
        self._current, self._mark = Step(), now

    @contextlib.contextmanager
    def _patched(self, owner: Any, name: str, part: str, item: bool = False) -> Iterator[None]:
        """Time ``owner.name`` (``owner[name]`` with ``item``) into the current step's ``part``."""
        original: Callable = owner[name] if item else getattr(owner, name)
        profile = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = profile.clock()
            try:
                return original(*args, **kwargs)
            finally:
                step = profile._current
                setattr(step, part, getattr(step, part) + profile.clock() - start)
                context = ACTIVE_FORWARD.get()
                if context is not None and context.step.is_decode:
                    step.kind = "decode"
                elif context is None and item and args[1].dim() == 4 and args[1].shape[2] == 1:
                    step.kind = "decode"  # outside the engine: query [batch, heads, 1, head_dim]

        if item:
            owner[name] = timed
        else:
            setattr(owner, name, timed)
        try:
            yield
        finally:
            if item:
                owner[name] = original
            else:
                setattr(owner, name, original)

    # ---------------------------------------------------------------------------------- summary
    def summary(self) -> dict[str, Any]:
        """Per kind of step ("decode", "mixed", "all"): number of steps, total seconds and the mean
        milliseconds per step of each part."""
        out: dict[str, Any] = {}
        for kind in ("decode", "mixed", "all"):
            steps = [s for s in self.steps if kind in ("all", s.kind)]
            if not steps:
                continue
            row: dict[str, Any] = {"steps": len(steps), "seconds": sum(s.total for s in steps)}
            row["step_ms"] = 1e3 * row["seconds"] / len(steps)
            row["step_ms_median"] = 1e3 * statistics.median(s.total for s in steps)
            for part in PARTS:
                row[f"{part}_ms"] = 1e3 * sum(getattr(s, part) for s in steps) / len(steps)
            out[kind] = row
        return out


def format_profile(summary: dict[str, Any]) -> str:
    """The summary as a table: ms per step by part, and each part's share of the step."""
    head = f"{'steps':<8}{'n':>5}{'total s':>9}{'ms/step':>9}" + "".join(f"{p + ' ms':>13}" for p in PARTS)
    lines = [head]
    for kind, row in summary.items():
        cells = "".join(
            f"{row[f'{p}_ms']:7.2f} {100 * row[f'{p}_ms'] / row['step_ms']:3.0f}%" for p in PARTS
        )
        lines.append(f"{kind:<8}{row['steps']:>5}{row['seconds']:>9.2f}{row['step_ms']:>9.2f}  {cells}")
    return "\n".join(lines)


def top_ops(run: Callable[[], object], limit: int) -> str:
    """``torch.profiler``'s ``limit`` most expensive ops (self CPU time) while ``run()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=limit)


def profile_workload(work: Workload, concurrency: int, threads: int = 2, ops: int = 0) -> dict[str, Any]:
    """Run ``work`` on the engine (kernel "torch", ``max_num_seqs=concurrency``) twice, plain and
    under :class:`StepProfile`, and return the summary with both wall times (the hooks' overhead)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="hf_paged_attn_profile_") as directory:
            work.model.save(directory)
            model = AutoModelForCausalLM.from_pretrained(
                directory, attn_implementation=NAME, dtype=torch.float32
            ).eval()
        config = PagedConfig(
            block_size=BLOCK_SIZE, num_blocks=work.num_blocks, max_num_seqs=concurrency,
            max_batch_tokens=MAX_BATCH_TOKENS, kernel="torch", progress_bar=False, seed=0,
            enable_prefix_caching=False,  # else the second run finds every prompt cached by the first
            compile=False,  # the timing hooks would split a compiled graph (and time nothing inside it)
        )  # fmt: skip
        engine = ContinuousBatchingEngine(model, config, greedy_config())
        engine.generate([WARMUP_PROMPT], max_new_tokens=2)  # allocates the pages

        def run() -> None:
            engine.generate(work.prompts, max_new_tokens=work.max_new_tokens)

        start = time.perf_counter()
        run()
        plain = time.perf_counter() - start
        profile = StepProfile(model)
        start = time.perf_counter()
        with profile.record():
            run()
        result = {
            "workload": work.name, "concurrency": concurrency, "threads": threads,
            "wall_seconds": plain, "profiled_wall_seconds": time.perf_counter() - start,
            "steps": profile.summary(),
        }  # fmt: skip
        if ops:
            result["top_ops"] = top_ops(run, ops)
        return result
    finally:
        torch.set_num_threads(previous)


def print_profile(result: dict[str, Any]) -> None:
    print(
        f"{result['workload']} on the engine @{result['concurrency']}, {result['threads']} threads: "
        f"{result['wall_seconds']:.2f} s plain, {result['profiled_wall_seconds']:.2f} s with the timing hooks"
    )
    print(format_profile(result["steps"]))
    print("host: scheduling, step tensors, sampling, outputs (between forwards); attention: the kernel and the "
          "cache update; linear: every nn.Linear; other: the rest of the forward")  # fmt: skip
    if "top_ops" in result:
        print(result["top_ops"])
