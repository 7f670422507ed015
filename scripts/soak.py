"""Soak test of the continuous-batching engine: thousands of requests on a tiny random Llama.

    python scripts/soak.py                 # 2000 requests (make soak)
    python scripts/soak.py --requests 200 --seed 3 --json soak.json

Requests arrive a few per step with random prompt lengths (many share one of a few "system
prompt" heads, so the prefix cache hits and the torch backend's cascade decode runs over the shared
blocks) and random ``max_new_tokens``; about 5% are aborted a random number of steps after they
arrive. The cache is small enough that the engine preempts all
the time. The loop checks the allocator's invariants after every step, that every request gets
exactly one terminal output (its last) and that its streamed ``new_ids`` add up to its final ids.
At the end it reports completions, aborts, errors, preemptions, prefix hits, leaked blocks and wall
time, and compares a random sample of completed greedy outputs with ``attn_implementation="sdpa"``
``generate`` on the same prompt (near-ties allowed, see ``hf_paged_attn_tools.testing``).

Exit code 0 when everything holds; 1 on any leaked block, errored request, missing or duplicate
terminal output, or greedy mismatch.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

import torch

import hf_paged_attn  # noqa: F401  (registers attn_implementation="paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn.core.request import RequestOutput
from hf_paged_attn.kernels.torch_backend import decode as torch_decode
from hf_paged_attn_tools.testing import compare_greedy, load_pair, save_random_model, tiny_llama_config

VOCAB = 256


@dataclass
class SoakReport:
    """What one soak run saw; ``ok`` says whether it passed."""

    requests: int
    completed: int = 0  # finished with "length" or "eos"
    aborted: int = 0  # finished with "abort"
    errors: int = 0  # finished with "error"
    abort_calls: int = 0  # abort() calls made
    late_aborts: int = 0  # abort() calls that came after the request had finished
    preemptions: int = 0
    prefix_hit_rate: float = 0.0
    generated_tokens: int = 0
    steps: int = 0
    num_blocks: int = 0
    leaked_blocks: int = 0
    terminal_problems: list[str] = field(default_factory=list)
    block_problems: list[str] = field(default_factory=list)  # reference counts vs holders, per step
    error_messages: list[str] = field(default_factory=list)
    parity_checked: int = 0
    parity_problems: list[str] = field(default_factory=list)
    loop_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        problems = self.terminal_problems or self.block_problems or self.parity_problems
        return not (self.leaked_blocks or self.errors or problems)


def tiny_llama_dir(directory: str) -> str:
    """A 2-layer random Llama (vocab 256, no EOS: requests run to max_new_tokens unless aborted)."""
    return save_random_model(tiny_llama_config(vocab_size=VOCAB), directory)


def make_workload(rng: random.Random, num_requests: int, max_prompt: int, max_new: int) -> list[tuple[list[int], int]]:
    """(prompt, max_new_tokens) pairs; about two thirds start with one of 6 shared heads."""
    heads = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, max_prompt // 2))] for _ in range(6)]
    workload = []
    for _ in range(num_requests):
        head = rng.choice(heads) if rng.random() < 0.66 else []
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_prompt - len(head)))]
        workload.append((head + tail, rng.randint(1, max_new)))
    return workload


def block_accounting(engine: ContinuousBatchingEngine, step: int) -> list[str]:
    """Blocks whose reference count differs from the number of running requests holding them."""
    holders = Counter(b for r in engine.scheduler.running for b in r.block_ids)
    allocator = engine.allocator
    return [
        f"step {step}: block {b} has reference count {allocator.ref_count(b)} but {holders[b]} holders"
        for b in range(allocator.num_blocks)
        if allocator.ref_count(b) != holders[b]
    ]


@dataclass(frozen=True)
class SoakConfig:
    """One soak run's settings (the command-line options, same names)."""

    requests: int = 2000
    seed: int = 0
    abort_rate: float = 0.05  # share of requests aborted ...
    abort_within: int = 150  # ... that many steps after they arrive at most (some after they end)
    check: int = 20  # finished outputs compared with sdpa
    block_size: int = 8
    num_blocks: int = 40  # small: the engine preempts constantly
    max_prompt: int = 48
    max_new: int = 32
    max_num_seqs: int = 16
    max_batch_tokens: int = 128
    arrivals_per_step: int = 3  # on average
    threads: int = 1  # torch intra-op threads while it runs (0: leave torch's setting)
    cascade_min_tokens: int = 8  # the torch backend's cascade threshold meanwhile (its 32 > these heads)
    progress: bool = False


def run_soak(config: SoakConfig | None = None) -> SoakReport:
    """Run the soak loop and return its report (see the module docstring).

    Torch runs with ``config.threads`` intra-op threads meanwhile (restored after): 1 is fastest
    for this tiny model, and many times faster than the default on a loaded machine.
    """
    config = config or SoakConfig()
    previous_threads, previous_cascade = torch.get_num_threads(), torch_decode.CASCADE_MIN_TOKENS
    if config.threads:
        torch.set_num_threads(config.threads)
    torch_decode.CASCADE_MIN_TOKENS = config.cascade_min_tokens  # shared heads decode through the cascade
    try:
        return _soak(config)
    finally:
        torch.set_num_threads(previous_threads)
        torch_decode.CASCADE_MIN_TOKENS = previous_cascade


def _soak(c: SoakConfig) -> SoakReport:
    longest = c.max_prompt + c.max_new - 1  # the last sampled token needs no slot
    if blocks_for(longest, c.block_size) > c.num_blocks:
        raise ValueError(f"num_blocks={c.num_blocks} cannot hold one request of {longest} tokens")
    start = time.perf_counter()
    torch.manual_seed(c.seed)
    rng = random.Random(c.seed)
    report = SoakReport(requests=c.requests, num_blocks=c.num_blocks)
    with tempfile.TemporaryDirectory(prefix="hf_paged_attn_soak_") as tmp:
        ref, paged = load_pair(tiny_llama_dir(tmp))
    paged_config = PagedConfig(
        block_size=c.block_size,
        num_blocks=c.num_blocks,
        max_num_seqs=c.max_num_seqs,
        max_batch_tokens=c.max_batch_tokens,
        enable_prefix_caching=True,
        seed=c.seed,
    )
    engine = ContinuousBatchingEngine(paged, paged_config)
    workload = make_workload(rng, c.requests, c.max_prompt, c.max_new)

    prompts: dict[str, list[int]] = {}
    streamed: dict[str, list[int]] = {}
    finals: dict[str, RequestOutput] = {}
    aborts_due: dict[int, list[str]] = {}  # step -> request ids to abort then
    next_request = 0
    step = 0
    loop_start = time.perf_counter()
    while next_request < c.requests or engine.has_unfinished():
        for _ in range(rng.randint(0, 2 * c.arrivals_per_step)):
            if next_request == c.requests:
                break
            prompt, new = workload[next_request]
            rid = engine.add_request(prompt, max_new_tokens=new)
            prompts[rid], streamed[rid] = prompt, []
            next_request += 1
            if rng.random() < c.abort_rate:
                aborts_due.setdefault(step + rng.randint(0, c.abort_within), []).append(rid)
        for rid in aborts_due.pop(step, []):
            report.abort_calls += 1
            try:
                if not engine.abort(rid):
                    report.late_aborts += 1
            except ValueError:  # its final output was already emitted
                report.late_aborts += 1
        for out in engine.step():
            if out.request_id in finals:
                report.terminal_problems.append(f"{out.request_id}: output after its terminal output")
            streamed.setdefault(out.request_id, []).extend(out.new_ids)
            if out.finished:
                finals[out.request_id] = out
        engine.allocator.check_invariants()
        if len(report.block_problems) < 10:
            report.block_problems += block_accounting(engine, step)
        step += 1
        if c.progress and step % 500 == 0:
            print(f"  step {step}: {len(finals)}/{c.requests} finished", file=sys.stderr, flush=True)
    report.loop_seconds = time.perf_counter() - loop_start

    for rid in prompts:
        out = finals.get(rid)
        if out is None:
            report.terminal_problems.append(f"{rid}: no terminal output")
            continue
        if streamed[rid] != out.output_ids:
            report.terminal_problems.append(f"{rid}: streamed new_ids differ from its final output_ids")
        if out.finish_reason in ("length", "eos"):
            report.completed += 1
        elif out.finish_reason == "abort":
            report.aborted += 1
        else:
            report.errors += 1
            report.error_messages.append(f"{rid}: {out.finish_reason}: {out.error}")
    report.terminal_problems += [f"{rid}: output for an unknown request" for rid in set(finals) - set(prompts)]
    stats = engine.stats
    report.preemptions = stats.num_preemptions
    report.prefix_hit_rate = stats.prefix_hit_rate
    report.generated_tokens = stats.num_generated_tokens
    report.steps = stats.num_steps
    report.leaked_blocks = engine.allocator.num_used_blocks

    # Greedy parity on a sample of finished requests (aborted ones too: their tokens so far).
    done = sorted(rid for rid, out in finals.items() if out.finish_reason in ("length", "abort") and out.output_ids)
    sample = rng.sample(done, min(c.check, len(done)))
    for rid in sample:
        prompt, got = prompts[rid], finals[rid].output_ids
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=len(got), do_sample=False)[0, len(prompt) :]
        report.parity_problems += [f"{rid}: {p}" for p in compare_greedy(ref, [prompt], [want.tolist()], [got])]
    report.parity_checked = len(sample)
    report.wall_seconds = time.perf_counter() - start
    return report


def format_report(r: SoakReport) -> str:
    tok_s = r.generated_tokens / r.loop_seconds if r.loop_seconds else 0.0
    lines = [
        f"soak: {r.requests} requests, {r.loop_seconds:.1f} s in the engine loop ({r.wall_seconds:.1f} s in all)",
        f"  completed        {r.completed}",
        f"  aborted          {r.aborted}  (abort() called {r.abort_calls} times, {r.late_aborts} after the end)",
        f"  errors           {r.errors}",
        f"  preemptions      {r.preemptions}",
        f"  prefix hits      {r.prefix_hit_rate:.1%} of admitted prompt tokens",
        f"  tokens           {r.generated_tokens} generated in {r.steps} steps ({tok_s:.0f} tok/s)",
        f"  leaked blocks    {r.leaked_blocks} of {r.num_blocks}"
        + (f" ({len(r.block_problems)} accounting problems)" if r.block_problems else ""),
        f"  terminal outputs {'exactly one per request' if not r.terminal_problems else 'PROBLEMS'}",
        f"  sdpa parity      {r.parity_checked - len(r.parity_problems)}/{r.parity_checked} sampled greedy outputs",
    ]
    problems = r.error_messages + r.terminal_problems + r.block_problems + r.parity_problems
    lines += [f"    {p}" for p in problems[:20]]
    lines.append(f"RESULT: {'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one soak from the command line; prints the report, returns the exit code."""
    defaults = SoakConfig()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    helps = {
        "requests": "number of requests",
        "abort_rate": "share of requests aborted",
        "abort_within": "an abort comes at most this many steps after the request arrives",
        "check": "finished greedy outputs compared with sdpa generate",
        "num_blocks": "cache blocks (small: constant preemption)",
        "threads": "torch threads while it runs (0: torch's default)",
        "cascade_min_tokens": "shared tokens that make a cascade-decode group (torch backend)",
        "progress": "print progress to stderr",
    }
    for f in fields(SoakConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=helps.get(f.name))
        else:
            parser.add_argument(
                flag, type=type(default), default=default, help=f"{helps.get(f.name, '')} (default {default})"
            )
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = vars(parser.parse_args(argv))
    json_path = args.pop("json")
    report = run_soak(SoakConfig(**args))
    print(format_report(report), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({**asdict(report), "ok": report.ok}, f, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
