"""Turn runs into the JSON report, the printed table and the throughput-vs-concurrency plot."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from hf_paged_attn_tools.bench.systems import STATIC, RunResult
from hf_paged_attn_tools.bench.workloads import Workload

BASELINES = ("hf_cb", "hf_padded")


def default_out_dir() -> Path:
    """The user's cache folder for results (not the current directory, which may be anything)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "hf_paged_attn" / "bench"


def _pct(values: list[float] | None, q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run_record(run: RunResult, bound: dict[str, Any], reference: RunResult | None) -> dict[str, Any]:
    """JSON record of one run: throughput, fraction of the bound, latency percentiles (ms)."""
    record: dict[str, Any] = {
        "system": run.system,
        "concurrency": run.concurrency,
        "wall_seconds": run.wall_seconds,
        "useful_tokens": run.useful_tokens,
        "generated_tokens": run.generated_tokens,
        "tokens_per_second": run.tokens_per_second,
        "fraction_of_bound": bound["seconds"] / run.wall_seconds,
        "cpu_seconds": run.cpu_seconds,
        "tokens_per_cpu_second": run.useful_tokens / run.cpu_seconds if run.cpu_seconds else None,
        "fraction_of_bound_cpu": bound["cpu_seconds"] / run.cpu_seconds if run.cpu_seconds else None,
    }
    if "seconds_unique_prefix" in bound:
        record["fraction_of_bound_unique_prefix"] = bound["seconds_unique_prefix"] / run.wall_seconds
    for name, values in (("ttft", run.ttft), ("tpot", run.tpot)):
        for q in (50, 99):
            value = _pct(values, q)
            record[f"{name}_p{q}_ms"] = None if value is None else 1e3 * value
    if reference is not None:
        same = sum(a == b for a, b in zip(run.outputs, reference.outputs))
        record["same_tokens_as_engine"] = same / len(reference.outputs)
    if run.settings:
        record["settings"] = run.settings
    if run.engine is not None:
        record["engine"] = run.engine
    return record


def headline_runs(runs: list[RunResult], work: Workload) -> dict[str, RunResult]:
    """Per system, the run at the workload's headline concurrency (else its largest)."""
    chosen: dict[str, RunResult] = {}
    for run in runs:
        want = work.headline["static" if run.system in STATIC else "continuous"]
        best = chosen.get(run.system)
        if best is None or run.concurrency == want or (best.concurrency != want and run.concurrency > best.concurrency):
            chosen[run.system] = run
    return chosen


def build_report(work: Workload, runs: list[RunResult], bound: dict[str, Any], environment: dict[str, Any]) -> dict:
    """The whole JSON document (see docs/performance.md for every field)."""
    reference = next((r for r in runs if r.system == "engine"), None)
    records = [run_record(r, bound, reference) for r in runs]
    heads = headline_runs(runs, work)
    headline: dict[str, Any] = {}
    for system, run in heads.items():
        entry = next(rec for rec, r in zip(records, runs) if r is run)
        entry = {k: v for k, v in entry.items() if k != "engine"}
        for base in BASELINES:
            if base in heads and base != system:
                entry[f"ratio_to_{base}"] = run.tokens_per_second / heads[base].tokens_per_second
        headline[system] = entry
    report: dict[str, Any] = {
        "workload": work.describe(),
        "environment": environment,
        "bound": bound,
        "headline": headline,
        "runs": records,
        "sweep": _sweep(runs),
    }
    if "engine" in heads:
        report["engine"] = _engine_summary(next(rec for rec, r in zip(records, runs) if r is heads["engine"]))
    return report


def _engine_summary(record: dict[str, Any]) -> dict[str, Any]:
    stats = record["engine"]
    return {
        "concurrency": record["concurrency"],
        "tokens_per_second": record["tokens_per_second"],
        **{k: record[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")},
        **{k: stats[k] for k in ("peak_used_blocks", "num_blocks", "kv_waste_at_peak", "num_preemptions",
                                 "num_steps", "busy_seconds", "forward_seconds", "overhead_per_step_ms",
                                 "outside_step_seconds", "num_cached_tokens", "prefix_hit_rate")},
        "overhead_fraction": 1.0 - stats["forward_seconds"] / stats["busy_seconds"] if stats["busy_seconds"] else 0.0,
    }


def _sweep(runs: list[RunResult]) -> dict[str, list[list[float]]]:
    sweep: dict[str, list[list[float]]] = {}
    for run in runs:
        sweep.setdefault(run.system, []).append([run.concurrency, run.tokens_per_second])
    return {k: sorted(v) for k, v in sweep.items()}


def format_table(report: dict[str, Any]) -> str:
    """Human-readable summary: one line per run, then the headline ratios and engine figures."""
    bound = report["bound"]
    lines = [
        f"workload {report['workload']['name']}: {report['workload']['num_requests']} requests, "
        f"{report['workload']['prompt_tokens']} prompt + {report['workload']['new_tokens']} new tokens; "
        f"forward-only bound {bound['tokens_per_second']:.0f} new tok/s ({bound['seconds']:.2f} s)",
        f"{'system':<14}{'conc':>5}{'tok/s':>9}{'wall s':>9}{'bound':>7}{'cpu':>6}{'TTFT p50/p99 ms':>18}"
        f"{'TPOT p50/p99 ms':>18}{'same':>6}",
    ]
    for rec in report["runs"]:
        lat = [_ms(rec[f"{n}_p{q}_ms"]) for n in ("ttft", "tpot") for q in (50, 99)]
        same = rec.get("same_tokens_as_engine")
        lines.append(
            f"{rec['system']:<14}{rec['concurrency']:>5}{rec['tokens_per_second']:>9.1f}{rec['wall_seconds']:>9.2f}"
            f"{rec['fraction_of_bound']:>7.2f}{rec['fraction_of_bound_cpu'] or 0:>6.2f}"
            f"{lat[0] + '/' + lat[1]:>18}{lat[2] + '/' + lat[3]:>18}"
            f"{'' if same is None else f'{same:.2f}':>6}"
        )
    for rec in report["runs"]:
        hit = (rec.get("engine") or {}).get("prefix_hit_rate")
        if hit:
            lines.append(f"{rec['system']} @{rec['concurrency']}: {hit:.1%} of prompt tokens from the prefix cache")
    for system, entry in report["headline"].items():
        ratios = ", ".join(f"{k[9:]} x{v:.2f}" for k, v in entry.items() if k.startswith("ratio_to_"))
        lines.append(f"headline {system} @{entry['concurrency']}: {entry['tokens_per_second']:.1f} tok/s"
                     + (f" ({ratios})" if ratios else ""))
    if "engine" in report:
        e = report["engine"]
        lines.append(
            f"engine: peak {e['peak_used_blocks']}/{e['num_blocks']} blocks, "
            f"KV waste at peak {e['kv_waste_at_peak']:.1%}, {e['num_preemptions']} preemptions, "
            f"{e['num_steps']} steps, overhead {e['overhead_per_step_ms']:.2f} ms/step "
            f"({e['overhead_fraction']:.1%} of step time)"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def plot(report: dict[str, Any], path: Path) -> Path:
    """PNG of new tokens/s against concurrency per system, the bound as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, points in report["sweep"].items():
        xs, ys = zip(*points)
        label = f"{system} ({'static batches' if system in STATIC else 'continuous'})"
        ax.plot(xs, ys, marker="o", label=label)
    ax.axhline(report["bound"]["tokens_per_second"], color="grey", linestyle="--", label="forward-only bound")
    ax.set_xscale("log", base=2)
    levels = sorted({c for points in report["sweep"].values() for c, _ in points})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent requests (max_num_seqs / static batch size)")
    ax.set_ylabel("new tokens / s")
    work = report["workload"]
    ax.set_title(f"{work['name']}: {work['num_requests']} requests, {report['environment']['threads']} CPU threads")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
