import os

import pytest
import torch

from hf_paged_attn.kernels import load_backend, resolve_kernel

CPU = torch.device("cpu")


def test_auto_is_torch_on_cpu():
    assert resolve_kernel("auto", CPU) == "torch"
    assert load_backend("auto", CPU).__name__.endswith("torch_backend")


def test_flash_on_cpu_is_refused_clearly():
    with pytest.raises(ValueError, match="kernel='flash' needs a CUDA device"):
        load_backend("flash", CPU)


def test_unknown_kernel():
    with pytest.raises(ValueError, match="'cuda' is not one of"):
        resolve_kernel("cuda", CPU)


def test_block_size_rules_of_gpu_backends():
    from hf_paged_attn.kernels import flash_backend

    with pytest.raises(ValueError, match="256"):
        flash_backend.check_block_size(16)
    flash_backend.check_block_size(256)
    if os.environ.get("TRITON_INTERPRET") is None:
        pytest.importorskip("triton")
    from hf_paged_attn.kernels import triton_backend

    with pytest.raises(ValueError, match="24"):
        triton_backend.check_block_size(24)
    triton_backend.check_block_size(32)
