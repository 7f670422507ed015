"""Where a ``vs_vllm.py`` row's time goes in our engine, by kind of step: prompt steps (any step with a prompt
token) and decode steps, each split into their wall time, the process's CPU time (2 threads: 2.0 is both cores
busy), the time outside the forwards by part (the scheduler, the step's tensors, the sampler, the update), the
decode steps' attention kernel calls, and, in one more run under ``torch.profiler``, the linears, the attention op
and the rest.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/step_split.py [--row random|demo] [--dtype float32] [--runs 3]
        [--no-profile]

The engine is ``vs_vllm.ours_engine``'s (compiled, prefix caching off), warmed up by one pass over the
workload. The CPU time of a step is ``time.process_time()`` around the executor's ``execute`` (all of this
process's threads), so ``CPU / wall`` below 2 is a core waiting (or taken by another process: read it on a quiet
machine). Under the profiler, "linear" is the packed projections' ops (oneDNN's packed matmul and their Python)
plus any ``aten::linear`` / ``aten::mm``, "attention" the ``hf_paged_attn::step_attention`` op, "rest" the step's
other time: inductor's fused kernels, the compiled graph's Python between ops, the logits and argmax.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable

os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # as our commands run (hf_paged_attn._env.CLI_DEFAULTS)

import torch  # noqa: E402

from hf_paged_attn_tools.bench import vs_vllm  # noqa: E402

LINEAR_OPS = ("hf_paged_attn::packed_linear", "hf_paged_attn::packed_linear_group", "aten::linear", "aten::mm",
              "aten::addmm")  # fmt: skip
ATTENTION_OPS = ("hf_paged_attn::step_attention",)
KINDS = ("prompt", "decode")


def kind_of(step: object) -> str:
    return "decode" if step.is_decode else "prompt"


def timed_steps(engine: object, record: Callable[[str, float, float], None], label: bool = False) -> None:
    """Wraps the engine's ``executor.execute`` so every step reports (kind, wall s, CPU s); with ``label`` each
    step also runs inside a ``torch.profiler.record_function`` named after its kind."""
    execute = engine.executor.execute

    def timed(step: object) -> torch.Tensor:
        kind = kind_of(step)
        start, cpu = time.perf_counter(), time.process_time()
        if label:
            with torch.profiler.record_function(f"step:{kind}"):
                out = execute(step)
        else:
            out = execute(step)
        record(kind, time.perf_counter() - start, time.process_time() - cpu)
        return out

    engine.executor.execute = timed


def add_wall_time(owner: object, attr: str, spent: dict[str, float], name: str) -> None:
    """Wraps ``owner.attr`` (a function or method, looked up there at each call) so that every call adds its wall
    seconds to ``spent[name]``."""
    call = getattr(owner, attr)

    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    setattr(owner, attr, wrapper)


def timed_host_parts(engine: object, spent: dict[str, float]) -> None:
    """Wraps the engine's host-side parts of a step (the scheduler, the step's tensors, the sampler, the update)
    so that each adds its wall seconds to ``spent[name]``: the time outside the forwards, part by part."""
    from hf_paged_attn.runtime import worker
    from hf_paged_attn.runtime.generation import sampling

    add_wall_time(engine.scheduler, "schedule", spent, "schedule")
    add_wall_time(worker, "build_step", spent, "build_step")  # the name worker.execute calls
    add_wall_time(engine.worker.sampler, "sample", spent, "sample")
    # inside the sampler's time (greedy rows' tokens): shown, not added
    add_wall_time(sampling, "row_argmax", spent, "argmax")
    add_wall_time(engine.updater, "update", spent, "update")


def timed_decode_attention(spent: dict[str, float]) -> None:
    """Wraps the compiled decode steps' attention (``attention._lean_decode``, each layer's call of the native
    kernel) so that it adds its wall seconds to ``spent["decode attention"]``: the kernel's time inside the
    forwards without the profiler's overhead."""
    from hf_paged_attn.runtime.cpu import attention

    add_wall_time(attention, "_lean_decode", spent, "decode attention")


def split_profile(events: list) -> dict[str, dict[str, float]]:
    """Seconds of each step kind's linears, attention and rest, from the profiler's events (wall time on the
    calling thread: an op's ``cpu_time_total`` is its span there, its OpenMP workers included)."""

    def spent(event: object, names: tuple[str, ...]) -> float:
        if event.name in names:
            return event.cpu_time_total
        return sum(spent(child, names) for child in event.cpu_children)

    split: dict[str, dict[str, float]] = {k: defaultdict(float) for k in KINDS}
    for event in events:
        if not event.name.startswith("step:"):
            continue
        parts = split[event.name[5:]]
        linear, attention = spent(event, LINEAR_OPS), spent(event, ATTENTION_OPS)
        parts["steps"] += 1
        parts["wall"] += event.cpu_time_total / 1e6
        parts["linear"] += linear / 1e6
        parts["attention"] += attention / 1e6
        parts["rest"] += (event.cpu_time_total - linear - attention) / 1e6
    return split


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vs_vllm.row_arguments(parser)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true", help="skip the run under torch.profiler")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    job = {**vs_vllm.workload(args.row, args.work_dir), "dtype": args.dtype}
    engine = vs_vllm.ours_engine(job)

    def run() -> None:
        engine.generate(job["prompts"], max_new_tokens=job["max_new_tokens"], progress_bar=False)

    run()  # warm-up: first-call paths, the thread tuner's first choices
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # kind -> [steps, wall, cpu]

    def record(kind: str, wall: float, cpu: float) -> None:
        totals[kind][0] += 1
        totals[kind][1] += wall
        totals[kind][2] += cpu

    original = engine.executor.execute
    timed_steps(engine, record)
    host: dict[str, float] = defaultdict(float)  # part -> wall s outside the forwards
    timed_host_parts(engine, host)
    kernel: dict[str, float] = defaultdict(float)  # part -> wall s inside the forwards
    timed_decode_attention(kernel)
    for r in range(args.runs):
        totals.clear()
        host.clear()
        kernel.clear()
        start, cpu = time.perf_counter(), time.process_time()
        run()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        inside = sum(t[1] for t in totals.values())
        print(f"run {r + 1}: wall {wall:.2f} s, CPU {cpu:.2f} s; outside the forwards wall {wall - inside:.2f} s ("
              + ", ".join(f"{name} {seconds:.3f}" for name, seconds in host.items())
              + f", the rest {wall - inside - sum(v for k, v in host.items() if k != 'argmax'):.3f})")  # fmt: skip
        for kind in KINDS:
            steps, w, c = totals.get(kind, (0, 0.0, 0.0))
            if steps:
                print(f"  {kind:7s} steps {steps:4d}  wall {w:6.2f} s  CPU {c:6.2f} s  CPU/wall {c / w:4.2f}"
                      f"  idle core-s {args.threads * w - c:5.2f}")  # fmt: skip
        print(f"  decode attention (the kernel's calls) {kernel['decode attention']:.3f} s")
    if args.no_profile:
        return
    engine.executor.execute = original
    timed_steps(engine, lambda *_: None, label=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    print("under torch.profiler (one run; its overhead included):")
    for kind, parts in split_profile(prof.events()).items():
        if parts["steps"]:
            w = parts["wall"]
            print(f"  {kind:7s} steps {int(parts['steps']):4d}  wall {w:6.2f} s  "
                  + "  ".join(f"{name} {parts[name]:5.2f} s ({parts[name] / w:4.0%})"
                              for name in ("linear", "attention", "rest")))  # fmt: skip


if __name__ == "__main__":
    main()
