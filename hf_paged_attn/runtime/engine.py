"""ContinuousBatchingEngine: the loop. Each step: schedule -> build step -> forward -> commit ->
sample -> update requests -> emit outputs."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..attention.cache import PagedAttentionCache
from ..attention.model_checks import check_model_supported
from ..attention.step import StepMetadata, build_step
from ..core.blocks import BlockAllocator
from ..core.intake import Intake
from ..core.kv_manager import KVBlockManager
from ..core.layers import LayerKinds
from ..core.policy import POLICIES
from ..core.request import Request, RequestOutput, validate_prompt
from ..core.scheduler import Scheduler, SchedulerOutput
from ..kernels import load_backend
from .batch_api import BatchAPI
from .beam import BeamGroup
from .config import PagedConfig
from .cuda_graphs import DecodeGraphs
from .placement import engine_class, fitting_blocks, input_device, layer_devices
from .sampling import Sample, make_sampling_params, resolve_max_new_tokens, sample_one, sample_rows, should_stop
from .stats import EngineStats, StepCounters


class ContinuousBatchingEngine(BatchAPI):
    """Serve many requests at once on a model loaded with ``attn_implementation="paged"``.

    ``add_request`` and ``abort`` may be called from any thread; the loop (``step``, ``stream``,
    ``generate``) runs in one thread at a time.
    """

    def __new__(cls, model: torch.nn.Module, *args: object, **kwargs: object) -> ContinuousBatchingEngine:
        return super().__new__(engine_class(model, cls))  # a model sharded over ranks: TensorParallelEngine

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
        num_blocks = num_blocks or config.num_blocks or fitting_blocks(model, config, self.layers)
        self.allocator = BlockAllocator(num_blocks, config.enable_prefix_caching)
        self.kv = KVBlockManager(self.allocator, config.block_size, self.layers, config.max_batch_tokens)
        policy = POLICIES[config.scheduling_policy]
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_batch_tokens, policy)
        self.graphs = DecodeGraphs.for_engine(self)  # decode steps as CUDA graphs (None: eager); one more page
        self.cache = PagedAttentionCache(model.config, num_blocks + bool(self.graphs), config.block_size, self.layers)
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
        padding: Sequence[int] | None = None,
    ) -> str:
        """Queue one prompt; returns its request id. Bad input raises ValueError and queues nothing.

        ``priority``: lower runs first under ``scheduling_policy="priority"``. ``logprobs=k``: record
        each new token's log-probability and its ``k`` best alternatives. ``seed``: the request's own
        sampling generator. ``tokenizer``: for ``stop_strings``. ``padding``: the prompt's left padding
        in ``model.generate``'s batch, which its processors see. Beam search: ``num_beams`` > 1.
        """
        text_config = self.model.config.get_text_config()
        prompt = validate_prompt(input_ids, text_config.vocab_size, self.max_position_embeddings)
        # As in generate: what the caller's config leaves unset (eos, pad, ...) comes from the model's.
        config = self.generation_config
        if generation_config is not None:
            config = self.model._prepare_generation_config(generation_config)[0]
        max_new_tokens = resolve_max_new_tokens(config, len(prompt), max_new_tokens)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        sampling = make_sampling_params(
            self.model, config, len(prompt), logits_processor,
            stopping_criteria=stopping_criteria, tokenizer=tokenizer, seed=seed, logprobs=logprobs,
            max_new_tokens=max_new_tokens, prefix=padding,
        )  # fmt: skip
        request = Request("", prompt, max_new_tokens, sampling, arrival=0, priority=priority)
        if (num_beams := config.num_beams or 1) > 1:
            request.group = BeamGroup(request, num_beams, int(config.num_return_sequences or 1))
        if not self.scheduler.can_ever_fit(request):
            need = self.kv.blocks_needed(request, copies=num_beams)
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
            meta = build_step(plan.scheduled, self.config.block_size, self.device, self.layers, backend=self.backend)
            logits = self.graphs.forward(meta, plan.scheduled) if self.graphs else self._forward(meta)
        except Exception as exc:  # one failing step must not take the engine down
            return [out for s in plan.scheduled for out in self._finish(s.request, "error", exc)]
        self.counters.num_steps += 1
        self.counters.forward_seconds += time.perf_counter() - forward_start
        if not self.layers.observed:  # every layer has now attended once: the windows they really use
            self.layers.observe(self.cache.observed_windows())
        for s in plan.scheduled:
            self.kv.commit(s.request, s.num_new_tokens)
        sampled = [s.request for s in plan.scheduled if s.request.num_computed_tokens == s.request.num_tokens]
        rows = [row for row, r in enumerate(sampled) if r.group is None]
        outputs = []
        mine = logits if len(rows) == len(sampled) else logits[rows]  # no beams: no [rows, vocab] copy
        for row, sample in zip(rows, sample_rows(mine, [sampled[row] for row in rows], self.generator)):
            siblings = self._fork(sampled[row], logits[row : row + 1]) if sampled[row].children else []
            for r, s in [(sampled[row], sample), *siblings]:
                outputs += self._update(r, s, logits[row : row + 1])
        for row, beam in enumerate(sampled):  # a beam group moves once all its beams' logits are in
            if beam.group is not None and not beam.finished and beam.group.receive(beam, logits[row]):
                outputs += self._advance(beam.group)
        return outputs

    def _forward(self, meta: StepMetadata) -> torch.Tensor:
        """Logits of the sampled rows only: [num_sampled, vocab] float32."""
        with self.cache.step(meta):
            out = self.model(input_ids=meta.input_ids, position_ids=meta.position_ids, cache=self.cache, use_cache=True,
                             paged_metadata=meta, logits_to_keep=meta.logits_indices)  # fmt: skip
        logits = out.logits[0]
        if logits.shape[0] != meta.logits_indices.numel():  # model without logits_to_keep support
            logits = logits[meta.logits_indices]
        return logits.float()

    def _advance(self, group: BeamGroup) -> list[RequestOutput]:
        """A beam search step: the next beams fork their parents' blocks, or the search ends."""
        try:
            return [self._emit(r) for r in group.advance(self.kv, self.scheduler, self.generator)]
        except Exception as exc:  # e.g. a caller's processor or criterion: this request fails alone
            return self._finish(group.head, "error", exc)

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[tuple[Request, Sample | Exception]]:
        """num_return_sequences: siblings share the parent's blocks (copy on write) and draw their
        own first token from the same logits."""
        forked = []
        for child in parent.children:
            if child.finished:  # aborted before its parent's prompt was computed
                continue
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            forked.append((child, sample_one(logits, child, self.generator)))
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
        if request.group is not None:  # a beam: the whole search ends, reported on its head
            request = request.group.head
            request.group.drop(self.scheduler)
        if request.finished:
            return []
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
