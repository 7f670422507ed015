"""The FastAPI application: routes, API-key check, OpenAI-shaped errors, engine thread lifetime.

Every route answers in OpenAI's error shape, whatever goes wrong: a client's mistake is a 4xx
naming the field (``param``), an unknown route 404, a wrong method 405 with ``Allow``; a bug is a
500 with ``Connection: close``, answered by the route itself so that the connection is closed
cleanly rather than reset under the client's next request. ``/openapi.json`` documents the request
bodies with the same pydantic models that validate them.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException

from .. import __version__
from .adapters import LoadAdapter, ServedAdapters, UnloadAdapter
from .control import Control, UpdateFromDisk, UpdateWeights, server_info, world_size
from .engine_loop import EngineLoop
from .errors import APIError, error_response
from .metrics import CONTENT_TYPE, ServeMetrics
from .openai.body import parse_json
from .openai.handlers import Handlers, ServeSettings
from .openai.protocol import ChatCompletionRequest, CompletionRequest, parse
from .openai.tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from .openai.tokens import GenerateRequest, TokenRoutes

logger = logging.getLogger("hf_paged_attn.serve")
STOP_TIMEOUT_S = 10.0  # for the engine thread to carry out the last aborts at shutdown
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def guarded(route: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
    """``route`` answering every exception itself: APIError in OpenAI's shape, anything else a 500."""

    @functools.wraps(route)
    async def wrapper(request: Request) -> Any:
        try:
            return await route(request)
        except APIError as exc:
            return error_response(exc)
        except Exception as exc:
            logger.exception("unhandled error on %s", request.url.path)
            return error_response(APIError(500, f"internal error: {type(exc).__name__}", None, "internal_error"))

    return wrapper


def build_app(
    engine: Any, tokenizer: Any, settings: ServeSettings, adapters: ServedAdapters | None = None, processor: Any = None
) -> FastAPI:
    """An app serving ``engine`` (a ContinuousBatchingEngine) under ``settings.model_name``, and its LoRA
    adapters (``adapters.py``) under theirs; ``processor``: a vision-language model's, for chats with images.

    The engine thread starts with the app's lifespan and stops with it; requests still running at
    shutdown (after uvicorn's graceful drain) are aborted. ``app.state.engine_loop.abort_all()``
    ends every open request now (a drain that ran out of time), each stream with an error event
    and ``data: [DONE]``.
    """
    metrics = ServeMetrics(lambda: loop.stats)
    loop = EngineLoop(engine, metrics)
    adapters = adapters or ServedAdapters(settings.model_name)
    handlers = Handlers(loop, tokenizer, settings, adapters, processor)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            if not loop.stop(STOP_TIMEOUT_S):
                logger.warning("the engine thread did not stop within %.0f s", STOP_TIMEOUT_S)
            handlers.close()

    app = FastAPI(title="hf-paged-attn", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
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
    async def api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(HTTPException)  # routing: 404, 405 (with its Allow header)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = HTTP_CODES.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), None, code, exc.headers))

    @app.exception_handler(Exception)  # a last resort: the routes answer their own errors (guarded)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", None, "internal_error"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    @guarded
    async def models(request: Request) -> Any:
        check_key(request)
        return handlers.models()

    @app.post("/v1/completions")
    @guarded
    async def completions(request: Request) -> Any:
        check_key(request)
        return await handlers.completions(request)

    @app.post("/v1/chat/completions")
    @guarded
    async def chat_completions(request: Request) -> Any:
        check_key(request)
        return await handlers.chat(request)

    tokens = TokenRoutes(handlers)

    @app.post("/v1/chat/completions/render")
    @guarded
    async def render_chat(request: Request) -> Any:
        check_key(request)
        return await tokens.render(request)

    @app.post("/inference/v1/generate")
    @guarded
    async def generate_tokens(request: Request) -> Any:
        check_key(request)
        return await tokens.generate(request)

    @app.post("/tokenize")
    @guarded
    async def tokenize(request: Request) -> Any:
        check_key(request)
        return await handlers.tokenize(request)

    @app.post("/detokenize")
    @guarded
    async def detokenize(request: Request) -> Any:
        check_key(request)
        return await handlers.detokenize(request)

    @app.get("/get_world_size")
    @guarded
    async def get_world_size(request: Request) -> Any:
        check_key(request)
        return {"world_size": world_size()}

    @app.get("/server_info")
    @guarded
    async def get_server_info(request: Request) -> Any:
        check_key(request)
        config_format = request.query_params.get("config_format", "json")
        if config_format != "json":
            raise APIError(400, f"config_format must be json, got {config_format!r}", "config_format")
        return server_info(engine, settings.model_name, handlers.context_length, __version__)

    if settings.rl_endpoints:
        add_control_routes(app, Control(loop), handlers, check_key)
    if settings.lora_updates:
        add_adapter_routes(app, loop, adapters, handlers, check_key)
    app.openapi = functools.partial(openapi_schema, app)  # type: ignore[method-assign]
    return app


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise APIError(400, f"{name} must be true or false, got {value[:64]!r}", name)
    return value.lower() in ("true", "1")


def add_adapter_routes(app: FastAPI, loop: EngineLoop, adapters: ServedAdapters, handlers: Handlers,
                       check_key: Callable[[Request], None]) -> None:  # fmt: skip
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``--enable-lora``), behind the API key;
    they answer plain text, as vLLM's do."""

    @app.post("/v1/load_lora_adapter")
    @guarded
    async def load_lora_adapter(request: Request) -> Any:
        check_key(request)
        body = parse(LoadAdapter, parse_json(await handlers._body(request)))
        return PlainTextResponse(await adapters.load(loop, body))

    @app.post("/v1/unload_lora_adapter")
    @guarded
    async def unload_lora_adapter(request: Request) -> Any:
        check_key(request)
        body = parse(UnloadAdapter, parse_json(await handlers._body(request)))
        return PlainTextResponse(await adapters.unload(loop, body))


def add_control_routes(app: FastAPI, control: Control, handlers: Handlers, check_key: Callable[[Request], None]
                       ) -> None:
    """The RL loop's routes (``control.py``), behind the API key: ``/pause``, ``/resume``, ``/is_paused``,
    ``/reset_prefix_cache``, ``/update_weights_from_disk`` (SGLang's), ``/update_weights`` (prime-rl's),
    ``/sleep``, ``/wake_up`` and ``/is_sleeping`` (vLLM's)."""
    handlers.admit = control.admit

    @app.post("/pause")
    @guarded
    async def pause(request: Request) -> Any:
        check_key(request)  # vLLM's defaults: abort what runs, drop the prefix cache
        return await control.pause(request.query_params.get("mode", "abort"), _flag(request, "clear_cache", True))

    @app.post("/resume")
    @guarded
    async def resume(request: Request) -> Any:
        check_key(request)
        return await control.resume()

    @app.get("/is_paused")
    @guarded
    async def is_paused(request: Request) -> Any:
        check_key(request)
        return {"is_paused": control.paused}

    @app.post("/sleep")
    @guarded
    async def sleep(request: Request) -> Any:
        check_key(request)
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise APIError(400, f"level must be 1 or 2, got {level[:64]!r}", "level")
        return await control.sleep(int(level))

    @app.post("/wake_up")
    @guarded
    async def wake_up(request: Request) -> Any:
        check_key(request)  # vLLM's: ?tags=weights&tags=kv_cache, none for everything
        tags = request.query_params.getlist("tags")
        return await control.wake_up(tags or None)

    @app.get("/is_sleeping")
    @guarded
    async def is_sleeping(request: Request) -> Any:
        check_key(request)
        return {"is_sleeping": control.sleeping}

    @app.post("/reset_prefix_cache")
    @guarded
    async def reset_prefix_cache(request: Request) -> Any:
        check_key(request)
        return await control.reset_prefix_cache()

    @app.post("/update_weights_from_disk")
    @guarded
    async def update_weights_from_disk(request: Request) -> Any:
        check_key(request)
        req = parse(UpdateFromDisk, parse_json(await handlers._body(request)))
        if not req.flush_cache:
            raise APIError(400, "flush_cache=false would serve K/V cached under the old weights; not supported",
                           "flush_cache", "unsupported_parameter")
        if req.load_format not in (None, "safetensors", "auto"):
            raise APIError(400, f"load_format {req.load_format!r}: only safetensors files load", "load_format",
                           "unsupported_parameter")
        if req.abort_all_requests:
            await control.pause("abort", True)
            try:
                return await control.load(req.model_path)
            finally:
                await control.resume()
        return await control.load(req.model_path)

    @app.post("/update_weights")
    @guarded
    async def update_weights(request: Request) -> Any:
        check_key(request)
        req = parse(UpdateWeights, parse_json(await handlers._body(request)))
        if req.update_info is not None or req.weight_dir is None:
            raise APIError(400, "this server loads weights from a directory ({\"weight_dir\": PATH}); vLLM's NCCL "
                           "weight transfer (update_info) is not available", "update_info", "unsupported_parameter")
        return await control.load(req.weight_dir)


COMPLETION_ANSWER = {"description": "the completion (JSON), or server-sent events ending with data: [DONE] when "
                     "stream is true", "content": {"application/json": {"schema": {"type": "object"}},
                                                   "text/event-stream": {"schema": {"type": "string"}}}}
# Each POST route: the models its body may be (one of), and its answer.
REQUEST_MODELS: dict[str, tuple[tuple[type, ...], dict[str, Any]]] = {
    "/v1/completions": ((CompletionRequest,), COMPLETION_ANSWER),
    "/v1/chat/completions": ((ChatCompletionRequest,), COMPLETION_ANSWER),
    "/v1/chat/completions/render": ((ChatCompletionRequest,), {
        "description": "vLLM's GenerateRequest for /inference/v1/generate: {request_id, token_ids, features, "
                       "sampling_params, model, ...}",
        "content": {"application/json": {"schema": {"type": "object"}}}}),
    "/inference/v1/generate": ((GenerateRequest,), {
        "description": "{request_id, choices: [{index, token_ids, logprobs, finish_reason}], prompt_logprobs, usage}",
        "content": {"application/json": {"schema": {"type": "object"}}}}),
    "/tokenize": ((TokenizeCompletionRequest, TokenizeChatRequest), {
        "description": '{"count", "max_model_len", "tokens", "token_strs"}: the prompt\'s token ids (a chat\'s: '
                       'those /v1/chat/completions would run)', "content": {"application/json": {"schema": {
                           "type": "object"}}}}),
    "/detokenize": ((DetokenizeRequest,), {
        "description": '{"prompt"}: the ids decoded, special tokens kept',
        "content": {"application/json": {"schema": {"type": "object"}}}}),
}
ERROR_STATUSES = {
    "400": "invalid request (the message names the problem, param the field)", "401": "missing or wrong API key",
    "408": "the body did not arrive in time", "413": "the body is larger than --max-body-bytes",
    "415": "the body is not application/json", "429": "the queue is full; retry later",
    "500": "internal error", "503": "shutting down",
}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
        },
    }},
}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus what it cannot see (the routes read their bodies themselves, to keep
    our limits and error format): the request bodies, from the models that validate them, and the
    error responses."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_SCHEMA
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, (models, answer) in REQUEST_MODELS.items():
        refs = []
        for model in models:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}}}
        operation["responses"] = {
            "200": answer, **{status: {"description": text, **error} for status, text in ERROR_STATUSES.items()},
        }
    app.openapi_schema = schema
    return schema
