"""The systems under test, each run on a whole workload at one concurrency.

* ``engine`` / ``engine+prefix``: :class:`ContinuousBatchingEngine` (``stream()``), prefix caching off / on;
* ``generate``: ``model.generate`` on the "paged" model, padded batches routed to the engine;
* ``hf_cb``: transformers' own continuous batching (``init_continuous_batching``, sdpa);
* ``hf_padded``: transformers' padded ``generate`` in static batches (sdpa).

Throughput counts *useful* new tokens: each request's ``max_new_tokens``. Static batches generate
up to the longest request of the batch; the surplus is reported as ``generated_tokens`` but not
counted. Setup (cache allocation, one warm-up request) is excluded from every timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from hf_paged_attn.runtime.config import PagedConfig
from hf_paged_attn.runtime.engine import ContinuousBatchingEngine
from hf_paged_attn_tools.bench.workloads import BLOCK_SIZE, MAX_BATCH_TOKENS, Workload
from hf_paged_attn_tools.testing import left_padded

WARMUP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@dataclass
class RunResult:
    """One system on one workload at one concurrency (``max_num_seqs`` or static batch size)."""

    system: str
    concurrency: int
    wall_seconds: float
    useful_tokens: int
    generated_tokens: int
    outputs: list[list[int]] = field(repr=False)  # new tokens of each request, in workload order
    ttft: list[float] | None = None  # seconds from submission to the first new token, per request
    tpot: list[float] | None = None  # (last - first token time) / (n - 1), per request
    engine: dict[str, Any] | None = None  # EngineStats fields (measured part only) and overheads
    cpu_seconds: float = 0.0  # process CPU time (all threads) over the same span as wall_seconds
    settings: dict[str, Any] = field(default_factory=dict)  # e.g. whether prefix caching / block sharing was on

    @property
    def tokens_per_second(self) -> float:
        return self.useful_tokens / self.wall_seconds


def greedy_config(**extra: Any) -> GenerationConfig:
    """Greedy decoding with EOS disabled (every request runs to its own ``max_new_tokens``)."""
    return GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, **extra)


def _batches(work: Workload, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, work.num_requests))) for i in range(0, work.num_requests, size)]


def _latencies(start: float, stamps: dict[int, list[float]], counts: list[int]) -> tuple[list[float], list[float]]:
    """TTFT per request and TPOT per request with more than one token, from (first, last) times."""
    ttft = [stamps[i][0] - start for i in range(len(counts))]
    tpot = [(stamps[i][1] - stamps[i][0]) / (n - 1) for i, n in enumerate(counts) if n > 1]
    return ttft, tpot


# ------------------------------------------------------------------------------------------ engine
# ``PagedConfig.compile`` of the paged systems: None (its default: on for the CPU), or the bench's
# ``--compile on|off``, set by ``command.run`` before any system runs.
COMPILE: dict[str, bool | None] = {"compile": None}


def run_engine(
    model: torch.nn.Module,
    work: Workload,
    concurrency: int,
    prefix_caching: bool = False,
    kernel: str = "torch",
    block_size: int = BLOCK_SIZE,
) -> RunResult:
    """All requests queued at t0, then ``stream()`` until done; per-token times from its outputs.
    A ``block_size`` above the workload's leaves room to spare (``num_blocks`` stays). The warm-up
    request also compiles the forward (``PagedConfig.compile``, ``COMPILE`` here)."""
    config = PagedConfig(
        block_size=block_size, num_blocks=work.num_blocks, max_num_seqs=concurrency,
        max_batch_tokens=MAX_BATCH_TOKENS, kernel=kernel, progress_bar=False, seed=0,
        enable_prefix_caching=prefix_caching, compile=COMPILE["compile"],
    )
    gen_config = greedy_config()
    engine = ContinuousBatchingEngine(model, config, gen_config)
    if hasattr(engine.executor, "wait"):  # a compiled forward: its compile is not timed
        engine.executor.wait()
    engine.generate([WARMUP_PROMPT], max_new_tokens=2)  # allocates the pages, warms the kernels
    before = engine.stats

    cpu_start, start = time.process_time(), time.perf_counter()
    index = {engine.add_request(p, max_new_tokens=n, generation_config=gen_config): i
             for i, (p, n) in enumerate(zip(work.prompts, work.max_new_tokens))}  # fmt: skip
    stamps: dict[int, list[float]] = {}
    finals: dict[int, Any] = {}
    for out in engine.stream():
        now = time.perf_counter()
        i = index[out.request_id]
        if out.new_ids:
            stamps.setdefault(i, [now, now])[1] = now
        if out.finished:
            if out.finish_reason == "error":
                raise RuntimeError(f"engine request {out.request_id} failed: {out.error}")
            finals[i] = out
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start

    outputs = [finals[i].output_ids for i in range(work.num_requests)]
    ttft, tpot = _latencies(start, stamps, [len(o) for o in outputs])
    after = engine.stats
    stats = asdict(after)
    counters = ("num_steps", "num_generated_tokens", "busy_seconds", "forward_seconds", "num_prompt_tokens",
                "num_cached_tokens")  # cumulative: subtract the warm-up (the last two are newer fields)
    for key in counters:
        if key in stats:
            stats[key] = getattr(after, key) - getattr(before, key)
    if "num_cached_tokens" not in stats:
        stats["num_cached_tokens"] = sum(out.num_cached_tokens for out in finals.values())
    stats["prefix_hit_rate"] = stats["num_cached_tokens"] / work.prompt_tokens
    stats["tokens_per_second"] = stats["num_generated_tokens"] / stats["busy_seconds"]  # inside step() only
    overhead = stats["busy_seconds"] - stats["forward_seconds"]
    stats["overhead_per_step_ms"] = 1e3 * overhead / max(stats["num_steps"], 1)
    stats["outside_step_seconds"] = wall - stats["busy_seconds"]  # the stream loop and add_request
    return RunResult(
        system="engine+prefix" if prefix_caching else "engine", concurrency=concurrency, wall_seconds=wall,
        useful_tokens=work.new_tokens, generated_tokens=sum(map(len, outputs)), outputs=outputs,
        ttft=ttft, tpot=tpot, engine=stats, cpu_seconds=cpu, settings={"enable_prefix_caching": prefix_caching},
    )


def run_routed_generate(model: torch.nn.Module, work: Workload, concurrency: int) -> RunResult:
    """``model.generate`` on the "paged" model, same padded batches as ``hf_padded``; PagedConfig's
    defaults (prefix caching included) except for the knobs every paged system shares."""
    paged = PagedConfig(
        block_size=BLOCK_SIZE, max_num_seqs=concurrency, max_batch_tokens=MAX_BATCH_TOKENS, kernel="torch",
        progress_bar=False, seed=0, compile=COMPILE["compile"],
    )
    run = _static_batches("generate", model, work, concurrency, paged_config=paged)
    run.settings = {"enable_prefix_caching": paged.enable_prefix_caching}
    return run


# ------------------------------------------------------------------------------------ transformers
def run_hf_padded(model: torch.nn.Module, work: Workload, concurrency: int) -> RunResult:
    """transformers' ``generate`` (sdpa) in static, left-padded batches of ``concurrency``."""
    return _static_batches("hf_padded", model, work, concurrency)


def _static_batches(name: str, model: torch.nn.Module, work: Workload, size: int, **kwargs: Any) -> RunResult:
    ids, mask = (t.to(model.device) for t in left_padded([WARMUP_PROMPT]))
    model.generate(ids, attention_mask=mask, generation_config=greedy_config(max_new_tokens=2), **kwargs)
    outputs: list[list[int]] = [[] for _ in range(work.num_requests)]
    generated = 0
    cpu_start, start = time.process_time(), time.perf_counter()
    for batch in _batches(work, size):
        ids, mask = (t.to(model.device) for t in left_padded([work.prompts[i] for i in batch]))
        longest = max(work.max_new_tokens[i] for i in batch)
        config = greedy_config(max_new_tokens=longest)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config, **kwargs)
        new = out[:, ids.shape[1] :].tolist()
        generated += sum(map(len, new))
        for row, i in enumerate(batch):
            outputs[i] = new[row][: work.max_new_tokens[i]]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return RunResult(name, size, wall, work.new_tokens, generated, outputs, cpu_seconds=cpu)


def run_hf_cb(model: torch.nn.Module, work: Workload, concurrency: int) -> RunResult:
    """transformers' continuous batching with the engine's block size, cache size and token budget
    (and its own defaults otherwise: block sharing, i.e. prefix caching, is on)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb_config = ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=work.num_blocks, max_batch_tokens=MAX_BATCH_TOKENS,
        max_requests_per_batch=concurrency, auto_switch_to_flash=False, seed=0,
    )
    gen_config = greedy_config()
    gen_config.eos_token_id = -1  # what init_continuous_batching sets (with a warning) for "no EOS"
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.batch_processor = manager._create_batch_processor()  # allocate the cache before timing
    manager.start()
    try:
        _collect(manager, [manager.add_request(WARMUP_PROMPT, max_new_tokens=2)])
        cpu_start, start = time.process_time(), time.perf_counter()
        ids = [
            manager.add_request(p, max_new_tokens=n, record_timestamps=True)
            for p, n in zip(work.prompts, work.max_new_tokens)
        ]
        results = _collect(manager, ids)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    outputs = [list(results[r].generated_tokens) for r in ids]
    stamps = {i: [results[r].timestamps[0], results[r].timestamps[-1]] for i, r in enumerate(ids)}
    ttft, tpot = _latencies(start, stamps, [len(o) for o in outputs])
    generated = sum(map(len, outputs))
    settings = {"allow_block_sharing": cb_config.allow_block_sharing}
    return RunResult(
        "hf_cb", concurrency, wall, work.new_tokens, generated, outputs, ttft, tpot, cpu_seconds=cpu, settings=settings
    )


def _collect(manager: Any, ids: list[str], timeout: float = 600.0) -> dict[str, Any]:
    """Block until every request in ``ids`` has finished; returns their final GenerationOutput."""
    results: dict[str, Any] = {}
    deadline = time.perf_counter() + timeout
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"hf_cb request {result.request_id} failed: {result.error}")
            results[result.request_id] = result
        elif result is None and (not manager.is_running() or time.perf_counter() > deadline):
            raise RuntimeError(f"hf_cb stopped with {len(ids) - len(results)} requests unfinished")
    return results


SYSTEMS: dict[str, Callable[[torch.nn.Module, Workload, int], RunResult]] = {
    "engine": run_engine,
    "engine+prefix": lambda model, work, c: run_engine(model, work, c, prefix_caching=True),
    "generate": run_routed_generate,
    "hf_cb": run_hf_cb,
    "hf_padded": run_hf_padded,
}
MODEL_KIND = {"engine": "paged", "engine+prefix": "paged", "generate": "paged", "hf_cb": "cb", "hf_padded": "sdpa"}
STATIC = {"generate", "hf_padded"}  # systems whose concurrency is a static batch size
