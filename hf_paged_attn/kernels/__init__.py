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

A backend that sets ``PREFILL_FROM_PAGES = True`` also has ``write_kv(k, v, k_cache, v_cache,
slot_mapping)`` and ``paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k,
block_table, max_seqlen_q, *, softmax_scale, causal, window_size, softcap, sinks)``: on the varlen
path the cache then writes the step's K/V with ``write_kv`` and gathers nothing, and the attention
reads each request's first ``seqused_k[b]`` keys straight from the pages through its block table.
Every built-in backend sets it (the torch backend's paged prefill gathers only what its native
decode kernel cannot read in place); without it the cache gathers packed K/V for ``varlen_attention``.

The registry below is the one place that says, for each backend, when it can run (device, dtype,
attention sinks), which block sizes it accepts and its default, and whether CUDA graphs can capture
its decode step: ``kernel="auto"``,
``PagedConfig.resolved`` and the engine all read it. Backends are imported lazily: only ``torch``
is always importable.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch


def _cuda_with(package: str, capability: tuple[int, int] = (0, 0)) -> Callable[[torch.device], bool]:
    """Availability probe: a CUDA device of at least ``capability`` and ``package`` importable."""

    def available(device: torch.device) -> bool:
        if device.type != "cuda" or importlib.util.find_spec(package) is None:
            return False
        return torch.cuda.get_device_capability(device) >= capability

    return available


def _power_of_two_at_least_16(block_size: int) -> bool:
    return block_size >= 16 and block_size & (block_size - 1) == 0


@dataclass(slots=True)
class Backend:
    """What the engine needs to know about a kernel backend before importing it."""

    name: str
    module: str
    is_available: Callable[[torch.device], bool]  # can it run on this device at all
    accepts_block_size: Callable[[int], bool]
    block_size_rule: str  # ``accepts_block_size`` in words, for error messages
    default_block_size: Callable[[torch.device], int]
    dtypes: tuple[torch.dtype, ...] | None = None  # None: every dtype
    supports_sinks: bool = True
    install_hint: str = ""
    # Whether a decode step through it can be captured in a CUDA graph (``cuda_graphs.py``): its
    # decode kernel reads lengths and block tables from device tensors only, and its launch
    # parameters (grid, split-K count) follow from shapes, which a graph's bucket fixes.
    graph_safe: bool = False

    def suits(self, device: torch.device, block_size: int | None, dtype: torch.dtype | None, sinks: bool) -> bool:
        """Can this backend run a cache of ``block_size`` (None: its own) in ``dtype`` on ``device``?"""
        return (
            self.is_available(device)
            and (block_size is None or self.accepts_block_size(block_size))
            and (dtype is None or self.dtypes is None or dtype in self.dtypes)
            and (self.supports_sinks or not sinks)
        )

    def check_block_size(self, block_size: int) -> None:
        if not self.accepts_block_size(block_size):
            raise ValueError(
                f"the {self.name} kernels need a block_size that is {self.block_size_rule}, got "
                f"block_size={block_size}; leave PagedConfig.block_size=None for the kernel's own, "
                "or pick another kernel"
            )

    def load(self, device: torch.device) -> ModuleType:
        if not self.is_available(device):
            raise ValueError(f"kernel={self.name!r} {self.install_hint}; the model is on {device.type}")
        return importlib.import_module(self.module)


# In order of preference for kernel="auto": the first that suits the cache wins.
BACKENDS: dict[str, Backend] = {
    "flash": Backend(
        name="flash",
        module="hf_paged_attn.kernels.flash_backend",
        is_available=_cuda_with("flash_attn"),
        accepts_block_size=lambda size: size % 256 == 0,  # flash-attn 2's paged kernels
        block_size_rule="a multiple of 256 (flash-attn 2's paged kernels)",
        default_block_size=lambda device: 256,
        dtypes=(torch.float16, torch.bfloat16),
        supports_sinks=False,
        install_hint="needs a CUDA device and flash-attn installed (pip install 'hf-paged-attn[flash]')",
        graph_safe=True,  # flash_attn_with_kvcache: cache_seqlens and block_table are device tensors
    ),
    "triton": Backend(  # passed the GPU check on an H200 at 5x the torch backend's throughput
        name="triton",
        module="hf_paged_attn.kernels.triton_backend",
        is_available=_cuda_with("triton", capability=(8, 0)),
        accepts_block_size=_power_of_two_at_least_16,
        block_size_rule="a power of two >= 16",
        default_block_size=lambda device: 16,
        install_hint="needs a CUDA GPU of compute capability 8.0 or newer and triton installed",
        graph_safe=True,  # lengths read on device; split-K count from batch size and block-table width
    ),
    "torch": Backend(  # the oracle: runs everywhere; not graph-safe (it plans its decode on the host)
        name="torch",
        module="hf_paged_attn.kernels.torch_backend",
        is_available=lambda device: True,
        accepts_block_size=lambda size: size > 0,
        block_size_rule="positive",
        # 8 on CPU halves the KV left unfilled in each request's last block at no measured cost
        default_block_size=lambda device: 16 if device.type == "cuda" else 8,
    ),
}

KERNELS = ("auto", *BACKENDS)


def resolve_kernel(
    kernel: str,
    device: torch.device,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    sinks: bool = False,
) -> str:
    """Turn ``"auto"`` into the first backend of ``BACKENDS`` that suits the cache (``block_size``
    and ``dtype`` of None suit every backend); an explicit name stays as it is."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    if kernel != "auto":
        return kernel
    return next(name for name, backend in BACKENDS.items() if backend.suits(device, block_size, dtype, sinks))


def load_backend(kernel: str, device: torch.device) -> ModuleType:
    """Import and return the module of a resolved ``kernel`` (lazily: optional deps stay optional)."""
    return BACKENDS[resolve_kernel(kernel, device)].load(device)
