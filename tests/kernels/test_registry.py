
import pytest
import torch

from hf_paged_attn import PagedConfig
from hf_paged_attn.kernels import BACKENDS, KERNELS, load_backend, resolve_kernel
from hf_paged_attn.kernels.torch_backend import TorchBackend

CPU = torch.device("cpu")


def test_auto_is_torch_on_cpu():
    assert resolve_kernel("auto", CPU) == "torch"
    assert isinstance(load_backend("auto", CPU), TorchBackend)


CUDA = torch.device("cuda")  # only inspected, never allocated on


@pytest.mark.parametrize(
    "flash, triton, block_size, dtype, expected",
    [
        (True, True, 256, torch.bfloat16, "flash"),
        (True, True, 16, torch.bfloat16, "triton"),  # flash-attn needs a multiple of 256
        (True, True, 256, torch.float32, "triton"),  # flash-attn has no fp32
        (False, True, 16, torch.float16, "triton"),
        (False, True, 24, torch.float16, "torch"),  # triton needs a power of two
        (False, False, 16, torch.float32, "torch"),
    ],
)
def test_auto_on_cuda_takes_the_fastest_backend_that_fits(monkeypatch, flash, triton, block_size, dtype, expected):
    import hf_paged_attn.kernels as kernels

    monkeypatch.setattr(kernels.BACKENDS["flash"], "is_available", lambda device: flash and device.type == "cuda")
    monkeypatch.setattr(kernels.BACKENDS["triton"], "is_available", lambda device: triton and device.type == "cuda")
    assert resolve_kernel("auto", CUDA, block_size, dtype) == expected
    assert resolve_kernel("auto", CPU, block_size, dtype) == "torch"
    assert resolve_kernel("torch", CUDA, block_size, dtype) == "torch"  # an explicit choice stays


def test_flash_on_cpu_is_refused_clearly():
    with pytest.raises(ValueError, match="kernel='flash' needs a CUDA device"):
        load_backend("flash", CPU)


def test_unknown_kernel():
    with pytest.raises(ValueError, match="'cuda' is not one of"):
        resolve_kernel("cuda", CPU)


def test_block_size_rules_of_gpu_backends():
    with pytest.raises(ValueError, match="256"):
        BACKENDS["flash"].check_block_size(16)
    BACKENDS["flash"].check_block_size(256)
    with pytest.raises(ValueError, match="24"):
        BACKENDS["triton"].check_block_size(24)
    BACKENDS["triton"].check_block_size(32)
    with pytest.raises(ValueError, match="power of two"):  # an explicit size is checked up front
        PagedConfig(kernel="triton", block_size=24).resolved(CUDA)


def test_the_registry_lists_every_kernel_once():
    assert set(BACKENDS) == {"torch", "flash", "triton"} and KERNELS == ("auto", *BACKENDS)
    assert list(BACKENDS)[-1] == "torch", "auto's last resort must run everywhere"
    for backend in BACKENDS.values():
        assert backend.accepts_block_size(backend.default_block_size(CUDA))
        assert backend.accepts_block_size(backend.default_block_size(CPU))
