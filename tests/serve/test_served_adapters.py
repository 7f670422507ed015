"""The server's resident adapters (``serve/adapters.py``) against a stand-in engine: ``--max-loras`` as vLLM's
LRU (evict the least recently used idle adapter, reload an evicted one from its path, 400 only when every
resident adapter has requests) and ``--max-lora-memory`` (a load past it evicts, or gets 400 naming the sizes)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("peft")

from peft import LoraConfig  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from hf_paged_attn.serve import adapters as served_adapters  # noqa: E402
from hf_paged_attn.serve.adapters import LoadAdapter, ServedAdapters, adapter_bytes  # noqa: E402
from hf_paged_attn.serve.errors import APIError  # noqa: E402


class FakeEngine:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 2)
        self.adapters: set[str] = set()
        self.busy: set[str] = set()  # adapters with a request running
        self.loads: list[str] = []

    def load_adapter(self, name: str, path: str) -> None:
        assert name not in self.adapters
        self.adapters.add(name)
        self.loads.append(path)

    def unload_adapter(self, name: str) -> None:
        assert name not in self.busy, "a running request's adapter was evicted"
        self.adapters.remove(name)

    def adapter_in_use(self, name: str) -> bool:
        return name in self.busy


class FakeLoop:
    def __init__(self) -> None:
        self.engine = FakeEngine()

    def hold(self, timeout: float) -> bool:
        return True

    def release(self) -> None:
        pass


def make_adapter(directory, r: int = 4, width: int = 64) -> str:
    LoraConfig(r=r, target_modules=["q_proj"]).save_pretrained(str(directory))
    save_file({"a.lora_A.weight": torch.zeros(r, width, dtype=torch.float16),
               "a.lora_B.weight": torch.zeros(width, r, dtype=torch.float16)},
              str(directory / "adapter_model.safetensors"))  # fmt: skip
    return str(directory)


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    return {name: make_adapter(tmp_path / name) for name in "abcd"}


def load(served: ServedAdapters, loop: FakeLoop, name: str, path: str) -> None:
    asyncio.run(served.load(loop, LoadAdapter(lora_name=name, lora_path=path)))


def use(served: ServedAdapters, loop: FakeLoop, model: str) -> str | None:
    """What a request naming ``model`` runs under, as the handlers resolve it."""

    async def resolve() -> str | None:
        async with served.using(loop, model) as adapter:
            return adapter

    return asyncio.run(resolve())


def test_adapter_bytes_count_float32_weights(paths):
    assert adapter_bytes(paths["a"]) == 4 * (4 * 64 + 64 * 4)  # saved in float16, held in float32 by PEFT


def test_max_loras_evicts_the_least_recently_used_idle_adapter_and_reloads_it(paths):
    loop, served = FakeLoop(), ServedAdapters("base", max_loras=2)
    load(served, loop, "a", paths["a"])
    load(served, loop, "b", paths["b"])
    use(served, loop, "a")  # b is now the least recently used
    load(served, loop, "c", paths["c"])
    assert sorted(served.resident(loop)) == ["a", "c"] and "b" in served.served  # b evicted, still served
    internal = use(served, loop, "b")  # named again: reloaded from its path, evicting a (LRU now)
    assert internal in loop.engine.adapters and internal != "b"  # a fresh engine name: its own prefix-cache root
    assert loop.engine.loads[-1] == paths["b"] and sorted(served.resident(loop)) == ["b", "c"]
    assert {card["id"] for card in served.cards()} == {"a", "b", "c"}
    assert use(served, loop, "base") is None


def test_max_loras_refuses_only_when_every_resident_adapter_runs(paths):
    loop, served = FakeLoop(), ServedAdapters("base", max_loras=2)
    load(served, loop, "a", paths["a"])
    load(served, loop, "b", paths["b"])
    loop.engine.busy = {"a"}  # a is the least recently used, but has a request running: b goes instead
    load(served, loop, "c", paths["c"])
    assert sorted(served.resident(loop)) == ["a", "c"]
    loop.engine.busy = {"a", "c"}
    with pytest.raises(APIError) as info:
        load(served, loop, "d", paths["d"])
    assert info.value.status == 400 and info.value.code == "max_loras" and "--max-loras 2" in info.value.message
    assert "d" not in served.served
    with pytest.raises(APIError) as info:  # an evicted adapter named while every slot is busy: the same answer
        use(served, loop, "b")
    assert info.value.code == "max_loras"
    loop.engine.busy = set()
    assert use(served, loop, "b") in loop.engine.adapters


def test_max_lora_memory_evicts_then_refuses_naming_the_sizes(paths, tmp_path):
    size = adapter_bytes(paths["a"])
    loop, served = FakeLoop(), ServedAdapters("base", max_lora_memory=2 * size)
    load(served, loop, "a", paths["a"])
    load(served, loop, "b", paths["b"])
    load(served, loop, "c", paths["c"])  # past the memory: a (least recently used, idle) evicted
    assert sorted(served.resident(loop)) == ["b", "c"]
    loop.engine.busy = {served.served["b"][0], served.served["c"][0]}
    with pytest.raises(APIError) as info:
        load(served, loop, "d", paths["d"])
    assert info.value.status == 400 and info.value.code == "max_lora_memory"
    assert "--max-lora-memory" in info.value.message and "KiB" in info.value.message
    big = make_adapter(tmp_path / "big", r=64)
    with pytest.raises(APIError) as info:  # larger than the whole cap: refused before anything is evicted
        load(served, loop, "big", big)
    assert info.value.code == "max_lora_memory" and sorted(served.resident(loop)) == ["b", "c"]


def test_a_load_past_the_free_memory_gets_400_naming_it(paths, monkeypatch):
    loop, served = FakeLoop(), ServedAdapters("base")
    monkeypatch.setattr(served_adapters, "free_memory", lambda device: adapter_bytes(paths["a"]) - 1)
    with pytest.raises(APIError) as info:
        load(served, loop, "a", paths["a"])
    assert info.value.code == "max_lora_memory" and "free" in info.value.message
    assert not loop.engine.adapters


def test_start_loads_what_fits_and_serves_the_rest_on_demand(paths):
    loop, served = FakeLoop(), ServedAdapters("base", max_loras=2)
    resident = served.start([("a", paths["a"]), ("b", paths["b"]), ("c", paths["c"])])
    assert resident == [("a", paths["a"]), ("b", paths["b"])] and set(served.served) == {"a", "b", "c"}
    loop.engine.adapters = {"a", "b"}  # what the server loads before the engine starts
    assert use(served, loop, "c") in loop.engine.adapters and sorted(served.resident(loop)) == ["b", "c"]
