"""Every notebook in examples/ runs top to bottom, is stored without outputs, and matches its generator."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
TIMEOUT_S = 180  # per notebook; each runs in well under a minute on 2 CPU cores


class ThisPythonKernels(KernelSpecManager):
    """Every kernel name maps to an ipykernel on the interpreter running the tests, so the notebooks
    import this checkout and its pinned packages whatever kernels are installed elsewhere."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name=f"Python ({sys.executable})",
            language="python",
            name=kernel_name,
        )


def test_notebooks_found():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_streaming_engine.ipynb",
        "03_sampling.ipynb",
        "04_prefix_caching.ipynb",
        "05_benchmark.ipynb",
    ]


def test_notebooks_match_generator_and_have_no_outputs():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "make_notebooks.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs not stripped"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path):
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ)
    # OpenMP threads that spin while waiting make a busy 2-core machine up to 10x slower.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("TQDM_DISABLE", "1")
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ThisPythonKernels())
    client = nbclient.NotebookClient(
        nb, km=km, timeout=TIMEOUT_S, resources={"metadata": {"path": str(EXAMPLES)}}
    )
    start = time.perf_counter()
    # cleanup_kc: shut the kernel down afterwards (nbclient leaves a kernel it did not start running).
    client.execute(env=env, cleanup_kc=True)  # raises CellExecutionError naming the cell if one fails
    elapsed = time.perf_counter() - start
    print(f"{path.name}: {elapsed:.1f} s")
    assert elapsed < TIMEOUT_S
