"""New weights into a served model without a restart: named tensors copied in place, or a directory's
safetensors files.

In place (``param.copy_``), so every tensor keeps its storage: CUDA graphs captured on it stay valid,
and every copy the runtime keeps of the weights sees the change through the version counters
(``weights.fingerprint``: the compiled forward retires itself, packed and float32 copies are rebuilt).
Every name and shape is checked before the first copy: a bad checkpoint changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch


def load_named_tensors(model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                       ) -> int:
    """Copy each ``(name, tensor)`` of ``weights`` into ``model``'s parameter or buffer of that name (also
    found with or without the model's ``base_model_prefix``); returns how many were copied. ValueError,
    with nothing copied, for an unknown name or a shape that differs."""
    items = list(weights.items() if isinstance(weights, Mapping) else weights)
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    prefix = getattr(model, "base_model_prefix", "") or ""
    pairs = []
    for name, tensor in items:
        target = targets.get(name)
        if target is None and prefix:  # a base model's checkpoint under a head model, or the reverse
            target = targets.get(f"{prefix}.{name}")
            if target is None:
                target = targets.get(name.removeprefix(f"{prefix}."))
        if target is None:
            raise ValueError(f"{name!r} is not a parameter or buffer of the model; nothing was loaded")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name!r} has shape {tuple(tensor.shape)}, the model's {tuple(target.shape)}; "
                             "nothing was loaded")
        pairs.append((target, tensor))
    with torch.no_grad():
        for target, tensor in pairs:
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))  # bumps the version counter
    return len(pairs)


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of directory ``path`` (ValueError if there are none)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(path)!r} holds no .safetensors file")
    return files


def load_directory(model: torch.nn.Module, path: str | Path) -> int:
    """Every tensor of the safetensors files in ``path`` (``save_pretrained``'s output) into ``model``."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        weights.update(load_file(str(file), device="cpu"))
    return load_named_tensors(model, weights)
