"""vLLM's tokens-in, tokens-out routes as RL rollout clients (TRL's ``VLLMClient`` multimodal rollouts) use them:
``/v1/chat/completions/render`` makes the ``/inference/v1/generate`` body of a chat with an image, whose
greedy tokens equal sdpa's ``generate`` on the processor's inputs; a body a client could break gets 4xx."""

from __future__ import annotations

import base64
import copy

import pytest
import torch

from hf_paged_attn_tools.tiny_vlms import random_image, tiny_llava

from .test_serve_images import NAME, NEW, TEMPLATE, TEXT, chat, data_url, image_part, serve


@pytest.fixture(scope="module")
def vlm():
    return tiny_llava()


def sdpa_greedy(vlm, image) -> list[int]:
    rendered = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT["text"]}]}]
    text = vlm.processor.apply_chat_template(rendered, chat_template=TEMPLATE, add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    inputs = vlm.processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
    vlm.model.set_attn_implementation("sdpa")
    try:
        out = vlm.model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    finally:
        vlm.model.set_attn_implementation("paged")
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1] :].tolist()


def test_render_then_generate_equals_sdpa(vlm):
    image = random_image(7, 20, 24)
    body = chat(image_part(data_url(image)), TEXT) | {"logprobs": True, "top_logprobs": 2}

    async def scenario(client):
        rendered = (await client.post("/v1/chat/completions/render", json=body)).json()
        generated = (await client.post("/inference/v1/generate", json=rendered)).json()
        text_only = (await client.post("/v1/chat/completions/render", json=chat(TEXT))).json()
        return rendered, generated, text_only

    rendered, generated, text_only = serve(vlm, scenario)
    prompt, want = sdpa_greedy(vlm, image)
    assert rendered["token_ids"] == prompt
    assert rendered["sampling_params"] == {"n": 1, "temperature": 0.0, "max_tokens": NEW, "logprobs": 2}
    features = rendered["features"]
    first = prompt.index(vlm.model.config.image_token_index)
    assert features["mm_placeholders"] == {"image": [{"offset": first, "length": 16}]}
    assert len(features["mm_hashes"]["image"]) == 1 and len(features["kwargs_data"]["image"]) == 1
    choice = generated["choices"][0]
    assert choice["token_ids"] == want and choice["finish_reason"] == "length"
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in want]
    assert generated["usage"]["prompt_tokens"] == len(prompt)
    assert text_only["features"] is None and text_only["token_ids"]


def test_generate_from_token_ids_alone(vlm):
    """Text only, with vLLM's sampling fields (stop_token_ids: the stop token kept, finish_reason "stop")."""
    ids = vlm.tokenizer("user: hello\nassistant:")["input_ids"]

    async def scenario(client):
        body = {"token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 3, "skip_special_tokens": True}}
        first = (await client.post("/inference/v1/generate", json=body)).json()
        body["sampling_params"]["stop_token_ids"] = [first["choices"][0]["token_ids"][1]]  # vLLM's: kept, then stop
        return first, (await client.post("/inference/v1/generate", json=body)).json()

    answer, stopped = serve(vlm, scenario)
    with torch.no_grad():
        want = vlm.model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)[0, len(ids) :].tolist()
    assert answer["choices"][0]["token_ids"] == want and answer["choices"][0]["logprobs"] is None
    assert stopped["choices"][0]["token_ids"] == want[:2] and stopped["choices"][0]["finish_reason"] == "stop"


def _broken(rendered: dict) -> dict[str, tuple[dict, int]]:
    """Bodies a client could send, each with the status it must get."""

    def edit(fn) -> dict:
        body = copy.deepcopy(rendered)
        fn(body)
        return body

    features = rendered["features"]
    wrong_shape = base64.b64encode(_safetensors({"pixel_values": torch.zeros(1, 3, 64, 64)})).decode()
    return {
        "no sampling_params": (edit(lambda b: b.pop("sampling_params")), 400),
        "token id past the vocabulary": (edit(lambda b: b["token_ids"].append(10**6)), 400),
        "unknown sampling param": (edit(lambda b: b["sampling_params"].update(best_of_n=3)), 400),
        "stop_token_ids past the vocabulary": (edit(lambda b: b["sampling_params"].update(stop_token_ids=[10**6])),
                                               400),
        "prompt inside sampling_params": (edit(lambda b: b["sampling_params"].update(prompt=[1, 2])), 400),
        "stream": (edit(lambda b: b.update(stream=True)), 400),
        "kv_transfer_params": (edit(lambda b: b.update(kv_transfer_params={"x": 1})), 400),
        "image tokens without features": (edit(lambda b: b.update(features=None)), 400),
        "a video": (edit(lambda b: b["features"]["mm_hashes"].update(video=["00"])), 400),
        "kwargs_data null": (edit(lambda b: b["features"].update(kwargs_data=None)), 400),
        "not base64": (edit(lambda b: b["features"]["kwargs_data"].update(image=["@@"])), 400),
        "not safetensors": (edit(lambda b: b["features"]["kwargs_data"].update(image=["aGVsbG8="])), 400),
        "wrong pixel shape": (edit(lambda b: b["features"]["kwargs_data"].update(image=[wrong_shape])), 400),
        "wrong hash": (edit(lambda b: b["features"]["mm_hashes"].update(image=["ab" * 32])), 400),
        "wrong placeholder": (edit(lambda b: b["features"]["mm_placeholders"]["image"][0].update(offset=0)), 400),
        "two images for one": (edit(lambda b: [b["features"][k]["image"].append(features[k]["image"][0])
                                               for k in ("mm_hashes", "mm_placeholders", "kwargs_data")]), 400),
        "unknown model": (edit(lambda b: b.update(model="other")), 404),
    }


def _safetensors(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def test_broken_generate_bodies_get_4xx(vlm):
    body = chat(image_part(data_url(random_image(8))), TEXT)

    async def scenario(client):
        rendered = (await client.post("/v1/chat/completions/render", json=body)).json()
        cases = _broken(rendered)
        got = {name: (await client.post("/inference/v1/generate", json=b)).status_code
               for name, (b, _) in cases.items()}  # fmt: skip
        got["render with a schema"] = (await client.post("/v1/chat/completions/render", json=body | {
            "structured_outputs": {"regex": "[0-9]+"}})).status_code  # fmt: skip
        still = (await client.post("/inference/v1/generate", json=rendered)).status_code
        return got, {name: code for name, (_, code) in cases.items()} | {"render with a schema": 400}, still

    got, want, still = serve(vlm, scenario)
    assert got == want
    assert still == 200  # none of it hurt the server


def test_a_text_model_refuses_features():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
    from hf_paged_attn.demo import DEMO_MODEL

    from .asgi import run_in_app

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=torch.float32)
    engine = ContinuousBatchingEngine(model, PagedConfig(block_size=4, num_blocks=32))
    features = {"mm_hashes": {"image": ["00"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]},
                "kwargs_data": {"image": ["aGVsbG8="]}}  # fmt: skip

    async def scenario(client):
        body = {"token_ids": [3, 4], "features": features, "sampling_params": {"max_tokens": 2}}
        return (await client.post("/inference/v1/generate", json=body)).json()

    answer = run_in_app(engine, AutoTokenizer.from_pretrained(DEMO_MODEL), scenario, NAME, 30.0)
    assert answer["error"]["code"] == "unsupported_content"
