"""Quantized pages: the KV cache dtypes (vLLM's names) and the write that rounds K/V into them.

fp8 pages are float8 tensors, so every reader knows their format from ``k_cache.dtype`` (e4m3: 3
mantissa bits, range ±448; e5m2: 2 mantissa bits, range ±57344). Their per-layer scales never reach a
kernel: the attention function stores ``k / k_scale`` and ``v / v_scale`` and folds the scales back in
outside the kernel, ``k_scale`` into ``softmax_scale`` (``q · (k_scale k8) * s = q · k8 * (s k_scale)``,
softcap applied after, as before) and ``v_scale`` into the output (``Σ p v_scale v8 = v_scale Σ p v8``).
So a kernel reads fp8 pages by converting each element to float, nothing more.

int8 pages carry a scale per (token, KV head) instead, beside the pages (float16 [num_blocks, block_size,
H_kv] per layer for K and for V): symmetric rounding, ``x ≈ scale * q`` with ``scale = max|x| / 127`` over the
head's D elements. They cannot be folded outside the kernel (they differ per key), so the kernels that read
int8 pages take them (``k_scales`` / ``v_scales``) and multiply what they read.
"""

from __future__ import annotations

import torch

# PagedConfig.kv_cache_dtype -> the pages' dtype (None: the model's own)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def page_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pages for ``PagedConfig.kv_cache_dtype`` and a model computing in ``model_dtype``."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_int8(dtype: torch.dtype | None) -> bool:
    return dtype == torch.int8


# int8 scales are float16 (2 bytes beside 1 per element: 3% more than fp8 at head dim 64), kept at least float16's
# smallest normal: a head of zeros then stores zeros, never 0 / 0.
SCALE_DTYPE = torch.float16
_MIN_SCALE = float(torch.finfo(torch.float16).tiny)


def quantize_int8(new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``new`` [..., D] as int8 [..., D] and its float16 scales [...]: ``new ≈ scale * q``, q in [-127, 127].
    The scale is rounded to float16 before dividing, so what is stored is what every reader multiplies by."""
    x = new.float()
    scale = (x.abs().amax(dim=-1) / 127).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)  # [...]
    q = torch.round(x / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 K/V [..., D] read with their scales [...] back to ``dtype``."""
    return (q.float() * scales.float().unsqueeze(-1)).to(dtype)


def write_pages(
    cache: torch.Tensor, scales: torch.Tensor | None, new: torch.Tensor, slots: torch.Tensor
) -> None:
    """``new`` [N, H_kv, D] written at the flat slots [N] of ``cache`` [num_blocks, block_size, H_kv, D] (contiguous),
    rounded to its dtype; int8 pages write their scales [num_blocks, block_size, H_kv] at the same slots."""
    if is_int8(cache.dtype):
        assert scales is not None, "int8 pages need their scales"
        q, scale = quantize_int8(new)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, q)
        scales.view(-1, scales.shape[-1]).index_copy_(0, slots, scale)
        return
    writable(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, to_pages(new, cache.dtype))


def to_pages(new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``new`` rounded to the pages' ``dtype``. fp8: saturated at the format's largest finite value first
    (a plain cast turns an e4m3 overflow into NaN, which would poison every later softmax), and returned
    as its uint8 bytes, the view every fp8 write goes through (CPU torch has no float8 ``index_copy_``)."""
    if not is_fp8(dtype):
        return new.to(dtype)
    limit = torch.finfo(dtype).max
    return new.float().clamp(-limit, limit).to(dtype).view(torch.uint8)


def writable(cache: torch.Tensor) -> torch.Tensor:
    """The pages as the tensor a write indexes: fp8 pages as their uint8 bytes (same storage)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
