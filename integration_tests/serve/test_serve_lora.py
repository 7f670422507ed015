"""LoRA adapters on the server, as vLLM serves them: ``--lora-modules``, ``model`` picking one, /v1/models,
/v1/load_lora_adapter (and ``load_inplace``) and /v1/unload_lora_adapter, ``--max-loras`` evicting the least
recently used adapter and reloading it when named, each answer against PEFT on sdpa."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("fastapi")

from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hf_paged_attn.demo import DEMO_MODEL  # noqa: E402
from hf_paged_attn_tools.launch import ServerProcess  # noqa: E402
from hf_paged_attn_tools.testing import save_random_lora  # noqa: E402

NEW = 6
PROMPT = [5, 300, 42, 17, 1000, 23, 7]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        "a": save_random_lora(DEMO_MODEL, tmp_path_factory.mktemp("a"), seed=1, std=0.2),
        "b": save_random_lora(
            DEMO_MODEL, tmp_path_factory.mktemp("b"), seed=2, std=0.2, r=4, target_modules=["k_proj", "o_proj"]
        ),  # fmt: skip
    }


@pytest.fixture(scope="module")
def reference(adapter_dirs):
    """Greedy tokens of PEFT on sdpa under an adapter (None: the base model)."""
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dirs["a"], adapter_name="a")
    model.load_adapter(adapter_dirs["b"], adapter_name="b")
    model.eval()

    def greedy(adapter: str | None) -> list[int]:
        ids = torch.tensor([PROMPT])
        names = ["__base__" if adapter is None else adapter]
        out = model.generate(ids, adapter_names=names, max_new_tokens=NEW, do_sample=False)
        return out[0, len(PROMPT) :].tolist()

    return greedy


@pytest.fixture(scope="module")
def server(adapter_dirs):
    args = ["--served-model-name", "demo", "--num-blocks", "64", "--lora-modules", f"a={adapter_dirs['a']}",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]  # fmt: skip
    with ServerProcess(DEMO_MODEL, args, env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc


def call(server, method: str, path: str, body=None) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def tokens(server, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    status, payload = call(server, "POST", "/v1/completions", body)
    assert status == 200, payload
    assert payload["model"] == model
    return payload["choices"][0]["token_ids"]


def test_adapters_are_served_as_models(server, reference, adapter_dirs):
    status, models = call(server, "GET", "/v1/models")
    assert status == 200
    cards = {card["id"]: card for card in models["data"]}
    assert set(cards) == {"demo", "a"} and cards["a"]["parent"] == "demo" and "parent" not in cards["demo"]
    assert tokens(server, "a") == reference("a")
    assert tokens(server, "demo") == reference(None)
    assert reference("a") != reference(None)  # the adapter is no no-op: the parity above means something
    status, payload = call(server, "POST", "/v1/completions", {"model": "c", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and payload["error"]["code"] == "model_not_found", payload


def test_load_inplace_and_unload(server, reference, adapter_dirs):
    status, text = call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapter_dirs["b"]})
    assert status == 200, text
    assert tokens(server, "b") == reference("b")
    # --max-loras 2: c's load evicts a (the least recently used, idle); naming a reloads it from its path
    status, text = call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapter_dirs["b"]})
    assert status == 200, text
    assert {card["id"] for card in call(server, "GET", "/v1/models")[1]["data"]} == {"demo", "a", "b", "c"}
    assert tokens(server, "a") == reference("a")
    assert tokens(server, "c") == reference("b")
    status, payload = call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapter_dirs["a"]})
    assert status == 400, payload  # loaded already, and load_inplace not asked for
    body = {"lora_name": "a", "lora_path": adapter_dirs["b"], "load_inplace": True}
    assert call(server, "POST", "/v1/load_lora_adapter", body)[0] == 200
    assert tokens(server, "a") == reference("b")  # a's new weights, b's K/V never reused (its own cache root)
    assert call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200
    status, payload = call(server, "POST", "/v1/completions", {"model": "b", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404, payload
    assert {card["id"] for card in call(server, "GET", "/v1/models")[1]["data"]} == {"demo", "a", "c"}
    assert tokens(server, "demo") == reference(None)
