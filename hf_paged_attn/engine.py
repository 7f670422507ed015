"""ContinuousBatchingEngine: the loop. Each step: schedule -> build step -> forward -> commit ->
sample -> update requests -> emit outputs."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .batch_api import BatchAPI
from .blocks import BlockAllocator, blocks_for
from .cache import PagedAttentionCache
from .config import PagedConfig
from .intake import Intake
from .kernels import load_backend
from .kv_manager import KVBlockManager
from .layers import LayerKinds
from .model_checks import check_model_supported
from .placement import blocks_from_memory, input_device, layer_devices
from .policy import POLICIES
from .request import Request, RequestOutput, validate_prompt
from .sampling import Sample, make_sampling_params, sample_tokens, should_stop
from .scheduler import Scheduler, SchedulerOutput
from .stats import EngineStats, StepCounters
from .step import StepMetadata, build_step


class ContinuousBatchingEngine(BatchAPI):
    """Serve many requests at once on a model loaded with ``attn_implementation="paged"``.

    ``add_request`` and ``abort`` may be called from any thread; the loop (``step``, ``stream``,
    ``generate``) runs in one thread at a time.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: PagedConfig | None = None,
        generation_config: GenerationConfig | None = None,
        num_blocks: int | None = None,
    ) -> None:
        attn = getattr(model.config, "_attn_implementation", None)
        if attn != "paged":
            raise ValueError(
                f"the model's attention implementation is {attn!r}; load it with "
                'from_pretrained(..., attn_implementation="paged") (after `import hf_paged_attn`)'
            )
        check_model_supported(model)
        self.model = model
        self.config = config = (config or PagedConfig()).for_model(model)  # the concrete kernel and block size
        self.generation_config = generation_config or model.generation_config
        self.device = input_device(model)  # not model.device: with accelerate's offload that may be "meta"
        self.max_position_embeddings = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.backend = load_backend(config.kernel, self.device)
        one_device = len(set(layer_devices(model))) == 1  # groups share page tensors, so one device
        self.layers = LayerKinds.from_config(model.config, share_pages=config.hybrid_kv and one_device)
        slots = self.layers.num_slots if len(self.layers.groups) > 1 else None
        if not (num_blocks := num_blocks or config.num_blocks):  # what fits, capped at what can be used
            useful = config.max_num_seqs * blocks_for(self.max_position_embeddings or 4096, config.block_size)
            fits = blocks_from_memory(model, config.block_size, config.memory_fraction, layers_per_block=slots)
            num_blocks = max(1, min(fits, useful * len(self.layers.groups)))
        self.allocator = BlockAllocator(num_blocks, config.enable_prefix_caching)
        self.kv = KVBlockManager(self.allocator, config.block_size, self.layers, config.max_batch_tokens)
        policy = POLICIES[config.scheduling_policy]
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_batch_tokens, policy)
        self.cache = PagedAttentionCache(model.config, num_blocks, config.block_size, self.layers)
        seed = config.seed if config.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.intake = Intake()
        self.counters = StepCounters()

    # ----------------------------------------------------------------------------- requests in
    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int | None = None,
        generation_config: GenerationConfig | None = None,
        request_id: str | None = None,
        logits_processor: LogitsProcessorList | None = None,
        priority: int = 0,
        logprobs: int | None = None,
        seed: int | None = None,
        tokenizer: object | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
    ) -> str:
        """Queue one prompt; returns its request id. Bad input raises ValueError and queues nothing.

        ``priority``: lower runs first under ``scheduling_policy="priority"``. ``logprobs=k``: record
        each new token's log-probability and its ``k`` best alternatives. ``seed``: the request's own
        sampling generator. ``tokenizer``: needed by ``generation_config.stop_strings``.
        """
        text_config = self.model.config.get_text_config()
        prompt = validate_prompt(input_ids, text_config.vocab_size, self.max_position_embeddings)
        # As in generate: what the caller's config leaves unset (eos, pad, ...) comes from the model's.
        config = self.generation_config
        if generation_config is not None:
            config = self.model._prepare_generation_config(generation_config)[0]
        if max_new_tokens is None:
            max_new_tokens = config.max_new_tokens
            if max_new_tokens is None:
                max_new_tokens = max(config.max_length - len(prompt), 0) if config.max_length else 20
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        sampling = make_sampling_params(
            self.model, config, len(prompt), logits_processor,
            stopping_criteria=stopping_criteria, tokenizer=tokenizer, seed=seed, logprobs=logprobs,
        )  # fmt: skip
        request = Request("", prompt, max_new_tokens, sampling, arrival=0, priority=priority)
        if not self.scheduler.can_ever_fit(request):
            need = blocks_for(request.max_total_tokens - 1, self.config.block_size)
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} needs {need} blocks of "
                f"{self.config.block_size} tokens; the whole cache has {self.allocator.num_blocks}"
            )
        return self.intake.add(request, request_id, num_siblings=max(int(config.num_return_sequences or 1) - 1, 0))

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed at the next step, which emits its final output
        (reason ``"abort"``). Returns False if it had already finished; unknown ids raise ValueError."""
        return self.intake.abort(request_id)

    # ----------------------------------------------------------------------------- the loop
    def has_unfinished(self) -> bool:
        return bool(self.intake.num_incoming or self.scheduler.has_work)

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: returns the requests that produced tokens or finished."""
        start = time.perf_counter()
        outputs = self._take_intake()
        plan = self.scheduler.schedule()
        if plan.scheduled:
            outputs += self._run(plan)
        self.counters.track_peak(self.allocator.num_used_blocks, lambda: self.kv.kv_waste(self.scheduler.running))
        self.counters.busy_seconds += time.perf_counter() - start
        return outputs

    def _take_intake(self) -> list[RequestOutput]:
        """Move new requests to the scheduler and carry out aborts; returns the aborted outputs."""
        incoming, to_abort = self.intake.take()
        for request in incoming:
            self.scheduler.add(request)
        outputs = []
        for request in to_abort:
            if not request.finished:
                outputs += self._finish(request, "abort")
        return outputs

    @torch.inference_mode()
    def _run(self, plan: SchedulerOutput) -> list[RequestOutput]:
        forward_start = time.perf_counter()
        try:
            self.cache.copy_blocks(plan.block_copies)
            meta = build_step(plan.scheduled, self.config.block_size, self.device, self.layers)
            meta.backend = self.backend
            logits = self._forward(meta)
        except Exception as exc:  # one failing step must not take the engine down
            return [out for s in plan.scheduled for out in self._finish(s.request, "error", exc)]
        self.counters.num_steps += 1
        self.counters.forward_seconds += time.perf_counter() - forward_start
        if not self.layers.observed:  # every layer has now attended once: the windows they really use
            self.layers.observe(self.cache.observed_windows())
        for s in plan.scheduled:
            self.kv.commit(s.request, s.num_new_tokens)
        sampled = [s.request for s in plan.scheduled if s.request.num_computed_tokens == s.request.num_tokens]
        outputs = []
        for row, (request, sample) in enumerate(zip(sampled, self._sample(logits, sampled))):
            siblings = self._fork(request, logits[row : row + 1]) if request.children else []
            for r, s in [(request, sample), *siblings]:
                outputs += self._update(r, s, logits[row : row + 1])
        return outputs

    def _forward(self, meta: StepMetadata) -> torch.Tensor:
        """Logits of the sampled rows only: [num_sampled, vocab] float32."""
        with self.cache.step(meta):
            out = self.model(
                input_ids=meta.input_ids,
                position_ids=meta.position_ids,
                cache=self.cache,
                use_cache=True,
                paged_metadata=meta,
                logits_to_keep=meta.logits_indices,
            )
        logits = out.logits[0]
        if logits.shape[0] != meta.logits_indices.numel():  # model without logits_to_keep support
            logits = logits[meta.logits_indices]
        return logits.float()

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[Sample | Exception]:
        """One sample per request; a request whose sampling raises (e.g. a custom logits processor)
        gets the exception instead, and the others are sampled row by row."""
        try:
            return sample_tokens(logits, requests, self.generator)
        except Exception:
            return [self._sample_one(logits[row : row + 1], r) for row, r in enumerate(requests)]

    def _sample_one(self, logits: torch.Tensor, request: Request) -> Sample | Exception:
        try:
            return sample_tokens(logits, [request], self.generator)[0]
        except Exception as exc:
            return exc

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[tuple[Request, Sample | Exception]]:
        """num_return_sequences: siblings share the parent's blocks (copy on write) and draw their
        own first token from the same logits."""
        forked = []
        for child in parent.children:
            if child.finished:  # aborted before its parent's prompt was computed
                continue
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            forked.append((child, self._sample_one(logits, child)))
        parent.children = []
        return forked

    def _update(self, request: Request, sample: Sample | Exception, logits: torch.Tensor) -> list[RequestOutput]:
        """Record ``sample`` on ``request``, finish it if it should stop; its output of this step."""
        if isinstance(sample, Exception):
            return self._finish(request, "error", sample)
        request.append(sample.token, sample.scores, sample.logits, sample.logprob)
        self.counters.num_generated_tokens += 1
        try:
            stop = should_stop(request, logits)
        except Exception as exc:  # a caller's stopping criterion raised: that request fails alone
            return self._finish(request, "error", exc)
        if sample.token in request.sampling.eos_token_ids:
            return self._finish(request, "eos")
        if stop:
            return self._finish(request, "stop")
        if len(request.output_ids) >= request.max_new_tokens:
            return self._finish(request, "length")
        return [request.take_output()]

    def _finish(self, request: Request, reason: str, exc: Exception | None = None) -> list[RequestOutput]:
        """Finish ``request`` (and the siblings it has yet to fork), free its blocks, emit its final output."""
        outputs = []
        for r in [request, *request.children]:
            r.finish(reason, f"{type(exc).__name__}: {exc}" if exc is not None else None)
            self.scheduler.remove(r)
            outputs.append(self._emit(r))
        request.children = []
        return outputs

    def _emit(self, request: Request) -> RequestOutput:
        """Final output of a finished request; the engine forgets it."""
        self.intake.forget(request)
        return request.take_output()

    # ----------------------------------------------------------------------------- conveniences
    def stream(self) -> Iterator[RequestOutput]:
        """Yield outputs until every queued request has finished (requests may be added meanwhile)."""
        while self.has_unfinished():
            yield from self.step()

    @property
    def stats(self) -> EngineStats:
        return self.counters.snapshot(self.scheduler, self.kv, self.intake.num_incoming)
