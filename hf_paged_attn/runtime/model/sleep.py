"""Sleep and wake (vLLM's ``sleep(level)`` / ``wake_up(tags)``): an engine gives its memory back between
rollouts so that a colocated trainer can use it, and takes it again before the next.

- the KV pool (tag ``"kv_cache"``): the page tensors are freed at both levels, their contents forgotten
  (the prefix cache is reset with them); waking allocates them again, zeroed, with the same shapes, so
  each page tensor keeps its place and its sharers (hybrid models' groups share slots);
- the weights (tag ``"weights"``): at level 1 the model's CUDA parameters move to host memory and come
  back at wake, unchanged; at level 2 they are dropped, and come back allocated but undefined, for
  ``load_weights`` to fill (vLLM's level 2). Parameters on the CPU are the user's model, never dropped:
  there level 2 frees only what the engine keeps beside them (``fp32_matmuls``' float32 copies and
  ``packed_linear``'s packed copies), made again at wake.

A CUDA-graph executor's graphs hold the old addresses of pages and weights: the engine closes its
executor at wake (its graphs go; the decode steps capture new ones). CPU tensors come from glibc's malloc:
a large one is usually ``mmap``-ed and unmapped when freed, but malloc serves it from a free chunk inside its
heap where it has one, and then it stays in memory when freed. A heap holds such chunks once tensors below the
mmap threshold were freed (glibc raises the threshold up to 32 MiB as large blocks are freed; a CPU engine fixes
it at 32 MiB and lets the heap keep 256 MiB, ``keep_freed_memory``); ``trim_heap`` gives them back.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from ...attention.cache import PagedAttentionCache
from ...kernels.kv_dtype import SCALE_DTYPE, is_int8
from ..cpu import fp32_matmuls

TAGS = ("weights", "kv_cache")


@dataclass(slots=True)
class _Pages:
    """One page tensor pair to allocate again: its shape, dtype, device, and the layers that use it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    layers: list[int]  # indices into the cache's layers; all share the pair


@dataclass
class SleepState:
    level: int
    pages: list[_Pages] | None = None  # None: the KV pool is awake
    host: dict[int, torch.Tensor] | None = None  # level 1, CUDA: id(param) -> its host copy (None: awake)
    dropped: dict[int, tuple[torch.Size, torch.dtype, torch.device]] | None = None  # level 2, CUDA
    params: list[torch.nn.Parameter] = field(default_factory=list)  # the parameters moved or dropped
    fp32_copies: bool = False  # level 2: fp32_matmuls' copies were removed, make them again
    packed: bool = False  # level 2: packed_linear's copies were removed, pack again

    @property
    def weights_asleep(self) -> bool:
        return self.host is not None or self.dropped is not None or self.fp32_copies or self.packed

    @property
    def asleep(self) -> bool:
        return self.pages is not None or self.weights_asleep


def pool_bytes(cache: PagedAttentionCache) -> int:
    """Bytes held by the cache's page tensors (shared ones once)."""
    distinct = {id(layer.keys): layer for layer in cache.layers if layer.is_initialized}
    scales = [t for layer in distinct.values() for t in (layer.k_scales, layer.v_scales) if t is not None]
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in distinct.values()) + sum(t.nbytes for t in scales)


def free_pages(cache: PagedAttentionCache) -> list[_Pages]:
    """Free the cache's page tensors; returns what ``allocate_pages`` needs to make them again."""
    groups: dict[int, _Pages] = {}
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            continue
        pages = groups.get(id(layer.keys))
        if pages is None:
            pages = groups[id(layer.keys)] = _Pages(tuple(layer.keys.shape), layer.keys.dtype, layer.keys.device, [])
        pages.layers.append(i)
    for i in (i for pages in groups.values() for i in pages.layers):
        layer = cache.layers[i]
        del layer.keys, layer.values  # the last references: the storage goes back now
        layer.k_scales = layer.v_scales = None  # int8 pages' scales (made again with the pages)
        layer.is_initialized = False
        layer.returned = None
    return list(groups.values())


def allocate_pages(cache: PagedAttentionCache, pages: list[_Pages]) -> None:
    """The page tensors ``free_pages`` freed, zeroed, each shared by the layers that shared it."""
    for spec in pages:
        keys = torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
        values = torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
        scales = None
        if is_int8(spec.dtype):
            scales = [torch.zeros(spec.shape[:3], dtype=SCALE_DTYPE, device=spec.device) for _ in range(2)]
        for i in spec.layers:
            layer = cache.layers[i]
            layer.keys, layer.values = keys, values
            if scales is not None:
                layer.k_scales, layer.v_scales = scales
            layer.is_initialized = True


def sleep_weights(model: torch.nn.Module, state: SleepState) -> None:
    """Level 1: CUDA parameters to host memory; level 2: dropped. CPU: only the engine's own copies go at
    level 2. Parameters elsewhere (meta, offloaded by accelerate) stay as they are."""
    params = [p for p in model.parameters() if p.device.type == "cuda"]  # each tied parameter once
    if params:
        state.params = params
        if state.level == 1:
            state.host = {id(p): p.data.to("cpu", copy=True) for p in params}
        else:
            state.dropped = {id(p): (p.shape, p.dtype, p.device) for p in params}
        for p in params:  # the last reference to the CUDA storage: freed (returned to torch's caching allocator)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        torch.cuda.empty_cache()
    if state.level == 2:
        from ..cpu import packed_linear  # registers its op: only where the engine may have packed

        state.fp32_copies = fp32_matmuls.uninstall(model) > 0
        state.packed = packed_linear.unpack(model) > 0


def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)``: the free pages inside the C heap go back to the OS. A page tensor freed by
    ``free_pages`` that malloc had carved from the heap stays resident otherwise (under ``make test`` 40-80 MiB
    of a 320 MiB pool did). False where the C library has no ``malloc_trim`` (musl, macOS)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def wake_weights(model: torch.nn.Module, state: SleepState) -> None:
    """The parameters back on their device (level 2: undefined values, to be loaded), the copies made again."""
    for p in state.params:
        if state.host is not None:
            p.data = state.host[id(p)].to(p.device)
        else:
            shape, dtype, device = state.dropped[id(p)]
            p.data = torch.empty(shape, dtype=dtype, device=device)
    state.params, state.host, state.dropped = [], None, None
    if state.fp32_copies:
        fp32_matmuls.install(model)
    if state.packed:
        from ..cpu import packed_linear

        packed_linear.pack(model)
    state.fp32_copies = state.packed = False
