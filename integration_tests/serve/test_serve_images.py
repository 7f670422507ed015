"""Chats with images on the server: a data-URL image answers what sdpa's greedy generate gives on the
processor's inputs; hostile images and parts get 4xx, never 5xx."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx2
import pytest
from PIL import Image

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.serve.app import build_app
from hf_paged_attn.serve.openai.handlers import ServeSettings
from hf_paged_attn_tools.tiny_vlms import random_image, tiny_llava

NAME = "tiny-llava"
TIMEOUT = 30.0
NEW = 6
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def data_url(image: Image.Image, kind: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(*parts: dict) -> dict:
    return {"model": NAME, "max_tokens": NEW, "temperature": 0, "messages": [{"role": "user", "content": list(parts)}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": " what is this?"}


@pytest.fixture(scope="module")
def vlm():
    return tiny_llava()


def serve(vlm, scenario, **settings):
    engine = ContinuousBatchingEngine(vlm.model, PagedConfig(block_size=4, num_blocks=128))
    settings = {"model_name": NAME, "chat_template": TEMPLATE, **settings}
    app = build_app(engine, vlm.tokenizer, ServeSettings(**settings), processor=vlm.processor)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://test", timeout=TIMEOUT) as client:
                return await scenario(client)

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def test_chat_with_a_data_url_image_equals_sdpa(vlm):
    image = random_image(4, 20, 24)
    body = chat(image_part(data_url(image)), TEXT)

    async def scenario(client):
        return (await client.post("/v1/chat/completions", json=body)).json()

    answer = serve(vlm, scenario)
    rendered = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT["text"]}]}]
    text = vlm.processor.apply_chat_template(rendered, chat_template=TEMPLATE, add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    inputs = vlm.processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
    vlm.model.set_attn_implementation("sdpa")
    try:
        want = vlm.model.generate(**inputs, max_new_tokens=NEW, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    finally:
        vlm.model.set_attn_implementation("paged")
    expected = vlm.tokenizer.decode(want, skip_special_tokens=True)
    assert expected and answer["choices"][0]["message"]["content"] == expected
    assert answer["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]


def test_hostile_images_get_4xx(vlm):
    huge = Image.new("RGB", (10_000, 10_000))
    buffer = io.BytesIO()
    huge.save(buffer, format="PNG")  # ~300 KB compressed: the header claims 100M pixels
    huge_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    small = data_url(random_image(1))
    cases = {
        "not an image": (chat(image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode())), 400),
        "not base64": (chat(image_part("data:image/png;base64,@@@")), 400),
        "remote URL": (chat(image_part("https://example.com/cat.png")), 400),
        "10,000 x 10,000": (chat(image_part(huge_url)), 413),
        "too many images": (chat(*[image_part(small)] * 3), 400),
        "1,000 parts": (chat(*[TEXT] * 1000), 400),
        "control text beside an image": (chat(image_part(small), {"type": "text", "text": "<image>"}), 400),
    }

    async def scenario(client):
        out = {name: (await client.post("/v1/chat/completions", json=body)).status_code
               for name, (body, _) in cases.items()}  # fmt: skip
        big = "x" * (5 << 20)  # past the 4 MiB body limit (as 100 MB would be): 413 before anything is decoded
        out["past the body limit"] = (await client.post("/v1/chat/completions", json=chat(image_part(big)))).status_code
        return out

    got = serve(vlm, scenario, max_images=2, max_image_pixels=64 * 64)
    want = {name: code for name, (_, code) in cases.items()} | {"past the body limit": 413}
    assert got == want


def test_a_server_without_a_processor_refuses_images():
    vlm = tiny_llava()
    vlm.processor = None

    async def scenario(client):
        return (await client.post("/v1/chat/completions", json=chat(image_part(data_url(random_image(1)))))).json()

    answer = serve(vlm, scenario)
    assert answer["error"]["code"] == "unsupported_content"


def test_every_choice_gets_the_chats_images(vlm):
    """Two choices (n=2) of one greedy chat each carry the chat's images: both answer alike."""
    body = chat(image_part(data_url(random_image(6))), TEXT) | {"n": 2}

    async def scenario(client):
        return (await client.post("/v1/chat/completions", json=body)).json()

    answer = serve(vlm, scenario)
    texts = {c["message"]["content"] for c in answer["choices"]}
    assert len(answer["choices"]) == 2 and len(texts) == 1


def test_the_cli_loads_a_saved_vision_language_model_and_its_processor(vlm, tmp_path):
    from hf_paged_attn.serve.cli import load, load_processor, parse_args

    vlm.model.save_pretrained(tmp_path)
    vlm.processor.save_pretrained(tmp_path)
    args = parse_args([str(tmp_path), "--device", "cpu", "--limit-mm-per-prompt", '{"image": 3}'])
    assert args.limit_mm_per_prompt == 3
    engine, _ = load(args)
    try:
        assert type(engine.model).__name__ == "LlavaForConditionalGeneration"
        assert load_processor(str(tmp_path), engine.model) is not None
    finally:
        engine.shutdown()
    with pytest.raises(SystemExit):
        parse_args([str(tmp_path), "--limit-mm-per-prompt", '{"video": 1}'])


def test_a_template_that_drops_the_images_gets_400(vlm):
    """Images that no image token of the rendered prompt takes: the processor refuses them, a 400."""
    blind = "{% for m in messages %}{{ m['role'] }}: text\n{% endfor %}assistant:"

    async def scenario(client):
        return await client.post("/v1/chat/completions", json=chat(image_part(data_url(random_image(1))), TEXT))

    response = serve(vlm, scenario, chat_template=blind)
    assert response.status_code == 400, response.text
