"""Test-session setup and the fixtures both tiers share (``tests/`` and ``integration_tests/``): tiny models
with random weights, saved with save_pretrained and loaded back with from_pretrained(..., attn_implementation=...),
so the real loading code runs (no hub access here)."""

from __future__ import annotations

import os

import pytest

# No GPU here: Triton kernels can only run under its interpreter, and the interpreter must be
# chosen before the first `import triton` anywhere in the session (test order must not matter).
os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_paged_attn  # noqa: E402, F401  (registers "paged")
from hf_paged_attn.runtime import config as _paged_config  # noqa: E402
from hf_paged_attn.runtime.cpu import prewarm as _prewarm  # noqa: E402
from hf_paged_attn_tools.testing import load_pair, save_random_model, tiny_llama_config  # noqa: E402

# Tiny models compile for longer than they run: PagedConfig(compile=None) means eager in the suite;
# tests of the compiled forward ask for compile=True (tests/runtime/cpu/test_compiled.py).
_paged_config.COMPILE_BY_DEFAULT = False
# A first compile in the background runs in a child process first (runtime/cpu/prewarm.py): a second compile of
# every tiny model the suite compiles. Its tests turn it on (tests/runtime/cpu/test_prewarm.py).
_prewarm.ENABLED = False


@pytest.fixture(scope="session")
def demo():
    """(tokenizer, paged model, sdpa model) of the bundled demo model: real text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged_attn.demo import DEMO_MODEL

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL, padding_side="left")
    paged = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged").eval()
    ref = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa").eval()
    return tokenizer, paged, ref


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def llama_pair(llama_dir):
    return load_pair(llama_dir)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``gpu`` need CUDA: on a machine without it they are skipped, saying so (scripts/gpu_check.sh
    runs them on a lent GPU), so the CPU suite never passes for code it did not run."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs under scripts/gpu_check.sh on a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
