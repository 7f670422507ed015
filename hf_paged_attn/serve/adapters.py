"""The LoRA adapters a server serves, as vLLM serves them: each a model name of its own.

``serve BASE --lora-modules a=PATH`` loads them at start; ``POST /v1/load_lora_adapter {"lora_name",
"lora_path", "load_inplace"}`` and ``POST /v1/unload_lora_adapter {"lora_name"}`` while serving. A request's
``model`` picks the base model or an adapter; ``/v1/models`` lists the adapters with ``parent`` the base.

A served name maps to the engine's adapter (``engine.load_adapter``). ``load_inplace`` loads the new
weights under a fresh engine name (``name@2``, ...) and points the served name at it: the requests already
running finish on the old adapter, and every later one runs the new, each with its own prefix-cache root.
An engine adapter no served name points at any more is deleted once no request runs under it (at the next
load or unload).

Resident adapters, as vLLM's ``--max-loras``: every served name stays known (its path kept), but at most
``max_loras`` are loaded in the engine at once, and their weights (float32, as PEFT keeps them) fit in
``max_lora_memory`` bytes and in the device's free memory. Loading past either (``/v1/load_lora_adapter``, or a
request naming an adapter not resident) first unloads the least recently used resident adapter that no request
runs under, and reloads it from its path when a request names it again; only when every resident adapter is in
use does the load get 400 (``max_loras``, ``max_lora_memory``, naming the cap and the sizes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .control import _Body
from .engine_loop import EngineLoop
from .errors import APIError, short
from .openai.fields import text

logger = logging.getLogger("hf_paged_attn.serve")
HOLD_TIMEOUT_S = 600.0  # for a step in flight to end before an adapter loads


class LoadAdapter(_Body):
    lora_name: text(256, min_length=1)
    lora_path: text(4096, min_length=1)
    load_inplace: bool = False


class UnloadAdapter(_Body):
    lora_name: text(256, min_length=1)
    lora_int_id: int | None = None  # vLLM's; names are what this server goes by


def parse_lora_module(spec: str) -> tuple[str, str]:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}`` (ValueError)."""
    if spec.lstrip().startswith("{"):
        data = json.loads(spec)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
            raise ValueError(f"--lora-modules {spec!r}: the JSON form needs string 'name' and 'path'")
        return data["name"], data["path"]
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH or a JSON object")
    return name, path


def adapter_rank(path: str) -> int:
    """The largest rank of the PEFT LoRA adapter saved at ``path`` (its ``r`` and ``rank_pattern``)."""
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(path)
    return max([int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())])


def adapter_bytes(path: str) -> int:
    """The bytes the LoRA weights saved at ``path`` take once loaded: float32 (PEFT's default
    ``autocast_adapter_dtype`` keeps LoRA weights in float32 under a float16 or bfloat16 base), from the shapes
    in ``adapter_model.safetensors``'s header; a pickled ``adapter_model.bin`` counts its file size."""
    weights = Path(path) / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            return sum(4 * _numel(f.get_slice(key).get_shape()) for key in f.keys())
    pickled = Path(path) / "adapter_model.bin"
    return pickled.stat().st_size if pickled.is_file() else 0


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def free_memory(device: Any) -> int | None:
    """Bytes free on ``device`` now: CUDA's ``mem_get_info``, the host's MemAvailable on a CPU (None where
    neither can be read)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(n: int) -> str:
    """``n`` bytes for a message: GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale // 8:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def with_adapters(model: Any, modules: list[tuple[str, str]]) -> Any:
    """``model`` with the PEFT LoRA adapters ``modules`` ((name, path), in order) loaded: their ``PeftModel``,
    which the engine runs (``model`` itself if there are none)."""
    if not modules:
        return model
    from peft import PeftModel

    (first, path), *rest = modules
    peft = PeftModel.from_pretrained(model, path, adapter_name=first)
    for name, path in rest:
        peft.load_adapter(path, adapter_name=name)
    return peft.eval()


@dataclass
class ServedAdapters:
    """Served adapter names -> (engine adapter name, path), resident in the engine or not; ``max_loras``,
    ``max_lora_rank``, ``max_lora_memory`` (bytes of resident adapters' weights): None is no cap."""

    base_name: str
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_lora_memory: int | None = None
    served: dict[str, tuple[str, str]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # engine adapter -> its weights' bytes, while loaded
    _used: dict[str, int] = field(default_factory=dict)  # served name -> tick of its last use: the LRU order
    _pins: Counter = field(default_factory=Counter)  # served name -> requests between resolving and submitting
    _ticks: itertools.count = field(default_factory=itertools.count)
    _versions: itertools.count = field(default_factory=lambda: itertools.count(2))
    _lock: asyncio.Lock | None = None

    def check_new(self, name: str, path: str, replacing: bool) -> int:
        """The bytes of an adapter that may be loaded as ``name``; APIError 400 for one that may not."""
        if name == self.base_name:
            raise APIError(400, f"{short(name)} is the base model's name", "lora_name", "invalid_value")
        if name in self.served and not replacing:
            raise APIError(400, f"adapter {short(name)} is loaded already (load_inplace: true replaces it)",
                           "lora_name", "invalid_value")  # fmt: skip
        if not (Path(path) / "adapter_config.json").is_file():
            raise APIError(400, f"no PEFT adapter at {short(path)} (adapter_config.json)", "lora_path", "invalid_value")
        rank = adapter_rank(path)
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise APIError(400, f"adapter {short(name)} has rank {rank}, above --max-lora-rank {self.max_lora_rank}",
                           "lora_path", "max_lora_rank")  # fmt: skip
        size = adapter_bytes(path)
        if self.max_lora_memory is not None and size > self.max_lora_memory:
            raise APIError(400, f"adapter {short(name)} needs {_gib(size)}, above --max-lora-memory "
                           f"{_gib(self.max_lora_memory)}", "lora_path", "max_lora_memory")  # fmt: skip
        return size

    def check_start(self, name: str, path: str) -> int:
        """``check_new`` of a ``--lora-modules`` adapter: ValueError naming what is wrong."""
        try:
            return self.check_new(name, path, replacing=False)
        except APIError as exc:
            raise ValueError(f"--lora-modules {name}={path}: {exc.message}") from None

    def start(self, modules: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Serve the ``--lora-modules`` (ValueError for a bad one); the first that fit ``max_loras`` and
        ``max_lora_memory`` are returned, to load before the engine starts, the others load when first named."""
        resident: list[tuple[str, str]] = []
        for name, path in modules:
            size = self.check_start(name, path)
            self.served[name] = (name, path)
            held = sum(self.sizes.values())
            if (self.max_loras is None or len(resident) < self.max_loras) and (
                self.max_lora_memory is None or held + size <= self.max_lora_memory
            ):
                resident.append((name, path))
                self.sizes[name] = size
                self._touch(name)
        return resident

    def engine_adapter(self, model: str) -> str | None:
        """The engine adapter of the model a request names (None: the base); APIError 404 for another name."""
        if model == self.base_name:
            return None
        found = self.served.get(model)
        if found is None:
            names = ", ".join(short(n) for n in [self.base_name, *self.served])
            raise APIError(404, f"the model {short(model)} does not exist; this server serves {names}", "model",
                           "model_not_found")  # fmt: skip
        return found[0]

    def cards(self) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": 0, "owned_by": "hf-paged-attn", "root": path,
                 "parent": self.base_name} for name, (_, path) in self.served.items()]  # fmt: skip

    def resident(self, loop: EngineLoop) -> list[str]:
        """The served names whose adapter is loaded in the engine now."""
        loaded = self._engine_adapters(loop)
        return [name for name, (internal, _) in self.served.items() if internal in loaded]

    # ----------------------------------------------------------------------------- while serving
    @contextlib.asynccontextmanager
    async def using(self, loop: EngineLoop, model: str) -> AsyncIterator[str | None]:
        """The engine adapter of the model a request names (None: the base; 404 for no model served here),
        loaded again from its path if it was evicted, and kept resident until the block ends (the request
        is submitted by then, and a running request's adapter is never evicted)."""
        if self.engine_adapter(model) is None:
            yield None
            return
        self._pins[model] += 1
        try:
            if self.served[model][0] not in self._engine_adapters(loop):
                async with self._locked():
                    self.engine_adapter(model)  # unloaded while this waited: 404
                    internal, path = self.served[model]
                    if internal not in self._engine_adapters(loop):
                        await self._load(loop, model, self._fresh(model, loop), path, adapter_bytes(path))
            self._touch(model)
            yield self.engine_adapter(model)
        finally:
            self._pins[model] -= 1

    async def load(self, loop: EngineLoop, body: LoadAdapter) -> str:
        async with self._locked():
            name, path = body.lora_name, body.lora_path
            size = self.check_new(name, path, replacing=body.load_inplace and name in self.served)
            internal = name if name not in self.served else self._fresh(name, loop)
            while internal in self._engine_adapters(loop):  # a name of an earlier load still in use
                internal = self._fresh(name, loop)
            await self._load(loop, name, internal, path, size)
            await self._sweep(loop)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, loop: EngineLoop, body: UnloadAdapter) -> str:
        async with self._locked():
            if self.served.pop(body.lora_name, None) is None:
                raise APIError(404, f"the adapter {short(body.lora_name)} is not loaded", "lora_name",
                               "model_not_found")  # fmt: skip
            self._used.pop(body.lora_name, None)
            await self._sweep(loop)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def _touch(self, name: str) -> None:
        self._used[name] = next(self._ticks)

    def _fresh(self, name: str, loop: EngineLoop) -> str:
        """A new engine name for ``name``'s weights: its own prefix-cache root, and the engine's prefix cache kept
        (loading a name the engine had before drops it)."""
        internal = f"{name}@{next(self._versions)}"
        while internal in self._engine_adapters(loop):
            internal = f"{name}@{next(self._versions)}"
        return internal

    async def _load(self, loop: EngineLoop, name: str, internal: str, path: str, size: int) -> None:
        """Load ``path`` as engine adapter ``internal`` for served ``name``, evicting what must go first."""
        await self._make_room(loop, name, size)
        await self._held(loop, loop.engine.load_adapter, internal, path)
        self.served[name] = (internal, path)
        self.sizes[internal] = size
        self._touch(name)

    async def _make_room(self, loop: EngineLoop, name: str, size: int) -> None:
        """Evict the least recently used idle resident adapters until one of ``size`` bytes fits ``max_loras``,
        ``max_lora_memory`` and the device's free memory; 400 naming the cap when only busy ones are left."""
        await self._sweep(loop)
        free, freed = free_memory(_device(loop.engine)), 0
        while True:
            others = [n for n in self.resident(loop) if n != name]
            held = sum(self.sizes.get(a, 0) for a in self._engine_adapters(loop))
            problem = None
            if self.max_loras is not None and len(others) >= self.max_loras:
                problem = (f"--max-loras {self.max_loras}: {len(others)} adapters are resident", "max_loras")
            elif self.max_lora_memory is not None and held + size > self.max_lora_memory:
                problem = (f"adapter {short(name)} needs {_gib(size)} and resident adapters hold {_gib(held)} of "
                           f"--max-lora-memory {_gib(self.max_lora_memory)}", "max_lora_memory")  # fmt: skip
            elif free is not None and size > free + freed:
                problem = (f"adapter {short(name)} needs {_gib(size)} and the device has {_gib(free + freed)} free",
                           "max_lora_memory")  # fmt: skip
            if problem is None:
                return
            idle = [n for n in others if not self._pins[n] and not loop.engine.adapter_in_use(self.served[n][0])]
            if not idle:
                busy = ", ".join(short(n) for n in others)
                raise APIError(400, f"{problem[0]}, and every one has requests running ({busy}): retry when one "
                               "finishes", "lora_name", problem[1])  # fmt: skip
            victim = self.served[min(idle, key=lambda n: self._used.get(n, -1))][0]
            await self._held(loop, loop.engine.unload_adapter, victim)
            freed += self.sizes.pop(victim, 0)
            logger.info("adapter %s evicted (least recently used) to load %s", victim, name)

    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    @staticmethod
    def _engine_adapters(loop: EngineLoop) -> set[str]:
        return loop.engine.adapters

    async def _sweep(self, loop: EngineLoop) -> None:
        """Delete the engine adapters no served name points at and no request runs under."""
        kept = {internal for internal, _ in self.served.values()}
        engine = loop.engine
        for internal in sorted(self._engine_adapters(loop) - kept):
            if not engine.adapter_in_use(internal):
                await self._held(loop, engine.unload_adapter, internal)
                self.sizes.pop(internal, None)

    async def _held(self, loop: EngineLoop, fn: Any, *args: Any) -> None:
        """``fn(*args)`` in a worker thread while the engine thread is held (no step in flight)."""
        run = asyncio.get_running_loop().run_in_executor
        try:
            if not await run(None, loop.hold, HOLD_TIMEOUT_S):
                raise APIError(503, f"the engine did not finish its step within {HOLD_TIMEOUT_S:.0f} s", None,
                               "engine_busy")  # fmt: skip
            try:
                await run(None, fn, *args)
            except (ValueError, OSError, NotImplementedError) as exc:
                raise APIError(400, f"loading the adapter failed: {exc}", "lora_path", "invalid_value") from None
            except RuntimeError as exc:
                raise APIError(409, str(exc), "lora_name", "adapter_in_use") from None
        finally:
            loop.release()


def _device(engine: Any) -> Any:
    return next(engine.model.parameters()).device
