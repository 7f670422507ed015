"""Layer kinds and attention groups: which layers attend to every earlier token, which through a
sliding window, and which layers share one block table.

Read once from the model's config when the engine is built, then checked against what the layers
really did at the first step (some models slide a window that only their mask knows about). The KV
manager reads it to give each group its own block table and to free blocks that left a window; the
step builder to build each group's tables and to start keys at the window; the cache to know which
pages a layer writes.

Groups (models that mix sliding and full layers: Gemma 2/3, Cohere 2, GPT-OSS, ...): layers of one
kind form groups of ``G`` layers each, ``G`` the greatest common divisor of the kinds' layer counts,
so that every group has the same number of layers and a block id means the same number of bytes in
every group: one pool of blocks serves all groups (as in vLLM's hybrid KV cache manager), and memory
flows to whichever group needs it. The ``j``-th layer of every group writes the ``j``-th page
tensor ("slot"), so the cache holds ``G`` page tensors instead of one per layer. Gemma 3's 5:1
pattern gives ``G = 1``: six groups of one layer, each with its own table, and a sliding table
holds only its window's blocks. Plain Python, no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import reduce
from math import gcd

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Layers that share one block table: the same kind, the same window (None: full attention)."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(slots=True)
class LayerKinds:
    """``windows[i]``: the sliding window of layer ``i`` in tokens, or None for full attention."""

    windows: list[int | None]
    share_pages: bool = False  # hybrid groups sharing a pool (see the module docstring)
    observed: bool = False  # True once the first step has confirmed (or corrected) ``windows``
    groups: list[AttentionGroup] = field(default_factory=list)
    group_of_layer: list[int] = field(default_factory=list)
    slot_of_layer: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._regroup()

    @classmethod
    def from_config(cls, config: object, share_pages: bool = True) -> LayerKinds:
        """``share_pages``: give each group of a model that mixes kinds its own block table (False:
        one table for all layers, every block kept, as before per-group tables existed)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_layers = text.num_hidden_layers
        window = getattr(text, "sliding_window", None)
        layer_types = getattr(text, "layer_types", None)
        if layer_types:
            windows = [window if kind == "sliding_attention" else None for kind in layer_types]
        elif window and getattr(text, "use_sliding_window", True) is not False:
            windows = [window] * num_layers
        else:
            windows = [None] * num_layers
        return cls(list(windows[:num_layers]), share_pages=share_pages)

    def _regroup(self) -> None:
        n = len(self.windows)
        kinds = list(dict.fromkeys(self.windows))  # in order of first appearance
        if len(kinds) <= 1 or not self.share_pages:
            self.groups = [AttentionGroup(self.uniform_window, tuple(range(n)))]
            self.group_of_layer, self.slot_of_layer = [0] * n, list(range(n))
            return
        members = {kind: [i for i, w in enumerate(self.windows) if w == kind] for kind in kinds}
        size = reduce(gcd, (len(m) for m in members.values()))
        self.groups, self.group_of_layer, self.slot_of_layer = [], [0] * n, [0] * n
        for kind in kinds:
            for start in range(0, len(members[kind]), size):
                layers = tuple(members[kind][start : start + size])
                for slot, layer in enumerate(layers):
                    self.group_of_layer[layer], self.slot_of_layer[layer] = len(self.groups), slot
                self.groups.append(AttentionGroup(kind, layers))

    @property
    def num_slots(self) -> int:
        """Page tensors the cache holds (layers one block id spans)."""
        return len(self.groups[0].layers) if self.groups and self.groups[0].layers else 1

    @property
    def layers_per_block(self) -> int:
        """Layers whose K/V one allocator block holds: a group's when groups share one pool, else all."""
        return self.num_slots if len(self.groups) > 1 else max(len(self.windows), 1)

    def pool_blocks(self, num_blocks: int) -> int:
        """Allocator blocks that hold the memory of ``num_blocks`` blocks in every layer
        (``PagedConfig.num_blocks``' unit): ``num_blocks`` times the number of groups sharing the
        pool. Per-group tables so only ever let more requests in, never fewer: a request needs at
        most its one-table count in every group, and the pool has that many per group."""
        return num_blocks * max(len(self.windows), 1) // self.layers_per_block

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides the same one, else None."""
        kinds = set(self.windows)
        return kinds.pop() if len(kinds) == 1 else None

    def observe(self, seen: list[int | None]) -> None:
        """What each layer's attention call used at the first step; it wins over the config. Once
        groups have their own tables, a changed kind can't regroup blocks already handed out."""
        if len(seen) == len(self.windows) and seen != self.windows:
            if len(self.groups) > 1:
                raise RuntimeError(
                    f"the layers attended with windows {seen}, not the {self.windows} of the config's "
                    "layer_types; load with PagedConfig(hybrid_kv=False) to keep one block table for all layers"
                )
            logger.info("layer windows from the config %s differ from what the layers used %s", self.windows, seen)
            self.windows = list(seen)
            self._regroup()
        self.observed = True
