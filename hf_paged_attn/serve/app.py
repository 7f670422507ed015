"""The FastAPI application: routes, API-key check, OpenAI-shaped errors, engine thread lifetime."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .engine_loop import EngineLoop
from .handlers import Handlers, ServeSettings, error_response
from .metrics import CONTENT_TYPE, ServeMetrics
from .protocol import APIError

logger = logging.getLogger("hf_paged_attn.serve")
STOP_TIMEOUT_S = 10.0  # for the engine thread to carry out the last aborts at shutdown


def build_app(engine: Any, tokenizer: Any, settings: ServeSettings) -> FastAPI:
    """An app serving ``engine`` (a ContinuousBatchingEngine) under ``settings.model_name``.

    The engine thread starts with the app's lifespan and stops with it; requests still running at
    shutdown (after uvicorn's graceful drain) are aborted.
    """
    metrics = ServeMetrics(lambda: loop.stats)
    loop = EngineLoop(engine, metrics)
    handlers = Handlers(loop, tokenizer, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            if not loop.stop(STOP_TIMEOUT_S):
                logger.warning("the engine thread did not stop within %.0f s", STOP_TIMEOUT_S)

    app = FastAPI(title="hf-paged-attn", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop = loop
    app.state.metrics = metrics

    def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')", None,
                           "invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        check_key(request)
        return handlers.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        check_key(request)
        return await handlers.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        check_key(request)
        return await handlers.chat(request)

    return app
