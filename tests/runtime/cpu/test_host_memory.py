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
from transformers import AutoModelForCausalLM

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu import host_memory
from hf_paged_attn_tools.testing import save_random_model, tiny_llama_config

GLIBC = "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {}) and (
    os.confstr("CS_GNU_LIBC_VERSION") or ""
).startswith("glibc")

# In a fresh process: whether a buffer is mapped on its own (above glibc's mmap threshold: given back to the kernel
# when freed), from mallinfo's bytes in mapped regions, for 8 MB before keep_freed_memory() and 30 MB after it;
# then the page faults of rounds of a step's worth of buffers (4 x 6 MB) allocated, written and freed.
ROUNDS = textwrap.dedent(
    """
    import ctypes, resource, torch
    from hf_paged_attn.runtime.cpu import host_memory

    class MallInfo(ctypes.Structure):  # glibc's struct mallinfo (int fields: enough for these sizes)
        _fields_ = [(name, ctypes.c_int) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo = ctypes.CDLL("libc.so.6").mallinfo
    mallinfo.restype = MallInfo

    def mapped_alone(nbytes):
        before = mallinfo().hblkhd
        buffer = torch.empty(nbytes // 4)
        mapped = mallinfo().hblkhd - before
        del buffer
        return mapped >= nbytes

    def faults():
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            buffers = [torch.empty(6 << 18).fill_(1.0) for _ in range(4)]  # 4 x 6 MB float32
            del buffers
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

    before = mapped_alone(8 << 20)  # glibc's threshold then rises to 8 MB: a 30 MB buffer would be mapped alone
    kept = host_memory.keep_freed_memory()
    after = mapped_alone(30 << 20)
    faults()  # the heap grows to the rounds' size once
    print(kept, before, after, faults())
    """
)


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's malloc's")
def test_freed_buffers_are_not_faulted_in_again() -> None:
    out = subprocess.run([sys.executable, "-c", ROUNDS], capture_output=True, text=True, timeout=120, check=True)
    kept, mapped_before, mapped_after, faults = out.stdout.split()
    assert (kept, mapped_before, mapped_after) == ("True", "True", "False"), out.stdout
    pages = 5 * 4 * (6 << 20) // 4096  # every page of every round's buffers
    assert int(faults) < pages // 50, out.stdout


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
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged")
    config = PagedConfig(num_blocks=16, compile=False, keep_freed_memory=keep)
    with ContinuousBatchingEngine(model, config) as engine:
        assert len(engine.generate([[1, 2, 3]], max_new_tokens=2)[0].output_ids) == 2
    assert calls == ([1] if keep is None else [])
