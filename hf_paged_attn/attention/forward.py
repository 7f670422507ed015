"""One forward's scratch: what the cache and the attention function work out while the model runs
a step, kept apart from the step's description (``step.StepMetadata``) and dropped after it.

The executor makes a ``ForwardContext`` for every model call and opens it on the cache
(``PagedAttentionCache.forward``); layers reach it through the cache (``update``) and the
``paged_forward`` forward kwarg (the attention function). It holds:

- the backend that runs the step's kernels;
- for each (attention group, device) the layers run on, a ``LayerInputs``: that group's tables with
  the step's shared tensors, moved to the device once (accelerate may spread layers over devices),
  and the ``memo`` dict its kernels share across layers (``kernels/base.py``);
- the cache layer ``update`` wrote last, whose pages the attention call that follows reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import CacheLayerMixin

from ..kernels.base import AttentionBackend
from .step import StepMetadata


@dataclass(slots=True)
class LayerInputs:
    """What a layer of attention group ``group`` reads, on one device. Shapes as ``StepMetadata``."""

    is_decode: bool
    cu_seq_lens_q: torch.Tensor  # [B + 1] int32
    cache_seqlens: torch.Tensor  # [B] int32
    seqused_k: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32, this group's
    slot_mapping: torch.Tensor  # [N] int64, this group's
    max_length_q: int
    max_length_k: int  # this group's
    memo: dict = field(default_factory=dict)  # the kernels' layer-independent work (kernels/base.py)


class ForwardContext:
    """The scratch of one model call on ``step``, with ``backend`` running its kernels."""

    def __init__(self, step: StepMetadata, backend: AttentionBackend) -> None:
        self.step = step
        self.backend = backend
        # the cache layer ``PagedAttentionCache.update`` wrote last (a ``cache.PagedLayer``; typed by its
        # transformers base so that this module, which the cache imports, need not import the cache)
        self.last_layer: CacheLayerMixin | None = None
        self._inputs: dict[tuple[int, torch.device], LayerInputs] = {}
        self._shared: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # the step-wide tensors per device

    def inputs(self, group: int, device: torch.device) -> LayerInputs:
        """Attention group ``group``'s inputs on ``device``, made once per forward."""
        found = self._inputs.get((group, device))
        if found is None:
            step, tables = self.step, self.step.groups[group]
            shared = self._shared.get(device)
            if shared is None:
                shared = self._shared[device] = tuple(
                    _on(t, device) for t in (step.cu_seq_lens_q, step.cache_seqlens, step.seqused_k)
                )
            found = self._inputs[(group, device)] = LayerInputs(
                step.is_decode, *shared, _on(tables.block_table, device), _on(tables.slot_mapping, device),
                step.max_length_q, tables.max_length_k,
            )  # fmt: skip
        return found


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a blocking copy, so a device-to-host move is safe (tiny tensors)."""
    return tensor if tensor.device == device else tensor.to(device)
