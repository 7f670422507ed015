"""Layer kinds: which layers attend to every earlier token and which through a sliding window.

Read once from the model's config when the engine is built, then checked against what the layers
really did at the first step (some models slide a window that only their mask knows about). The KV
manager reads it to free blocks that left a window; the step builder to start keys at the window.
Plain Python, no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LayerKinds:
    """``windows[i]``: the sliding window of layer ``i`` in tokens, or None for full attention."""

    windows: list[int | None]
    observed: bool = False  # True once the first step has confirmed (or corrected) ``windows``

    @classmethod
    def from_config(cls, config: object) -> LayerKinds:
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
        return cls(list(windows[:num_layers]))

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides the same one, else None. Only then can blocks that
        left the window be freed while one block id serves every layer."""
        kinds = set(self.windows)
        return kinds.pop() if len(kinds) == 1 else None

    def observe(self, seen: list[int | None]) -> None:
        """What each layer's attention call used at the first step; it wins over the config."""
        if len(seen) == len(self.windows) and seen != self.windows:
            logger.info("layer windows from the config %s differ from what the layers used %s", self.windows, seen)
            self.windows = list(seen)
        self.observed = True
