"""Kernel backends for paged attention, behind one interface (``base.AttentionBackend``: three
entry points named and shaped like flash-attn's, capabilities as class attributes).

| backend | module | runs on |
| --- | --- | --- |
| ``flash`` | ``flash_backend`` | CUDA 8.0+ with flash-attn 2: fp16/bf16, pages of 256k, head dim 8k <= 256, no sinks |
| ``triton`` | ``triton_backend`` (kernels in ``triton_ops``) | CUDA GPUs of compute capability 8.0+ |
| ``torch`` | ``torch_backend/`` (native CPU kernels in ``cpu_native`` / ``cpu_attention*.c``) | everywhere |

torch and triton read fp8 pages (``kv_dtype.py``, ``supports_fp8_pages``; triton's e4m3 needs compute
capability 8.9+), only torch reads int8 pages (``supports_int8_pages``): ``kernel="auto"`` picks the first that
reads the cache's pages, and an explicit kernel that does not is refused.

``lora_triton.py`` holds the batched LoRA kernels (Punica's SGMV shrink / expand), ``lora_reference.py`` their
float64 reference, ``cpu_bitmask.py`` a grammar's token mask added to CPU logits; they are not an attention
backend. ``reference.py`` is the float64 reference every backend is tested against. The registry below is
the one place that lists the backends in ``kernel="auto"``'s order of preference; ``PagedConfig``
and the engine read it. Only torch is imported to choose: flash-attn and triton load when a kernel
first runs.
"""

from __future__ import annotations

import torch

from .base import AttentionBackend
from .flash_backend import FlashBackend
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend

# In order of preference for kernel="auto": the first that suits the cache wins; torch suits every one.
BACKENDS: dict[str, type[AttentionBackend]] = {"flash": FlashBackend, "triton": TritonBackend, "torch": TorchBackend}

KERNELS = ("auto", *BACKENDS)


def resolve_kernel(
    kernel: str,
    device: torch.device,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    sinks: bool = False,
    head_dim: int | None = None,
    page_dtype: torch.dtype | None = None,
) -> str:
    """Turn ``"auto"`` into the first backend of ``BACKENDS`` that suits the cache (``block_size``,
    ``dtype``, ``head_dim`` and ``page_dtype`` of None suit every backend); an explicit name stays as it is."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    if kernel != "auto":
        return kernel
    cache = (device, block_size, dtype, sinks, head_dim, page_dtype)
    return next(name for name, backend in BACKENDS.items() if backend.suits(*cache))


def load_backend(kernel: str, device: torch.device) -> AttentionBackend:
    """The backend that runs a resolved ``kernel`` on ``device``; ValueError if it can't run there."""
    backend = BACKENDS[resolve_kernel(kernel, device)]
    if not backend.is_available(device):
        raise ValueError(f"kernel={backend.name!r} {backend.install_hint}; the model is on {device.type}")
    return backend()
