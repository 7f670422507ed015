"""The server most serve tests share: the bundled demo model behind a real uvicorn, started once per
session (each start costs ~10 s on a loaded machine). Tests that need other settings start their own."""

from __future__ import annotations

import pytest

from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn_tools.launch import ServerProcess

DEMO_NAME = "demo"


@pytest.fixture(scope="session")
def demo_server():
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
    args = ["--served-model-name", DEMO_NAME, "--num-blocks", "512", "--max-num-seqs", "64"]
    with ServerProcess(DEMO_MODEL, [*args, "--no-compile"], env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc
