"""The worker: the executor's side of a step, as vLLM's model runner. From the scheduler's plan it builds
the step's description, runs the forward through the engine's ``Executor`` (eager, CUDA graphs, compiled,
tensor-parallel) and hands the logits to the ``Sampler``, which returns token ids. The engine gets those,
never logits."""

from __future__ import annotations

import contextlib
import time

import torch

from ..attention.cache import PagedAttentionCache
from ..attention.step import build_step, prompt_scoring
from ..core.layers import LayerKinds
from ..core.scheduler import SchedulerOutput
from .executor import Executor
from .generation.sampler import Sampler, StepOutput
from .model.lora import LoraRouter
from .multimodal import MultimodalSteps


class Worker:
    def __init__(
        self,
        executor: Executor,
        sampler: Sampler,
        cache: PagedAttentionCache,
        layers: LayerKinds,
        block_size: int,
        device: torch.device,
        multimodal: MultimodalSteps,
        lora: LoraRouter | None,
    ) -> None:
        self.executor = executor
        self.sampler = sampler
        self.cache = cache
        self.layers = layers
        self.block_size = block_size
        self.device = device
        self.multimodal = multimodal
        self.lora = lora  # the model's LoRA router (the engine sets a new one when an adapter loads)

    def execute(self, plan: SchedulerOutput) -> StepOutput:
        """Run ``plan``: the forward, then the sampler on its logits."""
        scored = prompt_scoring(plan.scheduled)  # prompt_logprobs: the positions this step scores
        drafts = [list(s.draft_ids) for s in plan.scheduled] if plan.num_lookahead_tokens else None
        step = build_step(plan.scheduled, self.block_size, self.device, self.layers,
                          block_copies=plan.block_copies, drafts=drafts, scored=scored)  # fmt: skip
        step = self.multimodal.prepare(step, plan.scheduled)  # image features and M-RoPE positions, if any
        with self.lora.step(step) if self.lora is not None else contextlib.nullcontext():
            logits = self.executor.execute(step)
        if not self.layers.observed:  # every layer has now attended once: the windows they really use
            self.layers.observe(self.cache.observed_windows())
        start = time.perf_counter()
        output = self.sampler.sample(plan, logits, scored)
        output.sample_seconds = time.perf_counter() - start
        return output
