"""The per-layer scales of quantized (fp8) pages: from the checkpoint when it has them, else 1.0.

Pages store ``k / k_scale`` and ``v / v_scale`` (``kernels/kv_dtype.py``). Checkpoints quantized for an
fp8 KV cache (llm-compressor, ModelOpt) carry one scale per layer, named as vLLM reads them:
``...layers.<i>.self_attn.k_scale`` / ``v_scale`` (or under ``k_proj`` / ``v_proj``, or ModelOpt's
``k_proj.output_scale``). transformers drops tensors the model has no parameter for, so they are looked
for both on the model and in its local safetensors files. A per-head scale is reduced to its largest
entry: never an overflow, at a little precision for the other heads.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_NAME = re.compile(r"layers\.(\d+)\.(?:.*\.)?(?:([kv])_scale|([kv])_proj\.output_scale)$")


def _found(names_and_tensors: Iterable[tuple[str, torch.Tensor]], into: dict[tuple[int, str], float]) -> None:
    for name, tensor in names_and_tensors:
        match = _NAME.search(name)
        if match and tensor.numel():
            into[(int(match[1]), match[2] or match[3])] = float(tensor.detach().float().abs().max())


def _checkpoint_files(model: torch.nn.Module) -> list[Path]:
    path = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    return sorted(path.glob("*.safetensors")) if path.is_dir() else []


def read_kv_scales(model: torch.nn.Module, num_layers: int) -> tuple[list[tuple[float, float]], str]:
    """Each layer's (k_scale, v_scale), and where they came from, in words for the log."""
    scales: dict[tuple[int, str], float] = {}
    _found(model.named_parameters(), scales)
    _found(model.named_buffers(), scales)
    source = "the model's parameters"
    if not scales:
        from safetensors import safe_open

        for file in _checkpoint_files(model):
            with safe_open(str(file), framework="pt") as f:
                _found(((name, f.get_tensor(name)) for name in f.keys() if _NAME.search(name)), scales)
        source = "the checkpoint's safetensors"
    if not scales:
        return [(1.0, 1.0)] * num_layers, "1.0 for every layer (the checkpoint has no k_scale/v_scale)"
    layers = [(scales.get((i, "k"), 1.0), scales.get((i, "v"), 1.0)) for i in range(num_layers)]
    found = sum((i, kind) in scales for i in range(num_layers) for kind in "kv")
    return layers, f"from {source} ({found} of {2 * num_layers} layer scales; missing ones 1.0)"


def kv_scales_for(model: torch.nn.Module, kv_cache_dtype: str, num_layers: int) -> list[tuple[float, float]] | None:
    """The scales of an fp8 cache, logged (a checkpoint's scales silently dropped cost accuracy elsewhere);
    None for ``kv_cache_dtype="auto"``."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype == "int8":  # scales per token and head, made as K/V are written: a checkpoint's don't apply
        logger.warning("kv_cache_dtype='int8': a scale per token and KV head (max|x| / 127), computed at each write; "
                       "checkpoint k_scale/v_scale are not used")  # fmt: skip
        return None
    scales, source = read_kv_scales(model, num_layers)
    logger.warning("kv_cache_dtype=%r: k_scale/v_scale %s", kv_cache_dtype, source)
    return scales
