"""Pure-torch backend: runs everywhere, and what every CPU user runs, so it is vectorised, leans on
SDPA and, on CPU, on a native decode kernel (``kernels/cpu_native.py``). It is not the reference:
``kernels/reference.py`` (float64, one request at a time) is what every backend, this one included,
is tested against.

One module per job: ``dense`` (batched attention on padded tensors), ``varlen`` (packed
variable-length attention), ``decode`` (the decode planner: length buckets, the shared-prefix
cascade, gather workspaces, the native kernel first on CPU) and ``prefill`` (the varlen path from
the pages: one-query rows in place, prefilling rows gathered). Measured on CPU in
``hf-paged-attn bench kernels``.
"""

from __future__ import annotations

import torch

from .. import cpu_native
from ..base import AttentionBackend
from .decode import paged_decode_attention
from .prefill import paged_prefill_attention, write_kv
from .varlen import varlen_attention

__all__ = ["TorchBackend", "paged_decode_attention", "paged_prefill_attention", "varlen_attention", "write_kv"]


class TorchBackend(AttentionBackend):
    name = "torch"
    block_size_rule = "positive"
    supports_fp8_pages = True  # gathers widen them; the native CPU kernels convert them in registers
    supports_int8_pages = True  # gathered and dequantized with their per-token scales (native kernels: not read)
    # not graph-safe: it plans its decode on the host (lengths and buckets read back from the device)

    @staticmethod
    def is_available(device: torch.device) -> bool:
        return True

    @staticmethod
    def accepts_block_size(block_size: int) -> bool:
        return block_size > 0

    @staticmethod
    def default_block_size(device: torch.device) -> int:
        # 8 on CPU halves the KV left unfilled in each request's last block at no measured cost
        return 16 if device.type == "cuda" else 8

    # The entry points are this package's functions, whose signatures are the protocol's
    write_kv = staticmethod(write_kv)
    paged_prefill_attention = staticmethod(paged_prefill_attention)
    paged_decode_attention = staticmethod(paged_decode_attention)

    # On CPU the native decode prepared once per step (``cpu_native.DecodeLayers``); None elsewhere.
    decode_layers = staticmethod(cpu_native.DecodeLayers.make)
