"""ContinuousBatchingEngine: schedule, build the batch, forward, sample, update requests, emit outputs."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList

from .batch import build_step
from .blocks import BlockAllocator, blocks_for
from .cache import PagedAttentionCache
from .config import PagedConfig
from .kernels import load_backend
from .placement import blocks_from_memory, input_device
from .request import Request, RequestOutput, validate_prompt
from .sampling import make_sampling_params, sample_tokens
from .scheduler import Scheduler, SchedulerOutput
from .stats import EngineStats
from .support import check_model_supported


class ContinuousBatchingEngine:
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
        self.config = (config or PagedConfig()).for_model(model)  # the concrete kernel and block size
        self.generation_config = generation_config or model.generation_config
        self.device = input_device(model)  # not model.device: with accelerate's offload that may be "meta"
        self.max_position_embeddings = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.backend = load_backend(self.config.kernel, self.device)
        check_block_size = getattr(self.backend, "check_block_size", None)
        if check_block_size is not None:
            check_block_size(self.config.block_size)
        num_blocks = num_blocks or self.config.num_blocks or self._blocks_from_memory()
        self.allocator = BlockAllocator(num_blocks, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.allocator, self.config.block_size, self.config.max_num_seqs, self.config.max_batch_tokens
        )
        self.cache = PagedAttentionCache(model.config, num_blocks, self.config.block_size)
        seed = self.config.seed if self.config.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._lock = threading.Lock()
        self._incoming: list[Request] = []
        self._to_abort: set[Request] = set()  # the requests themselves: an id may be reused
        self._live: dict[str, Request] = {}
        self._ids = itertools.count()
        self._num_steps = 0
        self._num_generated = 0
        self._peak_used = 0
        self._busy_seconds = 0.0
        self._forward_seconds = 0.0
        self._waste_at_peak = 0.0

    # ----------------------------------------------------------------------------- requests in
    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int | None = None,
        generation_config: GenerationConfig | None = None,
        request_id: str | None = None,
        logits_processor: LogitsProcessorList | None = None,
    ) -> str:
        """Queue one prompt; returns its request id. Bad input raises ValueError and queues nothing."""
        prompt = validate_prompt(
            input_ids, self.model.config.get_text_config().vocab_size, self.max_position_embeddings
        )
        config = generation_config or self.generation_config
        if max_new_tokens is None:
            max_new_tokens = config.max_new_tokens
            if max_new_tokens is None:
                max_new_tokens = max(config.max_length - len(prompt), 0) if config.max_length else 20
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        sampling = make_sampling_params(self.model, config, len(prompt), logits_processor)
        request = Request(
            request_id="",
            prompt_ids=prompt,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            arrival=0,
            num_children=max(int(config.num_return_sequences or 1) - 1, 0),
        )
        if not self.scheduler.can_ever_fit(request):
            need = blocks_for(request.max_total_tokens - 1, self.config.block_size)
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} needs {need} blocks of "
                f"{self.config.block_size} tokens; the whole cache has {self.allocator.num_blocks}"
            )
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self._live:
                    request_id = f"req-{next(self._ids)}"
            elif request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use")
            request.request_id = request_id
            request.arrival = next(self._ids)
            self._live[request_id] = request
            self._incoming.append(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed at the next step, which emits its final output
        (reason ``"abort"``). Returns False if it had already finished; unknown ids raise ValueError."""
        with self._lock:
            request = self._live.get(request_id)
            if request is None:
                raise ValueError(f"unknown request_id {request_id!r} (never added, or already finished)")
            if request.finished:
                return False
            self._to_abort.add(request)
            return True

    # ----------------------------------------------------------------------------- the loop
    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._incoming or self.scheduler.has_work)

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: returns the requests that produced tokens or finished."""
        start = time.perf_counter()
        outputs = self._drain_incoming()
        plan = self.scheduler.schedule()
        if plan.scheduled:
            outputs += self._run(plan)
        self._track_peak()
        self._busy_seconds += time.perf_counter() - start
        return outputs

    def _track_peak(self) -> None:
        used = self.allocator.num_used_blocks
        if used > self._peak_used:
            self._peak_used = used
            size = self.config.block_size
            filled: dict[int, int] = {}  # per distinct block: shared blocks count once
            for r in self.scheduler.running:
                for i, block in enumerate(r.block_ids):
                    if block < 0:  # freed: out of its sliding window
                        continue
                    filled[block] = max(filled.get(block, 0), min(size, r.num_computed_tokens - i * size))
            self._waste_at_peak = 1.0 - sum(max(f, 0) for f in filled.values()) / (used * size)

    def _drain_incoming(self) -> list[RequestOutput]:
        """Move new requests to the scheduler and carry out aborts; returns the aborted outputs."""
        with self._lock:
            incoming, self._incoming = self._incoming, []
            to_abort, self._to_abort = self._to_abort, set()
        for request in incoming:
            self.scheduler.add(request)
        outputs = []
        for request in to_abort:
            if not request.finished:
                self.scheduler.remove(request)
                request.finish("abort")
                outputs.append(self._emit(request))
        return outputs

    @torch.inference_mode()
    def _run(self, plan: SchedulerOutput) -> list[RequestOutput]:
        forward_start = time.perf_counter()
        try:
            self.cache.copy_blocks(plan.block_copies)
            meta = build_step(plan.scheduled, self.config.block_size, self.device, window=self.scheduler.window)
            meta.backend = self.backend
            logits = self._forward(meta)
        except Exception as exc:  # one failing step must not take the engine down
            return self._fail([s.request for s in plan.scheduled], exc)
        self._num_steps += 1
        self._forward_seconds += time.perf_counter() - forward_start
        if self._num_steps == 1:  # every layer has now attended once: does one window fit them all?
            self.scheduler.window = self.cache.uniform_window()
        self.scheduler.commit(plan.scheduled)
        sampled = [s.request for s in plan.scheduled if s.request.num_computed_tokens == s.request.num_tokens]
        if not sampled:
            return []
        tokens, outputs = self._sample(logits, sampled)
        for request, token, row in zip(sampled, tokens, range(len(sampled))):
            if token is None:
                continue
            children = self._fork(request, logits[row : row + 1]) if request.num_children else []
            for r, t in [(request, token), *children]:
                if isinstance(t, Exception):  # that child's sampling raised: it fails alone
                    outputs += self._fail([r], t)
                    continue
                self._append(r, t)
                outputs.append(self._emit(r) if r.finished else r.take_output())
        return outputs

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int | None], list[RequestOutput]]:
        """Tokens for ``requests``; a request whose sampling raises (e.g. a custom logits
        processor) fails alone, with its token None, and the others go on."""
        recorded = [(r.scores, r.logits) for r in requests]
        try:
            return sample_tokens(logits, requests, self.generator), []
        except Exception:  # undo what the rows before the failing one recorded; retry row by row
            for request, (scores, raw) in zip(requests, recorded):
                request.scores, request.logits = scores, raw
        tokens: list[int | None] = []
        failed: list[RequestOutput] = []
        for row, request in enumerate(requests):
            try:
                tokens += sample_tokens(logits[row : row + 1], [request], self.generator)
            except Exception as exc:
                tokens.append(None)
                failed += self._fail([request], exc)
        return tokens, failed

    def _forward(self, meta) -> torch.Tensor:
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

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[tuple[Request, int | Exception]]:
        """num_return_sequences: children share the parent's blocks (copy-on-write) and draw their
        own first token from the same logits (or carry the exception their sampling raised)."""
        children = []
        for i in range(1, parent.num_children + 1):
            child = Request(
                request_id=f"{parent.request_id}#{i}",
                prompt_ids=parent.prompt_ids,
                max_new_tokens=parent.max_new_tokens,
                sampling=parent.sampling,
                arrival=parent.arrival,
                num_computed_tokens=parent.num_computed_tokens,
                block_ids=self.allocator.fork(parent.block_ids),
                scores=list(parent.scores or []) or None,
                logits=list(parent.logits or []) or None,
            )
            if parent.scores:  # the parent already recorded this step's scores; the child redoes its own
                child.scores = child.scores[:-1] or None
            if parent.logits:
                child.logits = child.logits[:-1] or None
            self._live[child.request_id] = child
            self.scheduler.add_running(child)
            try:
                (token,) = sample_tokens(logits, [child], self.generator)
            except Exception as exc:
                children.append((child, exc))
                continue
            children.append((child, token))
        parent.num_children = 0
        return children

    def _append(self, request: Request, token: int) -> None:
        request.output_ids.append(token)
        request.new_ids.append(token)
        self._num_generated += 1
        if token in request.sampling.eos_token_ids:
            request.finish("eos")
        elif len(request.output_ids) >= request.max_new_tokens:
            request.finish("length")
        if request.finished:
            self.scheduler.remove(request)

    def _fail(self, requests: Iterable[Request], exc: Exception) -> list[RequestOutput]:
        message = f"{type(exc).__name__}: {exc}"
        outputs = []
        for request in requests:
            self.scheduler.remove(request)
            request.finish("error", message)
            outputs.append(self._emit(request))
        return outputs

    def _emit(self, request: Request) -> RequestOutput:
        """Final output of a finished request; the engine forgets it."""
        with self._lock:
            self._live.pop(request.request_id, None)
        return request.take_output()

    # ----------------------------------------------------------------------------- conveniences
    def stream(self) -> Iterator[RequestOutput]:
        """Yield outputs until every queued request has finished (requests may be added meanwhile)."""
        while self.has_unfinished():
            yield from self.step()

    def generate(
        self,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        max_new_tokens: int | Sequence[int] | None = None,
        generation_config: GenerationConfig | None = None,
        progress_bar: bool | None = None,
    ) -> list[RequestOutput]:
        """Ragged prompts in, final outputs in input order (``num_return_sequences`` outputs per prompt)."""
        if isinstance(max_new_tokens, Sequence):
            if len(max_new_tokens) != len(prompts):
                raise ValueError(f"got {len(max_new_tokens)} max_new_tokens for {len(prompts)} prompts")
            limits = list(max_new_tokens)
        else:
            limits = [max_new_tokens] * len(prompts)
        ids: list[str] = []
        try:
            for p, n in zip(prompts, limits):
                ids.append(self.add_request(p, n, generation_config))
        except Exception:  # refuse the whole batch: withdraw the prompts already queued
            with self._lock:
                self._incoming = [r for r in self._incoming if r.request_id not in ids]
                for rid in ids:
                    self._live.pop(rid, None)
            raise
        finals: dict[str, RequestOutput] = {}
        total = len(ids) * int((generation_config or self.generation_config).num_return_sequences or 1)
        with self._progress(total, progress_bar) as bar:
            for output in self.stream():
                if output.finished:
                    finals[output.request_id] = output
                    bar.update(1)
        ordered = []
        for rid in ids:
            family = [k for k in finals if k == rid or k.startswith(rid + "#")]
            ordered += [finals[k] for k in sorted(family, key=lambda k: int(k.partition("#")[2] or 0))]
        return ordered

    def _progress(self, total: int, flag: bool | None):
        from tqdm.auto import tqdm

        show = flag if flag is not None else self.config.progress_bar
        if show is None:
            show = total > 8 and sys.stderr.isatty()
        return tqdm(total=total, disable=not show, desc="paged generate", unit="req")

    def _blocks_from_memory(self) -> int:
        # each device that holds layers (accelerate's device_map) must fit its layers' pages
        budget = blocks_from_memory(self.model, self.config.block_size, self.config.memory_fraction)
        # More blocks than max_num_seqs full-length sequences can never be used.
        max_len = self.max_position_embeddings or 4096
        useful = self.config.max_num_seqs * blocks_for(max_len, self.config.block_size)
        return max(1, min(budget, useful))

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._incoming),
            num_blocks=self.allocator.num_blocks,
            num_free_blocks=self.allocator.num_free_blocks,
            peak_used_blocks=self._peak_used,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated,
            tokens_per_second=self._num_generated / self._busy_seconds if self._busy_seconds else 0.0,
            busy_seconds=self._busy_seconds,
            forward_seconds=self._forward_seconds,
            kv_waste_at_peak=self._waste_at_peak,
            num_prompt_tokens=self.scheduler.num_prompt_tokens,
            num_cached_tokens=self.scheduler.num_cached_tokens,
        )
