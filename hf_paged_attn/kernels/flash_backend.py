"""flash-attn 2 backend: a thin adapter onto ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``.

The adapter only reshapes what flash-attn is strict about: int32 lengths and block table on the
query's device, a contiguous block table without ``-1`` entries, tensors with a contiguous last
dimension, and a paged block size that is a multiple of 256. What flash-attn 2 refuses or handles
badly (attention sinks, fp32, head dims above 256 or not a multiple of 8, GPUs before Ampere, an
install without the FA2 extension) raises ``NotImplementedError`` / ``ImportError`` naming it, and
``kernel="auto"`` never picks flash-attn for it (``suits``, ``is_available``).

Read against flash-attn's source at v2.6.0, v2.8.3 and main (none of it has run on a GPU here;
``docs/kernels.md``). flash-attn is imported lazily by ``_load_flash_attn`` (tests substitute a
stand-in module there).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from types import ModuleType

import torch

from .base import AttentionBackend, AttentionOptions

__all__ = ["FlashBackend", "graph_safe_for", "paged_decode_attention", "paged_prefill_attention", "write_kv"]

_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # flash_api.cpp: "FlashAttention forward only supports head dimension at most 256"
# flash_attn_interface.py pads q/k/v to a multiple of 8 otherwise: for a paged call, the whole page tensor.
HEAD_DIM_MULTIPLE = 8
MIN_CAPABILITY = (8, 0)  # flash_api.cpp: "FlashAttention only supports Ampere GPUs or newer."
_EXTENSION = "flash_attn_2_cuda"  # FA2's compiled kernels; a flash-attn-4-only install has a bare namespace
# First flash-attn 2 version whose mha_fwd_kvcache syncs with the host when given a block table
# (``seqlens_k.max().item()``, a bounds check; flash-attn commit 77aacb68, PR #2711, on main where
# flash_attn/__init__.py says 2.8.4). Up to v2.8.3.post1 it sizes the launch from the table's shape only.
GRAPH_UNSAFE_FROM = (2, 8, 4)


_INSTALL = "`pip install flash-attn --no-build-isolation` (or use kernel='torch' / 'triton')"


def _load_flash_attn() -> ModuleType:
    """Import flash_attn on first use, with an install hint when it is missing or is not flash-attn 2
    (flash-attn 4 installs ``flash_attn`` as a namespace package holding only ``flash_attn.cute``)."""
    try:
        import flash_attn
    except ImportError as exc:
        raise ImportError(f"kernel='flash' needs flash-attn 2 on a CUDA machine: {_INSTALL}") from exc
    if not all(hasattr(flash_attn, f) for f in ("flash_attn_varlen_func", "flash_attn_with_kvcache")):
        raise ImportError(
            f"kernel='flash' needs flash-attn 2; the installed flash_attn lacks its functions: {_INSTALL}"
        )
    return flash_attn


def installed_version() -> str | None:
    """The installed flash-attn 2 distribution's version (flash-attn 4 is another one), without importing it."""
    try:
        return importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """``"2.8.3.post1"`` -> (2, 8, 3): the release numbers, whatever suffix follows."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


@functools.cache
def graph_safe_for(version: str | None) -> bool:
    """Whether ``flash_attn_with_kvcache`` of this flash-attn version can be captured in a CUDA graph with a
    block table: not from ``GRAPH_UNSAFE_FROM`` on (a host sync per call), nor when flash-attn is absent."""
    return version is not None and _release(version) < GRAPH_UNSAFE_FROM


class _InstalledGraphSafe:
    """``FlashBackend.graph_safe``: a bool read from the installed flash-attn's version whenever it is asked."""

    def __get__(self, instance: object, owner: type | None = None) -> bool:
        return graph_safe_for(installed_version())


def accepts_head_dim(head_dim: int) -> bool:
    return head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0


def _check_supported(q: torch.Tensor, sinks: torch.Tensor | None) -> None:
    if sinks is not None:
        raise NotImplementedError(
            "flash-attn 2 has no attention sinks (sinks=...); use kernel='torch' or 'triton'"
        )
    if q.dtype not in _DTYPES:
        raise NotImplementedError(f"flash-attn 2 supports float16 and bfloat16 only, got {q.dtype}")
    if not accepts_head_dim(q.shape[-1]):
        raise NotImplementedError(
            f"flash-attn 2 takes head dims up to {MAX_HEAD_DIM} that are multiples of {HEAD_DIM_MULTIPLE} "
            f"(others it refuses, or pads by copying every page), got {q.shape[-1]}; use kernel='triton' or 'torch'"
        )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # flash-attn takes arbitrary outer strides but needs stride(-1) == 1; copying only then keeps
    # the common (already contiguous) case free.
    return x if x.stride(-1) == 1 else x.contiguous()


def _int32(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Lengths / offsets as contiguous int32 on ``device`` (flash-attn checks all three)."""
    return x.to(device=device, dtype=torch.int32).contiguous()


def _safe_block_table(block_table: torch.Tensor, device: torch.device) -> torch.Tensor:
    # -1 marks unallocated pages past each request's length; flash never reads them for attention,
    # but clamping to block 0 makes any address it might form valid.
    return block_table.to(device=device, dtype=torch.int32).clamp(min=0).contiguous()


def _check_pages(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    FlashBackend.check_block_size(k_cache.shape[1])
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        # The pages are updated in place, so they cannot be copied to fix their layout.
        raise ValueError("k_cache and v_cache must have a contiguous last dimension for flash-attn")


def _options(options: AttentionOptions) -> dict:
    """The options every flash-attn entry point takes, as plain Python scalars (no tensors, no
    numpy ints: flash-attn's C++ binding rejects them)."""
    left, right = options.window_size
    return dict(
        softmax_scale=float(options.softmax_scale),
        causal=bool(options.causal),
        window_size=(int(left), int(right)),
        softcap=float(options.softcap),
    )


def _key_bound(block_table: torch.Tensor, k_cache: torch.Tensor) -> int:
    """``max_seqlen_k`` for flash-attn: the block table's capacity, which bounds every request's keys.

    With a block table flash-attn always runs its split-KV kernel, and ``compute_attn_1rowblock_splitkv``
    reads key blocks only below ``ceil(max_seqlen_k / kBlockN)``: keys past ``max_seqlen_k`` are never
    read and a row left without keys is written as zeros. A caller's bound can be too small (a sliding
    group's ``max_length_k`` counts the window, not the keys from position 0 that ``cu_seqlens_k``
    counts); this one can't, costs no sync, and is what ``mha_fwd_kvcache`` itself uses for decode."""
    return block_table.shape[1] * k_cache.shape[1]


def _query_bound(max_seqlen_q: int, num_queries: int, batch: int) -> int:
    """``max_seqlen_q`` for flash-attn. At 1 with grouped heads and no window, ``mha_varlen_fwd`` reshapes q
    to [batch, H_kv, groups, D], which only fits when every request has a query; 2 (still an upper bound,
    and the grid of one 64-row block is the same) takes the general path when some request has none."""
    return 2 if max_seqlen_q == 1 and num_queries != batch else max_seqlen_q


def paged_prefill_attention(
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
    """Packed queries against keys read from the pages: flash-attn's varlen kernel with a block table.

    q: [total_q, H, D]; k_cache, v_cache: [num_blocks, block_size, H_kv, D] already holding this
    step's keys; cu_seqlens_q: [B + 1]; seqused_k: [B] keys per request; block_table: [B, max_blocks].
    flash-attn gets the block table's capacity as ``max_seqlen_k`` whatever the caller passes (see
    ``_key_bound``); ``memo`` is accepted for the protocol only.
    Returns [total_q, H, D].
    """
    _check_supported(q, options.sinks)
    _check_pages(k_cache, v_cache)
    fa = _load_flash_attn()
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0
    # With a block table, flash-attn reads each request's key count from cu_seqlens_k.
    cu_seqlens_k = torch.zeros(seqused_k.numel() + 1, dtype=torch.int32, device=q.device)
    cu_seqlens_k[1:] = seqused_k.to(q.device).cumsum(0)  # [B + 1]
    return fa.flash_attn_varlen_func(
        q=_last_dim_contiguous(q),
        k=k_cache,
        v=v_cache,
        cu_seqlens_q=_int32(cu_seqlens_q, q.device),
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=_query_bound(int(max_seqlen_q), q.shape[0], cu_seqlens_q.numel() - 1),
        max_seqlen_k=_key_bound(block_table, k_cache),
        **_options(options),
        block_table=_safe_block_table(block_table, q.device),
    )


def paged_decode_attention(
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
    """One new token per request. q: [B, 1, H, D]; k_cache, v_cache: [num_blocks, block_size, H_kv,
    D]; k, v: [B, 1, H_kv, D] appended in place at cache_seqlens[b] (then cache_seqlens[b] + 1 keys
    are attended), or None (then cache_seqlens[b] keys, already in the pages); block_table:
    [B, max_blocks]. ``max_seqlen_k`` and ``memo`` are accepted for the protocol only. Returns [B, 1, H, D]."""
    _check_supported(q, options.sinks)
    _check_pages(k_cache, v_cache)
    if (k is None) != (v is None):
        raise ValueError("pass both k and v, or neither")
    fa = _load_flash_attn()
    return fa.flash_attn_with_kvcache(
        q=_last_dim_contiguous(q),
        k_cache=k_cache,
        v_cache=v_cache,
        k=None if k is None else _last_dim_contiguous(k),
        v=None if v is None else _last_dim_contiguous(v),
        cache_seqlens=_int32(cache_seqlens, q.device),
        block_table=_safe_block_table(block_table, q.device),
        **_options(options),
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V into the pages (flash-attn 2 has no standalone writer: a torch scatter).

    k, v: [N, H_kv, D]; k_cache, v_cache: [num_blocks, block_size, H_kv, D]; slot_mapping: [N],
    slot = block * block_size + offset, -1 skips the token.

    No device sync (it runs once per layer of every prefill step): rather than dropping skipped
    tokens (a boolean index waits for the device), a skipped token rewrites the first kept token's
    slot with that token's K/V, or slot 0 with its own content when no token is kept, so duplicate
    targets always receive identical values.
    """
    slots = slot_mapping.long()  # [N]
    keep = slots >= 0
    first = keep.int().argmax()  # the first kept token, 0 when none is
    any_kept = keep[first]
    spare_slot = torch.where(any_kept, slots[first], 0)
    targets = torch.where(keep, slots, spare_slot)  # [N]
    for new, cache in ((k, k_cache), (v, v_cache)):
        flat = cache.view(-1, *cache.shape[2:])  # [num_slots, H_kv, D]
        new = new.to(cache.dtype)
        spare = torch.where(any_kept, new[first], flat[0])  # [H_kv, D]
        flat.index_copy_(0, targets, torch.where(keep[:, None, None], new, spare))


class FlashBackend(AttentionBackend):
    name = "flash"
    dtypes = _DTYPES
    supports_sinks = False
    block_size_rule = "a multiple of 256 (flash-attn 2's paged kernels)"
    install_hint = (
        "needs a CUDA device of compute capability 8.0+ and flash-attn 2 installed (pip install 'hf-paged-attn[flash]')"
    )
    # flash_attn_with_kvcache reads cache_seqlens and block_table on the device, until a version that syncs
    graph_safe = _InstalledGraphSafe()

    @staticmethod
    def is_available(device: torch.device) -> bool:
        # find_spec("flash_attn") alone is also true of a flash-attn-4-only install (a namespace package)
        return (
            device.type == "cuda"
            and importlib.util.find_spec(_EXTENSION) is not None
            and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY
        )

    @staticmethod
    def accepts_head_dim(head_dim: int) -> bool:
        return accepts_head_dim(head_dim)

    @staticmethod
    def accepts_block_size(block_size: int) -> bool:
        return block_size % 256 == 0

    @staticmethod
    def default_block_size(device: torch.device) -> int:
        return 256

    # The entry points are this module's functions, whose signatures are the protocol's
    write_kv = staticmethod(write_kv)
    paged_prefill_attention = staticmethod(paged_prefill_attention)
    paged_decode_attention = staticmethod(paged_decode_attention)
