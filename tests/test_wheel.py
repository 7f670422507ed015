"""What the wheel holds: the runtime package, not the tooling (``hf_paged_attn_tools``), and what
``hf-paged-attn bench`` says where the tooling is absent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from setuptools import find_namespace_packages, find_packages
from setuptools.config.pyprojecttoml import load_file  # tomllib is 3.11+

from hf_paged_attn import cli

ROOT = Path(__file__).resolve().parents[1]


def wheel_packages() -> list[str]:
    """The packages setuptools puts in the wheel, found as the build finds them (pyproject.toml's
    ``[tool.setuptools.packages.find]``)."""
    find = load_file(ROOT / "pyproject.toml")["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    return finder(str(ROOT), include=find.get("include", ["*"]), exclude=find.get("exclude", ()))


def test_the_wheel_holds_the_runtime_not_the_tools():
    packages = wheel_packages()
    assert {"hf_paged_attn", "hf_paged_attn.runtime", "hf_paged_attn.serve"} <= set(packages)
    assert all(p == "hf_paged_attn" or p.startswith("hf_paged_attn.") for p in packages), packages
    assert not [p for p in packages if p.startswith("hf_paged_attn_tools")]


def test_bench_without_the_tools_says_to_use_a_checkout(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m.startswith("hf_paged_attn_tools")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hf_paged_attn_tools", None)  # as in an installed wheel: no such package
    monkeypatch.setattr(cli, "checkout_root", lambda: tmp_path)  # nor a checkout beside the package
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--smoke"])
    assert "source checkout" in str(exit_.value.code) and "pip install -e ." in str(exit_.value.code)


def test_bench_from_a_checkout_finds_the_tools(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("hf_paged_attn_tools")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    assert cli.checkout_root() == ROOT
    assert cli.bench_main().__module__ == "hf_paged_attn_tools.bench.command"
