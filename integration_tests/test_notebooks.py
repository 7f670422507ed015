"""Every notebook in examples/ is stored executed and clean, matches its generator, and runs top to bottom."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import ipykernel  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import nbclient  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
TIMEOUT_S = 180  # per cell; each notebook runs in well under a minute on 2 CPU cores


def load_generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", EXAMPLES / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_notebooks = load_generator()


def test_notebooks_found():
    assert [p.name for p in NOTEBOOKS] == [f"{name}.ipynb" for name in make_notebooks.NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_streaming_engine.ipynb",
        "03_sampling.ipynb",
        "04_prefix_caching.ipynb",
        "05_benchmark.ipynb",
        "06_structured_outputs.ipynb",
    ]


def test_stored_notebooks_match_generator_and_are_executed():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "make_notebooks.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        first_code = next(cell for cell in nb.cells if cell.cell_type == "code")
        assert first_code.outputs, f"{path.name}: stored without outputs"


def test_check_catches_noise_and_missing_figures():
    """The checker is not a rubber stamp: stderr output, errors and a missing figure are reported."""
    nb = make_notebooks.build("02_streaming_engine", make_notebooks.NOTEBOOKS["02_streaming_engine"])
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    for i, cell in enumerate(code, 1):
        cell.execution_count = i
    code[0].outputs = [nbformat.v4.new_output("stream", name="stderr", text="TqdmWarning: IProgress not found")]
    code[1].outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="x", traceback=[])]
    found = make_notebooks.problems("02_streaming_engine", nb)
    assert any("stderr" in p and "IProgress" in p for p in found), found
    assert any("raised ValueError" in p for p in found), found
    assert any("0 figures, expected 1" in p for p in found), found


@pytest.mark.slow  # ~3 min for the six on 2 cores; the tests above check they are stored executed and current
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path):
    """Executed again from its stored cells: no error, nothing on stderr, its figures drawn."""
    nb = make_notebooks.stripped(nbformat.read(path, as_version=4))
    start = time.perf_counter()
    make_notebooks.execute(nb, timeout=TIMEOUT_S)  # raises CellExecutionError naming the cell if one fails
    elapsed = time.perf_counter() - start
    print(f"{path.name}: {elapsed:.1f} s")
    assert make_notebooks.problems(path.stem, nb) == []
