"""Registration: the one module that patches anything.

``register()`` adds ``"paged"`` to transformers' attention and mask interfaces, routes ``generate``
and transformers' continuous-batching API (``generate_batch``, ``init_continuous_batching``,
``continuous_batching_context_manager``, ``destroy_cached_continuous_batching_manager``) of models
whose attention is ``"paged"`` to the continuous-batching engine (every other model keeps
transformers' own methods untouched), and gives the runtime the tensor-parallel launcher for models
sharded over ranks and the process-wide patches its CPU compile needs (``COMPILE_PATCHES``), which are
installed at the first compile, each once, with its undo (``undo_patch``).
"""

from __future__ import annotations

import atexit
import functools
import threading
from collections.abc import Callable

from transformers import AttentionInterface, GenerationMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import transformers_private as hf
from ..attention.function import PagedWindow, paged_attention_forward
from ..parallel import claim as tensor_parallel_launcher
from ..runtime.cpu.patches import COMPILE_PATCHES
from ..runtime.launcher import LAUNCHERS

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
    if install_compile_patches not in COMPILE_PATCHES:
        COMPILE_PATCHES.append(install_compile_patches)
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


# ----------------------------------------------------------------------------- the compile's process-wide patches
# name -> its undo, for each patch installed (``patch``); ``undo_patch`` restores what was there.
_UNDO: dict[str, Callable[[], None]] = {}
_PATCHING = threading.Lock()


def _fx_trace_lock() -> Callable[[], None]:
    """torch.fx's ``Tracer.trace`` (every subclass calls it) holding the compile's lock
    (``compiled.locked_trace``: the tracer patches ``torch.nn.Module`` for the whole process while it runs)."""
    import torch

    from ..runtime.cpu.compiled import locked_trace

    tracer = torch.fx.Tracer
    original = tracer.__dict__["trace"]
    tracer.trace = locked_trace(original)  # type: ignore[method-assign]
    patched = tracer.__dict__["trace"]

    def undo() -> None:
        if tracer.__dict__.get("trace") is patched:
            tracer.trace = original  # type: ignore[method-assign]

    return undo


def _recompile_limit() -> Callable[[], None]:
    """Dynamo's graphs per code object at least ``compiled.RECOMPILE_LIMIT``: every model compiles one function."""
    from ..runtime.cpu.compiled import RECOMPILE_LIMIT
    from ..torch_private import raise_recompile_limit

    return raise_recompile_limit(RECOMPILE_LIMIT)


def _wait_at_exit() -> Callable[[], None]:
    """At exit, wait for a background compile to end (``compiled.wait_for_compiles_at_exit``)."""
    from ..runtime.cpu.compiled import wait_for_compiles_at_exit

    atexit.register(wait_for_compiles_at_exit)
    return functools.partial(atexit.unregister, wait_for_compiles_at_exit)


PATCHES: dict[str, Callable[[], Callable[[], None]]] = {
    "fx_trace_lock": _fx_trace_lock,
    "recompile_limit": _recompile_limit,
    "wait_at_exit": _wait_at_exit,
}


def patch(name: str) -> None:
    """Install the process-wide patch ``name`` of ``PATCHES`` unless it is installed."""
    with _PATCHING:
        if name not in _UNDO:
            _UNDO[name] = PATCHES[name]()


def undo_patch(name: str) -> bool:
    """Undo the patch ``name`` (what it replaced is back, unless someone replaced it since); False if it
    was not installed."""
    with _PATCHING:
        undo = _UNDO.pop(name, None)
    if undo is None:
        return False
    undo()
    return True


def install_compile_patches() -> None:
    """Every patch a compiled forward needs (``runtime.cpu.patches.COMPILE_PATCHES`` calls it before a compile)."""
    for name in PATCHES:
        patch(name)
