"""Serving benchmark: concurrent streaming ``openai`` clients on loopback against our server and
``transformers serve --continuous-batching``, same model, same prompts, greedy.

    python -m hf_paged_attn_tools.bench --serve  # bundled model, 32 clients x 2 requests, 64 tokens
    python -m hf_paged_attn_tools.bench --serve --model random  # a 28M-parameter random Llama, demo tokenizer
    python -m hf_paged_attn_tools.bench --serve --smoke  # 4 clients, 8 tokens, our server only (seconds)

Each client sends its requests one after another (streamed, ``temperature=0``); all clients start
together. Throughput is completion tokens over the wall time of the whole run; time to first token
(TTFT) and inter-token latency (ITL, the gap between consecutive text chunks) are per request, as the
client sees them. The systems alternate, ``--repeat`` runs each; the report gives medians.
Writes ``OUT/serve_<model>.json`` (``--out``, default: the bench's folder in the user's cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_paged_attn._env import freeze_heap
from hf_paged_attn.demo import DEMO_MODEL, PROMPTS
from hf_paged_attn_tools.bench.report import default_out_dir
from hf_paged_attn_tools.bench.workloads import ModelSpec
from hf_paged_attn_tools.launch import ServerProcess

PROG = "python -m hf_paged_attn_tools.bench --serve"
SYSTEMS = ("paged", "transformers")
# The random model: the benchmark's usual Llama shape with the demo tokenizer's vocabulary.
RANDOM_MODEL = ModelSpec(vocab_size=4096, max_position_embeddings=1024)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class RequestTiming:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with text
    num_tokens: int = 0
    text: str = ""


def parse_args(argv: list[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="'demo' (bundled), 'random' (28M random Llama) or a local path")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--repeat", type=int, default=3, help="runs per system, alternating systems; medians reported")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each server (default 2)")
    p.add_argument("--out", type=Path, default=None, help=f"directory for the JSON (default: {default_out_dir()})")
    p.add_argument("--smoke", action="store_true", help="4 clients x 1 request, 8 tokens, our server only")
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.requests_per_client, args.max_tokens, args.systems, args.repeat = 4, 1, 8, "paged", 1
    return args


def model_dir(name: str, scratch: Path) -> Path:
    if name == "demo":
        return DEMO_MODEL
    if name == "random":
        path = Path(RANDOM_MODEL.save(str(scratch / "random-llama")))
        for file in TOKENIZER_FILES:
            shutil.copy(DEMO_MODEL / file, path / file)
        return path
    return Path(name)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(system: str, model: Path, args: argparse.Namespace) -> ServerProcess:
    env = {"OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    if system == "paged":
        max_len = 64 + args.max_tokens  # the prompts are short
        num_blocks = 2 * args.clients * (max_len // 8 + 1)
        flags = ["--served-model-name", str(model), "--max-num-seqs", str(args.clients),
                 "--num-blocks", str(num_blocks), "--log-level", "warning"]
        return ServerProcess(model, flags, env=env, start_timeout=300).start()
    port = free_port()
    exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    # Its cache is sized like ours, for the workload: left to itself it takes 60-90% of free memory (14 GB
    # here), which made it ~15% slower and risks the OOM killer on a shared machine. Its pages hold 256
    # tokens, so each request needs one; 4 per client leaves its scheduler ample room.
    command = [exe, "serve", str(model), "--continuous-batching", "--device", "cpu", "--host", "127.0.0.1",
               "--port", str(port), "--cb-num-blocks", str(4 * args.clients)]
    return ServerProcess(model, command=command, env=env, url=f"http://127.0.0.1:{port}", start_timeout=300).start()


async def one_request(client: Any, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    timing = RequestTiming(sent=time.perf_counter())
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            timing.chunks.append(time.perf_counter())
            timing.text += chunk.choices[0].text
            chunks += 1
        if getattr(chunk, "usage", None):
            timing.num_tokens = chunk.usage.completion_tokens
    timing.num_tokens = timing.num_tokens or chunks
    return timing


async def drive(url: str, model: str, prompts: list[list[str]], max_tokens: int) -> tuple[list[RequestTiming], float]:
    """Each inner list is one client's requests, sent one after another; returns timings and wall time."""
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:
        async def client_loop(mine: list[str]) -> list[RequestTiming]:
            return [await one_request(client, model, prompt, max_tokens) for prompt in mine]

        await asyncio.gather(*(client_loop(p[:1]) for p in prompts[:4]))  # warm-up, not measured
        start = time.perf_counter()
        results = await asyncio.gather(*(client_loop(p) for p in prompts))
        wall = time.perf_counter() - start
    return [t for per_client in results for t in per_client], wall


def summarize(timings: list[RequestTiming], wall: float) -> dict[str, Any]:
    ttft = sorted(t.chunks[0] - t.sent for t in timings if t.chunks)
    itl = [b - a for t in timings for a, b in zip(t.chunks, t.chunks[1:])]
    tokens = sum(t.num_tokens for t in timings)
    return {
        "requests": len(timings),
        "completion_tokens": tokens,
        "wall_seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
        "ttft_p99_ms": round(1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
        "itl_p50_ms": round(1000 * statistics.median(itl), 2) if itl else None,
    }


def median_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs (tokens: the first run's, they are the same greedy tokens)."""
    keys = ("tokens_per_second", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "wall_seconds")
    medians = {k: statistics.median(r[k] for r in results if r[k] is not None) for k in keys}
    return {"requests": results[0]["requests"], "completion_tokens": results[0]["completion_tokens"], **medians}


def run(argv: list[str] | None = None, prog: str = PROG) -> dict[str, Any]:
    args = parse_args(argv, prog)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system(s) {sorted(unknown)}; choose from {SYSTEMS}")
    prompts = [[PROMPTS[(c * args.requests_per_client + r) % len(PROMPTS)] for r in range(args.requests_per_client)]
               for c in range(args.clients)]
    report: dict[str, Any] = {
        "model": args.model, "clients": args.clients, "requests_per_client": args.requests_per_client,
        "max_tokens": args.max_tokens, "threads": args.threads, "repeat": args.repeat,
        "cpu_count": os.cpu_count(), "systems": {},
    }
    texts: dict[str, list[str]] = {}
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
    with tempfile.TemporaryDirectory() as scratch:
        model = model_dir(args.model, Path(scratch))
        freeze_heap()  # this client's own full collections (torch is imported here) are not the servers' time
        for _ in range(args.repeat):  # alternate the systems: a shared machine's load drifts
            for system in systems:
                server = start(system, model, args)
                try:
                    timings, wall = asyncio.run(drive(server.url, str(model), prompts, args.max_tokens))
                except Exception:
                    print(f"{system} server log (last lines):\n" + "".join(server.log[-30:]), file=sys.stderr)
                    raise
                finally:
                    server.stop(60)
                runs[system].append(summarize(timings, wall))
                texts[system] = [t.text for t in timings]
    for system, results in runs.items():
        report["systems"][system] = {**median_of(results), "runs": results}
    if len(texts) == 2:
        a, b = texts.values()
        report["same_text"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
    out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    name = args.model if args.model in ("demo", "random") else Path(args.model).name
    path = out / f"serve_{'smoke' if args.smoke else name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {path}")
    return report


def format_table(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']}: {report['clients']} clients x {report['requests_per_client']} streamed "
             f"requests, {report['max_tokens']} tokens, greedy, {report['threads']} threads per server, "
             f"medians of {report['repeat']} runs",
             f"{'system':<14}{'tok/s':>9}{'TTFT p50':>11}{'TTFT p99':>11}{'ITL p50':>10}{'tokens':>8}"]
    for name, s in report["systems"].items():
        lines.append(f"{name:<14}{s['tokens_per_second']:>9.1f}{s['ttft_p50_ms']:>9.1f}ms{s['ttft_p99_ms']:>9.1f}ms"
                     f"{s['itl_p50_ms'] or 0:>8.2f}ms{s['completion_tokens']:>8}")
    systems = report["systems"]
    if "paged" in systems and "transformers" in systems:
        ratio = systems["paged"]["tokens_per_second"] / systems["transformers"]["tokens_per_second"]
        runs = [p["tokens_per_second"] / t["tokens_per_second"]
                for p, t in zip(systems["paged"]["runs"], systems["transformers"]["runs"])]
        lines.append(f"paged / transformers throughput: {ratio:.2f}x (per run: {', '.join(f'{r:.2f}' for r in runs)}); "
                     f"same text on {report['same_text']} requests")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = PROG) -> None:
    run(argv, prog)


if __name__ == "__main__":
    main()
