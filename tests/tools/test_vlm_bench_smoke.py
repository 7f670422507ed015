"""The VLM benchmark's plumbing (``benchmarks/vlm_generate.py``) on the tiny LLaVA: a few requests, one round,
the eager engine and sdpa's batches; the figures are the script's, this checks it runs and agrees."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vlm_generate.py"


def test_vlm_benchmark_runs_and_tokens_agree(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("vlm_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    # eager only: the compiled systems would spend their compile (tens of seconds) on a 3-token run
    module.main(["--model", "tiny", "--requests", "10", "--new", "3", "--rounds", "1", "--systems", "eager,sdpa8"])
    out = capsys.readouterr().out
    assert "10 requests (10 with an image)" in out
    for name in ("engine, eager", "sdpa, batches of 8", "sdpa, all 10"):
        assert f"median {name}" in out
        assert f"tokens of {name} against sdpa, all 10's: equal" in out
