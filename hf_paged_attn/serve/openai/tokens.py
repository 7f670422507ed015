"""Tokens in, tokens out, as vLLM's disaggregated routes: ``POST /v1/chat/completions/render`` turns a chat request
into the body of ``POST /inference/v1/generate`` that runs it (the prompt's ``token_ids``, its images'
``features``, its ``sampling_params``), and ``/inference/v1/generate`` answers each choice's generated
``token_ids`` (logprobs named ``token_id:<id>``: this route decodes nothing). RL rollout clients (TRL's
``VLLMClient`` multimodal rollouts) render once and generate from the tokens, so the tokens the policy saw are
the ones it trains on. Both routes run under the API key and, with ``--enable-rl-endpoints``, wait while paused.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from ... import MultimodalInputs
from ..errors import APIError, json_response
from .body import parse_json
from .features import Features, generate_inputs, render_features
from .fields import text
from .images import image_prompt
from .protocol import MAX_PROMPT_TOKENS, CompletionRequest, TokenId, parse

if TYPE_CHECKING:
    from .handlers import Handlers

# The chat request's sampling fields that render copies into ``sampling_params`` (vLLM's SamplingParams names).
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "logit_bias")  # fmt: skip
# SamplingParams fields that shape only the text, which /inference/v1/generate does not return: accepted, unused.
TEXT_ONLY = ("detokenize", "skip_special_tokens", "spaces_between_special_tokens")
# CompletionRequest fields that are not sampling params: a sampling_params naming one is refused.
NOT_SAMPLING = ("model", "prompt", "echo", "stream", "stream_options", "suffix", "best_of", "user", "return_token_ids",
                "return_tokens_as_token_ids")  # fmt: skip
MAX_STOP_IDS = 256
PROBE_PIXELS = (90, 150, 200)  # the colour of the probe image (all-zero pixels would read as padding: Idefics3)


class GenerateRequest(BaseModel):
    """vLLM's ``GenerateRequest``; the fields it has that this engine cannot honour are refused when set."""

    model_config = ConfigDict(extra="forbid", strict=True)
    request_id: text(256) | None = None
    token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    features: Features | None = None
    sampling_params: dict[text(64), Any]
    model: text(4096) | None = None
    stream: bool = False
    cache_salt: text(256) | None = None
    priority: int = 0
    kv_transfer_params: dict[text(64), Any] | None = None

    def unsupported_options(self) -> list[str]:
        bad = [name for name, off in (("stream", False), ("cache_salt", None), ("priority", 0),
                                      ("kv_transfer_params", None)) if getattr(self, name) != off]  # fmt: skip
        return bad + [f"sampling_params.{k}" for k in self.sampling_params if k in NOT_SAMPLING]

    def check_fields(self) -> None:
        pass

    def check(self, limits: Any) -> None:
        pass


class TokenRoutes:
    """The two routes, on the chat handlers' machinery (validation, jobs, the engine loop)."""

    def __init__(self, handlers: Handlers) -> None:
        self.h = handlers
        self._probe: dict[str, Any] | None = None  # one image's processor outputs: what features must look like

    async def render(self, request: Request) -> Any:
        return json_response(await self.h._off_loop(self._render, await self.h._body(request)))

    async def generate(self, request: Request) -> Any:
        from .handlers import _chat_logprobs, _collect, _usage, _vllm_prompt_logprobs

        req, sampling, limit, images = await self.h._off_loop(self._prepare, await self.h._body(request))
        async with self.h.adapters.using(self.h.loop, sampling.model):
            job = self.h._job(sampling, [req.token_ids], [limit], sampling.logprobs, prompt_param="token_ids",
                              prompt_logprobs=sampling.prompt_logprobs)  # fmt: skip
            job.engine_kwargs.update(images)
            stop_ids = req.sampling_params.get("stop_token_ids")
            if stop_ids:  # vLLM's: these end the output as EOS does (finish_reason "stop"), min_tokens holding them
                config = job.engine_kwargs.get("generation_config") or self.h._generation_config({})
                eos = config.eos_token_id
                config.eos_token_id = sorted({*([eos] if isinstance(eos, int) else eos or []), *stop_ids})
                job.engine_kwargs["generation_config"] = config
            run = await self.h._start(job)
        events = await _collect(run, request)
        choices, scored = [], []
        for choice in job.choices:
            mine = [e for e in events if e.choice is choice]
            scored = scored or next((e.prompt_logprobs for e in mine if e.prompt_logprobs is not None), [])
            entries = [lp for e in mine for lp in e.logprobs]
            choices.append({"index": choice.index, "finish_reason": choice.finish_reason,
                            "logprobs": _chat_logprobs(entries, True) if sampling.logprobs is not None else None,
                            "token_ids": list(choice.text.ids)})  # fmt: skip
        prompt_logprobs = (_vllm_prompt_logprobs(scored, sampling.prompt_logprobs)
                           if sampling.prompt_logprobs is not None else None)  # fmt: skip
        return json_response({"request_id": req.request_id or f"generate-tokens-{uuid.uuid4().hex}",
                              "choices": choices, "prompt_logprobs": prompt_logprobs, "kv_transfer_params": None,
                              "usage": _usage(job)})  # fmt: skip

    # ----------------------------------------------------------------------------- in the thread pool
    def _render(self, data: bytes) -> dict[str, Any]:
        req, prompt, structure, images = self.h._prepare_chat(data)
        if structure[0] is not None:
            raise APIError(400, f"{structure[1]}: constrained outputs are not carried into render's sampling_params",
                           structure[1], "unsupported_parameter")  # fmt: skip
        params = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
        if req.stop_list():
            params["stop"] = req.stop_list()
        if req.ignore_eos:
            params["ignore_eos"] = True
        if req.token_limit() is not None:
            params["max_tokens"] = req.token_limit()
        if req.logprobs:
            params["logprobs"] = req.top_logprobs or 0
        features = render_features(self.h.loop.engine.model, prompt, images) if images else None
        return {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "token_ids": prompt, "features": features,
                "sampling_params": params, "model": req.model, "stream": False, "cache_salt": None, "priority": 0,
                "kv_transfer_params": None}  # fmt: skip

    def _prepare(self, data: bytes) -> tuple[GenerateRequest, CompletionRequest, int, dict[str, Any]]:
        req: GenerateRequest = parse(GenerateRequest, parse_json(data))
        params = {k: v for k, v in req.sampling_params.items() if k not in TEXT_ONLY and k != "stop_token_ids"}
        self._check_stop_ids(req.sampling_params.get("stop_token_ids"), bool(params.get("ignore_eos")))
        body = {"model": req.model or self.h.settings.model_name, **params, "prompt": req.token_ids}
        try:
            sampling: CompletionRequest = parse(CompletionRequest, body, self.h.limits)
        except APIError as exc:
            param = "token_ids" if exc.param == "prompt" else f"sampling_params.{exc.param}" if exc.param else None
            raise APIError(exc.status, f"sampling_params: {exc.message}", param, exc.code) from None
        self.h._check_model(sampling.model)
        limit = sampling.max_tokens
        if "max_tokens" not in params or limit is None:  # vLLM's default: the generation config's, or the context
            rest = self.h.context_length - len(req.token_ids)
            limit = min(self.h.generation_config.max_new_tokens or rest, rest) if rest > 0 else 1
        images: dict[str, Any] = {}
        token_id = MultimodalInputs.image_token(self.h.loop.engine.model)
        if req.features is None and token_id is not None and token_id in req.token_ids:
            raise APIError(400, f"token_ids hold image tokens ({token_id}) but no features carry their images",
                           "features", "invalid_features")  # fmt: skip
        if req.features is not None:
            settings = self.h.settings
            images = generate_inputs(self.h.loop.engine.model, req.token_ids, req.features, self._image_probe(),
                                     settings.max_images, settings.max_image_pixels)  # fmt: skip
        return req, sampling, limit, images

    def _check_stop_ids(self, ids: Any, ignore_eos: bool) -> None:
        if ids is None:
            return
        vocab = self.h.limits.vocab_size
        if not isinstance(ids, list) or len(ids) > MAX_STOP_IDS or not all(
                type(t) is int and 0 <= t < vocab for t in ids):  # fmt: skip
            raise APIError(400, f"sampling_params.stop_token_ids must be at most {MAX_STOP_IDS} token ids in [0, "
                           f"{vocab})", "sampling_params.stop_token_ids", "invalid_value")  # fmt: skip
        if ids and ignore_eos:  # the engine's ignore_eos would ignore them too, where vLLM's stops on them
            raise APIError(400, "stop_token_ids cannot be combined with ignore_eos on this server",
                           "sampling_params.stop_token_ids", "unsupported_parameter")  # fmt: skip

    def _image_probe(self) -> dict[str, Any]:
        """One probe image's processor outputs, as the processor lays out an image of a chat."""
        if self._probe is not None:
            return self._probe
        processor = self.h.processor
        if processor is None:
            raise APIError(400, "this model takes no images (it has no image processor)", "features",
                           "unsupported_content")  # fmt: skip
        template = self.h.image_template()
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " ."}]}]
        image = Image.new("RGB", (32, 32), PROBE_PIXELS)
        prompt, inputs = image_prompt(processor, template, messages, [image], [])
        self._probe = MultimodalInputs.split(self.h.loop.engine.model, [prompt], inputs)[0][0].inputs
        return self._probe
