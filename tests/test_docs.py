"""The documentation site builds with no warning (broken links and anchors fail), and every runnable
Python block of its pages runs as written.

A block that must not run here (it needs a GPU, a server, torchrun or a package outside the [dev] extra)
is preceded by the line ``<!-- no-run -->``. The blocks of one page run in order in one namespace, as a
reader pastes them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged_attn.runtime import config as paged_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NO_RUN = "<!-- no-run -->"


def python_blocks(text: str) -> list[tuple[bool, str]]:
    """Each ```python block of ``text`` as (runnable, code); runnable unless the line before says no-run."""
    blocks = []
    for match in re.finditer(r"```python\n(.*?)^```", text, flags=re.M | re.S):
        previous_line = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((previous_line.strip() != NO_RUN, match.group(1)))
    return blocks


def pages_with_code() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if any(run for run, _ in python_blocks(p.read_text())))


def test_mkdocs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.fail("mkdocs is not installed: pip install -c constraints.txt -e '.[dev]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "site" / "performance" / "index.html").exists()


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in DOCS.glob("*.md") if p.name not in nav]
    assert not missing, f"pages outside mkdocs.yml's nav: {missing}"


def test_no_run_blocks_are_few():
    """Most examples run; the marked ones are those needing a GPU, a server, torchrun or extra packages."""
    blocks = [run for p in DOCS.glob("*.md") for run, _ in python_blocks(p.read_text())]
    assert sum(blocks) >= 10 and blocks.count(False) <= 12, (sum(blocks), blocks.count(False))


@pytest.mark.parametrize("page", pages_with_code(), ids=lambda p: p.name)
def test_page_code_runs(page, monkeypatch, capsys):
    monkeypatch.setattr(paged_config, "COMPILE_BY_DEFAULT", False)  # no background compile: seconds, not a minute
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for runnable, code in python_blocks(page.read_text()):
        if runnable:
            exec(compile(code, str(page), "exec"), namespace)  # noqa: S102 - our own documentation
    capsys.readouterr()
