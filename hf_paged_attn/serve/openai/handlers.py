"""``/v1/completions`` and ``/v1/chat/completions``: request → Job → JSON or server-sent events.

Decisions that differ from OpenAI (documented in docs/serving.md): sampling fields a request
leaves out come from the model's ``generation_config`` (as ``transformers serve`` does), so the
demo model is greedy unless ``temperature`` > 0 is asked for; chat's default ``max_tokens`` is
the generation config's ``max_new_tokens`` (or the rest of the context).

Structured outputs (``response_format``, vLLM's ``structured_outputs``, a forced tool call) are the
engine's: the request carries a spec, the engine compiles it in ``add_request``. That call (a compile
takes ms to seconds) runs in a worker thread, never on the event loop, and a spec the engine refuses
is a 400 before anything is queued. With ``tools`` (and ``tool_choice`` other than ``none``) the
output is parsed for tool calls in the model's format (``tool_parser``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.util
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from transformers import GenerationConfig

from ... import SamplingParams
from ..adapters import ServedAdapters
from ..engine_loop import EngineLoop
from ..errors import APIError, dumps, json_response
from ..jobs import ChoiceEvent, Job, JobRun, TokenInfo
from ..limits import CHARS_PER_TOKEN, DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, TOKENIZER_THREADS, RequestLimits
from ..outputs.tool_parser import FORMATS, ToolCallFormat, ToolCallStream, detect_format, parse_tool_calls
from ..outputs.tools import NamedToolChoice, forced_grammar, template_tools
from .body import check_content_type, parse_json, read_body
from .chat import chat_prompt_ids, control_strings
from .images import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    MediaLimits,
    decode_image,
    image_prompt,
)
from .protocol import ChatCompletionRequest, CompletionRequest, parse
from .tokenization import (
    DetokenizeRequest,
    TokenizeChatRequest,
    parse_tokenize,
    special_tokens_around,
    tokenize_answer,
)

logger = logging.getLogger("hf_paged_attn.serve")
Structure = tuple[dict[str, Any] | None, str | None]  # (the engine's structured spec, the field it comes from)


@dataclass
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_queue: int = 512  # engine requests (choices) admitted at once, running + waiting; more get 429
    chat_template: str | None = None  # overrides the tokenizer's
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger POST body gets 413
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT_S  # seconds for a POST body to arrive; then 408
    max_prompt_chars: int | None = None  # characters of a prompt (chat: all messages); None: CHARS_PER_TOKEN x context
    tool_call_parser: str = "auto"  # the tool-call format: hermes, llama3, or auto (from the chat template)
    # the RL control routes (weights, pause, prefix cache) and request chat templates; off by default
    rl_endpoints: bool = False
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (--enable-lora); off by default: they read paths on disk
    lora_updates: bool = False
    max_images: int = DEFAULT_MAX_IMAGES  # images in one chat request (more: 400)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height of one image (more: 413)
    # hosts whose http(s) image URLs are fetched (vLLM's --allowed-media-domains); none: data: URLs only
    allowed_media_domains: tuple[str, ...] = ()
    image_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S  # seconds for one fetched image, all of it
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # of one fetched image (more: 413)

    def __post_init__(self) -> None:
        if self.tool_call_parser not in ("auto", *FORMATS):
            raise ValueError(f"tool_call_parser must be auto, {', '.join(FORMATS)}; got {self.tool_call_parser!r}")
        self.allowed_media_domains = tuple(d.lower() for d in self.allowed_media_domains)
        if not self.image_fetch_timeout > 0:
            raise ValueError(f"image_fetch_timeout must be > 0, got {self.image_fetch_timeout}")
        for name in ("max_queue", "max_body_bytes", "max_image_pixels", "max_image_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1 or None, got {self.max_prompt_chars}")
        if self.body_timeout is not None and not self.body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0 or None, got {self.body_timeout}")


    @property
    def media(self) -> MediaLimits:
        return MediaLimits(self.max_image_pixels, self.allowed_media_domains, self.image_fetch_timeout,
                           self.max_image_bytes)


class Handlers:
    """The two POST endpoints. Everything a request costs before the engine (JSON, validation,
    tokenizing, the chat template) runs in a small thread pool, never on the event loop: /health
    and the streams of other requests go on while a long prompt is tokenized (the Rust tokenizer
    releases the GIL)."""

    def __init__(self, loop: EngineLoop, tokenizer: Any, settings: ServeSettings,
                 adapters: ServedAdapters | None = None, processor: Any = None) -> None:  # fmt: skip
        self.loop = loop
        self.adapters = adapters or ServedAdapters(settings.model_name)
        self.tokenizer = tokenizer
        self.processor = processor  # a vision-language model's: chats with images (serve/openai/images.py)
        self.settings = settings
        engine = loop.engine
        self.generation_config: GenerationConfig = engine.generation_config
        text_config = engine.model.config.get_text_config()
        self.context_length = int(engine.max_position_embeddings or tokenizer.model_max_length)
        self.limits = RequestLimits(
            vocab_size=int(getattr(text_config, "vocab_size", None) or len(tokenizer)),
            max_prompt_chars=settings.max_prompt_chars or CHARS_PER_TOKEN * self.context_length,
            max_choices=settings.max_queue,
        )
        self.engine_options = engine_options(engine.add_request)
        self.structured_ok = "structured" in self.engine_options and importlib.util.find_spec("llguidance") is not None
        template = settings.chat_template or getattr(tokenizer, "chat_template", None)
        self.tool_format: ToolCallFormat = detect_format(template if isinstance(template, str) else None,
                                                         settings.tool_call_parser)
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        self.marker_ids = {m: added[m] for m in (self.tool_format.start, self.tool_format.end) if m and m in added}
        tokenizer("warm up", add_special_tokens=False)  # its first call may set state; later calls only read it
        self.special_tokens = special_tokens_around(tokenizer)  # what /tokenize's add_special_tokens adds to a chat
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="hf-paged-tokenize")
        # Grammars compile here once the engine has its grammar compiler: the first constrained request
        # builds it from the tokenizer (~1 s for a large vocabulary), so that one runs in the tokenizer's
        # thread; after it, a compile (which releases the GIL) holds up no tokenizing.
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="hf-paged-grammar")
        self._grammars_ready = False
        # set by the app with the RL control routes: 503 while asleep, waits while paused
        self.admit: Callable[[], Awaitable[None]] | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _body(self, request: Request) -> bytes:
        check_content_type(request)
        return await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout)

    # ----------------------------------------------------------------------------- endpoints
    async def completions(self, request: Request) -> Any:
        req, prompts, texts = await self._off_loop(self._prepare_completion, await self._body(request))
        limit = req.max_tokens if req.max_tokens is not None else 16  # an explicit null: OpenAI's default
        async with self.adapters.using(self.loop, req.model):  # an evicted adapter loads again
            job = self._job(req, prompts, [limit] * len(prompts), req.logprobs, structure=req.structured(),
                            prompt_logprobs=req.num_prompt_logprobs())  # fmt: skip
            run = await self._start(job)
        echo = texts if req.echo else [""] * len(prompts)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
        if req.stream:
            return _sse(_completion_chunks(run, meta, echo, StreamUsage.of(req), bool(req.return_tokens_as_token_ids)))
        events = await _collect(run, request)
        choices = []
        as_ids = bool(req.return_tokens_as_token_ids)
        for choice in job.choices:
            mine = [e for e in events if e.choice is choice]
            text = "".join(e.text for e in mine)
            scored = next((e.prompt_logprobs for e in mine if e.prompt_logprobs is not None), [])
            echoed = [_top_cut(e, req.logprobs) for e in scored] if req.echo and req.logprobs is not None else []
            logprobs = _completion_logprobs([lp for e in mine for lp in e.logprobs], len(echo[choice.prompt_index]),
                                            echoed, as_ids)  # fmt: skip
            answer = {"index": choice.index, "text": echo[choice.prompt_index] + text,
                      "logprobs": logprobs if req.logprobs is not None else None,
                      "finish_reason": choice.finish_reason}
            if req.prompt_logprobs is not None:
                answer["prompt_logprobs"] = _vllm_prompt_logprobs(scored, req.prompt_logprobs)
            if req.return_token_ids:
                answer["prompt_token_ids"] = prompts[choice.prompt_index]
                answer["token_ids"] = list(choice.text.ids)
            choices.append(answer)
        return json_response({**meta, "object": "text_completion", "choices": choices, "usage": _usage(job)})

    async def chat(self, request: Request) -> Any:
        req, prompt, structure, images = await self._off_loop(self._prepare_chat, await self._body(request))
        limit = req.token_limit()
        if limit is None:  # the generation config's max_new_tokens, raised to min_tokens, within the context
            rest = self.context_length - len(prompt)
            wanted = max(self.generation_config.max_new_tokens or rest, req.min_tokens or 0)
            limit = min(wanted, rest) if rest > 0 else 1
        top = (req.top_logprobs or 0) if req.logprobs else None
        async with self.adapters.using(self.loop, req.model):
            job = self._job(req, [prompt], [limit], top, prompt_param="messages", structure=structure)
            job.engine_kwargs.update(images)  # pixel_values, ...: every choice's request gets the chat's images
            run = await self._start(job)
        tools = self.tool_format if req.parses_tool_calls() else None
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
        if req.stream:
            return _sse(_chat_chunks(run, meta, StreamUsage.of(req), tools, bool(req.return_tokens_as_token_ids)))
        events = await _collect(run, request)
        choices = []
        for choice in job.choices:
            mine = [e for e in events if e.choice is choice]
            logprobs = (_chat_logprobs([lp for e in mine for lp in e.logprobs], bool(req.return_tokens_as_token_ids))
                        if req.logprobs else None)
            message: dict[str, Any] = {"role": "assistant", "content": "".join(e.text for e in mine)}
            finish = choice.finish_reason
            if tools is not None:
                content, calls = parse_tool_calls(tools, message["content"])
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = "tool_calls" if finish == "stop" else finish
            answer = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish, "message": message}
            if req.return_token_ids:
                answer["token_ids"] = list(choice.text.ids)
            choices.append(answer)
        ids = {"prompt_token_ids": prompt} if req.return_token_ids else {}
        return json_response({**meta, "object": "chat.completion", "choices": choices, "usage": _usage(job), **ids})

    async def tokenize(self, request: Request) -> Any:
        return json_response(await self._off_loop(self._tokenize, await self._body(request)))

    async def detokenize(self, request: Request) -> Any:
        return json_response(await self._off_loop(self._detokenize, await self._body(request)))

    def models(self) -> dict[str, Any]:
        card = {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "hf-paged-attn"}
        return {"object": "list", "data": [card, *self.adapters.cards()]}

    # ----------------------------------------------------------------------------- in the thread pool
    def _prepare_completion(self, data: bytes) -> tuple[CompletionRequest, list[list[int]], list[str]]:
        req: CompletionRequest = parse(CompletionRequest, parse_json(data), self.limits)
        self._check_model(req.model)
        prompts, texts = self._completion_prompts(req.prompts())
        return req, prompts, texts

    def _prepare_chat(self, data: bytes) -> tuple[ChatCompletionRequest, list[int], Structure, dict[str, Any]]:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, parse_json(data), self.limits)
        self._check_model(req.model)
        urls = [url for m in req.messages for url in m.image_urls()]
        if not urls:
            return req, self._chat_prompt(req), self._chat_structure(req), {}
        prompt, images = self._image_chat_prompt(req, urls)
        return req, prompt, self._chat_structure(req), images

    def _image_chat_prompt(self, req: ChatCompletionRequest, urls: list[str]) -> tuple[list[int], dict[str, Any]]:
        """The prompt ids and image inputs of a chat with images (``serve/openai/images.py``)."""
        if self.processor is None:
            raise APIError(400, "this model takes no images (it has no image processor)", "messages",
                           "unsupported_content")  # fmt: skip
        if len(urls) > self.settings.max_images:
            raise APIError(400, f"a request may hold at most {self.settings.max_images} images; this one has "
                           f"{len(urls)}", "messages", "too_many_images")  # fmt: skip
        template = self.image_template()
        images = [decode_image(url, self.settings.media) for url in urls]
        messages = [m.for_template() for m in req.messages]
        return image_prompt(self.processor, template, messages, images, control_strings(self.tokenizer))

    def image_template(self) -> str:
        """The chat template of chats with images: the server's, else the processor's, else the tokenizer's."""
        template = self.settings.chat_template or getattr(self.processor, "chat_template", None)
        template = template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, "this model has no chat template; start the server with --chat-template FILE",
                           "messages", "no_chat_template")
        return template

    def _tokenize(self, data: bytes) -> dict[str, Any]:
        req = parse_tokenize(parse_json(data), self.limits)
        if req.model is not None:
            self._check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = self._chat_prompt(req, req.add_generation_prompt)  # what /v1/chat/completions would run
            if req.add_special_tokens:
                prefix, suffix = self.special_tokens
                ids = prefix + ids + suffix
        else:
            ids = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return tokenize_answer(self.tokenizer, ids, self.context_length, req.return_token_strs)

    def _detokenize(self, data: bytes) -> dict[str, Any]:
        req: DetokenizeRequest = parse(DetokenizeRequest, parse_json(data), self.limits)
        if req.model is not None:
            self._check_model(req.model)
        return {"prompt": self.tokenizer.decode(req.tokens)}  # special tokens kept, as vLLM answers

    def _chat_structure(self, req: ChatCompletionRequest) -> Structure:
        """(the engine's spec, the field it comes from): a forced tool call's grammar, or the request's own."""
        if not req.forced_tool_call():
            return req.structured()
        assert req.tools is not None
        name = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
        parallel = req.parallel_tool_calls is not False  # OpenAI's default: true
        grammar = forced_grammar(self.tool_format, req.tools, name, parallel, self.marker_ids)
        return {"grammar": grammar}, "tools"

    # ----------------------------------------------------------------------------- building jobs
    def _check_model(self, name: str) -> str | None:
        """The engine adapter of model ``name`` (None: the base model); 404 ``model_not_found`` for a model
        not served here, as vLLM and OpenAI answer."""
        return self.adapters.engine_adapter(name)

    def _completion_prompts(self, prompts: list[str] | list[list[int]]) -> tuple[list[list[int]], list[str]]:
        """Token ids and text of each prompt (validated: non-empty strings or in-vocabulary ids)."""
        ids, texts = [], []
        for p in prompts:
            if isinstance(p, str):
                ids.append(self.tokenizer(p)["input_ids"])
                texts.append(p)
            else:
                ids.append(list(p))
                texts.append(self.tokenizer.decode(p, skip_special_tokens=True))
        return ids, texts

    def _chat_prompt(
        self, req: ChatCompletionRequest | TokenizeChatRequest, generation_prompt: bool = True
    ) -> list[int]:
        own = getattr(req, "chat_template", None)
        if own is not None and not self.settings.rl_endpoints:
            raise APIError(400, "this server takes no chat_template from requests (a template is code the server "
                           "runs); start it with --enable-rl-endpoints to allow them", "chat_template",
                           "unsupported_parameter")
        template = own or self.settings.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, "this model has no chat template; start the server with --chat-template FILE",
                           "messages", "no_chat_template")
        messages = [m.for_template() for m in req.messages]
        tools = template_tools(req.tools) if req.tools else None
        # control-token text in a message stays text
        return chat_prompt_ids(self.tokenizer, messages, template, tools, generation_prompt,
                               getattr(req, "chat_template_kwargs", None))

    def _job(self, req: Any, prompts: list[list[int]], limits: list[int], top_logprobs: int | None,
             prompt_param: str = "prompt", structure: Structure = (None, None),
             prompt_logprobs: int | None = None) -> Job:
        """``limits``: each prompt's max_tokens as the client asked (0: echo only, Job.echo_only)."""
        echo_only = 0 in limits
        for prompt, limit in zip(prompts, limits):
            if echo_only and len(prompt) >= self.context_length:  # the engine still computes one position past it
                raise APIError(400, f"with max_tokens=0 a prompt may have at most {self.context_length - 1} tokens "
                               f"(this model's context is {self.context_length}); it has {len(prompt)}", prompt_param,
                               "context_length_exceeded")  # fmt: skip
            if len(prompt) + limit > self.context_length:
                raise APIError(
                    400, f"this model's maximum context length is {self.context_length} tokens; the request asks "
                    f"for {len(prompt) + limit} ({len(prompt)} in the prompt, {limit} to generate)",
                    prompt_param if len(prompt) >= self.context_length else "max_tokens", "context_length_exceeded",
                )
            if (req.min_tokens or 0) > limit:
                raise APIError(400, f"min_tokens={req.min_tokens} is more than max_tokens={limit}", "min_tokens",
                               "invalid_value")
        kwargs: dict[str, Any] = {}
        adapter = self._check_model(req.model)  # the served adapter's engine name now (a load_inplace moves it)
        if adapter is not None:
            kwargs["adapter_name"] = adapter
        changes = self._sampling_changes(req)
        if changes:
            kwargs["generation_config"] = self._generation_config(changes)
        # else the engine's own config serves as it is: a copy, and the engine merging it with the model's
        # defaults, cost ~0.2 ms of the event loop per request, which a burst of arrivals waits on.
        # Stop sequences are ours alone (text.IncrementalText, stops.StopMatcher): the engine's
        # stop_strings would build transformers' vocabulary x length table per distinct string.
        options = (("logprobs", top_logprobs), ("seed", req.seed), ("ignore_eos", req.ignore_eos or None),
                   ("prompt_logprobs", prompt_logprobs))
        for name, value in options:
            if value is None:
                continue
            if name not in self.engine_options:
                raise APIError(400, f"{name} is not supported by this version of hf_paged_attn's engine", name,
                               "unsupported_parameter")
            kwargs[name] = value
        spec, param = structure
        if spec is not None and req.ignore_eos:
            raise APIError(400, f"ignore_eos cannot be combined with {param}: a constrained output ends where its "
                           "grammar does, at EOS", "ignore_eos", "invalid_value")
        if spec is not None:
            if not self.structured_ok:
                raise APIError(400, f"{param}: structured outputs are not available on this server (they need the "
                               "'structured' extra: pip install 'hf-paged-attn[structured]')", param,
                               "unsupported_parameter")
            kwargs.update(structured=spec, tokenizer=self.tokenizer)
        # max_tokens=0 (with echo): the engine samples once after any prompt; that token is dropped
        engine_limits = [max(limit, 1) for limit in limits]
        return Job(prompts, req.n, engine_limits, req.stop_list(), kwargs, want_logprobs=top_logprobs is not None,
                   structured_param=param, min_tokens=req.min_tokens or 0, echo_only=echo_only)

    def _sampling_changes(self, req: Any) -> dict[str, Any]:
        """The generation-config fields the request sets to something other than the engine's."""
        wanted: dict[str, Any] = {"num_return_sequences": 1}  # n is n engine requests
        if req.temperature is not None:
            wanted["do_sample"] = req.temperature > 0
            if wanted["do_sample"]:
                wanted["temperature"] = req.temperature
        if req.top_p is not None:
            wanted["top_p"] = req.top_p
        if req.top_k is not None:  # vLLM's 0 and -1 are off: transformers adds no top-k processor for 0
            wanted["top_k"] = max(req.top_k, 0)
        if req.min_p is not None:  # vLLM's 0 is off: no min-p processor
            wanted["min_p"] = req.min_p or None
        if req.min_tokens is not None:  # transformers' MinNewTokensLengthLogitsProcessor suppresses EOS
            wanted["min_new_tokens"] = req.min_tokens or None
        if req.logit_bias:  # logit_bias and OpenAI's penalties: read by the engine's processor plan (openai_options)
            wanted["logit_bias"] = req.token_bias()
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if getattr(req, name) is not None:
                wanted[name] = getattr(req, name)
        base = self.generation_config
        return {k: v for k, v in wanted.items() if _setting(base, k) != v}

    def _generation_config(self, changes: dict[str, Any]) -> GenerationConfig:
        config = copy.deepcopy(self.generation_config)
        for name, value in changes.items():
            setattr(config, name, value)
        config.num_return_sequences = 1
        return config

    async def _start(self, job: Job) -> JobRun:
        if self.admit is not None:  # asleep: 503; paused by /pause: the request runs after /resume
            await self.admit()
        num_new = len(job.prompts) * job.n
        if self.loop.num_unfinished + num_new > self.settings.max_queue:
            raise APIError(429, f"the server's queue is full ({self.settings.max_queue} requests); retry later",
                           None, "queue_full")
        run = JobRun(job, self.loop, self.tokenizer)
        if "structured" not in job.engine_kwargs:
            run.submit()  # ~0.2 ms: on the event loop, no thread hop
            return run
        # The engine compiles the grammar inside add_request: off the event loop (see __init__ for which thread).
        pool = self._grammar_pool if self._grammars_ready else self._pool
        future = asyncio.get_running_loop().run_in_executor(pool, run.submit)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:  # our caller went away: what was queued must not run unheard
            future.add_done_callback(lambda _: run.abort())
            raise
        self._grammars_ready = True
        return run


# What an unset (None) generation-config field means, where it is a value a request can name.
# Not top_k: an unset top_k is transformers' default of 50 at generate, so vLLM's 0 (off) must be sent as 0.
NEUTRAL = {"num_return_sequences": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def _setting(config: GenerationConfig, name: str) -> Any:
    value = getattr(config, name, None)
    return NEUTRAL.get(name) if value is None else value


# --------------------------------------------------------------------------------- responses
async def _collect(run: JobRun, request: Request) -> list[ChoiceEvent]:
    """Every event of ``run``; if the client disconnects first, abort it (no response to send)."""

    async def consume() -> list[ChoiceEvent]:
        return [event async for event in run.events()]

    task = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client left (or we are cancelled): stop generating for it
            task.cancel()
            run.abort()
    if not task.done():
        raise APIError(499, "client disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(job: Job) -> dict[str, int]:
    prompt, completion = job.num_prompt_tokens, job.num_completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """What a stream says of its usage (``stream_options``): ``final``, a last chunk with the usage and no
    choices; ``continuous``, the usage so far (all of the request's choices) on every chunk."""

    final: bool = False
    continuous: bool = False

    @staticmethod
    def of(req: Any) -> StreamUsage:
        options = req.stream_options
        return StreamUsage(options.include_usage, options.continuous_usage_stats) if options else StreamUsage()

    def chunk(self, job: Job) -> dict[str, Any]:
        """The usage field of a chunk with choices: the usage so far, null (OpenAI's), or none at all."""
        if self.continuous:
            return {"usage": _usage(job)}
        return {"usage": None} if self.final else {}


def _completion_logprobs(entries: list[TokenInfo], shift: int, prompt: Sequence[TokenInfo] = (),
                         as_ids: bool = False) -> dict[str, Any]:
    """The legacy ``logprobs`` object: the ``prompt``'s tokens first (echo with logprobs; the first
    one's log-probability and alternatives are null), then the generated ``entries``, their offsets
    shifted by the ``shift`` characters of the echoed prompt, or with a scored prompt by its
    tokens' texts (equal unless a character is split across tokens, each piece shown as U+FFFD).
    ``as_ids`` (vLLM's ``return_tokens_as_token_ids``): tokens named ``"token_id:<id>"``."""
    both = [*prompt, *entries]
    if prompt:  # offsets count the tokens' own texts throughout (vLLM's), so they never run backwards
        shift = prompt[-1].end
    return {
        "tokens": [_name(e, as_ids) for e in both],
        "token_logprobs": [e.logprob for e in both],
        "top_logprobs": [dict(_top(e, as_ids)) if e.top is not None else None for e in both],
        "text_offset": [e.offset for e in prompt] + [shift + e.offset for e in entries],
    }


def _name(entry: TokenInfo, as_ids: bool) -> str:
    return f"token_id:{entry.token_id}" if as_ids else entry.text


def _top(entry: TokenInfo, as_ids: bool) -> list[tuple[str, float]]:
    if not as_ids or entry.top is None:
        return entry.top or []
    return [(f"token_id:{i}", lp) for i, (_, lp) in zip(entry.top_ids or [], entry.top)]


def _top_cut(entry: TokenInfo, k: int) -> TokenInfo:
    """``entry`` with its first ``k`` alternatives (a prompt scored for more than echo's ``logprobs``)."""
    if entry.top is None or len(entry.top) <= k:
        return entry
    return dataclasses.replace(entry, top=entry.top[:k], top_ids=(entry.top_ids or [])[:k])


def _vllm_prompt_logprobs(scored: Sequence[TokenInfo], k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position, ``{token id: {logprob, rank, decoded_token}}`` for the
    ``k`` likeliest tokens and the prompt's own token; null for the first position (nothing precedes it)."""
    positions: list[dict[str, dict[str, Any]] | None] = []
    for e in scored:
        if e.logprob is None:
            positions.append(None)
            continue
        entry = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.text}}
        for rank, (token_id, (text, lp)) in enumerate(zip(e.top_ids or [], (e.top or [])[:k]), start=1):
            if token_id != e.token_id:
                entry[str(token_id)] = {"logprob": lp, "rank": rank, "decoded_token": text}
        positions.append(entry)
    return positions


def _chat_logprobs(entries: list[TokenInfo], as_ids: bool = False) -> dict[str, Any]:
    content = []
    for e in entries:
        top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in _top(e, as_ids)]
        name = _name(e, as_ids)
        content.append({"token": name, "logprob": e.logprob, "bytes": list(name.encode()), "top_logprobs": top})
    return {"content": content, "refusal": None}


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {dumps(chunk)}\n\n"
        except APIError as exc:  # headers are sent: the error goes in the stream, as OpenAI does
            yield f"data: {dumps(exc.body())}\n\n"
        except Exception as exc:  # a bug, not the client's fault: still a well-formed end of stream
            logger.exception("a stream failed")
            yield f"data: {dumps(APIError(500, f'internal error: {type(exc).__name__}').body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _completion_chunks(
    run: JobRun, meta: dict[str, Any], echo: list[str], usage: StreamUsage, as_ids: bool = False
) -> AsyncIterator[dict[str, Any]]:
    base = {**meta, "object": "text_completion"}
    scored = "prompt_logprobs" in run.job.engine_kwargs  # the echo waits for its log-probabilities
    for choice in run.job.choices:
        if echo[choice.prompt_index] and not scored:
            yield {**base, "choices": [{"index": choice.index, "text": echo[choice.prompt_index], "logprobs": None,
                                        "finish_reason": None}], **usage.chunk(run.job)}
    async for event in run.events():
        if event.prompt_logprobs is not None:  # the choice's first event: its echo, with the prompt's logprobs
            echoed = {"index": event.choice.index, "text": echo[event.choice.prompt_index],
                      "logprobs": _completion_logprobs([], 0, event.prompt_logprobs, as_ids), "finish_reason": None}
            yield {**base, "choices": [echoed], **usage.chunk(run.job)}
        if not (event.text or event.logprobs or event.finish_reason):
            continue
        prompt_chars = event.choice.prompt_chars  # with a scored prompt, offsets count its tokens' texts
        shift = prompt_chars if prompt_chars is not None else len(echo[event.choice.prompt_index])
        logprobs = _completion_logprobs(event.logprobs, shift, (), as_ids) if run.job.want_logprobs else None
        choice = {"index": event.choice.index, "text": event.text, "logprobs": logprobs,
                  "finish_reason": event.finish_reason}
        yield {**base, "choices": [choice], **usage.chunk(run.job)}
    if usage.final:
        yield {**base, "choices": [], "usage": _usage(run.job)}


async def _chat_chunks(
    run: JobRun, meta: dict[str, Any], usage: StreamUsage, tools: ToolCallFormat | None = None, as_ids: bool = False
) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed chat; with ``tools``, tool calls as OpenAI streams them."""
    base = {**meta, "object": "chat.completion.chunk"}
    parsers = {choice.index: ToolCallStream(tools) for choice in run.job.choices} if tools is not None else {}
    for choice in run.job.choices:
        first = {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
        yield {**base, "choices": [first], **usage.chunk(run.job)}
    async for event in run.events():
        if not (event.text or event.logprobs or event.finish_reason):
            continue
        deltas: list[dict[str, Any]] = [{"content": event.text} if event.text else {}]
        finish = event.finish_reason
        parser = parsers.get(event.choice.index)
        if parser is not None:  # one chunk per tool-call delta (a call's first one apart), as OpenAI sends them
            found = parser.feed(event.text, final=finish is not None)
            deltas = [{"content": found.content}] if found.content else []
            deltas = deltas + [{"tool_calls": [call]} for call in found.tool_calls] or [{}]
            if parser.num_calls and finish == "stop":
                finish = "tool_calls"
            if not (deltas[0] or event.logprobs or finish):
                continue
        logprobs = _chat_logprobs(event.logprobs, as_ids) if run.job.want_logprobs else None
        for i, delta in enumerate(deltas):
            choice = {"index": event.choice.index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                      "finish_reason": finish if i == len(deltas) - 1 else None}
            yield {**base, "choices": [choice], **usage.chunk(run.job)}
    if usage.final:
        yield {**base, "choices": [], "usage": _usage(run.job)}


def engine_options(add_request: Callable[..., str]) -> set[str]:
    """The options an engine's ``add_request`` takes: its parameters, and ``SamplingParams``' fields where it
    takes those (as keywords beside ``params``); an older engine's are its parameters alone."""
    names = set(inspect.signature(add_request).parameters)
    return names | {f.name for f in dataclasses.fields(SamplingParams)} if "params" in names else names
