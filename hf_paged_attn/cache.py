"""PagedAttentionCache: K/V stored in fixed-size blocks, addressed through a block table.

Each layer owns two page tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``, created
lazily at the layer's first write so that models whose layers differ in head count or head dim get
pages of the right shape per layer. One block id means the same block in every layer, so a single
allocator and a single block table serve the whole model.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin

from .blocks import blocks_for
from .step import StepMetadata

# The step running in this thread, for the attention function of models whose decoder layers don't
# forward **kwargs (Nemotron), so that the ``paged_metadata`` forward kwarg never reaches it.
ACTIVE_STEP: contextvars.ContextVar[StepMetadata | None] = contextvars.ContextVar("paged_step", default=None)


def pad_head_dim(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with its last (head) dim zero-padded to ``width``. Zero query/key columns leave q·k
    unchanged and zero value columns give zero output columns, so padding is exact."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


class PagedLayer(CacheLayerMixin):
    """One layer's pages. ``keys``/``values``: [num_blocks, block_size, num_kv_heads, width], where
    ``width`` is the larger of the key and value head dims (equal in most models)."""

    def __init__(self, num_blocks: int, block_size: int, is_sliding: bool = False) -> None:
        super().__init__()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.is_sliding = is_sliding
        self.window: int | None = None  # sliding window the attention used last (None: full)
        # Weak references to the K/V that the last update returned: the attention function checks
        # that it got exactly these (model_checks.check_attention_call) without keeping them alive.
        self.returned: tuple[weakref.ref, weakref.ref] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # key_states: [batch, num_kv_heads, seq, head_dim] as transformers' attention modules give them
        _, num_kv_heads, _, self.key_dim = key_states.shape
        self.value_dim = value_states.shape[-1]
        # K and V pages share one width, the larger head dim (zero-padded): flash-attn and the decode
        # kernels need equal head dims, and models with latent attention (DeepSeek, MiMo) differ.
        shape = (self.num_blocks, self.block_size, num_kv_heads, max(self.key_dim, self.value_dim))
        self.keys = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(shape, dtype=value_states.dtype, device=value_states.device)
        self.device = key_states.device
        self.is_initialized = True

    @property
    def width(self) -> int:
        return self.keys.shape[-1]

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """key/value: [N, num_kv_heads, head_dim] written at flat slots [N]."""
        self.keys.view(-1, *self.keys.shape[2:]).index_copy_(0, slots, pad_head_dim(key, self.width))
        self.values.view(-1, *self.values.shape[2:]).index_copy_(0, slots, pad_head_dim(value, self.width))

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V at flat ``slots`` [K], packed: [K, num_kv_heads, key_dim] and [K, num_kv_heads, value_dim]."""
        keys = self.keys.view(-1, *self.keys.shape[2:]).index_select(0, slots)
        values = self.values.view(-1, *self.values.shape[2:]).index_select(0, slots)
        return keys[..., : self.key_dim], values[..., : self.value_dim]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError("PagedLayer is written through PagedAttentionCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # kv_length 0 tells the "paged" mask function that the kernels mask by cu_seqlens instead
        # (see integration.paged_mask): no [q, kv] mask is ever built for a packed step.
        return 0, 0

    def get_seq_length(self) -> int:
        return 0  # lengths are per request, in the step metadata

    def get_max_length(self) -> int:
        return self.num_blocks * self.block_size


class PagedAttentionCache(Cache):
    """A ``transformers.Cache`` whose layers are paged.

    The engine opens a step with ``with cache.step(metadata): model(...)``; inside it, ``update``
    writes the step's new K/V through ``metadata.slot_mapping`` and, on the varlen path, returns each
    request's full K/V packed along one axis for the kernel. On the decode path it returns the new
    K/V untouched: the paged decode kernel appends them in place.
    """

    def __init__(self, config: PreTrainedConfig, num_blocks: int, block_size: int) -> None:
        text_config = config.get_text_config()
        num_layers = text_config.num_hidden_layers
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers
        layers = [
            PagedLayer(num_blocks, block_size, is_sliding=layer_types[i] != "full_attention")
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.metadata: StepMetadata | None = None

    @contextlib.contextmanager
    def step(self, metadata: StepMetadata) -> Iterator[StepMetadata]:
        self.metadata = metadata
        token = ACTIVE_STEP.set(metadata)
        try:
            yield metadata
        finally:
            ACTIVE_STEP.reset(token)
            self.metadata = None
            for layer in self.layers:
                layer.returned = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states/value_states: [1, num_kv_heads, N, head_dim] -> the K/V the kernel reads."""
        meta = self.metadata
        if meta is None:
            raise RuntimeError(
                "PagedAttentionCache.update was called outside an engine step; run generation through "
                "model.generate or ContinuousBatchingEngine, or call the model without this cache"
            )
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        if not meta.is_decode:
            assert key_states.shape[0] == 1, f"paged steps pack every request in batch row 0, got {key_states.shape}"
            layer.write(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), meta.slot_mapping)
            keys, values = layer.gather(meta.gather_slots)  # [K, H_kv, D] each
            key_states = keys.transpose(0, 1).unsqueeze(0)  # [1, H_kv, K, D]
            value_states = values.transpose(0, 1).unsqueeze(0)
        layer.returned = (weakref.ref(key_states), weakref.ref(value_states))
        # The attention call that follows reads this layer's pages. Not through the module's
        # layer_idx, which some models offset (HRM reuses layers across recurrent cycles).
        meta.last_layer = layer
        return key_states, value_states

    def observed_windows(self) -> list[int | None]:
        """The sliding window each layer's attention used at the last step (None: full)."""
        return [layer.window for layer in self.layers]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src`` in every layer."""
        if not pairs:
            return
        for layer in self.layers:
            if layer.is_initialized:
                src = torch.tensor([s for s, _ in pairs], device=layer.keys.device)
                dst = torch.tensor([d for _, d in pairs], device=layer.keys.device)
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return 0, 0


def bytes_per_block(config: PreTrainedConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V bytes of one block across all layers (from the config: pages are made lazily)."""
    text = config.get_text_config()
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * text.num_hidden_layers * block_size * num_kv_heads * head_dim * element


def blocks_from_memory(
    config: PreTrainedConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    memory_fraction: float,
    max_num_seqs: int,
) -> int:
    """How many blocks ``memory_fraction`` of the free memory of ``device`` holds, capped at what
    ``max_num_seqs`` sequences of the model's full length could ever use."""
    budget = int(free_memory_bytes(device) * memory_fraction) // bytes_per_block(config, block_size, dtype)
    max_len = getattr(config.get_text_config(), "max_position_embeddings", None) or 4096
    return max(1, min(budget, max_num_seqs * blocks_for(max_len, block_size)))


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30  # no /proc (macOS, Windows): assume 4 GiB rather than fail
