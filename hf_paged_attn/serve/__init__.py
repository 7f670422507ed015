"""OpenAI-compatible HTTP server on the paged engine (``hf-paged-attn serve MODEL``).

Needs the ``serve`` extra: ``pip install "hf-paged-attn[serve]"`` (fastapi, uvicorn, prometheus-client).
``build_app(engine, tokenizer, ServeSettings(...))`` gives the FastAPI app for embedding; the command
line is :func:`hf_paged_attn.serve.cli.main`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeSettings", "build_app", "main"]


def __getattr__(name: str) -> Any:  # the heavy imports (fastapi, uvicorn) wait until they are used
    if name == "build_app":
        from .app import build_app

        return build_app
    if name == "ServeSettings":
        from .openai.handlers import ServeSettings

        return ServeSettings
    if name == "main":
        from .cli import main

        return main
    raise AttributeError(name)
