"""Executors: what runs a step's forward. The engine hands each step's description to its executor
and gets the sampled rows' logits back; it never knows how the forward ran.

- ``LocalExecutor``: the model's forward in this process, eagerly.
- ``cuda_graphs.CudaGraphExecutor``: decode steps replayed from CUDA graphs, the rest eagerly.
- ``compiled.CompiledExecutor``: the forward through ``torch.compile`` (on the CPU).
- ``threads.ThreadTunedExecutor``: another executor's steps, each with the thread count that ran
  steps of its size faster (on the CPU).
- ``parallel.TensorParallelExecutor``: rank 0 broadcasts the step, every rank runs its shard.

A ``Launcher`` sets an engine up for one kind of execution: it sizes the cache (the ranks of a
tensor-parallel model must agree on it) and builds the executor over the engine's cache.
``choose_launcher`` is the one factory: the first of ``LAUNCHERS`` that claims the model, else
the local one. ``hf_paged_attn.parallel`` adds the tensor-parallel launcher when it is imported
(as importing ``hf_paged_attn`` does), so the runtime never imports parallel code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..attention.cache import PagedAttentionCache
from ..attention.forward import ForwardContext
from ..attention.step import StepMetadata
from ..core.layers import LayerKinds
from ..kernels.base import AttentionBackend
from .config import PagedConfig
from .cpu import fp32_matmuls
from .model.marks import marks_for
from .model.memory import fitting_blocks
from .model.placement import layer_devices


class Executor(Protocol):
    def execute(self, step: StepMetadata) -> torch.Tensor:
        """Run ``step``'s forward (its copy-on-write block copies first): logits of its sampled rows,
        [num_sampled, vocab] float32."""

    def close(self) -> None:
        """Release what the executor holds (other ranks, graphs); idempotent."""


class LocalExecutor:
    """The model's forward in this process, on ``cache``, with ``backend``'s kernels."""

    def __init__(self, model: torch.nn.Module, cache: PagedAttentionCache, backend: AttentionBackend) -> None:
        self.model = model
        self.cache = cache
        self.backend = backend

    def execute(self, step: StepMetadata) -> torch.Tensor:
        self.prepare(step)
        return self.forward(step)

    @torch.inference_mode()
    def prepare(self, step: StepMetadata) -> None:
        """What must happen to the cache before the forward: the step's copy-on-write copies."""
        self.cache.copy_blocks(list(step.block_copies))

    def forward(self, step: StepMetadata) -> torch.Tensor:
        """Logits of the sampled rows only: [num_sampled, vocab] float32."""
        logits = self.logits(step, step.logits_indices)
        if logits.shape[0] != step.logits_indices.numel():  # a model without logits_to_keep support
            logits = logits[step.logits_indices]
        return logits.float()

    @torch.inference_mode()
    def logits(self, step: StepMetadata, logits_to_keep: torch.Tensor | int) -> torch.Tensor:
        """The model's logits of the rows ``logits_to_keep`` keeps (0: every row), [rows, vocab] as
        the model returns them."""
        context = ForwardContext(step, self.backend)
        tokens = {"input_ids": step.input_ids} if step.inputs_embeds is None else {"inputs_embeds": step.inputs_embeds}
        with self.cache.forward(context):
            out = self.model(**tokens, position_ids=step.position_ids, cache=self.cache,
                             use_cache=True, paged_forward=context, logits_to_keep=logits_to_keep)  # fmt: skip
        return out.logits[0]

    def close(self) -> None:
        pass


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
        return CacheSize(num_blocks, num_blocks + int(self._graphs(model, config)))

    def executor(
        self,
        model: torch.nn.Module,
        cache: PagedAttentionCache,
        backend: AttentionBackend,
        config: PagedConfig,
        layers: LayerKinds,
        size: CacheSize,
    ) -> Executor:
        eager = LocalExecutor(model, cache, backend)
        counts = self._thread_counts(model, config)
        if self._compiled(model, config):
            from .cpu.compiled import CompiledExecutor

            return self._threads(CompiledExecutor(eager, layers, counts), counts, model)  # eager until compiled
        if not self._graphs(model, config):
            return self._threads(eager, counts, model)
        from .cuda_graphs import CudaGraphExecutor

        max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        return CudaGraphExecutor(eager, layers, config, scratch_block=size.num_blocks, max_positions=max_positions)

    @staticmethod
    def _on_cpu(model: torch.nn.Module) -> bool:
        return {d.type for d in layer_devices(model)} == {"cpu"}

    @classmethod
    def _thread_counts(cls, model: torch.nn.Module, config: PagedConfig) -> tuple[int, ...]:
        """The thread counts steps run with (the tuner's candidates, and the compiled graphs'): 1 and
        torch's where they adapt (``threads.py``: on in the config, every layer on the CPU, more than
        one thread), else torch's alone."""
        from .cpu.threads import candidates

        adapt = config.adaptive_threads and cls._on_cpu(model)
        return candidates(torch.get_num_threads()) if adapt else (torch.get_num_threads(),)

    @staticmethod
    def _threads(executor: Executor, counts: tuple[int, ...], model: torch.nn.Module) -> Executor:
        """``executor`` with each step's thread count chosen among ``counts``, if there is a choice, by the
        model's tuner (its measurements kept for its later engines)."""
        if len(counts) < 2:
            return executor
        from .cpu.threads import ThreadTunedExecutor, tuner_for

        return ThreadTunedExecutor(executor, counts, tuners=functools.partial(tuner_for, model))

    @classmethod
    def _compiled(cls, model: torch.nn.Module, config: PagedConfig) -> bool:
        """A compiled forward: on in the resolved config, every layer on the CPU, nothing offloaded."""
        if not config.compile or not cls._on_cpu(model):
            return False
        return not {"disk"} & {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}

    @staticmethod
    def _graphs(model: torch.nn.Module, config: PagedConfig) -> bool:
        """Decode steps as CUDA graphs: on in the resolved config, every layer on one CUDA device, and
        no weights that accelerate offloads (its hooks copy them in at every forward, from the host)."""
        devices = set(layer_devices(model))
        if not config.cuda_graphs or len(devices) != 1 or next(iter(devices)).type != "cuda":
            return False
        return not {"cpu", "disk"} & {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}


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
