"""``hf-paged-attn serve MODEL``: an OpenAI-compatible HTTP server on the paged engine.

    hf-paged-attn serve Qwen/Qwen2.5-0.5B-Instruct --port 8000
    python -m hf_paged_attn.serve path/to/model --api-key secret --max-num-seqs 32

It logs one line when ready, ``ready: http://HOST:PORT``. SIGTERM or SIGINT stop accepting
connections, let running requests finish (at most --drain-timeout seconds; then every open request
is aborted, each stream ended with an error event and ``data: [DONE]``) and exit 0.

Limits on what one client can cost (413, 408, 400 past them) and on connections are flags below; for
TLS, authentication beyond one key, per-client rate limits and slow clients (partial headers), put a
reverse proxy in front (docs/serving.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import PagedConfig, SpeculativeConfig
from .._env import freeze_heap
from .limits import CHARS_PER_TOKEN, DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DRAIN_GRACE_S, MAX_HEADER_BYTES
from .openai.images import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
)

logger = logging.getLogger("hf_paged_attn.serve")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="hf-paged-attn serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="hub id or local path of a causal LM")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (the ready line names it)")
    p.add_argument("--api-key", default=os.environ.get("HF_PAGED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $HF_PAGED_API_KEY; none: open)")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL as given)")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="a Jinja chat template to use instead of the tokenizer's")
    p.add_argument("--tool-call-parser", choices=("auto", "hermes", "llama3"), default="auto",
                   help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>, Qwen), llama3 "
                        "({\"name\": ..., \"parameters\": ...}), or auto: read from the chat template (default)")
    p.add_argument("--enable-rl-endpoints", action="store_true",
                   help="the RL loop's control routes (/pause, /resume, /is_paused, /reset_prefix_cache, "
                        "/update_weights_from_disk, /update_weights, /sleep, /wake_up, /is_sleeping) and "
                        "chat_template in requests; behind --api-key")
    p.add_argument("--max-queue", type=int, default=512,
                   help="most requests (choices) in the engine at once, running and waiting; more get HTTP 429")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to let running requests finish on SIGTERM/SIGINT before aborting them")
    lim = p.add_argument_group("limits per request and connection")
    lim.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help="largest POST body; larger ones get 413 (default: %(default)s = 4 MiB)")
    lim.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                     help="seconds a POST body may take to arrive; then 408 (default: %(default)s; 0: no limit)")
    lim.add_argument("--max-prompt-chars", type=int,
                     help=f"most characters in a prompt (chat: all messages), checked before tokenizing "
                          f"(default: {CHARS_PER_TOKEN} x the model's context length)")
    lim.add_argument("--limit-mm-per-prompt", type=_image_limit, default=DEFAULT_MAX_IMAGES, metavar="N",
                     help="most images in one chat request, more get 400: N or vLLM's JSON '{\"image\": N}' "
                          "(default: %(default)s; 0: no images)")
    lim.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                     help="largest image (width x height) in a chat request; larger ones get 413 "
                          "(default: %(default)s)")
    lim.add_argument("--allowed-media-domains", nargs="+", metavar="HOST", default=[],
                     help="hosts whose http(s):// image URLs the server fetches (vLLM's flag; default: none, only "
                          "data: URLs); no redirects are followed")
    lim.add_argument("--image-fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT_S, metavar="S",
                     help="seconds to fetch one image URL, all of it; then 400 (default: %(default)s)")
    lim.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                     help="largest fetched image in bytes; larger ones get 413 (default: %(default)s = 16 MiB)")
    lim.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto",
                     help="uvicorn's HTTP parser: httptools (auto, when installed) is faster; h11 caps request "
                          f"headers at {MAX_HEADER_BYTES // 1024} KiB (431 past it), httptools has no cap")
    lim.add_argument("--timeout-keep-alive", type=float, default=5.0,
                     help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    lim.add_argument("--limit-concurrency", type=int,
                     help="most connections and requests at once; more get 503 from uvicorn "
                          "(default: 2 x --max-queue + 64; 0: no limit)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--tp-plan", choices=("auto",),
                   help="tensor parallel over the ranks of a torchrun launch (from_pretrained(tp_plan=...)): "
                        "rank 0 serves, the other ranks run its steps on their shards")
    lo = p.add_argument_group("LoRA adapters (docs/lora.md; the [lora] extra)")
    lo.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                    help="PEFT LoRA adapters served as models of their own (or vLLM's JSON form "
                         "'{\"name\": ..., \"path\": ...}'); requests pick one with \"model\": NAME")
    lo.add_argument("--enable-lora", action="store_true",
                    help="LoRA adapters, and POST /v1/load_lora_adapter and /v1/unload_lora_adapter while serving "
                         "(they read paths on this machine's disk; behind --api-key)")
    lo.add_argument("--max-loras", type=int, help="most adapters resident at once; loading another evicts the least "
                    "recently used idle one (reloaded from its path when named again), 400 when all have requests")
    lo.add_argument("--max-lora-memory", type=float, metavar="GIB",
                    help="most GiB of adapter weights resident at once (float32, as PEFT keeps them), evicting as "
                    "--max-loras does; every load is also checked against the device's free memory")
    lo.add_argument("--max-lora-rank", type=int, help="largest adapter rank loaded; a larger one gets 400")
    g = p.add_argument_group("paged engine (PagedConfig)")
    g.add_argument("--block-size", type=int)
    g.add_argument("--num-blocks", type=int)
    g.add_argument("--memory-fraction", type=float)
    g.add_argument("--kv-cache-memory-bytes", type=int, metavar="N",
                   help="the KV cache's size in bytes (vLLM's flag), instead of --memory-fraction")
    g.add_argument("--kv-cache-dtype", metavar="DTYPE",
                   help="auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2 or int8: one byte per K/V element, "
                        "twice a bf16 cache's tokens; check the model first (docs/kv_cache.md)")
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-batch-tokens", type=int)
    g.add_argument("--kernel")
    g.add_argument("--scheduling-policy")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-compile", action="store_true",
                   help="eager forwards: no torch.compile of the model on the CPU before the server listens "
                        "(PagedConfig(compile=False); by default it compiles first, PagedConfig(compile='startup'))")
    g.add_argument("--logprobs-mode", choices=("processed_logprobs", "raw_logprobs"),
                   help="vLLM's: the log-probabilities of sampled tokens after the request's processors, temperature "
                        "and truncation (processed_logprobs, the default), or of the model's raw logits")
    g.add_argument("--speculative", metavar="SPEC",
                   help="speculative decoding: ngram:K (prompt lookup, K tokens a step; ngram:K:N matches up to "
                        "N-grams) or, with --draft-model, draft:K")
    g.add_argument("--draft-model", metavar="PATH", help="a draft model with the model's vocabulary (hub id or path)")
    args = p.parse_args(argv)
    if args.max_queue < 1:
        p.error(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.drain_timeout < 0:
        p.error(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    for name in ("max_body_bytes", "max_prompt_chars"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("body_timeout", "timeout_keep_alive"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.limit_concurrency is None:
        args.limit_concurrency = 2 * args.max_queue + 64
    elif args.limit_concurrency < 0:
        p.error(f"--limit-concurrency must be >= 0, got {args.limit_concurrency}")
    for name in ("max_loras", "max_lora_rank"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_lora_memory is not None and args.max_lora_memory <= 0:
        p.error(f"--max-lora-memory must be > 0, got {args.max_lora_memory}")
    if args.speculative and args.speculative.startswith("ngram") == bool(args.draft_model):
        p.error(f"--speculative {args.speculative}: ngram:K goes without --draft-model, draft:K with it")
    return args


def _image_limit(value: str) -> int:
    """``--limit-mm-per-prompt``: an int, or vLLM's JSON ``{"image": N}``."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and set(parsed) <= {"image"}:
        parsed = parsed.get("image", 0)
    if isinstance(parsed, bool) or not isinstance(parsed, int) or parsed < 0:
        raise argparse.ArgumentTypeError(f"expected N >= 0 or {{\"image\": N}}, got {value!r}")
    return parsed


def load_processor(path: str, model: Any) -> Any:
    """The processor of a vision-language model at ``path`` (chats with images), or None: a text model,
    or a processor that does not load (a warning says why; chats with images then get 400)."""
    from .. import MultimodalInputs

    if not MultimodalInputs.takes_images(model):
        return None
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except Exception as exc:  # e.g. a processor that needs torchvision
        logging.getLogger("hf_paged_attn.serve").warning("no image processor for %s (%s): chats with images get "
                                                         "400", path, exc)  # fmt: skip
        return None


def paged_config(args: argparse.Namespace) -> PagedConfig:
    """The PagedConfig the flags describe (ValueError naming a bad field)."""
    names = ("block_size", "num_blocks", "memory_fraction", "kv_cache_memory_bytes", "kv_cache_dtype", "max_num_seqs",
             "max_batch_tokens", "kernel", "scheduling_policy", "logprobs_mode")
    fields = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.no_prefix_caching:
        fields["enable_prefix_caching"] = False
    if args.no_compile:
        fields["compile"] = False
    if args.speculative and not args.draft_model:
        fields["speculative"] = SpeculativeConfig.parse(args.speculative)
    # A LoRA server runs eagerly: its adapters load and unload while it serves (LRU, load_inplace every RL step),
    # and each change makes the compiled forward compile again (lora_rows.py); CUDA graphs can't run adapters.
    if lora_enabled(args):
        fields.update(compile=False, cuda_graphs=False)
    return PagedConfig().replace(**fields)


def compiled_at_startup(config: PagedConfig, device: Any) -> PagedConfig:
    """A server compiles where ``compile=None`` would, but before it listens (``compile="startup"``): no request
    then runs eagerly, nor beside a background compile that shares its cores (passes up to 7x slower on 2)."""
    if config.compile is None and device.type == "cpu" and config.resolved(device).compile:
        return config.replace(compile="startup")
    return config


def lora_enabled(args: argparse.Namespace) -> bool:
    return bool(args.enable_lora or args.lora_modules)


def served_adapters(args: argparse.Namespace) -> tuple[Any, list[tuple[str, str]]]:
    """(the server's ``ServedAdapters``, the ``--lora-modules`` as (name, path)), ValueError naming a bad one."""
    from .adapters import ServedAdapters, parse_lora_module

    memory = None if args.max_lora_memory is None else int(args.max_lora_memory * 2**30)
    adapters = ServedAdapters(args.served_model_name or args.model, args.max_loras, args.max_lora_rank, memory)
    return adapters, [parse_lora_module(spec) for spec in args.lora_modules]


def speculative_config(args: argparse.Namespace, draft: Any) -> SpeculativeConfig:
    """The ``--draft-model`` speculation (``--speculative draft:K``, else the default K)."""
    if args.speculative:
        return SpeculativeConfig.parse(args.speculative, draft)
    return SpeculativeConfig(draft_model=draft)


def load(args: argparse.Namespace, adapters: Any = None, modules: Sequence[tuple[str, str]] = ()) -> tuple[Any, Any]:
    """(paged engine, tokenizer) for ``args.model``, with the LoRA adapters ``modules`` loaded (and recorded in
    ``adapters``, a ``ServedAdapters``) before the engine sizes its cache, so their weights count against the
    memory. With ``--tp-plan`` on a rank other than 0: runs rank 0's steps until its server stops, then returns
    (None, None)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_paged_attn  # noqa: F401  registers attn_implementation="paged"

    from .. import ContinuousBatchingEngine
    from ..parallel import is_driver, serve_worker

    config = paged_config(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = compiled_at_startup(config, torch.device(device))
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    sharded = {"tp_plan": args.tp_plan} if args.tp_plan else {}  # transformers places each rank's shard
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="paged", dtype=dtype, **sharded)
    except ValueError:  # a vision-language model with no causal-LM mapping (LLaVA, Qwen2-VL, ...)
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(args.model, attn_implementation="paged", dtype=dtype,
                                                            **sharded)  # fmt: skip
    model = (model if sharded else model.to(device)).eval()
    if not is_driver(model):
        serve_worker(model)
        return None, None
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.draft_model:
        draft = AutoModelForCausalLM.from_pretrained(args.draft_model, attn_implementation="paged", dtype=dtype)
        config = config.replace(speculative=speculative_config(args, draft.to(device).eval()))
    if modules:
        from .adapters import with_adapters

        model = with_adapters(model, adapters.start(list(modules)))  # past --max-loras: loaded when named
    return ContinuousBatchingEngine(model, config), tokenizer


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit status."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from ..parallel import leave as leave_tensor_parallel
    from .app import build_app
    from .openai.handlers import ServeSettings

    try:
        paged_config(args)
        template = args.chat_template.read_text() if args.chat_template else None
        adapters, modules = served_adapters(args)
    except (ValueError, OSError) as exc:
        print(f"hf-paged-attn serve: error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    engine, tokenizer = load(args, adapters, modules)  # with compile="startup", compiled before it listens
    logger.info("loaded the model%s in %.1f s", " and compiled its forward" if engine is not None and
                engine.config.compile == "startup" else "", time.perf_counter() - start)  # fmt: skip
    if engine is None:  # a tensor-parallel rank other than 0: its work is done
        leave_tensor_parallel()
        return 0
    settings = ServeSettings(
        model_name=args.served_model_name or args.model, api_key=args.api_key or None,
        max_queue=args.max_queue, chat_template=template, max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout or None, max_prompt_chars=args.max_prompt_chars,
        tool_call_parser=args.tool_call_parser, rl_endpoints=args.enable_rl_endpoints,
        lora_updates=args.enable_lora,
        max_images=args.limit_mm_per_prompt, max_image_pixels=args.max_image_pixels,
        allowed_media_domains=tuple(args.allowed_media_domains), image_fetch_timeout=args.image_fetch_timeout,
        max_image_bytes=args.max_image_bytes,
    )
    app = build_app(engine, tokenizer, settings, adapters, processor=load_processor(args.model, engine.model))
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # printed at every log level: scripts wait for this line
                print(f"hf-paged-attn serve: ready: {url} (model {settings.model_name!r}, {engine.device}, "
                      f"{engine.stats.num_blocks} KV blocks of {engine.config.block_size} tokens)",
                      file=sys.stderr, flush=True)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn waits for open connections, then cancels them mid-chunk: abort the requests at
            # the drain deadline instead, so that every stream ends with an error event and [DONE].
            timer = asyncio.get_running_loop().call_later(args.drain_timeout, drain_expired)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    def drain_expired() -> None:
        num = app.state.engine_loop.abort_all()
        logger.warning("drain timeout (%.1f s): aborted %d unfinished request(s)", args.drain_timeout, num)

    config = uvicorn.Config(
        app, log_level=args.log_level if args.log_level == "debug" else "warning", access_log=False,
        lifespan="on", http=args.http, timeout_keep_alive=args.timeout_keep_alive,
        limit_concurrency=args.limit_concurrency or None,
        # after the drain deadline, the aborted streams get this long to send their last events
        timeout_graceful_shutdown=math.ceil(args.drain_timeout) + DRAIN_GRACE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,  # with --http h11; httptools has no such bound
    )
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal to the handler found before it
    # started: make that one a no-op so a drained shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    # what the server holds from here on lives as long as it does: full collections no longer walk it
    logger.info("froze the %d objects of start-up (_env.freeze_heap)", freeze_heap())
    Server(config).run(sockets=[sock])
    if hasattr(engine, "shutdown"):  # tensor parallel: ends the other ranks' loop
        engine.shutdown()
    leave_tensor_parallel()
    logger.info("stopped")
    return 0
