"""The hf-paged-attn command: help, forwarding, the serve extra, and OpenMP's waiting set before torch loads."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hf_paged_attn import _env
from hf_paged_attn.cli import main

ROOT = Path(__file__).resolve().parents[1]
PY = "/venv/bin/python"


@pytest.mark.parametrize(
    ("orig_argv", "expected"),
    [
        ([PY, "-m", "hf_paged_attn.demo"], "-m hf_paged_attn.demo"),
        (
            [PY, "-X", "importtime", "-W", "ignore", "-m", "hf_paged_attn_tools.bench", "--smoke"],
            "-m hf_paged_attn_tools.bench",
        ),
        ([PY, "-Ximporttime", "-Bmhf_paged_attn.cli", "demo"], "-m hf_paged_attn.cli"),
        ([PY, "-I", "/venv/bin/hf-paged-attn", "demo"], "/venv/bin/hf-paged-attn"),
        ([PY, "-c", "import hf_paged_attn", "-m", "hf_paged_attn.demo"], None),
        ([PY, "script.py", "-m", "hf_paged_attn.demo"], "script.py"),
        ([PY], None),
    ],
)
def test_entry_point(orig_argv, expected):
    assert _env.entry_point(orig_argv) == expected


@pytest.mark.parametrize(
    ("orig_argv", "is_cli"),
    [
        ([PY, "-m", "hf_paged_attn.demo"], True),
        ([PY, "-m", "hf_paged_attn_tools.bench"], True),
        ([PY, "-m", "hf_paged_attn.cli", "bench"], True),
        ([PY, "/venv/bin/hf-paged-attn", "demo"], True),
        ([PY, "-m", "pytest", "tests"], False),
        ([PY, "-m", "hf_paged_attn_tools.compat"], False),
        ([PY, "train.py"], False),
        ([PY, "-c", "import hf_paged_attn"], False),
    ],
)
def test_is_cli(orig_argv, is_cli):
    assert _env.is_cli(orig_argv) is is_cli


def test_defaults_only_for_commands_and_the_user_wins():
    command = [PY, "-m", "hf_paged_attn.demo"]
    environ: dict[str, str] = {}
    assert _env.apply_cli_defaults(command, environ) == {"GOMP_SPINCOUNT": "3000"}
    assert environ == {"GOMP_SPINCOUNT": "3000"}
    for choice in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}):
        environ = dict(choice)
        assert _env.apply_cli_defaults(command, environ) == {}
        assert environ == choice
    environ = {"OMP_WAIT_POLICY": ""}  # empty is libgomp's default, not a choice
    assert _env.apply_cli_defaults(command, environ) == {"GOMP_SPINCOUNT": "3000"}
    assert environ == {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "3000"}
    environ = {}
    assert _env.apply_cli_defaults([PY, "my_app.py"], environ) == {} and environ == {}


def test_env_is_the_first_import_of_the_package():
    """The default must be in the environment before torch (and its OpenMP runtime) loads."""
    tree = ast.parse((ROOT / "hf_paged_attn" / "__init__.py").read_text())
    first = next(node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))
    assert isinstance(first, ast.ImportFrom) and first.level == 1 and [a.name for a in first.names] == ["_env"]


def test_demo_sets_the_default_when_unset():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    args = ["--num-prompts", "1", "--max-new-tokens", "1", "--no-progress"]
    result = subprocess.run(
        [sys.executable, "-m", "hf_paged_attn.demo", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "default environment: GOMP_SPINCOUNT=3000" in result.stdout
    assert "Loading weights" not in result.stderr  # no progress-bar noise from transformers


def test_freeze_heap_leaves_only_later_objects_to_the_collector():
    """In a process of its own (a frozen heap is never walked again): after ``freeze_heap`` the collector tracks
    only what was made since; at exit nothing is reported leaked (nanobind's check of triton's objects)."""
    code = ("import gc, torch; from hf_paged_attn._env import freeze_heap; n = freeze_heap(); "
            "later = [[] for _ in range(10)]; print(n, gc.get_freeze_count(), len(gc.get_objects()))")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    frozen, count, tracked = map(int, result.stdout.split())
    assert frozen == count > 50_000 and 10 <= tracked < 1_000  # torch's objects frozen; the new lists tracked
    assert "leaked" not in result.stderr, result.stderr[-2000:]


def test_help(capsys):
    assert main([]) == 2
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "usage: hf-paged-attn" in text and "``" not in text
    for command in ("bench", "demo", "serve"):
        assert f"  {command} " in text


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_subcommand_help_names_the_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: hf-paged-attn {command} ")
    assert "``" not in text


def test_unknown_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nope"])
    assert exit_.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_serve_forwards_its_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("hf_paged_attn.serve.cli")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "hf_paged_attn.serve", types.ModuleType("hf_paged_attn.serve"))
    monkeypatch.setitem(sys.modules, "hf_paged_attn.serve.cli", fake)
    assert main(["serve", "--port", "0", "--help"]) == 3
    assert seen == [["--port", "0", "--help"]]


class MissingDependency:
    """Import hook: importing the server fails the way a missing [serve] extra does."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("hf_paged_attn.serve"):
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
        return None


def test_serve_without_the_extra(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "hf_paged_attn.serve", raising=False)
    monkeypatch.delitem(sys.modules, "hf_paged_attn.serve.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [MissingDependency(), *sys.meta_path])
    assert main(["serve"]) == 1
    err = capsys.readouterr().err
    assert "needs the [serve] extra (fastapi is not installed)" in err
    assert "pip install 'hf-paged-attn[serve]'" in err


def test_bench_writes_to_the_user_cache_not_the_current_directory(monkeypatch, tmp_path):
    from hf_paged_attn_tools.bench.command import default_out_dir, parse_args

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_out_dir() == tmp_path / "cache" / "hf_paged_attn" / "bench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_out_dir() == Path.home() / ".cache" / "hf_paged_attn" / "bench"
    assert parse_args(["--smoke"]).out is None  # run() then uses default_out_dir()
    assert parse_args(["--out", "here"]).out == Path("here")
