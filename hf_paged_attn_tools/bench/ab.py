"""A/B benchmarks: two variants run alternating in one process, so both see the same host.

``report`` prints each variant's runs and median, the ratio of the second's median to the first's with each
round's ratio, and how many requests got the same tokens from both (``benchmarks/*_ab.py`` use it too).
``run_ab`` is ``hf-paged-attn bench --ab A B``: the engine on a workload with two ``PagedConfig`` overrides."""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any


def report(walls: dict[str, list[float]], tokens: dict[str, list[list[int]]], about: str) -> None:
    """``walls``: two variants' run times in seconds, in round order (the faster one expected first);
    ``tokens``: each variant's last output ids per request; ``about``: the workload, for the last line."""
    (first, firsts), (second, seconds) = walls.items()
    for name, runs in walls.items():
        print(f"{name:8s}: runs {', '.join(f'{w:.3f}' for w in runs)} s, median {statistics.median(runs):.3f} s")
    per_round = ", ".join(f"{b / a:.3f}" for a, b in zip(firsts, seconds))
    same = sum(a == b for a, b in zip(tokens[first], tokens[second]))
    ratio = statistics.median(seconds) / statistics.median(firsts)
    print(f"{second} / {first}: {ratio:.3f} (per round {per_round}); same tokens {same}/{len(tokens[first])}; {about}")


def run_ab(work: Any, variants: dict[str, dict[str, Any]], rounds: int = 3, threads: int = 2) -> dict[str, Any]:
    """Run ``work`` (a ``workloads.Workload``) on the engine once per variant and round, alternating; each
    variant is a dict of ``PagedConfig`` fields over the benchmark's engine settings. One model, one
    process; a warm-up pass per variant first (the compile, the thread tuner). Prints and returns the runs."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from hf_paged_attn.runtime.config import PagedConfig
    from hf_paged_attn.runtime.engine import ContinuousBatchingEngine
    from hf_paged_attn_tools.bench.runner import DTYPE
    from hf_paged_attn_tools.bench.systems import greedy_config
    from hf_paged_attn_tools.bench.workloads import BLOCK_SIZE, MAX_BATCH_TOKENS

    torch.set_num_threads(threads)
    base = {"block_size": BLOCK_SIZE, "num_blocks": work.num_blocks, "max_num_seqs": work.headline["continuous"],
            "max_batch_tokens": MAX_BATCH_TOKENS, "kernel": "torch", "progress_bar": False, "seed": 0,
            "enable_prefix_caching": False}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hf_paged_attn_ab_") as directory:
        work.model.save(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged", dtype=DTYPE["dtype"])
    model.eval()
    engines = {name: ContinuousBatchingEngine(model, PagedConfig(**{**base, **over}), greedy_config())
               for name, over in variants.items()}  # fmt: skip

    def run(engine: ContinuousBatchingEngine) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = engine.generate(work.prompts, max_new_tokens=work.max_new_tokens)
        return time.perf_counter() - start, [list(o.output_ids) for o in outs]

    for engine in engines.values():
        if hasattr(engine.executor, "wait"):
            engine.executor.wait()
        run(engine)
    walls: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[list[int]]] = {}
    with tqdm(total=rounds * len(variants), desc="ab", unit="run", disable=None) as bar:
        for _ in range(rounds):
            for name, engine in engines.items():
                seconds, tokens[name] = run(engine)
                walls[name].append(seconds)
                bar.update()
    for engine in engines.values():
        engine.shutdown()
    report(walls, tokens, f"workload {work.name}, {threads} threads")
    return {"variants": variants, "walls": walls}
