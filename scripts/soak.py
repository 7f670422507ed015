"""Soak test of the continuous-batching engine: thousands of mixed requests on a tiny random Llama.

    python scripts/soak.py                 # 2000 requests (make soak)
    python scripts/soak.py --requests 150 --seed 3 --json soak.json

Requests arrive a few per step with random prompt lengths (many share one of a few "system
prompt" heads, so the prefix cache hits) and random ``max_new_tokens``, in every kind the engine
serves: greedy, sampled (seeded), ``num_return_sequences`` families (seeded), beam search,
constrained to a regex or a list of choices, speculative (prompt lookup), and a few with a
caller's logits processor that raises part-way (those must fail alone). About 5% are aborted a
random number of steps after they arrive. The cache is small enough that the engine preempts
all the time.

Checked after every step: the allocator's invariants and that every block's reference count is
its number of holders. At the end: every request got exactly one terminal output (its last), its
streamed ``new_ids`` add up to its final ids, no block leaked, no request errored but the planted
ones — and every finished request's tokens equal the same request run alone (a fresh engine with
room to spare), up to numerical near-ties: a greedy difference is accepted where the reference's
top-2 logits are within 1e-4 (``hf_paged_attn_tools.testing.compare_greedy``), a seeded sample's
where its replayed uniform draw lies within 1e-5 of the boundary between the two tokens.

Exit code 0 when everything holds; 1 otherwise.
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
from transformers import AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList

import hf_paged_attn  # noqa: F401  (registers attn_implementation="paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn.core.request import RequestOutput
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn_tools.testing import compare_greedy, load_pair, save_random_model, tiny_llama_config

KINDS = ("greedy", "sampled", "family", "beam", "constrained", "speculative", "failing")
CHOICES = ["alpha", "beta gamma", "delta"]
REGEX = r"[0-9]{2}-[a-z]{1,3}"


@dataclass
class SoakReport:
    """What one soak run saw; ``ok`` says whether it passed."""

    requests: int
    kinds: dict[str, int] = field(default_factory=dict)  # requests of each kind
    completed: int = 0  # finished with "length", "eos" or "stop"
    aborted: int = 0  # finished with "abort"
    planted_errors: int = 0  # the failing processors' requests, finished with "error" as they must
    errors: int = 0  # any other "error"
    abort_calls: int = 0
    late_aborts: int = 0  # abort() calls that came after the request had finished
    preemptions: int = 0
    prefix_hit_rate: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    num_blocks: int = 0
    leaked_blocks: int = 0
    terminal_problems: list[str] = field(default_factory=list)
    block_problems: list[str] = field(default_factory=list)  # reference counts vs holders, per step
    error_messages: list[str] = field(default_factory=list)
    alone_checked: int = 0  # finished sequences compared with the same request run alone
    near_ties: int = 0  # differences accepted as numerical near-ties
    alone_problems: list[str] = field(default_factory=list)
    loop_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        problems = self.terminal_problems or self.block_problems or self.alone_problems
        return not (self.leaked_blocks or self.errors or problems)


@dataclass(frozen=True)
class SoakConfig:
    """One soak run's settings (the command-line options, same names)."""

    requests: int = 2000
    seed: int = 0
    abort_rate: float = 0.05  # share of requests aborted ...
    abort_within: int = 150  # ... that many steps after they arrive at most (some after they end)
    check: int = -1  # finished requests compared with the same request run alone (-1: all)
    block_size: int = 8
    num_blocks: int = 48  # small: the engine preempts constantly
    max_prompt: int = 48
    max_new: int = 24
    max_num_seqs: int = 16
    max_batch_tokens: int = 128
    arrivals_per_step: int = 3  # on average
    threads: int = 1  # torch intra-op threads while it runs (0: leave torch's setting)
    mix: str = "greedy=40,sampled=15,family=10,beam=5,constrained=10,speculative=15,failing=5"
    progress: bool = False


class FailAt(LogitsProcessor):
    """A caller's processor that raises at its ``at``-th call: its request must fail alone."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls += 1
        if self.calls >= self.at:
            raise RuntimeError(f"planted failure at call {self.calls}")
        return scores


@dataclass
class Job:
    """One soak request: its kind, prompt and ``add_request`` arguments."""

    kind: str
    prompt: list[int]
    max_new: int
    seed: int | None = None
    temperature: float = 1.0
    kwargs: dict = field(default_factory=dict)

    def add(self, engine: ContinuousBatchingEngine, tokenizer: object) -> str:
        """Queue this request on ``engine`` (a fresh processor for a failing one)."""
        kwargs = dict(self.kwargs)
        if self.kind == "failing":
            kwargs["logits_processor"] = LogitsProcessorList([FailAt(kwargs.pop("fail_at"))])
        if self.kind == "constrained":
            kwargs["tokenizer"] = tokenizer
        return engine.add_request(self.prompt, max_new_tokens=self.max_new, seed=self.seed, **kwargs)


def parse_mix(mix: str) -> dict[str, int]:
    weights = {}
    for part in mix.split(","):
        name, _, weight = part.partition("=")
        if name not in KINDS:
            raise ValueError(f"--mix: unknown kind {name!r} (kinds: {', '.join(KINDS)})")
        weights[name] = int(weight)
    return weights


def make_workload(rng: random.Random, c: SoakConfig, vocab: int) -> list[Job]:
    """Requests of every kind; about two thirds start with one of 6 shared heads."""
    heads = [[rng.randrange(1, vocab) for _ in range(rng.randint(4, c.max_prompt // 2))] for _ in range(6)]
    weights = parse_mix(c.mix)
    kinds = rng.choices(list(weights), weights=list(weights.values()), k=c.requests)
    jobs = []
    for kind in kinds:
        head = rng.choice(heads) if rng.random() < 0.66 else []
        tail = [rng.randrange(1, vocab) for _ in range(rng.randint(1, c.max_prompt - len(head)))]
        job = Job(kind, head + tail, rng.randint(1, c.max_new))
        temperature = rng.choice([0.7, 1.0])
        if kind in ("sampled", "family"):
            job.seed, job.temperature = rng.randrange(2**31), temperature
            n = rng.randint(2, 3) if kind == "family" else 1
            job.kwargs["generation_config"] = GenerationConfig(
                do_sample=True, temperature=temperature, top_k=0, top_p=1.0, num_return_sequences=n
            )
        elif kind == "beam":
            job.max_new = min(job.max_new, 10)
            job.kwargs["generation_config"] = GenerationConfig(num_beams=rng.randint(2, 3), do_sample=False)
        elif kind == "constrained":
            job.kwargs["structured"] = {"regex": REGEX} if rng.random() < 0.5 else {"choice": CHOICES}
            job.max_new = c.max_new
        elif kind == "speculative":
            job.prompt = (job.prompt * 3)[: c.max_prompt]  # repetitive: the lookup finds candidates
            job.kwargs["generation_config"] = GenerationConfig(do_sample=False, prompt_lookup_num_tokens=3)
        elif kind == "failing":
            job.kwargs["fail_at"] = rng.randint(1, max(job.max_new, 1))
        jobs.append(job)
    return jobs


def block_accounting(engine: ContinuousBatchingEngine, step: int) -> list[str]:
    """Blocks whose reference count differs from the number of running requests holding them."""
    holders = Counter(b for r in engine.scheduler.running for t in r.block_tables for b in t if b >= 0)
    allocator = engine.allocator
    return [
        f"step {step}: block {b} has reference count {allocator.ref_count(b)} but {holders[b]} holders"
        for b in range(allocator.num_blocks)
        if allocator.ref_count(b) != holders[b]
    ]


def run_soak(config: SoakConfig | None = None) -> SoakReport:
    """Run the soak loop and return its report (see the module docstring). Torch runs with
    ``config.threads`` intra-op threads meanwhile (restored after): 1 is fastest for this tiny
    model, and many times faster than the default on a loaded machine."""
    config = config or SoakConfig()
    previous_threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _soak(config)
    finally:
        torch.set_num_threads(previous_threads)


def _engine_config(c: SoakConfig, num_blocks: int) -> PagedConfig:
    return PagedConfig(
        block_size=c.block_size, num_blocks=num_blocks, max_num_seqs=c.max_num_seqs,
        max_batch_tokens=c.max_batch_tokens, enable_prefix_caching=True, seed=c.seed,
    )  # fmt: skip


def _soak(c: SoakConfig) -> SoakReport:
    longest = c.max_prompt + c.max_new - 1  # the last sampled token needs no slot
    if 3 * blocks_for(longest, c.block_size) > c.num_blocks:  # a beam group of 3 recomputed beam by beam
        raise ValueError(f"num_blocks={c.num_blocks} cannot hold a beam group of 3 requests of {longest} tokens")
    start = time.perf_counter()
    torch.manual_seed(c.seed)
    rng = random.Random(c.seed)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)  # its vocabulary: constrained requests need text
    with tempfile.TemporaryDirectory(prefix="hf_paged_attn_soak_") as tmp:
        ref, paged = load_pair(save_random_model(tiny_llama_config(vocab_size=len(tokenizer)), tmp))
    report = SoakReport(requests=c.requests, num_blocks=c.num_blocks)
    engine = ContinuousBatchingEngine(paged, _engine_config(c, c.num_blocks))
    jobs = make_workload(rng, c, len(tokenizer))
    report.kinds = dict(Counter(job.kind for job in jobs))

    job_of: dict[str, Job] = {}
    streamed: dict[str, list[int]] = {}
    finals: dict[str, RequestOutput] = {}
    aborts_due: dict[int, list[str]] = {}  # step -> request ids to abort then
    next_job, step = 0, 0
    loop_start = time.perf_counter()
    while next_job < c.requests or engine.has_unfinished():
        for _ in range(rng.randint(0, 2 * c.arrivals_per_step)):
            if next_job == c.requests:
                break
            job = jobs[next_job]
            rid = job.add(engine, tokenizer)
            job_of[rid], streamed[rid] = job, []
            next_job += 1
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
            print(f"  step {step}: {len(finals)} of {c.requests}+ finished", file=sys.stderr, flush=True)
    report.loop_seconds = time.perf_counter() - loop_start

    families = {rid: [rid] for rid in job_of}
    for rid, out in finals.items():
        if out.parent_id is not None and out.parent_id in families:
            families[out.parent_id].append(rid)
    for rid in [member for family in families.values() for member in family]:
        out = finals.get(rid)
        job = job_of.get(rid) or job_of[finals[rid].parent_id]
        if out is None:
            report.terminal_problems.append(f"{rid}: no terminal output")
            continue
        if streamed[rid] != out.output_ids:
            report.terminal_problems.append(f"{rid}: streamed new_ids differ from its final output_ids")
        if out.finish_reason in ("length", "eos", "stop"):
            report.completed += 1
        elif out.finish_reason == "abort":
            report.aborted += 1
        elif job.kind == "failing" and "planted failure" in (out.error or ""):
            report.planted_errors += 1
        else:
            report.errors += 1
            report.error_messages.append(f"{rid} ({job.kind}): {out.finish_reason}: {out.error}")
    report.terminal_problems += [f"{rid}: output for an unknown request" for rid in set(finals) - set(streamed)]
    stats = engine.stats
    report.preemptions = stats.num_preemptions
    report.prefix_hit_rate = stats.prefix_hit_rate
    report.generated_tokens = stats.num_generated_tokens
    report.draft_tokens = getattr(stats, "num_draft_tokens", 0)
    report.accepted_tokens = getattr(stats, "num_accepted_tokens", 0)
    report.steps = stats.num_steps
    report.leaked_blocks = engine.allocator.num_used_blocks
    check_alone(report, c, rng, paged, ref, tokenizer, job_of, families, finals)
    report.wall_seconds = time.perf_counter() - start
    return report


def check_alone(
    report: SoakReport,
    c: SoakConfig,
    rng: random.Random,
    paged: torch.nn.Module,
    ref: torch.nn.Module,
    tokenizer: object,
    job_of: dict[str, Job],
    families: dict[str, list[str]],
    finals: dict[str, RequestOutput],
) -> None:
    """Run finished requests again, one at a time, on an engine with room to spare; their tokens
    must be the soak's, up to near-ties."""
    done = [rid for rid, fam in families.items() if all(finals[m].finish_reason in ("length", "eos", "stop")
                                                          for m in fam if m in finals)]  # fmt: skip
    done = [rid for rid in done if job_of[rid].kind != "failing"]
    chosen = done if c.check < 0 else rng.sample(done, min(c.check, len(done)))
    alone = ContinuousBatchingEngine(paged, _engine_config(c, 4096))
    for rid in sorted(chosen, key=lambda r: int(r.split("-")[-1])):
        job = job_of[rid]
        outs = alone.collect([job.add(alone, tokenizer)])
        for member, out in zip(families[rid], outs):
            got, want = finals[member].output_ids, out.output_ids
            report.alone_checked += 1
            if got == want:
                continue
            problem = difference(job, ref, got, want, index=out.index)
            if problem is None:
                report.near_ties += 1
            else:
                report.alone_problems.append(f"{member} ({job.kind}): {problem}")


def difference(job: Job, ref: torch.nn.Module, got: list[int], want: list[int], index: int) -> str | None:
    """Why ``got`` (the soak's) and ``want`` (alone) differ, or None for a numerical near-tie."""
    if job.kind in ("greedy", "speculative"):
        problems = compare_greedy(ref, [job.prompt], [want], [got])
        return problems[0] if problems else None
    pos = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if pos is None:
        return f"lengths differ ({len(got)} in the soak, {len(want)} alone)"
    if job.kind in ("sampled", "family") and sampled_near_tie(job, ref, want[:pos], got[pos], want[pos], index):
        return None
    return f"first difference at new token {pos}: {got[pos]} in the soak, {want[pos]} alone"


def sampled_near_tie(job: Job, ref: torch.nn.Module, before: list[int], a: int, b: int, index: int) -> bool:
    """Whether the seeded draw at this position lies within 1e-5 of the boundary between tokens
    ``a`` and ``b``: the generator is replayed (one uniform per token, as the engine draws), the
    distribution is the reference's at temperature ``job.temperature``."""
    seed = job.seed if index == 0 else (job.seed * 1_000_003 + index) % (2**63)  # SamplingParams.for_sequence
    generator = torch.Generator().manual_seed(seed)
    u = [torch.rand(1, 1, generator=generator, dtype=torch.float32) for _ in range(len(before) + 1)][-1]
    with torch.no_grad():
        logits = ref(torch.tensor([job.prompt + before])).logits[0, -1].float()
    cdf = torch.softmax(logits / job.temperature, dim=-1).cumsum(-1)
    x = float(u * cdf[-1])
    return abs(x - float(cdf[min(a, b)])) <= 1e-5


def format_report(r: SoakReport) -> str:
    tok_s = r.generated_tokens / r.loop_seconds if r.loop_seconds else 0.0
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(r.kinds.items()))
    lines = [
        f"soak: {r.requests} requests ({kinds}), {r.loop_seconds:.1f} s in the engine loop "
        f"({r.wall_seconds:.1f} s in all)",
        f"  completed        {r.completed} sequences",
        f"  aborted          {r.aborted}  (abort() called {r.abort_calls} times, {r.late_aborts} after the end)",
        f"  planted errors   {r.planted_errors} (a caller's processor raised: failed alone)",
        f"  other errors     {r.errors}",
        f"  preemptions      {r.preemptions}",
        f"  prefix hits      {r.prefix_hit_rate:.1%} of admitted prompt tokens",
        f"  speculation      {r.accepted_tokens} of {r.draft_tokens} proposed tokens accepted",
        f"  tokens           {r.generated_tokens} generated in {r.steps} steps ({tok_s:.0f} tok/s)",
        f"  leaked blocks    {r.leaked_blocks} of {r.num_blocks}"
        + (f" ({len(r.block_problems)} accounting problems)" if r.block_problems else ""),
        f"  terminal outputs {'exactly one per sequence' if not r.terminal_problems else 'PROBLEMS'}",
        f"  run alone        {r.alone_checked - len(r.alone_problems)}/{r.alone_checked} sequences equal "
        f"({r.near_ties} of them up to a near-tie)",
    ]
    problems = r.error_messages + r.terminal_problems + r.block_problems + r.alone_problems
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
        "check": "finished requests run again alone and compared (-1: all)",
        "num_blocks": "cache blocks of every layer (small: constant preemption)",
        "threads": "torch threads while it runs (0: torch's default)",
        "mix": "relative share of each request kind",
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
