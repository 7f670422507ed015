"""The interface every kernel backend implements: three entry points named and shaped like
flash-attn's, and its capabilities as declared class attributes.

A backend is a stateless class; the engine holds one instance. Entry points (shapes: ``N`` packed
query tokens, ``B`` requests, ``H`` query heads, ``H_kv`` K/V heads, ``D`` head dim):

``write_kv(k, v, k_cache, v_cache, slot_mapping)``
    k, v: [N, H_kv, D] written in place at the flat slots [N] (``block * block_size + offset``) of the
    pages k_cache, v_cache: [num_blocks, block_size, H_kv, D].

``paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q,
max_seqlen_k, *, options, memo) -> [N, H, D]``
    The varlen path (any step with prefill). q: [N, H, D], packed requests; cu_seqlens_q: int32
    [B + 1]; request b attends its first ``seqused_k[b]`` keys (int32 [B], the step's own keys
    included: they were written with ``write_kv`` first), read straight from the pages through
    ``block_table`` (int32 [B, max_blocks], -1 unallocated). The causal mask is aligned bottom-right
    (flash-attn >= 2.1), so a query chunk sees every earlier key. Requests without keys output zeros.

``paged_decode_attention(q, k_cache, v_cache, k, v, cache_seqlens, block_table, max_seqlen_k, *,
options, memo) -> [B, 1, H, D]``
    The decode path (every request feeds one token), ``flash_attn_with_kvcache`` semantics.
    q: [B, 1, H, D]; k, v: [B, 1, H_kv, D], appended in place at position ``cache_seqlens[b]``
    (int32 [B], the tokens cached before), or None when already written (then cache_seqlens counts
    the keys to attend).

int8 pages (``PagedConfig(kv_cache_dtype="int8")``) come with their scales: the backends that declare
``supports_int8_pages`` take them in ``AttentionOptions.k_scales`` / ``v_scales`` ([num_blocks, block_size,
H_kv]) and as keywords of ``write_kv``; the others are never given int8 pages.

``options``: an ``AttentionOptions``, what the layer computes besides its tensors (below). ``max_seqlen_q`` /
``max_seqlen_k``: host-side upper bounds of the query and key lengths, so a launch is sized without
a device sync (None: the backend reads what it needs from the lengths, or takes the block table's
capacity). ``max_seqlen_q`` >= every request's query count; at 1 some requests may have none.
``max_seqlen_k`` >= every request's key count as the lengths give it, counted from position 0 of the
block table (prefill: ``seqused_k[b]``; decode: ``cache_seqlens[b]``, + 1 with ``k``), never the
keys a window leaves visible: a kernel may read no key past it (flash-attn's split-KV kernel does not).
``block_table.shape[1] * block_size`` always qualifies. ``memo``: a dict that lives
for one forward and one attention group on one device, the same for every layer of it: a backend
may keep layer-independent work there (the torch backend's gather plans); others ignore it. Every
call with one ``memo`` passes the same lengths and block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True, slots=True, eq=False)
class AttentionOptions:
    """What one layer's attention computes besides its tensors: the same for its prefill and decode calls,
    made once per call by the attention function and read by every backend.

    ``window_size`` (left, right), -1 unbounded: key j is visible to query i (absolute positions) when
    i - left <= j <= i + right. ``softcap`` > 0 applies ``softcap * tanh(s / softcap)``. ``sinks``: [H]
    per-head logits that join the softmax denominator only (GPT-OSS). ``k_scales`` / ``v_scales``: int8
    pages' per-token scales [num_blocks, block_size, H_kv] (``kv_dtype.py``), None for other pages.
    """

    softmax_scale: float
    causal: bool = True
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None


class AttentionBackend(ABC):
    """A kernel backend: capabilities (class attributes, known before anything heavy is imported)
    and the three entry points."""

    name: ClassVar[str]
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None  # None: every dtype
    supports_sinks: ClassVar[bool] = True
    # Whether its kernels read fp8 pages (``kv_dtype.py``: float8 page tensors, scales folded in outside)
    supports_fp8_pages: ClassVar[bool] = False
    # Whether its kernels read int8 pages: entry points that take ``k_scales`` / ``v_scales`` keywords (per token
    # and KV head, [num_blocks, block_size, H_kv] float16, ``kv_dtype.py``) and ``write_kv`` that writes them
    supports_int8_pages: ClassVar[bool] = False
    # Whether a decode step through it can be captured in a CUDA graph (``runtime/cuda_graphs.py``):
    # its decode reads lengths and block tables from device tensors only, and its launch parameters
    # (grid, split-K count) follow from shapes, which a graph's bucket fixes.
    graph_safe: ClassVar[bool] = False
    block_size_rule: ClassVar[str]  # ``accepts_block_size`` in words, for error messages
    install_hint: ClassVar[str] = ""  # what to install when ``is_available`` says no

    # ------------------------------------------------------------------ capabilities
    @staticmethod
    @abstractmethod
    def is_available(device: torch.device) -> bool:
        """Can it run on ``device`` at all (device type, compute capability, package installed)?"""

    @staticmethod
    @abstractmethod
    def accepts_block_size(block_size: int) -> bool: ...

    @staticmethod
    @abstractmethod
    def default_block_size(device: torch.device) -> int: ...

    @staticmethod
    def accepts_head_dim(head_dim: int) -> bool:
        """Can it run pages of this head dim (the wider of the key and value head dims)?"""
        return True

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
        """Can it run a cache of ``block_size`` (None: its own) for a model in ``dtype`` with pages ``head_dim``
        wide (None: unknown) of ``page_dtype`` (None: the model's) on ``device``?"""
        fp8 = page_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        return (
            (cls.supports_fp8_pages or not fp8)
            and (cls.supports_int8_pages or page_dtype != torch.int8)
            and cls.is_available(device)
            and (block_size is None or cls.accepts_block_size(block_size))
            and (dtype is None or cls.dtypes is None or dtype in cls.dtypes)
            and (cls.supports_sinks or not sinks)
            and (head_dim is None or cls.accepts_head_dim(head_dim))
        )

    @classmethod
    def check_block_size(cls, block_size: int) -> None:
        if not cls.accepts_block_size(block_size):
            raise ValueError(
                f"the {cls.name} kernels need a block_size that is {cls.block_size_rule}, got "
                f"block_size={block_size}; leave PagedConfig.block_size=None for the kernel's own, "
                "or pick another kernel"
            )

    # ------------------------------------------------------------------ entry points
    @abstractmethod
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    @abstractmethod
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
    ) -> torch.Tensor: ...

    def decode_layers(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor,
        max_seqlen_k: int,
        softmax_scale: float,
    ) -> Callable[..., torch.Tensor | None] | None:
        """Optional: a decode step's calls, prepared once for all its layers (plain causal attention: no
        window, softcap or sinks), for the compiled forward's attention op. Given the first layer's query
        [1, H, M, D] and new key/value [1, H_kv, M, D] (M >= the step's B requests, one token each), its
        pages, and the step's lengths and block table ([B], [B, W] int32), returns a callable
        ``(query, key, value, k_cache, v_cache, softmax_scale) -> [1, M, H, D] | None`` that appends each
        layer's new K/V to its pages and attends (padding rows zero), or None from a layer it can't take as
        prepared. None here: the backend has no such path (``paged_decode_attention`` runs every layer)."""
        return None

    @abstractmethod
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
    ) -> torch.Tensor: ...


def power_of_two_at_least_16(block_size: int) -> bool:
    """The Triton kernels' page sizes: a key tile never straddles two pages."""
    return block_size >= 16 and block_size & (block_size - 1) == 0
