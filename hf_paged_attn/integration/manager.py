"""transformers' ``ContinuousBatchingManager``, on our engine, for a "paged" model.

``model.init_continuous_batching()`` returns one: the same public surface (``start``, ``stop``,
``is_running``, ``join``, ``destroy``, ``pause``, ``warmup``, ``add_request(s)``, ``cancel_request``,
``get_result``, iteration, ``request_id_iter``, ``register_result_handler``) and the same outputs
(``GenerationOutput``, ids ``req_<n>`` and ``req_<n>__child#<k>``). ``start`` runs the engine's loop in
a background thread; ``generate_batch`` runs one batch on the calling thread.

Each session (``start`` .. ``stop``, or one ``generate_batch``) has its own engine, sized for its
workload, so nothing that depends on the weights (prefix-cache entries, captured graphs, pages)
outlives a session: weights updated between sessions are always honoured, ``persistent_manager=True``
included. Within a session, ``pause()`` lets the caller change the weights; requests in flight keep
the K/V they have (as transformers' does), no later request reuses a prefix cached before the pause,
and graphs are captured anew if a weight tensor was replaced.

Requests run with the generation config of ``generate`` (the caller's merged with the model's), so
a greedy ``generate_batch`` gives ``generate``'s tokens; ``max_new_tokens=None`` resolves as in
``generate`` (the config's, else what ``max_length`` leaves), where transformers' engine has no limit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.generation.continuous_batching.utils import WorkloadHints

from .. import transformers_private as hf
from ..core.request import RequestOutput
from ..parallel.tensor_parallel import is_tensor_parallel, on_driver
from ..runtime.background import EngineThread
from ..runtime.engine import ContinuousBatchingEngine
from ..runtime.generation.sampling import resolve_max_new_tokens
from ..runtime.model.memory import blocks_for_batch
from ..runtime.model.placement import layer_kinds
from .cb_config import paged_config_from
from .cb_outputs import Ledger
from .modes import generation_mode, weights_version

logger = logging.getLogger(__name__)
PER_REQUEST_KEYS = ("temperature", "top_k", "top_p")  # what transformers' per-request processors take
CACHE_ATTRIBUTE = "_hf_paged_attn_cb_manager"  # where a persistent manager waits for its next start()


def cached_manager(model: torch.nn.Module) -> PagedContinuousBatchingManager | None:
    return getattr(model, CACHE_ATTRIBUTE, None)


def cache_manager(model: torch.nn.Module, manager: PagedContinuousBatchingManager) -> None:
    setattr(model, CACHE_ATTRIBUTE, manager)


class PagedContinuousBatchingManager:
    """transformers' continuous-batching manager for a model loaded with ``attn_implementation="paged"``."""

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        workload_hints: WorkloadHints | None = None,
    ) -> None:
        self.model = model
        self.generation_config = generation_config
        self.continuous_batching_config = continuous_batching_config or ContinuousBatchingConfig()
        base = getattr(model, "paged_config", None)
        self.paged_config, self.options = paged_config_from(self.continuous_batching_config, base)
        self.resolved = self.paged_config.for_model(model)  # the kernel's block size, for sizing
        self.workload_hints = workload_hints
        self.config = hf.prepare_generation_config(model, generation_config)[0]  # as generate merges it
        self.num_return_sequences = int(self.config.num_return_sequences or 1)
        self.warmed_up = False
        self.engine: ContinuousBatchingEngine | None = None
        self.ledger = Ledger(self.options.return_logprobs)
        self.output_queue: queue.Queue[GenerationOutput] = queue.Queue()
        self.result_handlers: dict[str, tuple[Callable, asyncio.AbstractEventLoop]] = {}
        self.fatal_error: Exception | None = None
        self._thread: EngineThread | None = None  # the session's loop (``runtime/background.py``)
        self._counter = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._pausing = threading.local()  # ``depth``: how many ``pause()`` contexts this thread is inside
        self._mode = ExitStack()  # holds generation_mode while a session runs

    # ----------------------------------------------------------------------------- sessions
    def warmup(self) -> None:
        """Nothing to capture ahead: decode graphs are captured at their first use. Kept for the API."""
        self.warmed_up = True

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def _stop(self) -> str | None:
        """How the session is ending: None (running or never started), "flush" or "hard"."""
        return self._thread.stop_mode if self._thread is not None else ("flush" if self._stopping else None)

    def start(self) -> None:
        """Start the background loop, on a new engine sized for the workload hints (else from memory)."""
        if self.is_running():
            logger.warning("Manager thread is already running.")
            return
        if is_tensor_parallel(self.model):
            raise NotImplementedError(
                "the continuous-batching manager's background loop under tensor parallelism; generate_batch and "
                "generate run tensor-parallel"
            )
        engine = self._ensure_engine()
        self.fatal_error, self._stopping = None, False
        self._mode.enter_context(generation_mode(self.model))
        self._thread = EngineThread(engine, self._deliver_all, self._on_error, name="paged-cb-manager")
        self._thread.start()

    def stop(
        self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:  # fmt: skip
        """Stop the loop: after the queued requests are done, or at once (``hard_stop``: they fail).
        ``keep_for_next_session`` caches the manager on the model (``init_continuous_batching`` returns it)."""
        if self._thread is None:
            logger.warning("Manager not started.")
            return
        if getattr(self._pausing, "depth", 0):
            raise RuntimeError("Cannot stop the manager from inside a pause: leave the `pause` context first.")
        self._stopping = True
        self._thread.stop("hard" if hard_stop else "flush", timeout=0)
        if block:
            self.join(time.perf_counter(), timeout)
        if keep_for_next_session:
            cache_manager(self.model, self)

    def join(self, stop_trigger_time: float, timeout: float | None = None) -> None:
        """Wait for the loop to end (at most ``timeout`` seconds), then release the session."""
        if self._thread is None:
            return
        if not self._thread.stop(self._thread.stop_mode or "flush", timeout):
            logger.warning("Generation thread did not exit after join timeout (%s).", timeout)
            return
        if self._thread.stop_mode == "hard" and self.engine is not None:  # what is still live fails, as in transformers
            self._deliver_all(self.engine.fail_unfinished(
                RuntimeError("Generation loop finished before this request completed")))
        self._thread = None
        self._close_engine()
        self._mode.close()  # the model's training flag as it was before start()
        logger.info("Background generation thread stopped after %.2fs.", time.perf_counter() - stop_trigger_time)

    def destroy(self) -> None:
        """Stop (waiting for the queued requests) and release everything; safe to call twice."""
        if self.is_running():
            self.stop(block=True)
        self._close_engine()

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Pause the loop so that the caller can use or change the model (update its weights in place);
        it resumes on exit with its requests in flight. No request admitted after the pause reuses a
        prefix cached before it; graphs are captured anew if a weight tensor was replaced."""
        thread = self._thread
        if thread is None or not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.")
        thread.hold()  # pauses nest and overlap: the loop steps again when the last one ends
        try:
            if not thread.is_alive():
                raise RuntimeError("The generation loop stopped before it could pause.") from self.fatal_error
            self._pausing.depth = getattr(self._pausing, "depth", 0) + 1
            try:
                yield
            finally:
                self._pausing.depth -= 1
                self._after_pause()
        finally:
            thread.release()

    # ----------------------------------------------------------------------------- requests in
    def add_request(
        self,
        input_ids: Sequence[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str | None:
        """Queue one prompt; its id (None if the manager is stopping, as transformers)."""
        if self._stop is not None or self.fatal_error is not None:
            logger.warning("The manager is stopping: a request of %d tokens is dropped.", len(input_ids))
            return None
        request_id = request_id if request_id is not None else self._next_ids(1)[0]
        return self._add([self._request(input_ids, request_id, max_new_tokens, eos_token_id, logit_processor_kwargs)],
                         streaming, record_timestamps)[0]  # fmt: skip

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **logit_processor_kwargs: Any,
    ) -> list[str]:
        """Queue every prompt (all or none): their ids ``req_<n>``, in input order. A stopping manager
        drops them (and still returns their ids, as transformers)."""
        ids = self._next_ids(len(inputs))
        if self._stop is not None or self.fatal_error is not None:
            logger.warning("The manager is stopping: %d requests are dropped.", len(inputs))
            return ids
        requests = [self._request(p, rid, max_new_tokens, None, logit_processor_kwargs) for p, rid in zip(inputs, ids)]
        return self._add(requests, streaming, record_timestamps)

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request: its blocks are freed at the next step and no output is delivered for it."""
        if self.engine is not None:
            try:
                self.engine.abort(request_id)
            except ValueError:  # unknown or already finished: nothing to cancel, as transformers
                pass

    def _next_ids(self, n: int) -> list[str]:
        with self._lock:
            first, self._counter = self._counter, self._counter + n
        return [f"req_{i}" for i in range(first, first + n)]

    def _request(
        self,
        input_ids: Sequence[int],
        request_id: str,
        max_new_tokens: int | None,
        eos_token_id: int | list[int] | None,
        overrides: dict[str, Any],
    ) -> dict[str, Any]:
        """``engine.add_request``'s arguments for one prompt."""
        config = None
        if overrides:
            bad = sorted(set(overrides) - set(PER_REQUEST_KEYS))
            if bad or not self.options.per_request_processors:
                raise ValueError(
                    f"logit_processor_kwargs {sorted(overrides)}: only {list(PER_REQUEST_KEYS)} are taken, and only "
                    "with ContinuousBatchingConfig(per_request_processors=True)"
                )
        if overrides or eos_token_id is not None:
            config = GenerationConfig.from_dict({**self.config.to_dict(), **overrides})
            if eos_token_id is not None:
                config.eos_token_id = eos_token_id
        return dict(input_ids=list(input_ids), max_new_tokens=max_new_tokens, generation_config=config,
                    request_id=request_id, logprobs=0 if self.options.return_logprobs else None)  # fmt: skip

    def _add(self, requests: list[dict[str, Any]], streaming: bool, record_timestamps: bool) -> list[str]:
        engine = self._ensure_engine()
        for r in requests:
            self.ledger.add(r["request_id"], self.num_return_sequences, streaming, record_timestamps)
        try:
            ids = engine.add_all(requests)
        except Exception:
            for r in requests:
                self.ledger.drop(r["request_id"])
            raise
        if self._thread is not None:
            self._thread.wake()
        return ids

    # ----------------------------------------------------------------------------- results out
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of ``request_id``, if given: another one is put back), or None after ``timeout``."""
        if self.output_queue.empty() and (self._thread is None or self.fatal_error is not None):
            return None
        try:
            result = self.output_queue.get(block=True, timeout=timeout)
        except queue.Empty:
            return None
        if request_id is not None and result.request_id != request_id:
            self.output_queue.put(result)
            return None
        return result

    def __iter__(self) -> Iterator[GenerationOutput]:
        while self.is_running() or not self.output_queue.empty():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """The outputs of one request, until its final one."""
        while self.is_running() or not self.output_queue.empty():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    def register_result_handler(self, request_id: str, callback: Callable) -> None:
        """``callback(output)`` on the running event loop for each output of ``request_id``."""
        loop = asyncio.get_running_loop()

        def deliver(result: GenerationOutput) -> None:
            callback(result)
            if result.is_finished():
                with self._lock:
                    self.result_handlers.pop(request_id, None)

        with self._lock:
            self.result_handlers[request_id] = (deliver, loop)

    def _deliver(self, out: RequestOutput) -> None:
        result = self.ledger.convert(out)
        if result is None:
            return
        with self._lock:
            handler = self.result_handlers.get(result.request_id)
        if handler is not None:
            callback, loop = handler
            loop.call_soon_threadsafe(callback, result)
        else:
            self.output_queue.put(result)

    # ----------------------------------------------------------------------------- one batch, here
    def generate_batch(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        record_timestamps: bool = False,
        progress_bar: bool = False,
    ) -> dict[str, GenerationOutput]:
        """Run ``inputs`` to completion on the calling thread, on an engine sized for them: the final
        outputs by id, in input order (each prompt's siblings ``__child#k`` before it, as transformers)."""
        if self.is_running():
            raise RuntimeError("the manager's loop is running: add the requests with add_requests and read the results")
        limits = [resolve_max_new_tokens(self.config, len(p), max_new_tokens) for p in inputs]

        def run() -> dict[str, GenerationOutput]:
            results: dict[str, GenerationOutput] = {}

            def on_output(out: RequestOutput) -> None:
                result = self.ledger.convert(out)
                if result is not None and result.is_finished():
                    results[result.request_id] = result

            engine = self._ensure_engine(self._blocks_for([len(p) for p in inputs], limits))
            ids = self._next_ids(len(inputs))
            requests = [self._request(p, rid, max_new_tokens, None, {}) for p, rid in zip(inputs, ids)]
            self._add(requests, streaming=False, record_timestamps=record_timestamps)
            engine.collect(ids, progress_bar=progress_bar, on_output=on_output)
            n = self.num_return_sequences
            order = [k for rid in ids for k in [*(f"{rid}__child#{i}" for i in range(n - 1)), rid]]
            return {k: results[k] for k in order if k in results}

        # Tensor-parallel model: rank 0 runs the engine, the other ranks its forwards; all get the outputs.
        # The engine closes after: closing it inside would end the other ranks' loop before the outputs reach them.
        try:
            with generation_mode(self.model):
                return on_driver(self.model, run)
        finally:
            self._close_engine()

    # ----------------------------------------------------------------------------- the engine
    def _ensure_engine(self, num_blocks: int | None = None) -> ContinuousBatchingEngine:
        if self.engine is None:
            num_blocks = self.paged_config.num_blocks or num_blocks or self._hinted_blocks()
            self.engine = ContinuousBatchingEngine(self.model, self.paged_config, self.config, num_blocks=num_blocks)
            self._weights = weights_version(self.model)
        return self.engine

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _blocks_for(self, prompt_lengths: list[int], max_new_tokens: list[int]) -> int:
        """The blocks these prompts hold at their peak, all at once (as ``model.generate`` sizes), in
        ``PagedConfig.num_blocks``' unit (blocks of every layer)."""
        layers = layer_kinds(self.model, self.resolved.hybrid_kv)  # the engine's groups
        n = self.num_return_sequences
        pool = sum(blocks_for_batch([p], m, self.resolved, layers.groups, n)
                   for p, m in zip(prompt_lengths, max_new_tokens))  # fmt: skip
        return -(-pool // layers.pool_blocks(1))

    def _hinted_blocks(self) -> int | None:
        """From ``generate_batch``'s workload hints, else None: the engine takes its share of free memory."""
        hints = self.workload_hints
        if hints is None or not hints.num_requests or not hints.max_generated_length:
            return None
        return hints.num_requests * self._blocks_for([hints.max_prompt_length], [hints.max_generated_length])

    # ----------------------------------------------------------------------------- the loop (its thread)
    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out)

    def _on_error(self, exc: Exception) -> None:
        """A step raised past the engine's own guard: the loop dies, and every request still live fails."""
        logger.error("Error in generation loop: %s", exc, exc_info=True)
        self.fatal_error = exc
        if self.engine is not None:
            self._deliver_all(self.engine.fail_unfinished(exc))

    def _after_pause(self) -> None:
        """(no step in flight) The caller may have changed the weights, through ``p.data`` too, which the
        engine cannot see: no later request reuses a prefix cached before the pause."""
        if self.engine is None:
            return
        weights = weights_version(self.model)
        self.engine.weights_changed(replaced=[w[0] for w in weights] != [w[0] for w in self._weights])
        self._weights = weights
