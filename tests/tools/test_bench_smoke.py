"""The benchmark's smoke configuration, run in-process: every JSON field present and sane."""

from __future__ import annotations

import json
import math

import pytest

from hf_paged_attn.cli import main as cli_main
from hf_paged_attn_tools.bench import run

SYSTEMS = ("engine", "generate", "hf_cb", "hf_padded")
RUN_FIELDS = (
    "system", "concurrency", "wall_seconds", "useful_tokens", "generated_tokens", "tokens_per_second",
    "fraction_of_bound", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
)
ENGINE_FIELDS = (
    "concurrency", "tokens_per_second", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
    "peak_used_blocks", "num_blocks", "kv_waste_at_peak", "num_preemptions", "num_steps", "busy_seconds",
    "forward_seconds", "overhead_per_step_ms", "outside_step_seconds", "overhead_fraction", "prefix_hit_rate",
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # One thread: the tiny model gains nothing from two, and a busy CI machine punishes spinning OpenMP threads.
    report = run(["--smoke", "--out", str(out), "--threads", "1"])
    return report, out


def test_files_written(smoke):
    report, out = smoke
    assert json.loads((out / "smoke.json").read_text()) == json.loads(json.dumps(report))
    png = out / "smoke_throughput.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_system_ran_and_agrees(smoke):
    report, _ = smoke
    assert set(report["headline"]) == set(SYSTEMS)
    workload = report["workload"]
    assert workload["num_requests"] == 6 and workload["new_tokens"] == 48
    longest = workload["max_new_tokens_min_max"][1]
    for rec in report["runs"]:
        for name in RUN_FIELDS:
            assert name in rec, f"{rec['system']}: {name} missing"
        # the figures are the counts over the measured time, nothing else
        assert 0 < rec["wall_seconds"] < math.inf
        assert rec["useful_tokens"] == 48
        assert math.isclose(rec["tokens_per_second"], 48 / rec["wall_seconds"], rel_tol=1e-12)
        assert math.isclose(rec["fraction_of_bound"], report["bound"]["seconds"] / rec["wall_seconds"], rel_tol=1e-12)
        if rec["system"] in ("engine", "hf_cb"):  # EOS off: each request emits exactly its max_new_tokens
            assert rec["generated_tokens"] == 48, rec
        else:  # static batches run to their longest request
            assert 48 <= rec["generated_tokens"] <= 6 * longest, rec
        if rec["system"] == "engine":  # the engine's own counter, inside step() only
            stats = rec["engine"]
            assert stats["num_generated_tokens"] == 48
            assert 0 < stats["busy_seconds"] <= rec["wall_seconds"]
            assert math.isclose(stats["tokens_per_second"], 48 / stats["busy_seconds"], rel_tol=1e-12)
        assert 0 < rec["fraction_of_bound"] < 1.5, rec
        for name in ("ttft", "tpot"):
            p50, p99 = rec[f"{name}_p50_ms"], rec[f"{name}_p99_ms"]
            if rec["system"] in ("engine", "hf_cb"):
                assert 0 < p50 <= p99, (rec["system"], name, p50, p99)
            else:
                assert p50 is None and p99 is None  # static batches give no per-token timestamps
        if rec["system"] in ("engine", "generate", "hf_cb"):
            assert rec["settings"], rec["system"]
        # Greedy with random weights: every system must produce the engine's tokens.
        assert rec["same_tokens_as_engine"] == 1.0, rec["system"]


def test_headline_ratios_and_bound(smoke):
    report, _ = smoke
    bound = report["bound"]
    assert 0 < bound["seconds"] < math.inf
    assert math.isclose(bound["tokens_per_second"], 48 / bound["seconds"], rel_tol=1e-12)
    assert bound["head_seconds_per_token"] > 0 and bound["best_body_tokens_per_second"] > 0
    for system, entry in report["headline"].items():
        ratios = {k: v for k, v in entry.items() if k.startswith("ratio_to_")}
        expected = {f"ratio_to_{b}" for b in ("hf_cb", "hf_padded") if b != system}
        assert set(ratios) == expected, system
        for key, ratio in ratios.items():
            base = report["headline"][key.removeprefix("ratio_to_")]
            assert math.isclose(ratio, entry["tokens_per_second"] / base["tokens_per_second"], rel_tol=1e-12)
    assert report["sweep"]["engine"][0][0] == 1 and len(report["sweep"]["engine"]) == 2


def test_engine_figures(smoke):
    report, _ = smoke
    engine = report["engine"]
    for name in ENGINE_FIELDS:
        assert name in engine, name
    assert 0 < engine["peak_used_blocks"] <= engine["num_blocks"]
    assert 0.0 <= engine["kv_waste_at_peak"] < 1.0
    assert engine["num_preemptions"] == 0
    assert engine["prefix_hit_rate"] == 0.0  # "engine" runs with prefix caching off
    assert engine["num_steps"] > 0 and engine["forward_seconds"] <= engine["busy_seconds"]
    assert engine["overhead_per_step_ms"] >= 0 and 0 <= engine["overhead_fraction"] < 1
    assert 0 < engine["ttft_p50_ms"] <= engine["ttft_p99_ms"] and 0 < engine["tpot_p50_ms"] <= engine["tpot_p99_ms"]


def test_cli_rejects_unknown_command(capsys):
    with pytest.raises(SystemExit):
        cli_main(["nope"])
    assert cli_main([]) == 2


def test_profile_breakdown(capsys):
    """--profile: every step is counted once, its parts add up to it, and each part was really timed."""
    result = run(["--smoke", "--profile", "--threads", "1"])
    steps = result["steps"]
    assert steps["mixed"]["steps"] >= 1 and steps["decode"]["steps"] >= 1  # prefill, then decode steps
    assert steps["all"]["steps"] == steps["mixed"]["steps"] + steps["decode"]["steps"]
    for row in steps.values():
        parts = sum(row[f"{part}_ms"] for part in ("host", "attention", "linear", "other"))
        assert math.isclose(parts, row["step_ms"], rel_tol=1e-6)
        assert row["attention_ms"] > 0 and row["linear_ms"] > 0 and row["host_ms"] > 0
    assert "attention ms" in capsys.readouterr().out
