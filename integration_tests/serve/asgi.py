"""The app in process: ``build_app`` on an engine, its lifespan running, an httpx client over ASGI."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2

from hf_paged_attn.serve.app import build_app
from hf_paged_attn.serve.openai.handlers import ServeSettings


def run_in_app(
    engine: Any, tokenizer: Any, scenario: Callable[[httpx2.AsyncClient], Awaitable[Any]], name: str,
    timeout: float, **settings: Any,
) -> Any:
    """``scenario(client)``'s result against the app serving ``engine`` as ``name``, every wait within ``timeout``."""

    async def main() -> Any:
        app = build_app(engine, tokenizer, ServeSettings(model_name=name, **settings))
        async with app.router.lifespan_context(app):
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://test", timeout=timeout) as client:
                return await scenario(client)

    return asyncio.run(asyncio.wait_for(main(), timeout))
