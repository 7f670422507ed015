"""PagedAttentionCache: K/V stored in fixed-size blocks, addressed through a block table.

Each layer owns two page tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``, created
lazily at the layer's first write so that models whose layers differ in head count or head dim get
pages of the right shape per layer. One block id means the same block in every layer of an
attention group, so one allocator serves the whole model (``core/layers.py`` for hybrid models,
whose groups share page tensors).

Pages may be stored in a narrower dtype than the model's (``PagedConfig.kv_cache_dtype``, fp8): each
layer then stores ``k / k_scale`` and ``v / v_scale``, and the attention function folds the scales back in
outside the kernels (``kernels/kv_dtype.py``). int8 pages carry a scale per token and KV head instead, in
tensors beside the pages (``k_scales`` / ``v_scales``) that every write, copy and read takes with them.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin

from ..core.layers import LayerKinds
from ..kernels.kv_dtype import SCALE_DTYPE, is_int8
from .forward import ForwardContext

# The forward running in this thread, for the attention function of models whose decoder layers
# don't forward **kwargs (Nemotron), so that the ``paged_forward`` forward kwarg never reaches it.
ACTIVE_FORWARD: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("paged_forward", default=None)


def pad_head_dim(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with its last (head) dim zero-padded to ``width``. Zero query/key columns leave q·k
    unchanged and zero value columns give zero output columns, so padding is exact."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


class PagedLayer(CacheLayerMixin):
    """One layer's pages. ``keys``/``values``: [num_blocks, block_size, num_kv_heads, width], where
    ``width`` is the larger of the key and value head dims (equal in most models)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        is_sliding: bool = False,
        group: int = 0,
        slot: int | None = None,
        page_dtype: torch.dtype | None = None,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        super().__init__()
        self.num_blocks = num_blocks
        self.page_dtype = page_dtype  # None: the dtype of the K/V the model gives
        self.k_scale, self.v_scale = scales  # pages hold k / k_scale and v / v_scale
        # int8 pages: a scale per (token, KV head), [num_blocks, block_size, num_kv_heads]; None otherwise
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        self.block_size = block_size
        self.is_sliding = is_sliding
        self.group = group  # attention group (layers.py): whose block tables address these pages
        self.slot = slot  # page tensor shared with the same slot of the other groups (None: own pages)
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
        self.keys = torch.zeros(shape, dtype=self.page_dtype or key_states.dtype, device=key_states.device)
        self.values = torch.zeros(shape, dtype=self.page_dtype or value_states.dtype, device=value_states.device)
        if is_int8(self.page_dtype):
            self.k_scales = torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=key_states.device)
            self.v_scales = torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=key_states.device)
        self.device = key_states.device
        self.is_initialized = True

    def can_share(self, owner: PagedLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether ``owner``'s page tensors can hold this layer's K/V (shape, dtype, device)."""
        _, num_kv_heads, _, key_dim = key_states.shape
        width = max(key_dim, value_states.shape[-1])
        dtype = self.page_dtype or key_states.dtype
        want = (owner.num_blocks, owner.block_size, num_kv_heads, width, dtype, key_states.device)
        return want == (*owner.keys.shape, owner.keys.dtype, owner.keys.device)

    def share_pages(self, owner: PagedLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Use ``owner``'s page tensors: the same slot of another attention group, addressed through
        other block ids."""
        self.key_dim, self.value_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys, self.values, self.device = owner.keys, owner.values, owner.device
        self.k_scales, self.v_scales = owner.k_scales, owner.v_scales
        self.is_initialized = True

    def descaled(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as the pages store them: divided by the layer's scales (unchanged at 1.0)."""
        keys = keys if self.k_scale == 1.0 else keys / self.k_scale
        return keys, values if self.v_scale == 1.0 else values / self.v_scale

    @property
    def scale_kwargs(self) -> dict[str, torch.Tensor]:
        """What a backend's entry points take besides the pages: int8 pages' scales (nothing for other pages,
        so that backends without the keywords are called as before)."""
        return {} if self.k_scales is None else {"k_scales": self.k_scales, "v_scales": self.v_scales}

    @property
    def width(self) -> int:
        return self.keys.shape[-1]

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

    An executor opens each forward with ``with cache.forward(context): model(...)``; inside it,
    ``update`` writes a prefill step's new K/V into their pages with the backend's ``write_kv`` (the
    kernels then read every key from the pages) and returns K/V untouched; on the decode path it
    writes nothing: the paged decode kernel appends the new K/V in place.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        num_blocks: int,
        block_size: int,
        layers: LayerKinds | None = None,
        page_dtype: torch.dtype | None = None,
        scales: list[tuple[float, float]] | None = None,
    ) -> None:
        """``page_dtype``: the pages' dtype (None: the model's K/V dtype); ``scales``: each layer's
        (k_scale, v_scale), 1.0 by default."""
        layers = layers or LayerKinds.from_config(config, share_pages=False)
        scales = scales or [(1.0, 1.0)] * len(layers.windows)
        shared = len(layers.groups) > 1  # hybrid groups: the j-th layer of every group shares slot j
        super().__init__(
            layers=[
                PagedLayer(
                    num_blocks, block_size, is_sliding=window is not None, group=layers.group_of_layer[i],
                    slot=layers.slot_of_layer[i] if shared else None, page_dtype=page_dtype, scales=scales[i],
                )
                for i, window in enumerate(layers.windows)
            ]
        )  # fmt: skip
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.context: ForwardContext | None = None
        self._slot_owner: dict[int, PagedLayer] = {}

    @contextlib.contextmanager
    def forward(self, context: ForwardContext) -> Iterator[ForwardContext]:
        """The model calls inside read and write the pages for ``context``'s step."""
        self.context = context
        token = ACTIVE_FORWARD.set(context)
        try:
            yield context
        finally:
            ACTIVE_FORWARD.reset(token)
            self.context = None
            for layer in self.layers:
                layer.returned = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states/value_states: [1, num_kv_heads, N, head_dim], returned as they are (the kernels
        read the pages); a prefill step's are written into the pages first."""
        context = self.context
        if context is None:
            raise RuntimeError(
                "PagedAttentionCache.update was called outside an engine step; run generation through "
                "model.generate or ContinuousBatchingEngine, or call the model without this cache"
            )
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            self._initialize(layer, key_states, value_states)
        if not context.step.is_decode:
            assert key_states.shape[0] == 1, f"paged steps pack every request in batch row 0, got {key_states.shape}"
            inputs = context.inputs(layer.group, key_states.device)  # this layer's block ids, where it runs
            new_keys, new_values = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)  # [N, H_kv, D]
            new_keys, new_values = layer.descaled(new_keys, new_values)
            context.backend.write_kv(
                pad_head_dim(new_keys, layer.width), pad_head_dim(new_values, layer.width),
                layer.keys, layer.values, inputs.slot_mapping, **layer.scale_kwargs,
            )  # fmt: skip
        layer.returned = (weakref.ref(key_states), weakref.ref(value_states))
        # The attention call that follows reads this layer's pages. Not through the module's
        # layer_idx, which some models offset (HRM reuses layers across recurrent cycles).
        context.last_layer = layer
        return key_states, value_states

    def _initialize(self, layer: PagedLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        owner = self._slot_owner.get(layer.slot) if layer.slot is not None else None
        # A layer whose K/V differ from its slot's (some models give sliding layers other head
        # counts) keeps pages of its own: still addressed by its group's block ids, only larger.
        if owner is not None and layer.can_share(owner, key_states, value_states):
            layer.share_pages(owner, key_states, value_states)
        else:
            layer.lazy_initialization(key_states, value_states)
            if layer.slot is not None:
                self._slot_owner[layer.slot] = layer

    def observed_windows(self) -> list[int | None]:
        """The sliding window each layer's attention used at the last step (None: full)."""
        return [layer.window for layer in self.layers]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src`` in every layer."""
        if not pairs:
            return
        distinct = {id(layer.keys): layer for layer in self.layers if layer.is_initialized}  # shared pages once
        for layer in distinct.values():
            if layer.is_initialized:
                src = torch.tensor([s for s, _ in pairs], device=layer.keys.device)
                dst = torch.tensor([d for _, d in pairs], device=layer.keys.device)
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]
                if layer.k_scales is not None:  # int8 pages: a block's scales are part of its content
                    layer.k_scales[dst] = layer.k_scales[src]
                    layer.v_scales[dst] = layer.v_scales[src]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return 0, 0
