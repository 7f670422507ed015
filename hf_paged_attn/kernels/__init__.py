"""Kernel backends for paged attention.

Every backend is a module exposing the same two entry points, named and shaped like flash-attn's
so a reader of either codebase feels at home:

``varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
softmax_scale, causal=True, window_size=(-1, -1), softcap=0.0, sinks=None) -> out``

    q: [total_q, num_heads, head_dim]; k, v: [total_k, num_kv_heads, head_dim] (packed requests).
    cu_seqlens_q / cu_seqlens_k: int32 [batch + 1] cumulative lengths. The causal mask is aligned
    bottom-right, so a query chunk shorter than its keys sees every earlier key (flash-attn >= 2.1).
    window_size (left, right): -1 means unbounded; a key j is visible to query i (both as absolute
    positions in the request) when i - left <= j <= i + right. softcap > 0 applies
    ``softcap * tanh(scores / softcap)``. sinks: [num_heads] per-head logits that join the softmax
    denominator only (GPT-OSS attention sinks). Returns [total_q, num_heads, head_dim].

``paged_decode_attention(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *,
softmax_scale, causal=True, window_size=(-1, -1), softcap=0.0, sinks=None) -> out``

    q: [batch, 1, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; k, v: [batch, 1, num_kv_heads, head_dim] new token, written in place at position
    cache_seqlens[b] of request b, or None when already written. cache_seqlens: int32 [batch], the
    tokens in the cache before ``k`` is appended; with ``k=None`` (as in flash-attn) the tokens to
    attend to, the new one included. block_table: int32 [batch, max_blocks_per_seq], -1 for unallocated.
    Returns [batch, 1, num_heads, head_dim].

Backends are imported lazily: only ``torch`` is always importable.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

KERNELS = ("auto", "torch", "flash", "triton")

_MODULES = {
    "torch": "hf_paged_attn.kernels.torch_backend",
    "flash": "hf_paged_attn.kernels.flash_backend",
    "triton": "hf_paged_attn.kernels.triton_backend",
}


def flash_available(device: torch.device) -> bool:
    """True when flash-attn can run on ``device`` (CUDA and the package importable)."""
    if device.type != "cuda":
        return False
    return importlib.util.find_spec("flash_attn") is not None


def triton_available(device: torch.device) -> bool:
    """True when the Triton kernels can run on ``device``: CUDA, the package importable (torch's CUDA
    wheels bring it) and a GPU Triton supports (compute capability 8.0 or newer)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_kernel(
    kernel: str,
    device: torch.device,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    sinks: bool = False,
) -> str:
    """Turn ``"auto"`` into a concrete backend name for ``device``.

    ``auto`` takes the fastest backend that can run this cache: flash-attn when it is installed and
    the block size (a multiple of 256) and dtype (fp16/bf16) suit it, else Triton on CUDA (a power
    of two >= 16; its kernels passed the GPU check on an H200 at 5x the torch backend's throughput),
    else torch. A ``block_size``/``dtype`` of None suits every backend (``PagedConfig.resolved``
    then picks the backend's block size). ``sinks``: the model has attention sinks (GPT-OSS),
    which flash-attn 2 lacks.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    if kernel != "auto":
        return kernel
    flash_block = block_size is None or block_size % 256 == 0
    flash_dtype = dtype is None or dtype in (torch.float16, torch.bfloat16)
    if flash_available(device) and flash_block and flash_dtype and not sinks:
        return "flash"
    triton_block = block_size is None or (block_size >= 16 and block_size & (block_size - 1) == 0)
    if triton_available(device) and triton_block:
        return "triton"
    return "torch"


def load_backend(kernel: str, device: torch.device) -> ModuleType:
    """Import and return the backend module for ``kernel`` (lazily, so optional deps stay optional)."""
    name = resolve_kernel(kernel, device)
    if name == "flash" and not flash_available(device):
        raise ValueError(
            f"kernel='flash' needs a CUDA device and flash-attn installed (pip install 'hf-paged-attn[flash]'); "
            f"the model is on {device.type}"
        )
    return importlib.import_module(_MODULES[name])
