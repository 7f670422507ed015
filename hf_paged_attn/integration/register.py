"""Registration: the one module that patches anything.

``register()`` adds ``"paged"`` to transformers' attention and mask interfaces, routes ``generate``
and transformers' continuous-batching API (``generate_batch``, ``init_continuous_batching``,
``continuous_batching_context_manager``, ``destroy_cached_continuous_batching_manager``) of models
whose attention is ``"paged"`` to the continuous-batching engine (every other model keeps
transformers' own methods untouched), and gives the runtime the tensor-parallel launcher for models
sharded over ranks.
"""

from __future__ import annotations

import functools

from transformers import AttentionInterface, GenerationMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import transformers_private as hf
from ..attention.function import PagedWindow, paged_attention_forward
from ..parallel import claim as tensor_parallel_launcher
from ..runtime.executor import LAUNCHERS

NAME = "paged"  # never "paged|...": transformers reserves that prefix for its own engine


def paged_mask(*args, kv_length: int, local_size: int | None = None, **kwargs):
    """Mask function for ``"paged"``: no tensor inside an engine step, sdpa's everywhere else.

    ``PagedAttentionCache.get_mask_sizes`` reports ``kv_length == 0`` (never a real length: the
    keys include the queries) because the kernels mask by ``cu_seqlens`` / ``cache_seqlens``.
    A sliding-window mask still passes its window on (``PagedWindow``): some models (PhiMoE) set
    the window only through the mask, not through the attention call's ``sliding_window``.
    """
    if kv_length == 0:
        return PagedWindow(local_size) if local_size else None
    return sdpa_mask(*args, kv_length=kv_length, local_size=local_size, **kwargs)


def register() -> str:
    """Register ``"paged"`` (idempotent) and return the name to pass as ``attn_implementation``."""
    AttentionInterface.register(NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, paged_mask)
    if tensor_parallel_launcher not in LAUNCHERS:
        LAUNCHERS.append(tensor_parallel_launcher)
    for name, target in ROUTES.items():
        original = getattr(GenerationMixin, name, None)
        if original is not None and not getattr(original, "_hf_paged_attn", False):
            setattr(GenerationMixin, name, _routed(original, target))
    return NAME


# GenerationMixin's methods that a "paged" model runs on our engine, and our function for each
ROUTES = {
    "generate": "paged_generate",
    "generate_batch": "paged_generate_batch",
    "init_continuous_batching": "paged_init_continuous_batching",
    "continuous_batching_context_manager": "paged_continuous_batching_context_manager",
    "destroy_cached_continuous_batching_manager": "paged_destroy_cached_manager",
}


def _ours(name: str):
    """Our function ``name`` (imported at the first call: importing hf_paged_attn stays light)."""
    if name == "paged_generate":
        from .generate import paged_generate

        return paged_generate
    from . import generate_batch

    return getattr(generate_batch, name)


def _routed(original, target: str):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if hf.attn_implementation(self) == NAME:
            return _ours(target)(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    method._hf_paged_attn = True
    return method
