"""The LoRA adapters a server serves, as vLLM serves them: each a model name of its own.

``serve BASE --lora-modules a=PATH`` loads them at start; ``POST /v1/load_lora_adapter {"lora_name",
"lora_path", "load_inplace"}`` and ``POST /v1/unload_lora_adapter {"lora_name"}`` while serving. A request's
``model`` picks the base model or an adapter; ``/v1/models`` lists the adapters with ``parent`` the base.

A served name maps to the engine's adapter (``engine.load_adapter``). ``load_inplace`` loads the new
weights under a fresh engine name (``name@2``, ...) and points the served name at it: the requests already
running finish on the old adapter, and every later one runs the new, each with its own prefix-cache root.
An engine adapter no served name points at any more is deleted once no request runs under it (at the next
load or unload).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .control import _Body
from .engine_loop import EngineLoop
from .errors import APIError, short
from .fields import text

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
    """Served adapter names -> (engine adapter name, path); ``max_loras``, ``max_lora_rank``: None is no cap."""

    base_name: str
    max_loras: int | None = None
    max_lora_rank: int | None = None
    served: dict[str, tuple[str, str]] = field(default_factory=dict)
    _versions: itertools.count = field(default_factory=lambda: itertools.count(2))
    _lock: asyncio.Lock | None = None

    def check_new(self, name: str, path: str, replacing: bool) -> None:
        """APIError 400 for an adapter that may not be loaded as ``name``."""
        if name == self.base_name:
            raise APIError(400, f"{short(name)} is the base model's name", "lora_name", "invalid_value")
        if name in self.served and not replacing:
            raise APIError(400, f"adapter {short(name)} is loaded already (load_inplace: true replaces it)",
                           "lora_name", "invalid_value")  # fmt: skip
        if self.max_loras is not None and not replacing and len(self.served) >= self.max_loras:
            raise APIError(400, f"{len(self.served)} adapters are loaded, --max-loras {self.max_loras}: unload one "
                           "first", "lora_name", "max_loras")  # fmt: skip
        if not (Path(path) / "adapter_config.json").is_file():
            raise APIError(400, f"no PEFT adapter at {short(path)} (adapter_config.json)", "lora_path", "invalid_value")
        rank = adapter_rank(path)
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise APIError(400, f"adapter {short(name)} has rank {rank}, above --max-lora-rank {self.max_lora_rank}",
                           "lora_path", "max_lora_rank")  # fmt: skip

    def check_start(self, name: str, path: str) -> None:
        """``check_new`` of a ``--lora-modules`` adapter: ValueError naming what is wrong."""
        try:
            self.check_new(name, path, replacing=False)
        except APIError as exc:
            raise ValueError(f"--lora-modules {name}={path}: {exc.message}") from None

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

    # ----------------------------------------------------------------------------- while serving
    async def load(self, loop: EngineLoop, body: LoadAdapter) -> str:
        async with self._locked():
            name, path = body.lora_name, body.lora_path
            self.check_new(name, path, replacing=body.load_inplace and name in self.served)
            internal = name if name not in self.served else f"{name}@{next(self._versions)}"
            while internal in self._engine_adapters(loop):  # a name of an earlier load still in use
                internal = f"{name}@{next(self._versions)}"
            await self._held(loop, loop.engine.load_adapter, internal, path)
            self.served[name] = (internal, path)
            await self._sweep(loop)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, loop: EngineLoop, body: UnloadAdapter) -> str:
        async with self._locked():
            if self.served.pop(body.lora_name, None) is None:
                raise APIError(404, f"the adapter {short(body.lora_name)} is not loaded", "lora_name",
                               "model_not_found")  # fmt: skip
            await self._sweep(loop)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

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
