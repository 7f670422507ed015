"""Constrained against free requests on one server: what structured outputs cost when serving.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/structured_serve.py [--rounds 5] [--clients 32] [--threads 2]
        [--workload weather|list]

One ``hf-paged-attn serve`` of the bundled demo model. Each round sends ``--clients`` concurrent
``/v1/completions`` requests constrained by a JSON schema (``response_format``), then the same number
of free ones with the same prompts, each with ``max_tokens`` set to the token count its constrained
twin produced, so both batches generate the same tokens per request: greedy, on prompts picked at
warm-up whose free greedy text runs at least ``MIN_FREE_TOKENS`` tokens without EOS (sampled, a
third of the demo model's free texts end early, and a batch that thins out runs fewer tokens per
step). ``--workload list``: a schema whose outputs run past ``max_tokens`` (``LIST_SCHEMA``: an object holding
an array of at least 12 strings of 12-16 characters), every request at ``max_tokens`` 48, the free ones with
``ignore_eos``, so both batches run 48 tokens a request. The figure is tokens per second of wall time; rounds
alternate constrained and free; medians are printed, with their ratio.

Where the constrained time goes, measured here in-process on the same tokenizer and schema with
the engine's own ``GrammarCompiler`` (the server's engine runs the same calls each step): the batch
mask fill of ``--clients`` rows, its application to ``[rows, 4096]`` float32 logits, and the
matchers' advance, replaying the outputs the server produced (re-tokenized); and per schema, the
compile time cold (a new spec) and cached (a request with a schema already seen), and the one-off
cost of the engine's first constrained request (llguidance reading the tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import openai
import torch
from transformers import AutoTokenizer

from hf_paged_attn._env import freeze_heap
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.runtime.generation.structured import GrammarCompiler, StructuredSpec, apply_bitmask
from hf_paged_attn.serve.outputs.tool_parser import HERMES
from hf_paged_attn.serve.outputs.tools import FunctionTool, forced_grammar
from hf_paged_attn_tools.launch import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 24},
        "temperature": {"type": "integer", "minimum": -40, "maximum": 50},
        "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
        "note": {"type": "string", "minLength": 20, "maxLength": 60},
    },
    "required": ["city", "temperature", "sky", "tags", "note"],
    "additionalProperties": False,
}
TOOLS = [FunctionTool.model_validate({"type": "function", "function": {"name": name, "parameters": SCHEMA}})
         for name in ("report", "forecast", "archive")]
LIST_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "minLength": 12, "maxLength": 16},
                             "minItems": 12}},
    "required": ["items"],
}
LIST_MAX_TOKENS = 48
MIN_FREE_TOKENS = 160  # constrained outputs of SCHEMA are ~60-120 tokens
COMPILE_SPECS = {
    "weather schema": StructuredSpec(json=SCHEMA),
    "json_object": StructuredSpec(json_object=True),
    "regex": StructuredSpec(regex=r"[A-Z][a-z]{2,8}-[0-9]{3,5}( [a-z]+){0,4}"),
    "choice (3)": StructuredSpec(choice=["yes", "no", "maybe"]),
    "3 tools, required": StructuredSpec(grammar=forced_grammar(HERMES, TOOLS, None, parallel=True)),
    "200-property schema": StructuredSpec(json={"type": "object", "properties": {
        f"field_{i}": {"type": "integer"} for i in range(200)}}),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="constrained and free batches each (alternating)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    p.add_argument("--workload", choices=("weather", "list"), default="weather",
                   help="weather: SCHEMA, free twins cut to the constrained lengths; list: LIST_SCHEMA, all at "
                        "max_tokens 48, the free ones with ignore_eos")  # fmt: skip
    return p.parse_args(argv)


async def batch(url: str, prompts: list[str], constrained: bool, max_tokens: list[int], schema: dict = SCHEMA,
                free_extra: dict | None = None):  # fmt: skip
    """(wall seconds, per-request completion tokens, texts) of one concurrent greedy batch."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600) as client:
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
        calls = [client.completions.create(model="demo", prompt=p, max_tokens=m, temperature=0,
                                           extra_body=extra if constrained else free_extra)
                 for p, m in zip(prompts, max_tokens)]
        start = time.perf_counter()
        results = await asyncio.gather(*calls)
        wall = time.perf_counter() - start
    return wall, [r.usage.completion_tokens for r in results], [r.choices[0].text for r in results]


def list_rounds(args: argparse.Namespace) -> tuple[dict[str, list[float]], list[str]]:
    """``--workload list``: constrained (``LIST_SCHEMA``) and free (``ignore_eos``) batches, 48 tokens a request."""
    prompts = [f"List number {i}, as JSON:" for i in range(args.clients)]
    rates: dict[str, list[float]] = {"constrained": [], "free": []}
    texts: list[str] = []
    server_args = ["--served-model-name", "demo", "--max-num-seqs", str(4 * args.clients), "--num-blocks", "2048"]
    full = [LIST_MAX_TOKENS] * args.clients
    with ServerProcess(DEMO_MODEL, server_args, env={"OMP_NUM_THREADS": str(args.threads)}) as server:
        for constrained in (True, False):  # warm up: the grammar compiler, the steps' sizes
            asyncio.run(batch(server.url, prompts, constrained, full, LIST_SCHEMA, {"ignore_eos": True}))
        freeze_heap()  # this client's own full collections (torch is imported here) are not the server's time
        for r in range(args.rounds):
            wall, counts, texts = asyncio.run(batch(server.url, prompts, True, full, LIST_SCHEMA))
            assert counts == full, f"a constrained output ended before max_tokens: {counts}"
            rates["constrained"].append(sum(counts) / wall)
            free_wall, free_counts, _ = asyncio.run(batch(server.url, prompts, False, full, LIST_SCHEMA,
                                                          {"ignore_eos": True}))  # fmt: skip
            assert free_counts == full
            rates["free"].append(sum(free_counts) / free_wall)
            print(f"round {r}: constrained {sum(counts)} tokens in {wall:.2f} s ({rates['constrained'][-1]:.0f} "
                  f"tok/s), free {sum(free_counts)} tokens in {free_wall:.2f} s ({rates['free'][-1]:.0f} tok/s)",
                  flush=True)  # fmt: skip
    return rates, texts


def serve_rounds(args: argparse.Namespace) -> tuple[dict[str, list[float]], list[str]]:
    topics = ("as JSON", "by the json module")
    candidates = [f"Weather report {i}, {topics[i % 2]}:" for i in range(4 * args.clients)]
    rates: dict[str, list[float]] = {"constrained": [], "free": []}
    texts: list[str] = []
    server_args = ["--served-model-name", "demo", "--max-num-seqs", str(4 * args.clients), "--num-blocks", "2048"]
    with ServerProcess(DEMO_MODEL, server_args, env={"OMP_NUM_THREADS": str(args.threads)}) as server:
        _, counts, _ = asyncio.run(batch(server.url, candidates, False, [MIN_FREE_TOKENS] * len(candidates)))
        prompts = [p for p, n in zip(candidates, counts) if n == MIN_FREE_TOKENS][: args.clients]
        assert len(prompts) == args.clients, f"only {len(prompts)} prompts run {MIN_FREE_TOKENS} tokens free"
        asyncio.run(batch(server.url, prompts[:2], True, [300, 300]))  # warm up: the grammar compiler
        freeze_heap()  # this client's own full collections (torch is imported here) are not the server's time
        for r in range(args.rounds):
            wall, counts, texts = asyncio.run(batch(server.url, prompts, True, [300] * args.clients))
            assert max(counts) <= MIN_FREE_TOKENS, max(counts)
            rates["constrained"].append(sum(counts) / wall)
            free_wall, free_counts, _ = asyncio.run(batch(server.url, prompts, False, counts))
            assert free_counts == counts  # the same tokens per request
            rates["free"].append(sum(free_counts) / free_wall)
            print(f"round {r}: constrained {sum(counts)} tokens in {wall:.2f} s "
                  f"({rates['constrained'][-1]:.0f} tok/s), free {sum(free_counts)} tokens in {free_wall:.2f} s "
                  f"({rates['free'][-1]:.0f} tok/s); "
                  f"longest output {max(counts)} tokens", flush=True)
    for text in texts:
        json.loads(text)  # every constrained output is JSON (the schema's tests are in integration_tests/serve)
    return rates, texts


def step_costs(tokenizer, texts: list[str], schema: dict = SCHEMA, repeat: int = 3) -> dict[str, float]:
    """Median ms per step of the structured work for len(texts) rows in lockstep, replaying ``texts``."""
    compiler = GrammarCompiler(tokenizer, 4096)
    grammar = compiler.compile(StructuredSpec(json=schema))
    outputs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    fills, applies, accepts = [], [], []
    for _ in range(repeat):
        matchers = [compiler.matcher(grammar) for _ in outputs]
        bitmask = compiler.allocate_bitmask(len(outputs))
        logits = torch.randn(len(outputs), 4096)
        for step in range(max(map(len, outputs))):
            live = [i for i, ids in enumerate(outputs) if step < len(ids)]
            ms = [matchers[i] for i in live]
            t0 = time.perf_counter()
            compiler.fill_bitmasks(ms, bitmask)
            t1 = time.perf_counter()
            apply_bitmask(logits[: len(ms)], bitmask[: len(ms)])
            t2 = time.perf_counter()
            for i in live:
                matchers[i].accept(outputs[i][step])  # a re-tokenization the grammar refuses: that row stops
            t3 = time.perf_counter()
            if len(live) == len(outputs):  # full batches only: the figure is per step of all the rows
                fills.append(t1 - t0)
                applies.append(t2 - t1)
                accepts.append(t3 - t2)
    return {name: 1e3 * statistics.median(v) for name, v in
            (("mask fill", fills), ("mask apply", applies), ("advance (accept)", accepts))}


def compile_costs(tokenizer, repeat: int = 5) -> tuple[float, dict[str, tuple[float, float]]]:
    """(seconds to build a compiler from the tokenizer, {spec: (cold ms, cached ms)}), medians."""
    builds, cold, cached = [], {n: [] for n in COMPILE_SPECS}, {n: [] for n in COMPILE_SPECS}
    for _ in range(repeat):
        t = time.perf_counter()
        compiler = GrammarCompiler(tokenizer, 4096)
        builds.append(time.perf_counter() - t)
        for name, spec in COMPILE_SPECS.items():
            t = time.perf_counter()
            compiler.matcher(spec)
            cold[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            compiler.matcher(spec)  # what add_request pays for a schema seen before: a copy of the built matcher
            cached[name].append(time.perf_counter() - t)
    return statistics.median(builds), {n: (1e3 * statistics.median(cold[n]), 1e3 * statistics.median(cached[n]))
                                       for n in COMPILE_SPECS}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {Path(DEMO_MODEL).name}, "
          f"{args.clients} clients, {args.rounds} rounds, server OMP_NUM_THREADS={args.threads}", flush=True)
    rates, texts = (list_rounds if args.workload == "list" else serve_rounds)(args)
    constrained, free = statistics.median(rates["constrained"]), statistics.median(rates["free"])
    ratios = [c / f for c, f in zip(rates["constrained"], rates["free"])]
    print(f"\nthroughput, medians: constrained {constrained:.0f} tok/s, free {free:.0f} tok/s: "
          f"{constrained / free:.2f}x (per-round ratios {', '.join(f'{r:.2f}' for r in ratios)})")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    costs = step_costs(tokenizer, texts, LIST_SCHEMA if args.workload == "list" else SCHEMA)
    total = sum(costs.values())
    ms_per_step = 1e3 * args.clients / free  # a decode step of the batch, from the free throughput
    print(f"\nper decode step of {args.clients} constrained rows (replayed in-process, medians):")
    for name, ms in costs.items():
        print(f"  {name:18s} {ms:6.3f} ms")
    print(f"  {'total':18s} {total:6.3f} ms = {100 * total / ms_per_step:.1f}% of a free step "
          f"(~{ms_per_step:.1f} ms: {args.clients} rows / {free:.0f} tok/s)")
    build, compiles = compile_costs(tokenizer)
    print(f"\ncompile (in add_request, off the event loop), medians; once per engine: llguidance reads the "
          f"tokenizer {1e3 * build:.0f} ms")
    print(f"  {'spec':22s} {'cold ms':>8s} {'cached ms':>10s}")
    for name, (cold, cached) in compiles.items():
        print(f"  {name:22s} {cold:8.2f} {cached:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
