"""A stand-in ``flash_attn`` module (no GPU, no flash-attn) that fails where flash-attn 2 would.

It has flash-attn 2's exact Python signatures (2.6.0 to 2.8.3 and main), so a misspelt or misplaced
argument fails to bind; it raises where ``csrc/flash_attn/flash_api.cpp`` raises (dtype, head dim,
int32 lengths and table, contiguous last dimension, page size multiple of 256, block ids in range,
the ``max_seqlen_q == 1`` reshape of grouped heads); and it computes what the CUDA kernels compute,
with the float64 reference, including where that differs from plain attention:

* With a block table, ``mha_varlen_fwd`` always runs the split-KV kernel (``run_mha_fwd(params,
  stream, /*force_split_kernel=*/paged_KV)``), whose ``compute_attn_1rowblock_splitkv`` reads key
  blocks only below ``ceil(params.seqlen_k / kBlockN)`` with ``params.seqlen_k = max_seqlen_k``
  (``flash_fwd_kernel.h``; the same at 2.6.0, 2.8.3 and main). Keys past that are never read, and a
  row left without keys is written as zeros.
* ``window_size_left >= max_seqlen_k`` turns the window off.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from hf_paged_attn.kernels import reference
from hf_paged_attn.kernels.base import AttentionOptions

MAX_HEAD_DIM = 256


def key_block(head_dim: int) -> int:
    """``kBlockN`` of ``run_mha_fwd_splitkv_dispatch`` (``flash_fwd_launch_template.h``)."""
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


def readable_keys(max_seqlen_k: int, head_dim: int) -> int:
    """How many leading keys of a request the split-KV kernel can read at most (one split)."""
    n = key_block(head_dim)
    return -(-max_seqlen_k // n) * n


def attend_split_kv(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, limit: int, options: AttentionOptions
) -> torch.Tensor:
    """One request as the split-KV kernel computes it: query i at position ``k_len - q_len + i`` (bottom-
    right), keys at positions >= ``limit`` never read. q: [q_len, H, D]; keys, values: [k_len, H_kv, D]."""
    q_len, k_len = q.shape[0], keys.shape[0]
    if limit >= k_len:  # nothing cut: the reference as it is
        return reference.attend_one(q, keys, values, options=options)
    # Rows see keys up to their own position (the adapter is always causal; with one query per request
    # flash-attn drops ``causal``, which changes nothing for a bottom-right query).
    left = options.window_size[0]
    out = torch.zeros_like(q)
    for i in range(q_len):
        position = k_len - q_len + i
        first = max(position - left, 0) if left >= 0 else 0
        last = min(position + 1, limit)  # causal, and cut at the limit
        if first < last:  # every key of [first, last) is visible: no mask needed
            rest = dataclasses.replace(options, causal=False, window_size=(-1, -1))
            out[i : i + 1] = reference.attend_one(q[i : i + 1], keys[first:last], values[first:last], options=rest)
    return out


class FakeFlashAttn(SimpleNamespace):
    """flash_attn stand-in: records every call's bound arguments in ``calls``."""

    def __init__(self) -> None:
        super().__init__(calls=[], __version__="2.8.3")

    @staticmethod
    def _check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
        if not q.dtype == k.dtype == v.dtype:
            raise RuntimeError("query and key must have the same dtype")
        head_dim = q.shape[-1]
        if head_dim > MAX_HEAD_DIM:
            raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
        # The Python wrapper pads q/k/v to a multiple of 8 before this check: for paged calls that copies
        # the whole page tensor every layer, which the adapter must never ask for.
        if head_dim % 8:
            raise RuntimeError("query, key, value, and out_ must have a head_size that is a multiple of 8")
        for t in (q, k, v):
            assert t.stride(-1) == 1, "flash-attn needs a contiguous last dimension"
            assert t.device == q.device

    @staticmethod
    def _check_table(block_table: torch.Tensor, k_cache: torch.Tensor, q: torch.Tensor) -> None:
        assert block_table.dtype == torch.int32 and block_table.device == q.device
        assert block_table.is_contiguous()
        assert int(block_table.min()) >= 0, "flash-attn would read block -1"
        assert int(block_table.max()) < k_cache.shape[0]
        if k_cache.shape[1] % 256:
            raise RuntimeError("Paged KV cache block size must be divisible by 256")

    @staticmethod
    def _swap_grouped_heads(q: torch.Tensor, num_kv_heads: int, batch: int, window: tuple[int, int]) -> None:
        """``mha_varlen_fwd``'s fast path for ``max_seqlen_q == 1``: q reshaped to [batch, H_kv, groups, D],
        which only fits when every request has exactly one query."""
        _, num_heads, head_dim = q.shape
        if num_heads > num_kv_heads and window[0] < 0 and window[1] < 0 and head_dim % 8 == 0:
            q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # raises as at::reshape does

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),  # -1 means infinite context window
        softcap=0.0,  # 0.0 means deactivated
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        self.calls.append(("varlen", dict(locals())))
        self._check_common(q, k, v)
        for cu in (cu_seqlens_q, cu_seqlens_k):
            assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == q.device
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        batch = cu_seqlens_q.numel() - 1
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        assert max(q_lens) <= max_seqlen_q, "max_seqlen_q sizes the grid: a longer request loses rows"
        left, right = window_size
        if max_seqlen_q == 1:
            causal = False  # one query sees every key either way (flash_api.cpp)
        if causal:
            right = 0
        if max_seqlen_q == 1:
            self._swap_grouped_heads(q, k.shape[-2], batch, (left, right))
        left = -1 if left >= max_seqlen_k else left
        right = -1 if right >= max_seqlen_k else right
        options = AttentionOptions(softmax_scale, causal=causal, window_size=(left, right), softcap=softcap)
        if max_seqlen_k == 0:
            return torch.zeros_like(q)
        if block_table is None:
            assert max(k_lens) <= max_seqlen_k
            return reference.varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, options=options)
        self._check_table(block_table, k, q)
        limit = readable_keys(max_seqlen_k, q.shape[-1])
        out = torch.zeros_like(q)
        for b, (q0, n_k) in enumerate(zip(cu_seqlens_q[:-1].tolist(), k_lens, strict=True)):
            keys = reference.gather_pages(k, block_table[b], n_k)  # [n_k, H_kv, D]
            values = reference.gather_pages(v, block_table[b], n_k)
            out[q0 : q0 + q_lens[b]] = attend_split_kv(q[q0 : q0 + q_lens[b]], keys, values, limit, options)
        return out

    def flash_attn_with_kvcache(
        self,
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_seqlens=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),  # -1 means infinite context window
        softcap=0.0,  # 0.0 means deactivated
        rotary_interleaved=True,
        alibi_slopes=None,
        num_splits=0,
        return_softmax_lse=False,
    ):
        self.calls.append(("kvcache", dict(locals())))
        self._check_common(q, k_cache, v_cache)
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.device == q.device
        self._check_table(block_table, k_cache, q)
        block_size = k_cache.shape[1]
        # mha_fwd_kvcache: seqlen_k = max_num_blocks_per_seq * page_block_size, so nothing the table
        # holds is cut; main checks (with a device sync) that no request needs more.
        capacity = block_table.shape[1] * block_size
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            n = int(cache_seqlens[b])
            assert n + (k is not None) <= capacity, "the kernel would index block_table out of bounds"
            if k is not None:  # appended in place at cache_seqlens[b], as flash-attn does
                page, off = int(block_table[b, n // block_size]), n % block_size
                k_cache[page, off], v_cache[page, off] = k[b, 0], v[b, 0]
                n += 1
            keys = reference.gather_pages(k_cache, block_table[b], n)
            values = reference.gather_pages(v_cache, block_table[b], n)
            out[b] = reference.attend_one(
                q[b], keys, values,
                options=AttentionOptions(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                         softcap=softcap),
            )  # fmt: skip
        return out
