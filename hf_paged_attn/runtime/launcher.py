"""Launchers: how an engine is set up for one kind of execution. A launcher sizes the cache (the ranks
of a tensor-parallel model must agree on it) and builds the executor over the engine's cache.

``choose_launcher`` is the one factory: the first of ``LAUNCHERS`` that claims the model, else the local
one. ``hf_paged_attn.parallel`` adds the tensor-parallel launcher when it is imported (as importing
``hf_paged_attn`` does), so the runtime never imports parallel code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..attention.cache import PagedAttentionCache
from ..attention.model_checks import max_positions
from ..core.layers import LayerKinds
from ..kernels.base import AttentionBackend
from .config import PagedConfig
from .cpu import fp32_matmuls, host_memory
from .executor import Executor, LocalExecutor
from .model.marks import marks_for
from .model.memory import fitting_blocks


@dataclass(frozen=True, slots=True)
class CacheSize:
    num_blocks: int  # blocks the allocator hands out to requests
    num_pages: int  # the page tensors' first dimension: the executor may keep pages no request holds


class Launcher(Protocol):
    def cache_size(
        self, model: torch.nn.Module, config: PagedConfig, layers: LayerKinds, num_blocks: int | None
    ) -> CacheSize:
        """The cache for ``config`` (``num_blocks``: the caller's, None to size it from memory)."""

    def executor(
        self,
        model: torch.nn.Module,
        cache: PagedAttentionCache,
        backend: AttentionBackend,
        config: PagedConfig,
        layers: LayerKinds,
        size: CacheSize,
    ) -> Executor: ...


class LocalLauncher:
    """One process: CUDA graphs for decode steps where they can run, a compiled forward on the CPU
    (``PagedConfig.compile``), else plain eager forwards."""

    def cache_size(
        self, model: torch.nn.Module, config: PagedConfig, layers: LayerKinds, num_blocks: int | None
    ) -> CacheSize:
        marks = marks_for(model)  # the engine's: on the model while it runs
        if config.fp32_matmuls:  # before sizing the cache from free memory: the copies take some
            fp32_matmuls.install(model, marks)
        else:  # an earlier engine's copies go (their memory too)
            fp32_matmuls.uninstall(model, marks)
        num_blocks = num_blocks or fitting_blocks(model, config, layers)
        # Graphs' padding rows write a scratch page that no request ever holds.
        return CacheSize(num_blocks, num_blocks + int(bool(config.cuda_graphs)))

    def executor(
        self,
        model: torch.nn.Module,
        cache: PagedAttentionCache,
        backend: AttentionBackend,
        config: PagedConfig,
        layers: LayerKinds,
        size: CacheSize,
    ) -> Executor:
        if config.keep_freed_memory:
            host_memory.keep_freed_memory()
        eager = LocalExecutor(model, cache, backend)
        counts = self._thread_counts(model, config)
        if config.compile:
            from .cpu import prewarm
            from .cpu.compiled import CompiledExecutor

            # A compile in the background (not one at start-up, which waits for it) runs first in a child process.
            child = None
            if config.compile is True:  # (torch's thread count now: a step may set another while it runs)
                child = functools.partial(prewarm.job_for, model, bool(config.fp32_matmuls),
                                          bool(config.adaptive_threads), torch.get_num_threads())  # fmt: skip
            executor = CompiledExecutor(eager, layers, counts, child)
            return self._threads(executor, counts, model)  # eager until compiled
        if not config.cuda_graphs:
            return self._threads(eager, counts, model)
        from .cuda_graphs import CudaGraphExecutor

        positions = max_positions(model)
        return CudaGraphExecutor(eager, layers, config, scratch_block=size.num_blocks, max_positions=positions)

    @classmethod
    def _thread_counts(cls, model: torch.nn.Module, config: PagedConfig) -> tuple[int, ...]:
        """The thread counts steps run with (the tuner's candidates, and the compiled graphs'): 1 and
        torch's where they adapt (``threads.py``: on in the config, every layer on the CPU, more than
        one thread), else torch's alone."""
        from .cpu.threads import candidates

        return candidates(torch.get_num_threads()) if config.adaptive_threads else (torch.get_num_threads(),)

    @staticmethod
    def _threads(executor: Executor, counts: tuple[int, ...], model: torch.nn.Module) -> Executor:
        """``executor`` with each step's thread count chosen among ``counts``, if there is a choice, by the
        model's tuner (its measurements kept for its later engines)."""
        if len(counts) < 2:
            return executor
        from .cpu.threads import ThreadTunedExecutor, tuner_for

        return ThreadTunedExecutor(executor, counts, tuners=functools.partial(tuner_for, model))


# Launchers of other kinds of execution, asked in order: one returns a launcher for a model it runs
# (e.g. a tensor-parallel one), else None.
LAUNCHERS: list[Callable[[torch.nn.Module], Launcher | None]] = []


def choose_launcher(model: torch.nn.Module) -> Launcher:
    """The launcher of ``model``'s engine: the first of ``LAUNCHERS`` that claims it, else local."""
    for claim in LAUNCHERS:
        launcher = claim(model)
        if launcher is not None:
            return launcher
    return LocalLauncher()
