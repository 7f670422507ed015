"""Executors: what runs a step's forward. The worker (``worker.py``) hands each step's description to
its executor and gets the sampled rows' logits back, for its sampler; it never knows how the forward ran.

- ``LocalExecutor``: the model's forward in this process, eagerly.
- ``cuda_graphs.CudaGraphExecutor``: decode steps replayed from CUDA graphs, the rest eagerly.
- ``cpu.compiled.CompiledExecutor``: the forward through ``torch.compile`` (on the CPU).
- ``cpu.threads.ThreadTunedExecutor``: another executor's steps, each with the thread count that ran
  steps of its size faster (on the CPU).
- ``parallel.TensorParallelExecutor``: rank 0 broadcasts the step, every rank runs its shard.

Which one an engine gets is ``launcher.py``'s choice; the executors wrap a ``LocalExecutor`` and never
import the launcher.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..attention.cache import PagedAttentionCache
from ..attention.forward import ForwardContext
from ..attention.step import StepMetadata
from ..kernels.base import AttentionBackend


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
