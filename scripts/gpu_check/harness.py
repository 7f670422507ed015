"""The run: argument parsing, the device set-up, and ``Runner``, which runs checks one after another,
prints one line per check and its seconds, stops a check at its time budget, and at the run's time
limit (SIGTERM from ``timeout`` in gpu_check.sh) reports the running check FAIL and the rest SKIPPED.

    [PASS|FAIL|SKIPPED] <check>: <details>
      (<check>: <seconds>s, <seconds>s so far)

Without CUDA every check prints SKIPPED and the run exits 0 (``--device cpu`` runs the checks that
have a CPU variant instead); otherwise it exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TextIO

import torch

from . import __doc__ as PACKAGE_DOC
from .base import Check, Context, Fail, Skip
from .helpers import device_name, short_error


class OutOfBudget(BaseException):
    """Raised inside a check by the budget alarm. A BaseException, like KeyboardInterrupt, so that
    the engine's own ``except Exception`` (a failing step fails its requests) does not swallow it."""


@dataclass
class Result:
    check: str
    status: str  # PASS, FAIL, SKIPPED
    detail: str
    seconds: float | None = None


class Runner:
    """Runs ``checks`` on ``context`` in order. ``budget_scale`` multiplies every check's budget (0:
    no budgets). ``exit``: what ends the process at the time limit (``os._exit``: unwinding through
    CUDA work could take longer than the limit's grace; tests pass their own)."""

    def __init__(
        self,
        checks: list[Check],
        context: Context,
        budget_scale: float = 1.0,
        json_path: str | None = None,
        exit: Callable[[int], object] = os._exit,
        out: TextIO | None = None,
    ) -> None:
        self.checks = checks
        self.context = context
        self.budget_scale = budget_scale
        self.json_path = json_path
        self.exit = exit
        self.out = out
        self.results: list[Result] = []
        self.pending = [c.name for c in checks]  # not finished yet
        self.running: str | None = None
        self.run_start = time.perf_counter()
        self._armed = False  # whether the budget alarm may still stop the running check

    # ----------------------------------------------------------------------------- reporting
    def print(self, text: str) -> None:
        print(text, file=self.out or sys.stdout, flush=True)

    def report(self, status: str, check: str, detail: str, seconds: float | None = None) -> None:
        self.results.append(Result(check, status, detail, seconds))
        self.print(f"[{status}] {check}: {detail}")

    @property
    def failures(self) -> list[str]:
        return [r.check for r in self.results if r.status == "FAIL"]

    def write_json(self) -> None:
        if not self.json_path:
            return
        payload = {
            "device": device_name(self.context.device), "torch": torch.__version__,
            "results": [asdict(r) for r in self.results], "failed": len(self.failures),
        }  # fmt: skip
        with open(self.json_path, "w") as f:
            json.dump(payload, f, indent=1)

    # ----------------------------------------------------------------------------- the run
    def run(self) -> int:
        self.run_start = time.perf_counter()
        previous = signal.signal(signal.SIGTERM, self.out_of_time)
        try:
            for check in self.checks:
                check_start = time.perf_counter()
                self.running = check.name
                status, detail = self.run_one(check)
                now = time.perf_counter()
                self.report(status, check.name, detail, now - check_start)
                self.pending.remove(check.name)
                self.running = None
                self.print(f"  ({check.name}: {now - check_start:.0f}s, {now - self.run_start:.0f}s so far)")
        finally:
            signal.signal(signal.SIGTERM, previous)
        self.print(f"{len(self.results) - len(self.failures)} passed or skipped, {len(self.failures)} failed")
        self.write_json()
        return 1 if self.failures else 0

    def run_one(self, check: Check) -> tuple[str, str]:
        """(status, detail) of one check; whatever it raises is reported, never propagated (one
        broken check must not hide the others), except the run's own time limit."""
        if self.context.device.type == "cpu" and not check.cpu:
            return "SKIPPED", "no CPU variant (needs a CUDA device)"
        budget = check.budget_s * self.budget_scale
        try:
            with self.budget(budget):
                try:
                    detail = check.run(self.context)
                finally:
                    self._armed = False
            return "PASS", detail
        except OutOfBudget:
            return "FAIL", f"stopped at its budget of {budget:g}s (--budget-scale {self.budget_scale:g})"
        except Skip as exc:
            return "SKIPPED", str(exc)
        except Fail as exc:
            if exc.__cause__ is not None:  # a Fail made from an error: the error's traceback
                traceback.print_exception(exc.__cause__, file=sys.stderr)
            return "FAIL", str(exc)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            return "FAIL", short_error(exc)
        finally:
            if self.context.on_cuda:
                torch.cuda.empty_cache()

    @contextlib.contextmanager
    def budget(self, seconds: float) -> Iterator[None]:
        """SIGALRM ``seconds`` from now raises ``OutOfBudget`` in the running check (at its next
        Python bytecode: a kernel that never returns is left to the run's time limit)."""
        if seconds <= 0:
            yield
            return

        def alarm(signum: int, frame: object) -> None:
            if self._armed:
                self._armed = False
                raise OutOfBudget()

        previous = signal.signal(signal.SIGALRM, alarm)
        self._armed = True
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            self._armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def out_of_time(self, signum: int, frame: object) -> None:
        """SIGTERM: a line for the check that was running and for each one that never started, then
        exit at once."""
        elapsed = time.perf_counter() - self.run_start
        self._armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        not_started = 0
        for name in self.pending:
            if name == self.running:
                self.report("FAIL", name, f"still running when the time limit came, {elapsed:.0f}s into the run")
            else:
                self.report("SKIPPED", name, "not started: the time limit (GPU_CHECK_TIMEOUT) came first")
                not_started += 1
        self.print(f"stopped at the time limit: {len(self.failures)} failed, {not_started} not started")
        self.write_json()
        self.exit(1)


# --------------------------------------------------------------------------------- set-up, CLI
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check", description=PACKAGE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="", help="comma-separated check prefixes (e.g. kernels/triton,greedy)")
    cpu = "cpu: the checks that have a CPU variant, tiny, Triton through its interpreter"
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=cpu)
    parser.add_argument("--tiny", action="store_true", help="the same as --device cpu (older name)")
    parser.add_argument("--list", action="store_true", help="print the checks in run order and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="import every check and resolve every API it uses; no device needed")  # fmt: skip
    scale = float(os.environ.get("GPU_CHECK_BUDGET_SCALE", 1))
    budget = "multiplies every check's time budget; 0 turns budgets off (default: env GPU_CHECK_BUDGET_SCALE or 1)"
    parser.add_argument("--budget-scale", type=float, default=scale, help=budget)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.tiny:
        args.device = "cpu"
    if args.budget_scale < 0:
        parser.error(f"--budget-scale must be >= 0, got {args.budget_scale}")
    return args


def select(checks: list[Check], only: str) -> list[Check]:
    """The checks whose name starts with one of ``only``'s comma-separated prefixes (all if empty);
    ValueError naming a prefix that matches none (a typo would otherwise run nothing, silently)."""
    prefixes = [p.strip() for p in only.split(",") if p.strip()]
    for prefix in prefixes:
        if not any(c.name.startswith(prefix) for c in checks):
            raise ValueError(f"--only {prefix!r} matches no check; the checks: {', '.join(c.name for c in checks)}")
    return [c for c in checks if not prefixes or any(c.name.startswith(p) for p in prefixes)]


def prepare_cpu() -> None:
    """The CPU dry run's set-up: Triton through its interpreter (set before triton is first
    imported; a triton_ops imported already is rebuilt), and the Triton backend accepted on the CPU
    (its ``is_available`` says no to anything but CUDA, so that an engine would refuse it)."""
    os.environ["TRITON_INTERPRET"] = "1"
    if importlib.util.find_spec("triton") is None:
        return
    ops = sys.modules.get("hf_paged_attn.kernels.triton_ops")
    if ops is not None and not getattr(ops, "_INTERPRETED", False):
        importlib.reload(ops)
    from hf_paged_attn.kernels.triton_backend import TritonBackend

    on_gpu = TritonBackend.is_available
    TritonBackend.is_available = staticmethod(lambda device: device.type == "cpu" or on_gpu(device))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .registry import load_checks

    if args.device == "cpu" and not (args.list or args.dry_run):
        prepare_cpu()  # before any check module could import triton
    checks = load_checks()
    if args.list:
        for check in checks:
            print(f"{check.name}  budget {check.budget_s:.0f}s{'  (cpu variant)' if check.cpu else ''}")
        return 0
    if args.dry_run:
        from .apis import dry_run

        return dry_run(checks)
    try:
        wanted = select(checks, args.only)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    device = torch.device(args.device)
    context = Context(device, tiny=device.type == "cpu")
    runner = Runner(wanted, context, args.budget_scale, args.json)
    if device.type == "cuda" and not torch.cuda.is_available():
        for check in wanted:
            runner.report("SKIPPED", check.name, "no CUDA device")
        runner.write_json()
        return 0
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the log is read as lines: no bar per model load
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references and backends stay IEEE fp32
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    else:
        print(f"device: cpu (Triton through its interpreter, figures meaningless), torch {torch.__version__}",
              flush=True)  # fmt: skip
    try:
        return runner.run()
    finally:
        if context.workdir:
            shutil.rmtree(context.workdir, ignore_errors=True)  # the models the checks saved
