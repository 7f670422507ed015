"""transformers' continuous-batching entry points on a "paged" model: ``generate_batch``,
``init_continuous_batching``, ``continuous_batching_context_manager`` and
``destroy_cached_continuous_batching_manager``, with transformers' signatures and return types
(``register.py`` routes them here for "paged" models only; other models keep transformers' engine).

``generate_batch`` runs its prompts on the calling thread, on an engine whose cache is sized for
exactly those prompts and their ``max_new_tokens`` (as ``model.generate`` sizes it, not from free
memory), in eval mode, and leaves the model as it found it (training flag, attention). It returns
``{request_id: GenerationOutput}`` in input order, as transformers does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.generation.continuous_batching.utils import WorkloadHints

from .. import transformers_private as hf
from .manager import CACHE_ATTRIBUTE, PagedContinuousBatchingManager, cache_manager, cached_manager


def paged_init_continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    workload_hints: WorkloadHints | None = None,
) -> PagedContinuousBatchingManager:
    """The model's cached manager if a session kept one (its configs win, as in transformers), else a new one."""
    cached = cached_manager(model)
    if cached is not None:
        return cached
    config = generation_config if generation_config is not None else model.generation_config
    if config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    return PagedContinuousBatchingManager(model, config, continuous_batching_config, workload_hints)


def paged_destroy_cached_manager(model: torch.nn.Module) -> None:
    cached = cached_manager(model)
    if cached is not None:
        cached.destroy()
        delattr(model, CACHE_ATTRIBUTE)


@contextmanager
def paged_continuous_batching_context_manager(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    block: bool = True,
    timeout: float | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    persistent_manager: bool = False,
    warmup: bool = True,
    workload_hints: WorkloadHints | None = None,
) -> Iterator[PagedContinuousBatchingManager]:
    """A started manager inside, stopped (and, unless ``persistent_manager``, destroyed) after."""
    manager = paged_init_continuous_batching(model, generation_config, continuous_batching_config, workload_hints)
    if warmup and not manager.warmed_up:
        manager.warmup()
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
        if not persistent_manager:
            manager.destroy()


@torch.no_grad()
def paged_generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """transformers' ``generate_batch`` on the paged engine. ``kwargs``: ``max_new_tokens`` and any
    ``GenerationConfig`` option (merged as ``generate`` merges them); anything else is refused by name."""
    if not inputs:
        return {}
    if hasattr(inputs, "tolist"):  # a [batch, len] tensor, as transformers' generate hands it over
        inputs = inputs.tolist()
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    if kwargs:
        generation_config, unknown = hf.prepare_generation_config(model, generation_config, **kwargs)
        if unknown:
            raise TypeError(f"generate_batch() got arguments it does not take: {sorted(unknown)}")
    hints = None
    if cached_manager(model) is None:
        hints = WorkloadHints(max(map(len, inputs)), max_new_tokens or 0, len(inputs))
    manager = paged_init_continuous_batching(model, generation_config, continuous_batching_config, hints)
    outputs = manager.generate_batch(inputs, max_new_tokens, record_timestamps, progress_bar)
    if persistent_manager:
        cache_manager(model, manager)
    return outputs
