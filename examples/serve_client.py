"""Start ``hf-paged-attn serve`` on the bundled demo model, query it with the ``openai`` client, stop it.

    pip install "hf-paged-attn[serve]" openai
    python examples/serve_client.py

The server runs in a child process on 127.0.0.1 (a free port); the same calls work against
``hf-paged-attn serve MODEL`` started by hand (base_url http://127.0.0.1:8000/v1).
"""

from __future__ import annotations

import asyncio

import openai

from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn_tools.launch import ServerProcess


async def many(base_url: str, prompts: list[str]) -> list[str]:
    """Concurrent requests: the server batches them into the same engine steps."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none") as client:
        outs = await asyncio.gather(
            *(client.completions.create(model="demo", prompt=p, max_tokens=16, temperature=0) for p in prompts)
        )
    return [out.choices[0].text for out in outs]


def main() -> None:
    with ServerProcess(DEMO_MODEL, ["--served-model-name", "demo"]) as server:
        print(f"server ready at {server.url}")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

        out = client.completions.create(model="demo", prompt="A list is", max_tokens=20, temperature=0)
        print("completion:", repr(out.choices[0].text), out.usage)

        chat = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "What does the for statement do?"}], max_tokens=24
        )
        print("chat:", repr(chat.choices[0].message.content))

        print("stream:", end=" ", flush=True)
        for chunk in client.completions.create(model="demo", prompt="The with statement", max_tokens=24, stream=True):
            print(chunk.choices[0].text, end="", flush=True)
        print()

        prompts = ["The for statement", "A dictionary maps", "Strings are", "The import statement"]
        for prompt, text in zip(prompts, asyncio.run(many(server.url + "/v1", prompts))):
            print(f"{prompt!r} -> {text!r}")
    print("server stopped")


if __name__ == "__main__":
    main()
