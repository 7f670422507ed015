"""Quantized pages: the KV cache dtypes (vLLM's names) and the write that rounds K/V into them.

fp8 pages are float8 tensors, so every reader knows their format from ``k_cache.dtype`` (e4m3: 3
mantissa bits, range ±448; e5m2: 2 mantissa bits, range ±57344). Their per-layer scales never reach a
kernel: the attention function stores ``k / k_scale`` and ``v / v_scale`` and folds the scales back in
outside the kernel, ``k_scale`` into ``softmax_scale`` (``q · (k_scale k8) * s = q · k8 * (s k_scale)``,
softcap applied after, as before) and ``v_scale`` into the output (``Σ p v_scale v8 = v_scale Σ p v8``).
So a kernel reads fp8 pages by converting each element to float, nothing more.
"""

from __future__ import annotations

import torch

# PagedConfig.kv_cache_dtype -> the pages' dtype (None: the model's own)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def page_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pages for ``PagedConfig.kv_cache_dtype`` and a model computing in ``model_dtype``."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


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
