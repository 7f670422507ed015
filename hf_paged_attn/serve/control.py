"""The control routes of an RL loop (``--enable-rl-endpoints``): pause and resume generation, new weights
from a directory, the prefix cache dropped; and what trainers ask of the server (world size, config).

Pause modes (vLLM's ``/pause?mode=``): ``keep`` stops stepping at once, and the requests in flight keep
their K/V and continue after ``/resume``; ``wait`` lets them finish first; ``abort`` ends them (their
clients get the abort). While paused, new generation requests wait (nothing is refused) and run after
``/resume``. Weights loaded while paused in ``keep`` mode: the kept requests recompute their prompt and
the tokens they have (``engine.load_weights``), so every token after the update follows the new weights
alone (vLLM's keep mode goes on with the old K/V instead). A weight update sent while the server runs
pauses it in ``wait`` mode first: the requests in flight finish on the old weights, and every later one
runs on the new. Every update drops the whole prefix cache.

Sleep (vLLM's ``/sleep?level=``): new generation requests get a 503 from then on, the requests in flight
finish first (within ``HOLD_TIMEOUT_S``), then the engine sleeps (``engine.sleep``) and its thread stays held
until ``/wake_up`` has woken every part.

The engine thread is held (``EngineLoop.hold``) whenever the engine's state changes here, so no step
runs meanwhile; loading runs in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict

from .engine_loop import EngineLoop
from .errors import APIError
from .openai.fields import text

PAUSE_MODES = ("keep", "wait", "abort")
HOLD_TIMEOUT_S = 600.0  # for a step in flight to end (a long prefill on a slow machine)
WAIT_POLL_S = 0.02  # how often a "wait" pause looks whether the requests in flight are done


class _Body(BaseModel):
    """A control route's body: strict, unknown fields refused (``protocol.parse``'s hooks, all empty)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def unsupported_options(self) -> list[str]:
        return []

    def check_fields(self) -> None:
        pass

    def check(self, limits: Any) -> None:
        pass


class UpdateFromDisk(_Body):
    """SGLang's ``/update_weights_from_disk``: ``flush_cache`` false is refused (the cached K/V would be stale)."""

    model_path: text(4096, min_length=1)
    flush_cache: bool = True
    load_format: text(64) | None = None  # only "safetensors" (None: the same)
    abort_all_requests: bool = False


class UpdateWeights(_Body):
    """prime-rl's ``/update_weights {"weight_dir"}``; vLLM's NCCL ``update_info`` is refused by name."""

    weight_dir: text(4096, min_length=1) | None = None
    update_info: dict[str, Any] | None = None


class Control:
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.mode: str | None = None  # the pause mode while paused
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._lock = asyncio.Lock()  # one control operation at a time
        self.sleeping = False  # from the start of /sleep until /wake_up has woken everything
        self._sleep_held = False  # the engine thread is held for the sleep

    @property
    def paused(self) -> bool:
        return self.mode is not None

    async def admit(self) -> None:
        """A generation request's way in: APIError 503 while asleep; while paused, waits for the resume."""
        self._check_awake()
        await self._unpaused.wait()
        self._check_awake()

    def _check_awake(self) -> None:
        if self.sleeping:
            raise APIError(503, "the engine is asleep (POST /sleep); POST /wake_up first", None, "sleeping")

    async def sleep(self, level: int) -> dict[str, Any]:
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 or 2, got {level!r}", "level")
        async with self._lock:
            if self.sleeping:
                return {"is_sleeping": True, "kv_cache_bytes_freed": 0}
            self.sleeping = True  # new generation requests are refused from now on
            try:
                deadline = asyncio.get_running_loop().time() + HOLD_TIMEOUT_S
                while not self.paused and self.loop.num_unfinished:  # (paused: the thread is held already)
                    if asyncio.get_running_loop().time() > deadline:
                        raise APIError(503, f"the requests in flight did not finish within {HOLD_TIMEOUT_S:.0f} s",
                                       None, "engine_busy")
                    await asyncio.sleep(WAIT_POLL_S)
                self._sleep_held = await self._hold()  # its own hold: a /resume while asleep keeps it
                try:
                    freed = await asyncio.get_running_loop().run_in_executor(None, self.engine.sleep, level)
                except RuntimeError as exc:  # requests kept by a pause(keep): they must finish or be aborted
                    raise APIError(409, f"cannot sleep: {exc}", None, "requests_in_flight") from None
            except BaseException:
                self.sleeping = False
                self._release_sleep_hold()
                raise
        return {"is_sleeping": True, "kv_cache_bytes_freed": freed}

    async def wake_up(self, tags: list[str] | None) -> dict[str, Any]:
        async with self._lock:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.engine.wake_up, tags)
            except ValueError as exc:
                raise APIError(400, str(exc), "tags") from None
            if self.sleeping and not self.engine.is_sleeping:
                self.sleeping = False
                self._release_sleep_hold()
        return {"is_sleeping": self.sleeping}

    def _release_sleep_hold(self) -> None:
        if self._sleep_held:
            self._sleep_held = False
            self.loop.release()

    async def pause(self, mode: str, clear_cache: bool) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", "mode")
        async with self._lock:
            if not self.paused:
                await self._pause(mode)
            if clear_cache:
                self.engine.reset_prefix_cache()  # the thread is held: no step reads the cache now
        return {"is_paused": True, "mode": self.mode}

    async def resume(self) -> dict[str, Any]:
        async with self._lock:
            self._resume()
        return {"is_paused": False}

    async def reset_prefix_cache(self) -> dict[str, Any]:
        async with self._lock:
            held = self.paused or await self._hold()
            try:
                num_blocks = self.engine.reset_prefix_cache()
            finally:
                if not self.paused and held:
                    self.loop.release()
        return {"success": True, "num_blocks_dropped": num_blocks}

    async def load(self, path: str) -> dict[str, Any]:
        """New weights from the safetensors files of ``path`` (see the module's docstring for the requests
        in flight). APIError 400 for a path or checkpoint that does not fit; the weights are then unchanged."""
        async with self._lock:
            was_paused = self.paused
            if not was_paused:
                await self._pause("wait")
            try:
                num_loaded = await asyncio.get_running_loop().run_in_executor(
                    None, self.engine.load_weights_from_dir, path)
            except (ValueError, OSError) as exc:
                raise APIError(400, f"loading weights from {path!r} failed: {exc}", "model_path",
                               "invalid_weights") from None
            finally:
                if not was_paused:
                    self._resume()
        return {"success": True, "message": f"loaded {num_loaded} tensors from {path}; prefix cache dropped"}

    # ----------------------------------------------------------------------------- internals (under _lock)
    async def _hold(self) -> bool:
        if not await asyncio.get_running_loop().run_in_executor(None, self.loop.hold, HOLD_TIMEOUT_S):
            self.loop.release()
            raise APIError(503, f"the engine did not finish its step within {HOLD_TIMEOUT_S:.0f} s", None,
                           "engine_busy")
        return True

    async def _pause(self, mode: str) -> None:
        self._unpaused.clear()  # new generation requests wait from now on
        try:
            if mode == "abort":
                self.loop.abort_running()
            if mode in ("wait", "abort"):  # the engine thread steps until the requests in flight are done
                while self.loop.num_unfinished:
                    await asyncio.sleep(WAIT_POLL_S)
            await self._hold()
        except BaseException:
            self._unpaused.set()
            raise
        self.mode = mode

    def _resume(self) -> None:
        if self.paused:
            self.mode = None
            self.loop.release()
        self._unpaused.set()


def world_size() -> int:
    """The ranks the model runs on: the tensor-parallel launch's world, else 1."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def server_info(engine: Any, model_name: str, context_length: int, version: str) -> dict[str, Any]:
    """vLLM's ``/server_info`` shape, ``{"vllm_config": {...}}``, holding this server's own settings."""
    config = engine.config
    model = engine.model
    return {"vllm_config": {
        "engine": "hf-paged-attn", "version": version, "model": model_name,
        "model_type": getattr(model.config, "model_type", None), "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(engine.device), "max_model_len": context_length, "block_size": config.block_size,
        "num_blocks": engine.allocator.num_blocks, "max_num_seqs": config.max_num_seqs,
        "max_batch_tokens": config.max_batch_tokens, "enable_prefix_caching": config.enable_prefix_caching,
        "kernel": config.kernel, "tensor_parallel_size": world_size(),
    }}
