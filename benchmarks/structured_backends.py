"""xgrammar against llguidance: the measurements behind the backend of ``runtime/generation/structured.py``.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/structured_backends.py [--big-vocab] [--rows 32] [--steps 96]

Both libraries side by side in one process, on the bundled demo model's tokenizer (byte-level BPE,
4096 tokens) and, with ``--big-vocab``, on a 128,000-token byte-level BPE that ``tokenizers`` trains
here in ~15 s on this Python's own standard library source (no hub: no real model's vocabulary can
be had offline; the size and byte-level form are Llama 3's, the merges are not). Prints:

- compile time per schema, cold (first compile) and cached (what a second request with the same
  schema pays: xgrammar's compiler cache; llguidance a ``deep_copy`` of a built matcher);
- per step, for ``--rows`` constrained rows in lockstep (random logits through the mask, a finished
  row restarts on the next schema): the batch mask fill (1 and 2 threads), the mask's application
  to a ``[rows, vocab]`` float32 logits tensor, and the matchers' advance;
- whether the batch fill releases the GIL (a Python thread counts while the main thread fills);
- JSON Schema / regex / grammar coverage: compiles, and 8 random samples each parse and validate.

Both are set up as vLLM sets them up for a JSON schema without ``any_whitespace``: compact
separators, no free whitespace, and properties the schema does not name refused (xgrammar's
``strict_mode``; llguidance by ``additionalProperties: false`` written into every object schema).
"""

from __future__ import annotations

import argparse
import copy
import glob
import importlib.metadata
import json
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema
import llguidance as llg
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_paged_attn.demo import DEMO_MODEL

SCHEMAS: dict[str, dict] = {
    "enum+const": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "v": {"const": 1}},
        "required": ["color", "v"],
    },
    "bounded": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
        },
        "required": ["age", "score", "name"],
    },
    "nested+array": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                                    "minItems": 1, "maxItems": 3}},
                "required": ["id", "tags"],
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
    },
    "$ref": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"]}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
    "anyOf": {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"},
                                       {"enum": ["x", "y"]}]}},
        "required": ["v"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "day": {"type": "string", "format": "date"}},
        "required": ["code", "day"],
    },
}

# Features probed for support: (name, schema). Each must compile and give 8 valid samples.
FEATURES: list[tuple[str, dict]] = [
    ("enum", {"enum": ["a", "b", 3, None]}),
    ("const", {"const": {"k": [1, 2]}}),
    ("integer min/max", {"type": "integer", "minimum": -5, "maximum": 5}),
    ("exclusiveMinimum/Maximum", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4}),
    ("number min/max", {"type": "number", "minimum": 0.5, "maximum": 2.5}),
    ("multipleOf", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    ("string min/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}),
    ("pattern", {"type": "string", "pattern": "^[a-c]{3}[0-9]$"}),
    ("format date-time", {"type": "string", "format": "date-time"}),
    ("format email", {"type": "string", "format": "email"}),
    ("format uuid", {"type": "string", "format": "uuid"}),
    ("array min/maxItems", {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3}),
    ("uniqueItems", {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3}),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False}),
    ("nested object", SCHEMAS["nested+array"]),
    ("$ref/$defs", SCHEMAS["$ref"]),
    ("recursive $ref", {"$defs": {"t": {"type": "object", "properties": {"c": {"type": "array", "maxItems": 2,
                                                                                "items": {"$ref": "#/$defs/t"}}}}},
                        "$ref": "#/$defs/t"}),
    ("anyOf", SCHEMAS["anyOf"]),
    ("oneOf", {"oneOf": [{"type": "integer", "maximum": 0}, {"type": "boolean"}]}),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}),
    ("type list", {"type": ["string", "null"], "maxLength": 3}),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"},
                                     "maxProperties": 2}),
    ("patternProperties", {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}},
                           "additionalProperties": False, "maxProperties": 2}),
    ("minProperties", {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 1,
                       "maxProperties": 2, "propertyNames": {"maxLength": 3}}),
    ("not", {"type": "integer", "not": {"const": 0}, "minimum": -2, "maximum": 2}),
    ("if/then/else", {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                      "if": {"properties": {"a": {"const": True}}}, "then": {"required": ["b"]}}),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}),
]
REGEXES = [r"\d{3}-\d{4}", r"(cat|dog)s?", r"[a-z]+@[a-z]+\.(com|org)", r"(?i)yes|no", r"\w{2,4}\s\w{2,4}",
           r"(a|b)\1", r"foo(?=bar)bar"]
LARK = 'start: expr\nexpr: term ("+" term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/\n'
GBNF = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] [0-9]? | "(" expr ")"\n'


def big_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A 128,000-token byte-level BPE trained on this Python's standard library (cached at ``path``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not path.exists():
        stdlib = os.path.dirname(os.__file__)
        files = sorted(f for ext in ("py", "txt", "rst") for f in glob.glob(f"{stdlib}/**/*.{ext}", recursive=True))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=128_000, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator((Path(f).read_text(errors="ignore") for f in files if os.path.isfile(f)), trainer)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|end_of_text|>", bos_token="<|begin_of_text|>")


def strict(schema: dict) -> dict:
    """``additionalProperties: false`` in every object schema that says nothing of it (xgrammar's strict_mode)."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node \
                    and "patternProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


class Xgr:
    name = "xgrammar"

    def __init__(self, tok, vocab: int) -> None:  # noqa: ANN001
        t = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.setup_s = time.perf_counter() - t
        self.batchers = {n: xgr.BatchGrammarMatcher(n) for n in (1, 2)}

    def compile(self, kind: str, text: object) -> object:
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(text), any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "lark":
            return self.compiler.compile_lark(text)
        return self.compiler.compile_grammar(text)

    def matcher(self, compiled: object) -> object:
        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor, threads: int) -> None:
        self.batchers[threads].batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_one(self, m: object, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m: object, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: object) -> bool:
        return m.is_terminated()


class Llg:
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:  # noqa: ANN001
        t = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.setup_s = time.perf_counter() - t
        self.executors = {n: llg.LLExecutor(n) for n in (1, 2)}
        self.cache: dict[str, object] = {}

    def compile(self, kind: str, text: object) -> object:
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(strict(text), defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(text)
        else:
            grammar = llg.grammar_from("lark" if kind == "lark" else "gbnf", text)
        key = grammar
        if key in self.cache:
            return self.cache[key].deep_copy()
        m = llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        self.cache[key] = m
        return m.deep_copy()

    def matcher(self, compiled: object) -> object:
        return compiled.deep_copy()

    def fill(self, matchers: list, bitmask: torch.Tensor, threads: int) -> None:
        llguidance.torch.fill_next_token_bitmask_par(self.executors[threads], [(m, i) for i, m in enumerate(matchers)],
                                                     bitmask)

    def fill_one(self, m: object, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m: object, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: object) -> bool:
        return m.is_stopped()


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:7.3f}"


def p90(xs: list[float]) -> str:
    return f"{sorted(xs)[int(0.9 * len(xs))] * 1e3:7.3f}"


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor, bits: torch.Tensor) -> None:
    """The plain torch application: bit j of word w is token 32*w+j; a 0 bit sets the logit to -inf."""
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [rows, words * 32]
    logits.masked_fill_(~allowed[:, : logits.shape[1]], float("-inf"))


def sample_text(b, tok, compiled: object, vocab: int, gen: torch.Generator, max_steps: int = 400) -> str | None:
    """Random logits through the mask until the matcher ends; None if it did not end in ``max_steps``."""
    m = b.matcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    out: list[int] = []
    for _ in range(max_steps):
        if b.done(m):
            return tok.decode([t for t in out if t != tok.eos_token_id])
        b.fill_one(m, bitmask, 0)
        logits = torch.randn(1, vocab, generator=gen)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert b.accept(m, token), (b.name, token)
        out.append(token)
    return None


def coverage(b, tok, vocab: int) -> list[tuple[str, str]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    cases = [("json:" + n, "json", s) for n, s in FEATURES] + [("regex:" + r, "regex", r) for r in REGEXES]
    cases += [("lark", "lark", LARK), ("gbnf", "gbnf", GBNF)]
    for name, kind, spec in cases:
        try:
            compiled = b.compile(kind, spec)
        except Exception as e:  # noqa: BLE001 - a refusal is the answer here
            rows.append((name, "refused: " + str(e).splitlines()[0][:90]))
            continue
        verdict = "ok"
        for _ in range(8):
            text = sample_text(b, tok, compiled, vocab, gen)
            if text is None:
                verdict = "no end in 400 steps"
                break
            try:
                if kind == "json":
                    jsonschema.validate(json.loads(text), spec)
                elif kind == "regex" and not re.fullmatch(spec, text):
                    verdict = f"WRONG {text!r}"
                    break
            except (ValueError, jsonschema.ValidationError) as e:
                verdict = f"WRONG {text!r}: {str(e).splitlines()[0][:60]}"
                break
        rows.append((name, verdict))
    return rows


def compile_times(make: Callable, tok, vocab: int) -> dict[str, tuple[float, float]]:
    b = make(tok, vocab)
    out = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        b.compile("json", schema)
        t1 = time.perf_counter()
        b.compile("json", schema)
        out[name] = (t1 - t0, time.perf_counter() - t1)
    return out


FILLS = ("batch, 1 thread", "batch, 2 threads", "row by row")


def lockstep(b, vocab: int, rows: int, steps: int, fill: str) -> dict[str, list[float]]:
    """``rows`` matchers in lockstep over the schemas; per step: mask fill (``fill``), apply, accept.

    Each fill mode runs on its own matchers with the same seed (same logits, same masks, so the same
    tokens): a matcher may keep the mask of its state, so a second fill of one state would be free.
    """
    compiled = [b.compile("json", s) for s in SCHEMAS.values()]
    gen = torch.Generator().manual_seed(1)
    matchers = [b.matcher(compiled[i % len(compiled)]) for i in range(rows)]
    nxt = rows
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    bits = torch.arange(32, dtype=torch.int32)
    times: dict[str, list[float]] = {"fill": [], "apply (torch ops)": [], "apply (xgrammar cpu kernel)": [],
                                     "accept": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        if fill == "row by row":
            for i, m in enumerate(matchers):
                b.fill_one(m, bitmask, i)
        else:
            b.fill(matchers, bitmask, 1 if fill == FILLS[0] else 2)
        t1 = time.perf_counter()
        logits = torch.randn(rows, vocab, generator=gen)
        spare = logits.clone()
        t2 = time.perf_counter()
        apply_mask(logits, bitmask, bits)
        t3 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(spare, bitmask)
        t4 = time.perf_counter()
        assert torch.equal(logits, spare)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).flatten().tolist()
        t5 = time.perf_counter()
        for m, token in zip(matchers, tokens):
            assert b.accept(m, token)
        t6 = time.perf_counter()
        for key, dt in zip(times, (t1 - t0, t3 - t2, t4 - t3, t6 - t5)):
            times[key].append(dt)
        for i, m in enumerate(matchers):
            if b.done(m):
                matchers[i] = b.matcher(compiled[nxt % len(compiled)])
                nxt += 1
    times["rows restarted"] = [float(nxt - rows)]
    return times


def gil_share(b, tok, vocab: int, rows: int, seconds: float = 1.5) -> float:
    """Iterations a Python thread makes while the main thread fills masks, over its iterations alone."""
    compiled = b.compile("json", SCHEMAS["bounded"])
    matchers = [b.matcher(compiled) for _ in range(rows)]
    prefix = tok.encode('{"age":3,"score":0.5,"name":"a', add_special_tokens=False)
    for m in matchers:  # inside a string value: the costliest masks
        assert all(b.accept(m, token) for token in prefix)
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    counts = []
    for busy in (False, True):
        stop, count = threading.Event(), [0]

        def spin(stop: threading.Event = stop, count: list[int] = count) -> None:
            while not stop.is_set():
                count[0] += 1

        th = threading.Thread(target=spin)
        th.start()
        end = time.perf_counter() + seconds
        if not busy:
            time.sleep(seconds)
        while busy and time.perf_counter() < end:
            b.fill(matchers, bitmask, 1)
        stop.set()
        th.join()
        counts.append(count[0])
    return counts[1] / counts[0]


def module_step(tok, vocab: int, rows: int, steps: int) -> dict[str, list[float]]:
    """``runtime/generation/structured.py`` as the engine will call it: ``mask_logits`` (fill + apply) on ``rows`` of a
    ``[rows, vocab]`` float32 tensor, then one ``accept`` per row; rows restart as they finish."""
    from hf_paged_attn.runtime.generation.structured import GrammarCompiler, StructuredSpec

    compiler = GrammarCompiler(tok, vocab)
    grammars = [compiler.compile(StructuredSpec(json=strict(s))) for s in SCHEMAS.values()]
    matchers = [compiler.matcher(grammars[i % len(grammars)]) for i in range(rows)]
    gen, nxt = torch.Generator().manual_seed(2), rows
    times: dict[str, list[float]] = {"mask_logits (fill + apply)": [], "accept": []}
    for _ in range(steps):
        logits = torch.randn(rows, vocab, generator=gen)
        t0 = time.perf_counter()
        compiler.mask_logits(logits, matchers)
        t1 = time.perf_counter()
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).flatten().tolist()
        t2 = time.perf_counter()
        for m, token in zip(matchers, tokens):
            assert m.accept(token)
        t3 = time.perf_counter()
        times["mask_logits (fill + apply)"].append(t1 - t0)
        times["accept"].append(t3 - t2)
        for i, m in enumerate(matchers):
            if m.is_terminated():
                matchers[i], nxt = compiler.matcher(grammars[nxt % len(grammars)]), nxt + 1
    return times


def decode_steps(num_rows: int, steps: int) -> list[float]:
    """Seconds of the engine's steps while ``num_rows`` requests of the demo model all decode."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    import hf_paged_attn
    from hf_paged_attn.demo import PROMPTS

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged")
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    engine = hf_paged_attn.ContinuousBatchingEngine(model, hf_paged_attn.PagedConfig(max_num_seqs=num_rows))
    config = GenerationConfig(do_sample=False, max_new_tokens=steps + 8, min_new_tokens=steps + 8)
    for i in range(num_rows):
        engine.add_request(tok(PROMPTS[i % len(PROMPTS)])["input_ids"][:32], generation_config=config)
    engine.step()
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        assert len(outs) == num_rows, len(outs)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-vocab", action="store_true", help="also the 128k-token BPE")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--skip-coverage", action="store_true")
    parser.add_argument("--engine", action="store_true", help="also the demo model's decode step against mask_logits")
    parser.add_argument("--engine-threads", type=int, default=2, help="torch threads of the decode steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    versions = f"xgrammar {importlib.metadata.version('xgrammar')}, llguidance {llg.__version__}"
    print(f"{versions}, torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    toks = [("demo (4096)", AutoTokenizer.from_pretrained(DEMO_MODEL), 4096)]
    if args.big_vocab:
        tok = big_tokenizer(Path("/tmp/hf_paged_attn_bpe128k.json"))
        toks.append((f"bpe128k ({len(tok)} -> 128256)", tok, 128256))
    for label, tok, vocab in toks:
        print(f"\n## tokenizer {label}")
        backends = [Xgr(tok, vocab), Llg(tok, vocab)]
        for b in backends:
            print(f"{b.name:10s} tokenizer setup {b.setup_s * 1e3:.0f} ms")
        print("\ncompile ms (cold / cached)   " + "   ".join(f"{b.name:>19s}" for b in backends))
        ct = [compile_times(type(b), tok, vocab) for b in backends]
        for name in SCHEMAS:
            print(f"  {name:26s}" + "".join(f"   {c[name][0] * 1e3:8.2f} / {c[name][1] * 1e3:6.3f}" for c in ct))
        print(f"\nper step, {args.rows} rows, ms: median (p90)" + "".join(f"   {b.name:>17s}" for b in backends))
        for fill in FILLS:
            runs = [lockstep(b, vocab, args.rows, args.steps, fill) for b in backends]
            keys = ["fill"] if fill != FILLS[0] else list(runs[0])
            for key in keys:
                label = f"fill ({fill})" if key == "fill" else key
                if key == "rows restarted":
                    print(f"  {label:34s}" + "".join(f"   {int(r[key][0]):17d}" for r in runs))
                else:
                    print(f"  {label:34s}" + "".join(f"   {ms(r[key])} ({p90(r[key])})" for r in runs))
        print("\nPython thread's progress while the batch fill runs (1.0: GIL released throughout)")
        for b in backends:
            print(f"  {b.name:10s} {gil_share(b, tok, vocab, args.rows):.2f}")
        if args.skip_coverage or vocab > 4096:
            continue
        print("\ncoverage (compiles, 8 random samples parse and validate / fullmatch)")
        cov = [dict(coverage(b, tok, vocab)) for b in backends]
        for name in cov[0]:
            print(f"  {name:32s} | {cov[0][name]:40s} | {cov[1][name]}")
    if args.engine:
        print(f"\n## runtime/generation/structured.py per step ({args.rows} rows) against the demo model's decode step")
        tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
        for label, t in module_step(tok, 4096, args.rows, args.steps).items():
            print(f"  {label:34s} {ms(t)} ({p90(t)}) ms")
        torch.set_num_threads(args.engine_threads)
        for n in (args.rows, 2 * args.rows):
            t = decode_steps(n, 24)
            print(f"  {f'decode step, {n} requests, {args.engine_threads} threads':34s} {ms(t)} ({p90(t)}) ms")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
