"""How many KV blocks a cache gets: from free memory (the engine), or exactly what a batch needs
(``model.generate``). One block id spans every layer of an attention group, so each device must
hold a block's pages for each of its layers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from transformers import PreTrainedConfig

from ...attention.model_checks import max_positions
from ...core.blocks import blocks_for
from ...core.kv_manager import blocks_at_peak
from ...core.layers import AttentionGroup, LayerKinds
from ...kernels.kv_dtype import SCALE_DTYPE, is_int8, page_dtype
from ..config import PagedConfig
from .placement import layer_devices

# The sequence length sizing assumes when the model's config names none: a cap on useful blocks, no limit.
UNKNOWN_MAX_POSITIONS = 4096


def bytes_per_block(
    config: PreTrainedConfig,
    block_size: int,
    dtype: torch.dtype,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
) -> int:
    """K and V bytes of one block across the ``num_layers`` layers one block id spans (default:
    all; a hybrid model's ``LayerKinds.num_slots``), from the config: pages are made lazily.
    ``num_kv_heads``: the K/V heads this process holds (default: the config's; a tensor-parallel
    rank holds its share)."""
    text = config.get_text_config()
    num_kv_heads = num_kv_heads or getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    # int8 pages: each token and head also stores its scale (kv_dtype.SCALE_DTYPE) beside its head_dim bytes
    scale = SCALE_DTYPE.itemsize if is_int8(dtype) else 0
    return 2 * (num_layers or text.num_hidden_layers) * block_size * num_kv_heads * (head_dim * element + scale)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30  # no /proc (macOS, Windows): assume 4 GiB rather than fail


def blocks_from_memory(
    model: torch.nn.Module,
    block_size: int,
    memory_fraction: float,
    dtype: torch.dtype | None = None,
    free_bytes: Callable[[torch.device], int] | None = None,
    layers_per_block: int | None = None,
    num_kv_heads: int | None = None,
    memory_bytes: int | None = None,
) -> int:
    """How many blocks fit everywhere: one block id spans every layer, so each device must hold a
    block's pages for each of its layers. The minimum over devices of
    ``free_bytes(device) * memory_fraction // (bytes per block per layer * layers on device)``, or of
    ``memory_bytes // (...)`` when given (``PagedConfig.kv_cache_memory_bytes``: each device's budget).

    ``dtype`` is the K/V dtype (default: the model's parameters'; offloaded ``meta`` parameters keep
    theirs). ``free_bytes``: free bytes of a device (default: ``free_memory_bytes``, looked up at
    call time so tests can replace it). ``layers_per_block``: the page tensors one block
    id spans when fewer than the layers (hybrid models share a pool between attention groups, all on
    one device). ``num_kv_heads``: as ``bytes_per_block``."""
    if dtype is None:
        dtype = next(model.parameters()).dtype
    num_layers = model.config.get_text_config().num_hidden_layers
    per_layer = bytes_per_block(model.config, block_size, dtype, num_kv_heads=num_kv_heads) // num_layers
    counts = Counter(layer_devices(model))
    if layers_per_block is not None:
        counts = Counter({device: layers_per_block for device in counts})
    if memory_bytes is not None:
        return min(memory_bytes // (per_layer * n) for n in counts.values())
    free_bytes = free_bytes or (lambda device: free_memory_bytes(device))
    return min(int(free_bytes(device) * memory_fraction) // (per_layer * n) for device, n in counts.items())


def fitting_blocks(
    model: torch.nn.Module,
    config: PagedConfig,
    layers: LayerKinds,
    free_bytes: Callable[[torch.device], int] | None = None,
    num_kv_heads: int | None = None,
) -> int:
    """The engine's ``num_blocks`` when none is given: what ``config.kv_cache_memory_bytes`` or
    ``config.memory_fraction`` of the free memory holds in pages of ``config.kv_cache_dtype``
    (``blocks_from_memory``), capped at what ``config.max_num_seqs`` requests can use.
    ``num_kv_heads``: as ``bytes_per_block``."""
    max_position = max_positions(model) or UNKNOWN_MAX_POSITIONS
    useful = config.max_num_seqs * blocks_for(max_position, config.block_size)
    slots = layers.num_slots if len(layers.groups) > 1 else None
    dtype = page_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)
    fits = blocks_from_memory(
        model, config.block_size, config.memory_fraction, dtype, free_bytes=free_bytes, layers_per_block=slots,
        num_kv_heads=num_kv_heads, memory_bytes=config.kv_cache_memory_bytes,
    )  # fmt: skip
    return max(1, min(fits, useful * len(layers.groups)))


def blocks_for_batch(
    prompt_lengths: list[int],
    max_new_tokens: int,
    config: PagedConfig,
    groups: list[AttentionGroup],
    sequences_per_prompt: int = 1,
) -> int:
    """``model.generate``'s cache: exactly what its batch holds at its peak, every request at once
    (``sequences_per_prompt`` copies of each: ``num_return_sequences``, or beams in the worst case,
    every beam recomputed alone after a preemption)."""
    size, budget = config.block_size, config.max_batch_tokens
    peak = sum(blocks_at_peak(n + max_new_tokens, size, groups, budget) for n in prompt_lengths)
    return peak * sequences_per_prompt
