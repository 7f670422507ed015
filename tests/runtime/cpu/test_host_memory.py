"""``PagedConfig.keep_freed_memory`` (``hf_paged_attn/runtime/cpu/host_memory.py``): glibc's malloc keeps the
buffers a step frees, so the next step's buffers are not faulted in again; the config switch and where the
launcher applies it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu import host_memory
from hf_paged_attn_tools.testing import save_random_model, tiny_llama_config

GLIBC = "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {}) and (
    os.confstr("CS_GNU_LIBC_VERSION") or ""
).startswith("glibc")

# A step's worth of buffers (4 x 6 MB, more than glibc's adaptive trim threshold can reach from them) allocated,
# written and freed, round after round; the page faults of each round before and after keep_freed_memory().
ROUNDS = textwrap.dedent(
    """
    import resource, torch
    from hf_paged_attn.runtime.cpu import host_memory

    def faults():
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            buffers = [torch.empty(6 << 18).fill_(1.0) for _ in range(4)]  # 4 x 6 MB float32
            del buffers
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

    faults()  # glibc's thresholds adapt to the first freed buffers
    before = faults()
    kept = host_memory.keep_freed_memory()
    faults()  # the heap grows to the rounds' size once
    print(kept, before, faults())
    """
)


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's malloc's")
def test_freed_buffers_are_not_faulted_in_again() -> None:
    out = subprocess.run([sys.executable, "-c", ROUNDS], capture_output=True, text=True, timeout=120, check=True)
    kept, before, after = out.stdout.split()
    assert kept == "True"
    pages = 5 * 4 * (6 << 20) // 4096  # every page of every round's buffers
    assert int(before) > pages // 2, out.stdout  # glibc's defaults hand the buffers back: faulted in again
    assert int(after) < pages // 50, out.stdout


def test_the_config_switch() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match="keep_freed_memory must be None or a bool, got 1"):
        PagedConfig(keep_freed_memory=1)
    with pytest.raises(ValueError, match="keep_freed_memory=True is for models on the CPU; the model is on cuda"):
        PagedConfig(kernel="torch", keep_freed_memory=True).resolved(cuda)
    assert PagedConfig().resolved(cpu).keep_freed_memory is True
    assert PagedConfig(kernel="torch").resolved(cuda).keep_freed_memory is False
    assert PagedConfig(keep_freed_memory=False).resolved(cpu).keep_freed_memory is False


@pytest.mark.parametrize("keep", [None, False])
def test_a_cpu_engine_keeps_freed_memory_unless_told_not_to(tmp_path, monkeypatch, keep) -> None:
    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append(1) or True)
    directory = save_random_model(tiny_llama_config(), tmp_path / "model")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged")
    config = PagedConfig(num_blocks=16, compile=False, keep_freed_memory=keep)
    with ContinuousBatchingEngine(model, config) as engine:
        assert len(engine.generate([[1, 2, 3]], max_new_tokens=2)[0].output_ids) == 2
    assert calls == ([1] if keep is None else [])
