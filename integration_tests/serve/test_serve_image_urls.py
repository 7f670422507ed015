"""Remote image URLs: refused unless their host is allowed (``--allowed-media-domains``); from a local HTTP
server on 127.0.0.1, allowed, the answer equals the data-URL answer; too large, redirected, missing or slow
images get 4xx within the fetch timeout."""

from __future__ import annotations

import http.server
import io
import threading
import time

import pytest

from hf_paged_attn.serve.cli import parse_args
from hf_paged_attn_tools.tiny_vlms import random_image, tiny_llava

from .test_serve_images import TEXT, chat, data_url, image_part, serve

FETCH_TIMEOUT = 1.0


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(seed, 20, 24).save(buffer, format="PNG")
    return buffer.getvalue()


class Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/cat.png":
            body = png(3)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/big.png":  # no Content-Length: the size limit must hold while reading
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\0" * (1 << 20))
        elif self.path == "/elsewhere.png":
            self.send_response(302)
            self.send_header("Location", "http://example.com/cat.png")
            self.end_headers()
        elif self.path == "/slow.png":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):  # a byte at a time: each read is quick, the whole is not
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def images_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def vlm():
    return tiny_llava()


def test_an_allowed_host_answers_as_the_data_url(vlm, images_url):
    from PIL import Image

    inline = data_url(Image.open(io.BytesIO(png(3))))

    async def scenario(client):
        remote = await client.post("/v1/chat/completions", json=chat(image_part(images_url + "/cat.png"), TEXT))
        local = await client.post("/v1/chat/completions", json=chat(image_part(inline), TEXT))
        return remote.json(), local.json()

    remote, local = serve(vlm, scenario, allowed_media_domains=("127.0.0.1",), image_fetch_timeout=FETCH_TIMEOUT)
    assert remote["choices"][0]["message"]["content"] == local["choices"][0]["message"]["content"]


def test_remote_urls_are_off_by_default(vlm, images_url):
    async def scenario(client):
        return await client.post("/v1/chat/completions", json=chat(image_part(images_url + "/cat.png"), TEXT))

    response = serve(vlm, scenario)
    assert response.status_code == 400 and "--allowed-media-domains" in response.json()["error"]["message"]


def test_bad_remote_images_get_4xx_in_time(vlm, images_url):
    cases = {"/big.png": 413, "/elsewhere.png": 400, "/missing.png": 400, "/slow.png": 400}

    async def scenario(client):
        out = {}
        for path in cases:
            start = time.monotonic()
            response = await client.post("/v1/chat/completions", json=chat(image_part(images_url + path), TEXT))
            out[path] = response.status_code, time.monotonic() - start
        other = await client.post("/v1/chat/completions", json=chat(image_part("http://localhost:1/x.png"), TEXT))
        return out, other.status_code

    out, other = serve(vlm, scenario, allowed_media_domains=("127.0.0.1",), image_fetch_timeout=FETCH_TIMEOUT,
                       max_image_bytes=64 << 10)  # fmt: skip
    assert {path: code for path, (code, _) in out.items()} == cases
    assert out["/slow.png"][1] < FETCH_TIMEOUT + 2.0  # cut off at the deadline, not after 4 s of dripping
    assert other == 400  # localhost is not 127.0.0.1: hosts match by name


def test_the_cli_takes_vllms_flags():
    args = parse_args(["m", "--allowed-media-domains", "a.example", "b.example", "--image-fetch-timeout", "2",
                       "--max-image-bytes", "1000"])  # fmt: skip
    assert args.allowed_media_domains == ["a.example", "b.example"]
    assert args.image_fetch_timeout == 2.0 and args.max_image_bytes == 1000
