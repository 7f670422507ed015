"""ContinuousBatchingEngine: the loop. Each step is three hand-offs, as in vLLM v1's ``EngineCore.step``:
the scheduler's plan (speculative proposals included, final once made), the worker's forward and sampler
(token ids), the update from those tokens."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from transformers import GenerationConfig

from .. import transformers_private as hf
from ..attention.cache import PagedAttentionCache
from ..attention.model_checks import check_paged_model, max_positions
from ..core.blocks import BlockAllocator
from ..core.intake import Intake
from ..core.kv_manager import KVBlockManager
from ..core.policy import POLICIES
from ..core.request import Request, RequestOutput, validate_prompt
from ..core.scheduler import Scheduler, SchedulerOutput
from ..kernels import load_backend
from ..kernels.kv_dtype import KV_CACHE_DTYPES, page_dtype
from .batch_api import BatchAPI
from .config import COMPILE_AT_STARTUP, PagedConfig
from .generation.beam import BeamGroup
from .generation.lockstep import Lockstep
from .generation.params import FIELDS, SamplingParams
from .generation.sampler import Sampler, StepOutput
from .generation.sampling import make_sampling_params, resolve_max_new_tokens
from .launcher import Launcher, choose_launcher
from .model import lora
from .model.kv_scales import kv_scales_for
from .model.marks import marks_for
from .model.placement import input_device, layer_kinds
from .model.sleep import (
    TAGS,
    SleepState,
    allocate_pages,
    free_pages,
    pool_bytes,
    sleep_weights,
    trim_heap,
    wake_weights,
)
from .model.weight_loading import load_directory, load_named_tensors
from .model.weights import WeightsWatch
from .multimodal import DERIVED_INPUTS, IMAGE_INPUTS, MultimodalInputs, MultimodalSteps, split_images
from .speculative.speculator import build_speculator
from .stats import EngineStats, StepCounters
from .update import Updater
from .worker import Worker

logger = logging.getLogger(__name__)


class ContinuousBatchingEngine(BatchAPI):
    """Serve many requests at once on a model loaded with ``attn_implementation="paged"``.

    ``add_request`` and ``abort`` may be called from any thread; the loop (``step``, ``stream``,
    ``generate``) runs in one thread at a time. ``launcher``: how the forwards run (default: the
    one ``executor.choose_launcher`` picks for the model: local, CUDA graphs, tensor-parallel).
    Call ``shutdown()``, or use the engine as a context manager, to release what the executor holds
    (a tensor-parallel engine's other ranks wait for it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: PagedConfig | None = None,
        generation_config: GenerationConfig | None = None,
        num_blocks: int | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        """``num_blocks`` (or ``config.num_blocks``): the memory of that many blocks in every layer. A PEFT
        ``PeftModel`` of LoRA adapters runs its base model, each request under its own adapter (``lora.py``)."""
        wrapper, model = model, lora.base_of(model)
        check_paged_model(model, hf.attn_implementation(model))
        self.model = model
        self._peft = wrapper if wrapper is not model else None  # the PeftModel adapters load through
        self._adapters_loaded: set[str] = set()  # names load_adapter has loaded
        # What the engine puts on the model (``marks.py``) is there from now until ``shutdown`` (or until the
        # engine is collected): the launcher and executor put theirs through the model's marks.
        self._release_marks = weakref.finalize(self, marks_for(model).open())
        try:
            self._start(model, config, generation_config, num_blocks, launcher)
        except BaseException:
            self._release_marks()
            raise

    def _start(
        self,
        model: torch.nn.Module,
        config: PagedConfig | None,
        generation_config: GenerationConfig | None,
        num_blocks: int | None,
        launcher: Launcher | None,
    ) -> None:
        self.lora = lora.attach(model, marks_for(model))  # None: the model has no LoRA layer
        config = config or PagedConfig()
        if self.lora is not None:
            config = _lora_config(model, config)
        self.config = config = config.for_model(model)  # the concrete kernel and block size
        self.generation_config = generation_config or model.generation_config
        self.device = input_device(model)  # not model.device: with accelerate's offload that may be "meta"
        self.max_position_embeddings = max_positions(model)  # None: the config does not say
        self.backend = load_backend(config.kernel, self.device)
        self.layers = layer_kinds(model, config.hybrid_kv)
        launcher = launcher or choose_launcher(model)
        wanted = num_blocks or config.num_blocks  # blocks in every layer; the allocator's are of one group's layers
        size = launcher.cache_size(model, config, self.layers, self.layers.pool_blocks(wanted) if wanted else None)
        self.allocator = BlockAllocator(size.num_blocks, config.enable_prefix_caching)
        self.kv = KVBlockManager(self.allocator, config.block_size, self.layers, config.max_batch_tokens)
        policy = POLICIES[config.scheduling_policy]
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_batch_tokens, policy)
        self.kv_dtype = page_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)  # the pages'
        scales = kv_scales_for(model, config.kv_cache_dtype, len(self.layers.windows))
        self.cache = PagedAttentionCache(model.config, size.num_pages, config.block_size, self.layers,
                                         KV_CACHE_DTYPES[config.kv_cache_dtype], scales)  # fmt: skip
        self.executor = launcher.executor(model, self.cache, self.backend, config, self.layers, size)
        seed = config.seed if config.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.intake = Intake()
        self.grammars = None  # structured.Grammars, made at the first constrained request
        self.counters = StepCounters()
        self.updater = Updater(self.scheduler, self.kv, self.intake, self.counters)
        self.speculator = build_speculator(
            model, config.speculative, self.kv, self.layers, size.num_pages, self.backend, config.max_batch_tokens,
            self.device, self.generator,
        )  # fmt: skip
        self._sleep: SleepState | None = None  # asleep: what sleep() freed (sleep.py)
        self.multimodal = MultimodalSteps(model)
        self._weights = WeightsWatch(model)  # what the prefix cache and graphs were made of
        self.sampler = Sampler(self.generator)
        self.worker = Worker(self.executor, self.sampler, self.cache, self.layers, config.block_size, self.device,
                             self.multimodal, self.lora)  # fmt: skip
        if config.compile == COMPILE_AT_STARTUP:
            self._compile_now()

    def _compile_now(self) -> None:
        """``PagedConfig(compile="startup")``: the compile before any request is served. A one-token request
        runs first, eagerly: the graph serves only steps after an engine's first (which confirms each layer's
        window, ``LayerKinds.observe``, and runs the model checks the graph skips). The counters start again
        after it, so the warm-up shows in no statistic."""
        wait = getattr(self.executor, "wait", None)  # a compiled executor's (none: tensor parallel, off the CPU)
        if wait is None:
            return
        start = time.perf_counter()
        warm_up = self.add_request([0], generation_config=GenerationConfig(max_new_tokens=1, do_sample=False))
        while not any(o.request_id == warm_up and o.finished for o in self.step()):
            pass
        ready = wait()
        self.counters = self.updater.counters = StepCounters()
        logger.info("hf_paged_attn: compiled at start-up in %.1f s (graph %s)", time.perf_counter() - start,
                    "ready" if ready else "failed: steps run eagerly")  # fmt: skip

    # ----------------------------------------------------------------------------- requests in
    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        params: SamplingParams | int | None = None,  # an int: max_new_tokens, the positional form of before
        *,
        request_id: str | None = None,
        priority: int = 0,
        adapter_name: str | None = None,
        multimodal: MultimodalInputs | None = None,
        padding: Sequence[int] | None = None,
        lockstep: Lockstep | None = None,
        **options: object,
    ) -> str:
        """Queue one prompt; returns its request id. Bad input raises ValueError and queues nothing.

        ``params``: how the request samples and what it records (``SamplingParams``: max_new_tokens,
        generation_config, logprobs, seed, stop criteria, structured outputs, ...). Its fields may be given
        as keywords instead (``add_request(ids, max_new_tokens=16, seed=0)``), never both; an int in its
        place is ``max_new_tokens``, as the positional form ``add_request(ids, 16)`` always meant.
        ``priority``: lower runs first under ``scheduling_policy="priority"``. ``adapter_name``: the LoRA
        adapter the request runs under (None or ``"__base__"``: the base model), one of the model's PEFT
        adapters. ``padding``: the prompt's left padding in ``model.generate``'s batch, which its
        processors see. ``lockstep``: the ``model.generate`` batch whose caller's processors and criteria
        the request's row runs under (``lockstep.py``; its own ``logits_processor`` is then None).
        Any other keyword is a vision-language model's image input for this prompt, as its processor
        returns them (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ``pixel_attention_mask``; the
        prompt holds their image tokens), or ``multimodal``, those already cut into images
        (``multimodal.MultimodalInputs``). The encoder runs when the prefill reaches the first image token.
        """
        if self._sleep is not None:
            raise RuntimeError("the engine is asleep: call wake_up() before adding requests")
        if isinstance(params, int) and not isinstance(params, bool) and "max_new_tokens" not in options:
            params, options = SamplingParams.split({**options, "max_new_tokens": params})  # add_request(ids, 16)
        elif params is None:
            params, options = SamplingParams.split(options)
        elif not isinstance(params, SamplingParams):
            raise TypeError(
                f"add_request's second argument is a SamplingParams, got {params!r}: pass max_new_tokens and "
                "generation_config by keyword, or as SamplingParams(max_new_tokens=..., generation_config=...)"
            )
        elif FIELDS & options.keys():
            raise TypeError(f"pass {sorted(FIELDS & options.keys())} inside params, not beside it")
        image_inputs: dict[str, object] = options  # what is left: the processor's image tensors
        if unknown := sorted(set(image_inputs) - {*IMAGE_INPUTS, *DERIVED_INPUTS}):
            raise TypeError(
                f"add_request() got unexpected keyword arguments {unknown}: it takes SamplingParams' fields "
                f"{sorted(FIELDS)}, request_id, priority, adapter_name, multimodal, padding, lockstep, and a "
                f"vision-language model's image inputs {list(IMAGE_INPUTS)}"
            )
        text_config = self.model.config.get_text_config()
        prompt = validate_prompt(input_ids, text_config.vocab_size, self.max_position_embeddings)
        # As in generate: what the caller's config leaves unset (eos, pad, ...) comes from the model's.
        config = self.generation_config
        if params.generation_config is not None:
            config = hf.prepare_generation_config(self.model, params.generation_config)[0]
        max_new_tokens = resolve_max_new_tokens(config, len(prompt), params.max_new_tokens)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        logprobs_mode = params.logprobs_mode or self.config.logprobs_mode
        sampling = make_sampling_params(
            self.model, config, len(prompt), params.logits_processor,
            stopping_criteria=params.stopping_criteria, tokenizer=params.tokenizer, seed=params.seed,
            logprobs=params.logprobs, max_new_tokens=max_new_tokens, prefix=padding, lockstep=lockstep,
            ignore_eos=params.ignore_eos, raw_logprobs=logprobs_mode == "raw_logprobs",
        )  # fmt: skip
        request = Request("", prompt, max_new_tokens, sampling, arrival=0, priority=priority)
        request.adapter = self._adapter(adapter_name)
        if image_inputs:
            if multimodal is not None:
                raise ValueError("pass images either as multimodal= or as the processor's outputs, not both")
            images = split_images(self.model, [prompt], image_inputs)[0]
            multimodal = MultimodalInputs.build(self.model, prompt, images) if images else None
        if multimodal is not None and multimodal.images:
            request.multimodal, request.mm_spans = multimodal, multimodal.spans
        if params.prompt_logprobs is not None:
            if (config.num_beams or 1) > 1 or lockstep is not None:
                raise NotImplementedError("prompt_logprobs with beam search or a model.generate batch is not supported")
            request.num_prompt_logprobs, request.prompt_logprobs = params.prompt_logprobs, [None]
        if params.structured is not None:
            request.matcher = self._matcher(
                params.structured, params.tokenizer, sampling.eos_token_ids, config.num_beams or 1
            )
        if (num_beams := config.num_beams or 1) > 1:
            request.group = BeamGroup(request, num_beams, int(config.num_return_sequences or 1))
        if not self.scheduler.can_ever_fit(request):
            per_layer = self.layers.pool_blocks(1)  # allocator blocks per block of every layer
            need = -(-self.kv.blocks_needed(request, copies=num_beams) // per_layer)
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} needs {need} blocks of "
                f"{self.config.block_size} tokens; the whole cache has {self.allocator.num_blocks // per_layer} "
                "(PagedConfig.num_blocks: blocks in every layer)"
            )
        return self.intake.add(request, request_id, num_siblings=max(int(config.num_return_sequences or 1) - 1, 0))

    def _adapter(self, name: str | None) -> str | None:
        """The adapter a request names, checked: None for the base model."""
        if name is None or name == lora.BASE:
            return None
        if name not in self.adapters:
            raise ValueError(f"unknown adapter {name!r}: the model's LoRA adapters are {sorted(self.adapters)}")
        return name

    def _matcher(self, structured: object, tokenizer: object | None, eos_ids: frozenset[int], num_beams: int) -> object:
        """A fresh grammar matcher for a constrained request (its children clone it)."""
        if num_beams > 1:
            raise NotImplementedError("structured outputs with beam search (num_beams > 1) are not supported")
        if tokenizer is None:
            raise ValueError("structured outputs need the tokenizer: pass tokenizer= (as for stop_strings)")
        from .generation.structured import Grammars, as_spec  # llguidance: the optional [structured] extra

        if self.grammars is None:
            head = self.model.get_output_embeddings()
            width = head.weight.shape[0] if head is not None else self.model.config.get_text_config().vocab_size
            self.grammars = Grammars(width)  # the logits' width: ids past the tokenizer's are never allowed
        return self.grammars.matcher(as_spec(structured), tokenizer, eos_ids)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed at the next step, which emits its final output
        (reason ``"abort"``). Returns False if it had already finished; unknown ids raise ValueError."""
        return self.intake.abort(request_id)

    # ----------------------------------------------------------------------------- weights and cache
    # These three change state that ``step`` reads: call them from the thread that steps, or while none steps.
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were forgotten. Requests running now keep
        their blocks, and the blocks they fill from now on join no cache (their K/V began before)."""
        return self.allocator.reset_prefix_cache()

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy named tensors into the model's parameters and buffers of those names, in place (checked
        first: a bad name or shape raises ValueError and loads nothing), and drop every K/V the old weights
        computed: the prefix cache, and the blocks of the requests in flight, which are preempted and
        recompute their prompt and the tokens generated so far, so every later token follows the new
        weights alone. Returns how many tensors were loaded."""
        return self._new_weights(load_named_tensors(self.model, weights))

    def _new_weights(self, num_loaded: int) -> int:
        self.scheduler.recompute_all()
        self.reset_prefix_cache()
        self._weights.changed()  # seen: the next step need not reset again
        return num_loaded

    def weights_changed(self, replaced: bool = True) -> None:
        """The model's weights changed (the engine notices changes by torch ops and replaced tensors itself when
        it starts work after being idle; call this for changes while requests run, or writes through ``p.data``):
        no later request reuses a prefix cached before, and ``replaced`` tensors get CUDA graphs captured anew.
        Requests in flight keep the K/V they computed (as transformers' continuous batching does);
        ``load_weights`` recomputes them."""
        self.reset_prefix_cache()
        if replaced and self.device.type == "cuda":
            self.executor.close()  # graphs hold the old tensors' addresses: captured again at the next decode

    def load_weights_from_dir(self, path: str | os.PathLike[str]) -> int:
        """``load_weights`` of every tensor in the ``*.safetensors`` files of directory ``path``."""
        return self._new_weights(load_directory(self.model, path))

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the PEFT LoRA adapter saved at ``path`` as ``name`` (through PEFT's ``load_adapter``; a model
        without one gets a ``PeftModel``); later requests may name it. ValueError for a name in use or an engine
        with CUDA graphs; NotImplementedError for an adapter ``lora.py`` refuses. A compiled forward compiles
        again for the new adapters (``compiled.retire``), its steps eager meanwhile."""
        if self.config.cuda_graphs:
            raise ValueError("LoRA adapters can't run in CUDA graphs: an engine with cuda_graphs=False runs them")
        self._check_one_process("load_adapter")
        if name == lora.BASE or name in self.adapters:
            raise ValueError(f"adapter name {name!r} is in use")
        self._peft = lora.load_adapter(self.model, self._peft, name, os.fspath(path))
        self.lora = self.worker.lora = lora.attach(self.model, marks_for(self.model))
        self._adapters_changed()
        if name in self._adapters_loaded:  # K/V cached under an earlier adapter of that name is stale
            self.reset_prefix_cache()
        self._adapters_loaded.add(name)

    def unload_adapter(self, name: str) -> None:
        """Delete adapter ``name`` from the model (PEFT's ``delete_adapter``). RuntimeError while a live request
        runs under it; ValueError for a name the model does not hold."""
        self._check_one_process("unload_adapter")
        if name not in self.adapters or self._peft is None:
            raise ValueError(f"unknown adapter {name!r}")
        if self.adapter_in_use(name):
            raise RuntimeError(f"adapter {name!r} has requests in flight")
        self._peft.delete_adapter(name)
        self._adapters_changed()

    def _check_one_process(self, what: str) -> None:
        """An engine's adapter loads are rank 0's alone: on a tensor-parallel model every rank must hold them."""
        if (getattr(self.model, "tp_size", None) or 1) > 1:
            raise NotImplementedError(
                f"engine.{what} on a tensor-parallel model: load or delete the adapter on every rank (PEFT's "
                "load_adapter / delete_adapter), then build the engine"
            )

    def _adapters_changed(self) -> None:
        if self.config.compile:  # the compiled forward holds the adapters it was traced with (``lora_rows.py``)
            from .cpu.compiled import retire

            retire(self.model)

    @property
    def adapters(self) -> set[str]:
        """The names of the model's LoRA adapters (``add_request(adapter_name=)``)."""
        return self.lora.adapters if self.lora is not None else set()

    def adapter_in_use(self, name: str) -> bool:
        """Whether a live request (queued or running) runs under adapter ``name``."""
        return any(r.adapter == name for r in list(self.intake.live.values()))

    # ----------------------------------------------------------------------------- sleep and wake
    # Like the three above: from the thread that steps, or while none does.
    @property
    def is_sleeping(self) -> bool:
        return self._sleep is not None

    def sleep(self, level: int = 1) -> int:
        """Give memory back until ``wake_up`` (vLLM's levels, ``sleep.py``): the KV pool is freed and the
        prefix cache forgotten; level 1 also moves CUDA weights to host memory, level 2 drops them (to be
        loaded again after ``wake_up``) and the engine's own weight copies. Weights on the CPU are the
        user's and stay. Needs no unfinished request (RuntimeError); returns the KV pool's bytes freed.
        Asleep already, it does nothing and returns 0 (``wake_up`` first to sleep at another level)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if (getattr(self.model, "tp_size", None) or 1) > 1:
            raise NotImplementedError("sleep on a tensor-parallel engine is not supported")
        if self._sleep is not None:
            return 0
        if self.has_unfinished():
            raise RuntimeError("cannot sleep with unfinished requests: let them finish or abort them first")
        state = SleepState(level)
        self.reset_prefix_cache()  # the pages' contents go with them
        freed = pool_bytes(self.cache)
        state.pages = free_pages(self.cache)
        sleep_weights(self.model, state)
        trim_heap()  # what malloc kept of the pages (and level 2's copies) goes back to the OS too
        self._sleep = state
        return freed

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back what ``sleep`` gave: ``tags`` ``["weights"]``, ``["kv_cache"]`` or both (None). After
        level 2, load the weights (``load_weights``) before generating: their values are undefined on CUDA."""
        tags = TAGS if tags is None else tuple(tags)
        if unknown := sorted(set(tags) - set(TAGS)):
            raise ValueError(f"unknown wake_up tag(s) {unknown}; the tags are {list(TAGS)}")
        state = self._sleep
        if state is None:
            return
        if "weights" in tags and state.weights_asleep:
            wake_weights(self.model, state)
            if self.device.type == "cuda":
                self.executor.close()  # CUDA graphs hold the old weights' addresses: captured again
        if "kv_cache" in tags and state.pages is not None:
            allocate_pages(self.cache, state.pages)
            state.pages = None
            if self.device.type == "cuda":
                self.executor.close()  # and the old pages'
        if not state.asleep:
            self._sleep = None

    # ----------------------------------------------------------------------------- the loop
    def has_unfinished(self) -> bool:
        return bool(self.intake.num_incoming or self.scheduler.has_work)

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: returns the requests that produced tokens or finished."""
        start = time.perf_counter()
        if not self.scheduler.has_work:  # idle until now: the caller may have changed the weights meanwhile
            changed, replaced = self._weights.changed()  # (~3 us a tensor: once per burst of work, not per step)
            if changed:  # before scheduling: no request admitted now may reuse K/V of the old weights
                self.weights_changed(replaced)
        outputs = self._take_intake()
        self.speculator.plan(self.scheduler.running)  # speculative decoding: each decode's lookahead
        plan = self.scheduler.schedule()
        if plan.scheduled:
            outputs += self._run(plan)
        self.counters.track_peak(self.allocator.num_used_blocks, lambda: self.kv.kv_waste(self.scheduler.running))
        self.counters.busy_seconds += time.perf_counter() - start
        return outputs

    @torch.inference_mode()
    def _run(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """The plan's proposals, then the worker's forward and sampler, then the update from its tokens."""
        forward_start = time.perf_counter()
        try:
            plan = self.speculator.propose(plan)  # the last of scheduling: the plan is final from here
            output = self.worker.execute(plan)
        except Exception as exc:  # one failing step must not take the engine down
            return self.updater.fail(plan, exc) + self._advance_lockstep()
        self.counters.num_steps += 1
        self.counters.forward_seconds += time.perf_counter() - forward_start - output.sample_seconds
        outputs = self.updater.update(plan, output)
        if self.grammars is not None:  # the matchers have their tokens: the next step's masks fill from here on
            self.sampler.prefill_masks(self.scheduler.running)
        return outputs

    def _take_intake(self) -> list[RequestOutput]:
        """Move new requests to the scheduler and carry out aborts; returns the aborted outputs."""
        incoming, to_abort = self.intake.take()
        for request in incoming:
            self.scheduler.add(request)
        outputs = []
        for request in to_abort:
            if not request.finished:
                outputs += self.updater.finish(request, "abort")
        return outputs + self._advance_lockstep() if to_abort else outputs

    @torch.inference_mode()
    def _advance_lockstep(self) -> list[RequestOutput]:
        """A ``model.generate`` batch whose rows waited on one that just ended outside a step (an abort, a
        failed step) moves now: its sampler draws the rows, the updater records them."""
        outputs = []
        for batch in self.updater.take_ready():
            output = StepOutput(advanced=[(batch, self.sampler.advance_lockstep(batch))])
            outputs += self.updater.update(SchedulerOutput(), output)
        return outputs

    def fail_unfinished(self, exc: Exception) -> list[RequestOutput]:
        """Fail every request not finished yet, queued or running, with ``exc`` (a loop that ends on an error):
        their blocks are freed and their final outputs (reason ``"error"``) returned. From the thread that
        steps, or while none steps."""
        outputs = self._take_intake()
        for request in list(self.intake.live.values()):
            if not request.finished:
                outputs += self.updater.finish(request, "error", exc)
        return outputs

    # ----------------------------------------------------------------------------- conveniences
    def stream(self) -> Iterator[RequestOutput]:
        """Yield outputs until every queued request has finished (requests may be added meanwhile)."""
        while self.has_unfinished():
            yield from self.step()

    @property
    def stats(self) -> EngineStats:
        dtype = str(self.kv_dtype).removeprefix("torch.")
        return self.counters.snapshot(self.scheduler, self.kv, self.intake.num_incoming, dtype)

    def shutdown(self) -> None:
        """Release what the executor holds (a tensor-parallel engine ends the other ranks' loop) and take the
        engine's marks off the model (and its draft model): their modules, ``forward``s, buffers and
        parameters are as they were before the engine. Idempotent."""
        try:
            self.executor.close()
            self.speculator.close()
            self.sampler.close()
        finally:
            self._release_marks()

    def __enter__(self) -> ContinuousBatchingEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _lora_config(model: torch.nn.Module, config: PagedConfig) -> PagedConfig:
    """``config`` for a model with LoRA layers: no CUDA graphs (a captured graph would freeze one step's adapter
    rows; the compiled CPU forward takes them as an input, ``lora_rows.py``)."""
    if config.cuda_graphs:
        raise ValueError("PagedConfig.cuda_graphs=True cannot run LoRA adapters (their rows change every step)")
    return config.replace(cuda_graphs=False)
