"""scripts/gpu_check/ without a GPU: the harness (registry order, argument parsing, per-check
budgets, the time limit's SIGTERM), the dry run that resolves every API the checks use, and the
parity checks' CPU variants (tiny shapes, Triton through its interpreter), judged as on a GPU.

The CPU runs and the dry run go through ``scripts/gpu_check.sh`` in a subprocess: ``--device cpu``
sets ``TRITON_INTERPRET`` and lets the Triton backend run on the CPU, which must not leak into the
other tests, and the dry run imports the Triton kernels. The harness itself is tested in-process
with fake checks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
LINE = re.compile(r"^\[(PASS|FAIL|SKIPPED)\] (\S+): ")
# The parity checks whose CPU variants run in seconds (the Triton interpreter takes ~0.3 s per call).
CPU_PARITY = ("lora", "kernels", "greedy/fp32", "greedy/bf16/torch", "graphs/fp32", "e2e/fp32-parity", "cascade",
              "mixed", "speculative", "prompt-logprobs", "structured")  # fmt: skip
FIGURES = ("bandwidth/", "splitk/", "graphs/bf16", "e2e/bf16", "throughput/")


@pytest.fixture(scope="module")
def gpu_check() -> Iterator[ModuleType]:
    """The ``gpu_check`` package from scripts/ (what gpu_check.sh puts on the path)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_check.harness  # noqa: F401 - its submodules, as the tests use them

        yield sys.modules["gpu_check"]
    finally:
        sys.path.remove(str(SCRIPTS))


def run_script(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    environ.pop("TRITON_INTERPRET", None)  # the script sets it itself where it must
    return subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), *args], capture_output=True, text=True, timeout=timeout, env=environ,
        cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def statuses(stdout: str) -> dict[str, str]:
    return {m.group(2): m.group(1) for m in map(LINE.match, stdout.splitlines()) if m}


def fake(gpu_check: ModuleType, name: str, run, budget: float = 30.0):
    return gpu_check.base.Check(name, run, budget, cpu=True)


def cpu_runner(gpu_check: ModuleType, checks: list, **kwargs):
    context = gpu_check.base.Context(torch.device("cpu"), tiny=True)
    return gpu_check.harness.Runner(checks, context, **kwargs)


# ----------------------------------------------------------------------------------- registry
def test_registry_runs_parity_first_and_figures_after(gpu_check):
    from gpu_check.registry import ORDER, load_checks

    checks = load_checks()
    names = [c.name for c in checks]
    assert names == list(ORDER) and len(set(names)) == len(names)
    # a lent GPU's minutes are few: the checks that can fail run first, the figures (which only measure)
    # after, throughput last
    first_figure = min(i for i, n in enumerate(names) if n.startswith(FIGURES))
    assert all(n.startswith(FIGURES) for n in names[first_figure:]) and names[-1] == "throughput/bf16"
    assert not any(n.startswith(FIGURES) for n in names[:first_figure])
    for check in checks:
        assert check.budget_s > 0 and check.module.startswith("gpu_check.checks."), check
        assert check.cpu, f"{check.name}: every check has a CPU variant, so a test runs its code"


def test_arguments(gpu_check):
    from gpu_check.harness import parse_args, select
    from gpu_check.registry import load_checks

    args = parse_args(["--tiny", "--only", "kernels/torch,greedy", "--json", "out.json", "--budget-scale", "2"])
    assert (args.device, args.only, args.json, args.budget_scale) == ("cpu", "kernels/torch,greedy", "out.json", 2.0)
    assert parse_args([]).device == "cuda" and parse_args([]).budget_scale == 1.0
    with pytest.raises(SystemExit):
        parse_args(["--budget-scale", "-1"])
    checks = load_checks()
    chosen = [c.name for c in select(checks, "kernels/torch,greedy/bf16")]
    assert chosen == ["kernels/torch/fp32", "kernels/torch/bf16", "greedy/bf16/torch", "greedy/bf16/triton",
                      "greedy/bf16/flash"]  # fmt: skip
    assert len(select(checks, "")) == len(checks)
    with pytest.raises(ValueError, match="'kernel/torch' matches no check"):
        select(checks, "kernels,kernel/torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the checks would run")
def test_without_cuda_every_check_is_skipped(gpu_check, capsys, tmp_path):
    from gpu_check.harness import main

    assert main(["--only", "kernels,mixed", "--json", str(tmp_path / "r.json")]) == 0
    found = statuses(capsys.readouterr().out)
    assert len(found) == 8 and set(found.values()) == {"SKIPPED"}
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [r["check"] for r in results] == list(found) and {r["detail"] for r in results} == {"no CUDA device"}


# ------------------------------------------------------------------------ budgets, outcomes
def test_outcomes_and_budgets(gpu_check, capsys, tmp_path):
    """A check over its budget is stopped and FAILs, even inside an ``except Exception`` (the
    engine's own); the run goes on; Skip, Fail and errors become their lines; seconds are printed."""
    from gpu_check.base import Fail, Skip

    def stubborn(ctx) -> str:
        try:
            time.sleep(30)
        except Exception:  # the engine turns a failing step into failed requests and goes on
            time.sleep(30)
        return "never"

    def skip(ctx) -> str:
        raise Skip("backend unavailable (none here)")

    def fail(ctx) -> str:
        raise Fail("token 3 is 7, sdpa gives 9")

    def error(ctx) -> str:
        raise RuntimeError("boom")

    checks = [fake(gpu_check, "fake/slow", stubborn, budget=0.5), fake(gpu_check, "fake/pass", lambda ctx: "fine"),
              fake(gpu_check, "fake/skip", skip), fake(gpu_check, "fake/fail", fail),
              fake(gpu_check, "fake/error", error),
              gpu_check.base.Check("fake/gpu-only", lambda ctx: "ran", 30)]  # fmt: skip
    runner = cpu_runner(gpu_check, checks, json_path=str(tmp_path / "r.json"))
    start = time.perf_counter()
    assert runner.run() == 1
    assert time.perf_counter() - start < 10
    out = capsys.readouterr().out
    assert statuses(out) == {
        "fake/slow": "FAIL", "fake/pass": "PASS", "fake/skip": "SKIPPED", "fake/fail": "FAIL", "fake/error": "FAIL",
        "fake/gpu-only": "SKIPPED",
    }  # fmt: skip
    assert "[SKIPPED] fake/gpu-only: no CPU variant (needs a CUDA device)" in out
    assert "[FAIL] fake/slow: stopped at its budget of 0.5s (--budget-scale 1)" in out
    assert "[FAIL] fake/error: RuntimeError: boom" in out and "[PASS] fake/pass: fine" in out
    assert re.search(r"^  \(fake/pass: \d+s, \d+s so far\)$", out, re.M)
    assert out.rstrip().endswith("3 passed or skipped, 3 failed")
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["failed"] == 3 and results["results"][0]["seconds"] < 5
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.default_int_handler, None)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)

    # budget scale 0: no budget at all; a fast check is never interrupted by a stale alarm
    quick = cpu_runner(gpu_check, [fake(gpu_check, "fake/quick", lambda ctx: time.sleep(0.3) or "ok", budget=0.1)],
                       budget_scale=0)  # fmt: skip
    assert quick.run() == 0


def test_time_limit_in_process(gpu_check, capsys):
    """SIGTERM while a check runs: that check FAILs, the ones after it are SKIPPED, the run exits 1."""

    def terminated(ctx) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        return "never"

    exits = []

    def exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    ok = lambda ctx: "ok"  # noqa: E731
    checks = [fake(gpu_check, "fake/first", ok), fake(gpu_check, "fake/running", terminated),
              fake(gpu_check, "fake/next", ok), fake(gpu_check, "fake/last", ok)]  # fmt: skip
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        cpu_runner(gpu_check, checks, exit=exit).run()
    assert exits == [1] and signal.getsignal(signal.SIGTERM) == before
    out = capsys.readouterr().out
    assert statuses(out) == {
        "fake/first": "PASS",
        "fake/running": "FAIL",
        "fake/next": "SKIPPED",
        "fake/last": "SKIPPED",
    }
    assert (
        "still running when the time limit came" in out and "stopped at the time limit: 1 failed, 2 not started" in out
    )


def test_time_limit_in_a_real_process(tmp_path):
    """The same through a real SIGTERM and ``os._exit``, as ``timeout`` in gpu_check.sh sends it."""
    code = textwrap.dedent(
        """
        import sys, time, torch
        from gpu_check.base import Check, Context
        from gpu_check.harness import Runner

        def running(ctx):
            print("started", flush=True)
            time.sleep(60)

        checks = [Check("fake/first", lambda ctx: "ok", 30, cpu=True), Check("fake/running", running, 120, cpu=True),
                  Check("fake/next", lambda ctx: "ok", 30, cpu=True)]
        sys.exit(Runner(checks, Context(torch.device("cpu")), json_path=sys.argv[1]).run())
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    report = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-c", code, str(report)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while "started" not in lines and time.monotonic() < deadline:
            lines.append(proc.stdout.readline().strip())
        assert "started" in lines, lines
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "\n".join(lines) + "\n" + rest
    assert proc.returncode == 1, out
    assert statuses(out) == {"fake/first": "PASS", "fake/running": "FAIL", "fake/next": "SKIPPED"}
    results = json.loads(report.read_text())["results"]
    assert [r["status"] for r in results] == ["PASS", "FAIL", "SKIPPED"]


# ---------------------------------------------------------------------------------- dry run
@pytest.mark.slow  # ~17 s: imports every check's kernels in a subprocess
def test_dry_run_resolves_every_api_of_every_check():
    proc = run_script("--dry-run", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    from_list = run_script("--list", timeout=120)
    assert from_list.returncode == 0, from_list.stderr
    names = [line.split()[0] for line in from_list.stdout.splitlines()]
    assert [line.split()[1].rstrip(":") for line in lines] == names and len(names) == 27
    assert all(line.startswith("[OK] ") for line in lines), lines
    assert proc.stdout.rstrip().endswith("dry run: 27 checks resolved, 0 with missing APIs")


def test_dry_run_reports_what_is_gone(gpu_check, capsys):
    """The dry run is not vacuous: removed names, attributes and keyword parameters are reported."""
    from gpu_check.apis import check_import, check_use, dry_run
    from gpu_check.base import Check

    assert check_use("hf_paged_attn.runtime.cuda_graphs:CudaGraphExecutor.num_replays") is None  # set in __init__
    assert check_use("hf_paged_attn.attention.step:StepMetadata.groups") is None  # a dataclass field
    assert check_use("hf_paged_attn:ContinuousBatchingEngine(model, config, launcher)") is None
    gone = [
        "hf_paged_attn:ContinuousBatchingEngine.graphs",  # now engine.executor
        "hf_paged_attn:ContinuousBatchingEngine._forward",
        "hf_paged_attn.attention.cache:PagedAttentionCache.step",  # now cache.forward(context)
        "hf_paged_attn.attention.cache:PagedLayer.gather",
        "hf_paged_attn.kernels.torch_backend:TorchBackend.varlen_attention",
        "hf_paged_attn.runtime.cuda_graphs:DecodeGraphs",
        # the protocol's decode has no num_splits (triton_ops' launcher does)
        "hf_paged_attn.kernels.base:AttentionBackend.paged_decode_attention(q, num_splits)",
        # a parameter only **kwargs would take is not accepted
        "transformers:LlamaForCausalLM.forward(past_key_values)",
    ]
    for spec in gone:
        assert check_use(spec) is not None, spec
    assert check_import("hf_paged_attn.attention", "step") is None
    assert check_import("hf_paged_attn.attention.step", "build_step") is None
    assert check_import("hf_paged_attn.kernels", "triton_backend_varlen") is not None
    broken = Check("fake/broken", lambda ctx: "", 1, uses=("hf_paged_attn.attention.cache:PagedLayer.gather",),
                   module="gpu_check.checks.cascade")  # fmt: skip
    assert dry_run([broken]) == 1
    assert "[FAIL] fake/broken: 1 of" in capsys.readouterr().out


# ------------------------------------------------------------------------ the checks on a CPU
@pytest.mark.slow  # ~2 min under the Triton interpreter; the in-suite kernel and parity tests check the same code
def test_parity_checks_pass_on_the_cpu(tmp_path):
    """Every parity check with a CPU variant, through gpu_check.sh: each PASSes (flash SKIPs: not
    installed here), judged by the same tolerances as on a GPU."""
    report = tmp_path / "cpu.json"
    proc = run_script("--device", "cpu", "--only", ",".join(CPU_PARITY), "--json", str(report), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = {r["check"]: r for r in json.loads(report.read_text())["results"]}
    assert statuses(proc.stdout) == {name: r["status"] for name, r in results.items()}
    for name, result in results.items():
        want = "SKIPPED" if "flash" in name else "PASS"
        assert result["status"] == want, (name, result["detail"])
    assert len(results) == 19
    assert {"greedy/fp32/triton", "graphs/fp32", "mixed/split", "structured/fp32"} <= set(results)
    assert re.search(r"twin draft \d+ steps, [1-9]\d*/", results["speculative/fp32"]["detail"])
    # not vacuous: cases ran, steps were compared, graphs replayed, prefill read from the pages
    assert results["kernels/triton/fp32"]["detail"].startswith("12 cases")
    assert results["lora/kernels"]["detail"].startswith("12 cases")
    assert re.search(r"\([1-9]\d* changed by their adapter\), 48/48 steps", results["lora/engine-fp32"]["detail"])
    assert results["kernels/torch/bf16"]["detail"].startswith("9 cases")
    assert re.search(r"buckets \[1, 2, 4\] captured once, \d+ replays", results["graphs/fp32"]["detail"])
    assert re.search(r"[1-9]\d* paged prefill calls", results["e2e/fp32-parity"]["detail"])
    assert re.search(r"[1-9]\d* cascades", results["cascade/fp32"]["detail"])
    for name in ("greedy/fp32/torch", "greedy/fp32/triton"):
        compared, total = map(int, re.search(r"(\d+)/(\d+) steps compared", results[name]["detail"]).groups())
        assert compared >= total // 2 > 0, results[name]["detail"]


@pytest.mark.slow
def test_every_check_runs_on_the_cpu(tmp_path):
    """The figure checks' CPU variants too (and greedy/bf16/triton): their code runs end to end
    (the figures themselves mean nothing on a CPU)."""
    report = tmp_path / "cpu.json"
    proc = run_script("--device", "cpu", "--json", str(report), timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = json.loads(report.read_text())["results"]
    assert len(results) == 29
    for result in results:
        want = "SKIPPED" if "flash" in result["check"] else "PASS"
        assert result["status"] == want, result


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90():
    """scripts/triton_compile_check.py --quick: the Triton kernels of kernels/triton_ops.py and lora_triton.py
    compile for an H100/H200 without a GPU (it relies on Triton internals: exit 2 if its stand-in driver fails)."""
    import triton  # noqa: F401
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "triton_compile_check.py"), "--quick"], capture_output=True,
                          text=True, timeout=900, env=env, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^\d+ cases compiled for sm_90, 0 failed", proc.stdout, re.M), proc.stdout[-2000:]
