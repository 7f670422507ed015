"""hf-paged-attn bench guidellm --smoke: guidellm drives both servers and every request succeeds.

guidellm is not a dependency (it lives in a virtual environment of its own, see docs/performance.md, Serving):
the test runs only where ``$GUIDELLM`` names its executable or ``guidellm`` is on ``PATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDELLM = os.environ.get("GUIDELLM") or shutil.which("guidellm")


@pytest.mark.skipif(
    not GUIDELLM or not Path(GUIDELLM).exists(),
    reason="guidellm is not installed (set GUIDELLM=/path/to/bin/guidellm or put it on PATH; see docs/performance.md)",
)
def test_smoke_both_servers_every_request_ok(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hf_paged_attn_tools.bench", "guidellm", "--smoke", "--guidellm", GUIDELLM,
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "guidellm_smoke.json").read_text())
    assert [r["system"] for r in report["runs"]] == ["paged", "transformers"]
    for run in report["runs"]:
        (level,) = run["levels"]
        assert level["concurrency"] == 2
        assert (level["ok"], level["errored"], level["incomplete"]) == (4, 0, 0), (run["system"], level["first_error"])
        # ignore_eos (ours) and eos_token_id=-1 (transformers'): every request runs to its max_tokens
        assert level["output_tokens_per_request"] == 16, run["system"]
        assert level["output_tok_s"] > 0 and 0 < level["ttft_p50_ms"] and level["itl_p50_ms"] > 0
        body = level["body"]
        assert body["max_tokens"] == 16 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        if run["system"] == "paged":  # guidellm's own body, unchanged
            assert body["ignore_eos"] is True and "generation_config" not in body
        else:  # the extras drop the field transformers serve refuses
            assert "ignore_eos" not in body and json.loads(body["generation_config"]) == {"eos_token_id": -1}
    assert set(report["ratios"]) == {"2"}  # JSON keys
    assert "ours / theirs @2" in done.stdout
