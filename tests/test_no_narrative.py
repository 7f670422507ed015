"""Tracked files say what is true and why, with the figure and the command; never when, or in which
working session, it was found (git history keeps that). This test fails on such words in any tracked
text file, so it stays true. The patterns are built from pieces so that this file does not match itself."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = r"(?:sess" + r"ions?|sitt" + r"ings?)"
ORDINALS = (
    r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    r"fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\d+(?:st|nd|rd|th)"
)
PATTERNS = [
    rf"\b(?:{ORDINALS})\s+(?:and\s+(?:{ORDINALS})\s+)?{WORK}\b",  # "the fifteenth ...", "fifth and sixth ..."
    rf"\b{WORK}\s+#?\d+\b",  # "... 17"
    rf"\b(?:this|that|last|previous|earlier|later)\s+{WORK}\b",  # "in this ...", "the last ..."
    r"\bin\s+this\s+sitt" + r"ing\b",
    r"_s\d{1,2}(?:_\w+)?\.log\b",  # run labels such as "_s17" in a log name
]
NARRATIVE = re.compile("|".join(f"(?:{p})" for p in PATTERNS), re.IGNORECASE)
TEXT = {".py", ".md", ".txt", ".toml", ".yml", ".yaml", ".cfg", ".sh", ".c", ".h", ".ipynb", ".jinja", ""}


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [ROOT / n for n in names.splitlines()]
    return [p for p in files if p.is_file() and (p.suffix in TEXT or p.name in {"Makefile", "run"})]


def test_no_development_narrative():
    hits = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if NARRATIVE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "development narrative in tracked files:\n" + "\n".join(hits)


def test_the_patterns_catch_what_they_should():
    for text in ["until the fifteen" + "th sess" + "ion", "the fifth and sixth sess" + "ions", "in this sitt" + "ing",
                 "logs of sess" + "ion 17", "vs_vllm_zen1_s1" + "7_all.log"]:  # fmt: skip
        assert NARRATIVE.search(text), text
    for text in ["a manager's run (start to stop)", "TLS sessions", "sessions of the HTTP client", "s3 bucket",
                 "each session (start .. stop)", "s0 += 16"]:
        assert not NARRATIVE.search(text), text
