"""The version is one number in three places: pyproject.toml, hf_paged_attn.__version__ and the latest
release heading of CHANGELOG.md (Keep a Changelog: an [Unreleased] section, then releases newest first)."""

import re
from pathlib import Path

import hf_paged_attn

ROOT = Path(__file__).resolve().parents[1]


def test_versions_agree():
    project = re.search(r'(?m)^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    headings = re.findall(r"(?m)^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text())
    assert headings[0] == "Unreleased", headings[:2]
    release = headings[1]
    assert project == hf_paged_attn.__version__ == release, (project, hf_paged_attn.__version__, release)


def test_changelog_is_by_release():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert len(text.splitlines()) <= 400
    for version, date in re.findall(r"(?m)^## \[(\d+\.\d+\.\d+)\] - (.*)$", text):
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), (version, date)
    sections = set(re.findall(r"(?m)^### (\w+)", text))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, sections
