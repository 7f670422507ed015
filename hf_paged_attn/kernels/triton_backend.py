"""Triton backend: paged decode (split-K, every query head of a KV head in one program), varlen
prefill straight from the pages, and the K/V page writer, for CUDA GPUs of compute capability 8.0+
(and CPU tensors under ``TRITON_INTERPRET=1``, how the tests run it). Passed the GPU check on an
H200 at 5x the torch backend's throughput.

This module is the backend class only; the kernels and their launchers are ``triton_ops``, imported
the first time a kernel runs, so that choosing a backend never imports triton.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from .base import AttentionBackend, AttentionOptions, power_of_two_at_least_16


def _ops() -> ModuleType:
    from . import triton_ops

    return triton_ops


class TritonBackend(AttentionBackend):
    name = "triton"
    block_size_rule = "a power of two >= 16"
    install_hint = "needs a CUDA GPU of compute capability 8.0 or newer and triton installed"
    graph_safe = True  # lengths read on device; split-K count from batch size and block-table width
    # fp8 pages widen to the query's dtype as the kernels load them (triton_ops). Tested under TRITON_INTERPRET=1
    # only, not yet on a GPU.
    supports_fp8_pages = True

    @classmethod
    def suits(
        cls,
        device: torch.device,
        block_size: int | None,
        dtype: torch.dtype | None,
        sinks: bool,
        head_dim: int | None = None,
        page_dtype: torch.dtype | None = None,
    ) -> bool:
        # Triton compiles e4m3 (its fp8e4nv) for compute capability 8.9+ only; e5m2 from 8.0.
        if page_dtype == torch.float8_e4m3fn and device.type == "cuda" and cls.is_available(device):
            if torch.cuda.get_device_capability(device) < (8, 9):
                return False
        return super().suits(device, block_size, dtype, sinks, head_dim, page_dtype)

    @staticmethod
    def is_available(device: torch.device) -> bool:
        if device.type != "cuda" or importlib.util.find_spec("triton") is None:
            return False
        return torch.cuda.get_device_capability(device) >= (8, 0)

    @staticmethod
    def accepts_block_size(block_size: int) -> bool:
        return power_of_two_at_least_16(block_size)

    @staticmethod
    def default_block_size(device: torch.device) -> int:
        return 16

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        _ops().write_kv(k, v, k_cache, v_cache, slot_mapping)

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seqused_k: torch.Tensor,
        block_table: torch.Tensor,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        *,
        options: AttentionOptions,
        memo: dict | None = None,
    ) -> torch.Tensor:
        return _ops().paged_prefill_attention(
            q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, options=options
        )

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor,
        max_seqlen_k: int | None = None,
        *,
        options: AttentionOptions,
        memo: dict | None = None,
    ) -> torch.Tensor:
        return _ops().paged_decode_attention(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, max_seqlen_k, options=options
        )
