"""scripts/soak.py in small: its main() runs end to end, passes, and its checks are not vacuous."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def soak() -> Iterator[ModuleType]:
    """scripts/soak.py imported as a module (scripts/ is not a package)."""
    name = "hf_paged_attn_soak_script"
    spec = importlib.util.spec_from_file_location(name, SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def test_soak_main_with_80_mixed_requests(soak, tmp_path, capsys):
    report_path = tmp_path / "soak.json"
    argv = ["--requests", "80", "--abort-rate", "0.2", "--abort-within", "20"]
    assert soak.main([*argv, "--json", str(report_path)]) == 0
    assert "RESULT: PASS" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["requests"] == 80 and report["errors"] == 0
    assert set(report["kinds"]) == {"greedy", "sampled", "family", "beam", "constrained", "speculative", "failing"}
    assert report["leaked_blocks"] == 0 and not report["block_problems"] and not report["terminal_problems"]
    # the run exercised what the soak is for
    assert report["preemptions"] > 0 and report["aborted"] > 0 and report["prefix_hit_rate"] > 0
    assert report["planted_errors"] > 0  # a caller's failing processor failed its request alone
    assert report["alone_checked"] >= report["completed"] - 10 and not report["alone_problems"]


def test_soak_fails_on_a_leaked_block(soak, monkeypatch):
    """A planted leak (an aborted running request's blocks never freed) makes the run fail."""
    from hf_paged_attn.core.scheduler import Scheduler

    remove = Scheduler.remove

    def leaky_remove(self, request):
        if request.finish_reason == "abort" and request in self.running:  # an abort of a running request
            self.running.remove(request)
            request.block_ids = []
            return
        remove(self, request)

    monkeypatch.setattr(Scheduler, "remove", leaky_remove)
    report = soak.run_soak(soak.SoakConfig(requests=40, abort_rate=0.5, abort_within=10, check=0, mix="greedy=1"))
    assert not report.ok and report.leaked_blocks > 0 and report.block_problems
