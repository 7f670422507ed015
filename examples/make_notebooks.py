"""Write the example notebooks of this folder from the cells below, without outputs.

    python examples/make_notebooks.py           # (re)write examples/*.ipynb
    python examples/make_notebooks.py --check   # exit 1 if a notebook differs from what this script writes

Edit the cells here, not in the .ipynb files, and run the script: the notebooks stay legible in
diffs, stripped of outputs (execution_count null) and reproducible (fixed cell ids).
``tests/test_notebooks.py`` runs every notebook top to bottom.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

# Every notebook loads the bundled demo model this way.
LOAD = """\
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_paged_attn  # importing it registers attn_implementation="paged" with transformers
{engine}from hf_paged_attn.demo import DEMO_MODEL{prompts}  # the 4.2M-parameter Llama that ships with the package

tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL{tokenizer_args})
model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged").eval()
print(f"hf_paged_attn {{hf_paged_attn.__version__}}: {{model.num_parameters():,}} parameters, "
      f"attn_implementation={{model.config._attn_implementation!r}}")"""


def load(padding_side: str | None = None, engine: bool = False, prompts: bool = False) -> str:
    """The loading cell (imports laid out as ruff's isort wants them)."""
    return LOAD.format(
        tokenizer_args=f', padding_side="{padding_side}"' if padding_side else "",
        engine="from hf_paged_attn import ContinuousBatchingEngine, PagedConfig\n" if engine else "",
        prompts=", PROMPTS" if prompts else "",
    )


NOTEBOOKS: dict[str, list[tuple[str, str]]] = {}

NOTEBOOKS["01_quickstart"] = [
    ("md", """\
# Quickstart: `attn_implementation="paged"`

`hf_paged_attn` puts a paged KV cache and continuous batching behind `model.generate`. This notebook
loads the small model bundled with the package, generates for a padded batch of prompts of different
lengths, and checks that the result is **token for token** what transformers' own `sdpa` attention
generates (greedy decoding).

The bundled model is a 4.2M-parameter Llama trained on the CPython documentation: it writes
Python-flavoured English, not sensible answers. Everything here runs on CPU in seconds."""),
    ("md", """\
## 1. Load the model with `attn_implementation="paged"`

`import hf_paged_attn` registers the `"paged"` attention implementation; after that, any
`from_pretrained` can ask for it. Batched generation needs **left padding**, so the tokenizer is
loaded with `padding_side="left"`."""),
    ("code", load("left")),
    ("md", """\
## 2. Generate for a padded batch

Prompts of different lengths become one padded tensor plus an `attention_mask`. Inside `generate`,
each row turns into a request of its own (the padding is dropped), and the requests run together in
a continuous-batching loop."""),
    ("code", """\
prompts = [
    "The for statement",
    "A dictionary maps keys to",
    "The try statement specifies exception handlers and",
]
batch = tokenizer(prompts, padding=True, return_tensors="pt")
print(batch["attention_mask"])"""),
    ("code", """\
out = model.generate(**batch, max_new_tokens=40)
print(out.shape, "= [batch, input length + new tokens], like transformers' generate")

new_tokens = out[:, batch["input_ids"].shape[1]:]
for prompt, completion in zip(prompts, tokenizer.batch_decode(new_tokens, skip_special_tokens=True)):
    print(f"{prompt!r} -> {completion!r}\\n")"""),
    ("md", """\
## 3. Same tokens as `sdpa`

Load the same checkpoint with transformers' standard `sdpa` attention and run the same greedy
`generate`: the two tensors are equal, padding included."""),
    ("code", """\
import torch

reference = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa").eval()
expected = reference.generate(**batch, max_new_tokens=40)

assert torch.equal(out, expected)
print("paged generate == sdpa generate:", torch.equal(out, expected))"""),
    ("md", """\
## 4. Tuning: `paged_config=`

`PagedConfig` holds the cache and scheduler settings. A tiny per-step token budget
(`max_batch_tokens=8`) forces the prompts to be prefilled in chunks over several steps, mixed with
decode tokens of the other requests; the output does not change."""),
    ("code", """\
from hf_paged_attn import PagedConfig

chunked = model.generate(**batch, max_new_tokens=40, paged_config=PagedConfig(block_size=8, max_batch_tokens=8))
assert torch.equal(chunked, expected)
print("chunked prefill, 8-token blocks: still identical")"""),
]

NOTEBOOKS["02_streaming_engine"] = [
    ("md", """\
# Streaming with `ContinuousBatchingEngine`

`model.generate` waits for the whole batch. To serve requests as they come, use the engine directly:
`add_request` queues a prompt, `stream()` runs the loop and yields a `RequestOutput` every time a
request produces tokens, `abort` cancels one, and `engine.stats` tells what happened."""),
    ("code", load()),
    ("md", """\
## 1. Queue requests

Each request has its own prompt (token ids, no padding) and its own `max_new_tokens`. Ids are
generated (`"req-0"`, ...) unless you pass `request_id=`."""),
    ("code", """\
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig

engine = ContinuousBatchingEngine(model, PagedConfig(max_num_seqs=8))

requests = {
    "for": ("The for statement", 12),
    "dict": ("A dictionary maps keys to", 8),
    "doomed": ("The try statement specifies exception handlers and", 30),
}
for request_id, (prompt, max_new_tokens) in requests.items():
    engine.add_request(tokenizer(prompt)["input_ids"], max_new_tokens=max_new_tokens, request_id=request_id)
print(engine.stats.num_waiting, "requests waiting")"""),
    ("md", """\
## 2. Stream

`RequestOutput.new_ids` holds the tokens produced since the last output and `output_ids` all of
them. Decoding `output_ids` and printing what was not printed yet is safe with byte-level tokenizers
(a character can span two tokens).

While streaming, the loop below
- **aborts** `"doomed"` after its 4th token: its final output comes with `finish_reason="abort"`;
- **adds** a request `"late"` after a few tokens: it joins the running batch at the next step
  (that is continuous batching: no waiting for the others to finish)."""),
    ("code", """\
shown = {}
for out in engine.stream():
    text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
    new_text = text[len(shown.get(out.request_id, "")):]
    shown[out.request_id] = text
    if new_text:
        print(f"[{out.request_id:>6}] +{new_text!r}")
    if out.finished:
        print(f"[{out.request_id:>6}] finished ({out.finish_reason}) after {len(out.output_ids)} tokens")
    if out.request_id == "doomed" and len(out.output_ids) == 4 and not out.finished:
        print("[doomed] abort requested")
        engine.abort("doomed")
    if out.request_id == "for" and len(out.output_ids) == 3:
        engine.add_request(tokenizer("A generator function")["input_ids"], max_new_tokens=6, request_id="late")"""),
    ("code", """\
for request_id, text in shown.items():
    print(f"{request_id:>6}: {text!r}")"""),
    ("md", """\
`add_request` and `abort` may also be called from other threads while one thread runs `stream()`.

## 3. Batch convenience and statistics

`engine.generate` queues a list of prompts, runs them to the end and returns their final outputs in
input order. `engine.stats` covers everything the engine has run."""),
    ("code", """\
prompts = ["The while loop", "Keyword arguments", "The lambda expression"]
results = engine.generate([tokenizer(p)["input_ids"] for p in prompts], max_new_tokens=[8, 16, 4])
for prompt, result in zip(prompts, results):
    print(f"{prompt!r} -> {tokenizer.decode(result.output_ids, skip_special_tokens=True)!r} ({result.finish_reason})")

stats = engine.stats
print(f"\\n{stats.num_generated_tokens} tokens in {stats.num_steps} steps, "
      f"peak {stats.peak_used_blocks}/{stats.num_blocks} KV blocks, {stats.num_preemptions} preemptions, "
      f"{stats.tokens_per_second:.0f} tokens/s inside step()")
stats"""),
]

NOTEBOOKS["03_sampling"] = [
    ("md", """\
# Sampling and seeds

Sampling uses transformers' own `GenerationConfig` and logits processors (temperature, top-k, top-p,
min-p, repetition penalty, ...). This notebook shows how to make sampled output reproducible and how
to draw several sequences per prompt."""),
    ("code", load("left") + """
batch = tokenizer(["The for statement", "A dictionary maps"], padding=True, return_tensors="pt")
prompt_len = batch["input_ids"].shape[1]"""),
    ("md", """\
## 1. A sampling `GenerationConfig`"""),
    ("code", """\
import torch
from transformers import GenerationConfig

sampling = GenerationConfig(do_sample=True, temperature=0.8, top_k=50, top_p=0.95, max_new_tokens=24)

def show(sequences):
    for text in tokenizer.batch_decode(sequences[:, prompt_len:], skip_special_tokens=True):
        print(repr(text))

show(model.generate(**batch, generation_config=sampling))"""),
    ("md", """\
## 2. Reproducible draws

Two ways to fix the random stream:
- `PagedConfig(seed=...)` gives the engine its own seeded generator;
- without a seed, the engine seeds itself from torch's global RNG, so `torch.manual_seed` works as
  it does with transformers' `generate`.

(The draws are reproducible run to run, but they are not the same draws as transformers' `generate`
with `sdpa`: the random stream is consumed in another order. Greedy output is identical.)"""),
    ("code", """\
from hf_paged_attn import PagedConfig

a = model.generate(**batch, generation_config=sampling, paged_config=PagedConfig(seed=0))
b = model.generate(**batch, generation_config=sampling, paged_config=PagedConfig(seed=0))
c = model.generate(**batch, generation_config=sampling, paged_config=PagedConfig(seed=1))
print("seed 0 twice equal:", torch.equal(a, b), "| seed 0 vs seed 1 equal:", torch.equal(a, c))
assert torch.equal(a, b)

torch.manual_seed(42)
d = model.generate(**batch, generation_config=sampling)
torch.manual_seed(42)
e = model.generate(**batch, generation_config=sampling)
print("torch.manual_seed(42) twice equal:", torch.equal(d, e))
assert torch.equal(d, e)"""),
    ("md", """\
## 3. Several sequences per prompt: `num_return_sequences`

Rows come back grouped by prompt, as in transformers: `[batch * num_return_sequences, length]`.
Inside, the extra sequences share the prompt's KV blocks (copy on write) instead of recomputing it."""),
    ("code", """\
three = GenerationConfig(do_sample=True, temperature=0.8, top_k=50, top_p=0.95, max_new_tokens=24,
                         num_return_sequences=3)
torch.manual_seed(0)
out = model.generate(**batch, generation_config=three)
print(out.shape)
show(out)"""),
    ("md", """\
## 4. Per-request settings in the engine

With `ContinuousBatchingEngine`, each request can carry its own `GenerationConfig`: greedy and
sampled requests run side by side in the same batch."""),
    ("code", """\
from hf_paged_attn import ContinuousBatchingEngine

engine = ContinuousBatchingEngine(model, PagedConfig(seed=7))
ids = tokenizer("The with statement is used to")["input_ids"]
hot = GenerationConfig(do_sample=True, temperature=1.2, top_p=0.9)
for request_id, config in [("greedy", None), ("hot", hot)]:
    engine.add_request(ids, max_new_tokens=20, generation_config=config, request_id=request_id)
for out in engine.stream():
    if out.finished:
        print(f"{out.request_id:>6}: {tokenizer.decode(out.output_ids, skip_special_tokens=True)!r}")"""),
]

NOTEBOOKS["04_prefix_caching"] = [
    ("md", """\
# Prefix caching

Requests often share a long beginning: a system prompt, few-shot examples, a document. With
`PagedConfig(enable_prefix_caching=True)` (the default), a request reuses the full KV blocks that an
earlier request computed for the same tokens, and computes only the rest of its prompt."""),
    ("code", load(engine=True) + """

SYSTEM = \"\"\"You are a helpful assistant that answers questions about the Python programming language.
Python is an interpreted, high-level programming language. Its design philosophy emphasizes code
readability with the use of significant indentation. A function is defined with the def statement;
a class with the class statement. Exceptions are raised with raise and handled with try and except.
Modules are imported with the import statement, and packages are directories of modules. Lists,
tuples, dictionaries and sets are the built-in container types. Iterators and generators produce
values one at a time; the for statement loops over any iterable. The with statement wraps a block
in the methods of a context manager. Decorators wrap functions and classes. Every object has an
identity, a type and a value; names refer to objects, and assignment binds a name to an object.
\"\"\"
questions = [
    "The for statement", "A dictionary maps", "The with statement is used to", "A generator function",
    "The import statement", "Exceptions are raised when", "The lambda expression", "A tuple consists of",
]
prompts = [tokenizer(SYSTEM + "\\n" + q)["input_ids"] for q in questions]
print(f"shared prefix: {len(tokenizer(SYSTEM)['input_ids'])} tokens; prompts: {[len(p) for p in prompts]} tokens")"""),
    ("md", """\
## 1. Who hit the cache

`RequestOutput.num_cached_tokens` says how many prompt tokens of a request came from the cache.
Only **full** blocks are shared (8 tokens each by default on CPU), so a hit is a multiple of the block
size. The first requests miss: they are prefilled in the same step, before any block of the prefix
exists (the step's token budget, `max_batch_tokens=512`, takes about three of these prompts)."""),
    ("code", """\
engine = ContinuousBatchingEngine(model, PagedConfig(enable_prefix_caching=True))
outputs = engine.generate(prompts, max_new_tokens=16)
for q, out in zip(questions, outputs):
    print(f"{q!r:34} {out.num_cached_tokens:>4} of {len(out.prompt_ids)} prompt tokens cached")
print(f"prefix hit rate: {engine.stats.prefix_hit_rate:.0%}")"""),
    ("md", """\
Blocks of finished requests stay cached until their memory is needed, so a second wave of requests
with the same system prompt hits from its first request on:"""),
    ("code", """\
second_wave = engine.generate(prompts, max_new_tokens=16)
print([out.num_cached_tokens for out in second_wave])
print(f"prefix hit rate over both waves: {engine.stats.prefix_hit_rate:.0%}")"""),
    ("md", """\
## 2. On vs off

The same requests with caching on and off: same tokens (it is an optimization, not an
approximation), less prefill work with it on. Each setting runs three times and keeps the fastest.
**Timings are noisy**, on a shared CPU especially; with this tiny model the saving is modest, and it
grows with the length of the shared prefix and the cost of the model."""),
    ("code", """\
import time


def run(enable_prefix_caching):
    engine = ContinuousBatchingEngine(model, PagedConfig(enable_prefix_caching=enable_prefix_caching))
    start = time.perf_counter()
    outputs = engine.generate(prompts, max_new_tokens=16)
    return time.perf_counter() - start, [o.output_ids for o in outputs], engine.stats


seconds, tokens = {}, {}
for enabled in (True, False):
    runs = [run(enabled) for _ in range(3)]
    seconds[enabled] = min(r[0] for r in runs)
    tokens[enabled], stats = runs[0][1], runs[0][2]
    print(f"enable_prefix_caching={enabled!s:5}: best of 3 {seconds[enabled]:.2f} s, "
          f"hit rate {stats.prefix_hit_rate:.0%}, {stats.num_steps} steps")

assert tokens[True] == tokens[False], "prefix caching changed the output"
print(f"same tokens either way; caching off took {seconds[False] / seconds[True]:.2f}x the time of caching on")"""),
]

NOTEBOOKS["05_benchmark"] = [
    ("md", """\
# Throughput: continuous batching vs padded `generate`

A small throughput experiment: the same requests served by
- the paged **engine** (continuous batching, up to `max_num_seqs` requests at once), and
- transformers' **padded `generate`** with `sdpa` attention, in static batches of the same size.

Then the package's own benchmark, `hf_paged_attn.bench`, in its smoke configuration. Numbers from a
tiny model on a CPU say little about a real model on a GPU; see `benchmarks/README.md` for the full
workloads (`make bench`)."""),
    ("code", load("left", prompts=True) + """

sdpa_model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa").eval()"""),
    ("md", """\
## 1. The workload

12 prompts from the demo, each with its own `max_new_tokens` (8 to 32). Requests may also stop
early at EOS; both systems run greedy decoding, so they produce the same tokens and we count the same
useful tokens for both."""),
    ("code", """\
import random
import time

import torch

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig

prompts = PROMPTS[:12]
rng = random.Random(0)
max_new = [rng.randint(8, 32) for _ in prompts]
eos = model.generation_config.eos_token_id


def useful(tokens, limit):
    \"\"\"New tokens up to the request's own limit and its first EOS (included).\"\"\"
    tokens = tokens[:limit]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def run_engine(concurrency):
    engine = ContinuousBatchingEngine(model, PagedConfig(max_num_seqs=concurrency))
    start = time.perf_counter()
    outputs = engine.generate([tokenizer(p)["input_ids"] for p in prompts], max_new_tokens=max_new)
    return time.perf_counter() - start, [o.output_ids for o in outputs]


def run_padded(batch_size):
    results, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[i : i + batch_size], padding=True, return_tensors="pt")
        out = sdpa_model.generate(**batch, max_new_tokens=max(max_new[i : i + batch_size]))
        results += out[:, batch["input_ids"].shape[1]:].tolist()  # runs to the batch's longest request
    return time.perf_counter() - start, [useful(r, n) for r, n in zip(results, max_new)]


_ = run_engine(4), run_padded(4)  # warm-up"""),
    ("md", """\
## 2. Sweep the concurrency

Concurrency 1, 4 and 16: `max_num_seqs` for the engine, the batch size for padded `generate`. A static
batch runs until its longest request is done and pads the others, while the engine refills a free
slot at once. On a CPU and a model this small, though, a forward costs nearly the same for 1 or 16
rows and the engine's per-step bookkeeping is not negligible, so expect the two to be close.
**Timings are noisy**: rerun the cell to see the spread."""),
    ("code", """\
levels = [1, 4, 16]
throughput = {"engine": [], "padded generate (sdpa)": []}
for c in levels:
    t_engine, engine_tokens = run_engine(c)
    t_padded, padded_tokens = run_padded(c)
    assert engine_tokens == padded_tokens  # greedy parity: the same useful tokens
    n = sum(map(len, engine_tokens))
    throughput["engine"].append(n / t_engine)
    throughput["padded generate (sdpa)"].append(n / t_padded)
    print(f"concurrency {c:>2}: {n} tokens, engine {n / t_engine:6.0f} tok/s ({t_engine:.2f} s), "
          f"padded {n / t_padded:6.0f} tok/s ({t_padded:.2f} s)")"""),
    ("code", """\
%matplotlib inline
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.5))
for name, values in throughput.items():
    ax.plot(levels, values, marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(levels, [str(c) for c in levels])
ax.set_xlabel("concurrent requests (max_num_seqs / batch size)")
ax.set_ylabel("useful new tokens / s")
ax.set_ylim(bottom=0)
ax.set_title(f"bundled demo model, {len(prompts)} requests, {torch.get_num_threads()} CPU threads")
ax.grid(True, alpha=0.3)
ax.legend()
plt.show()"""),
    ("md", """\
## 3. The packaged benchmark

`hf_paged_attn.bench.run` takes the command line of `python -m hf_paged_attn.bench` and returns the
report it writes as JSON. `--smoke` is its tiny configuration (a random-weight model, 6 requests):
it compares the engine, the routed `model.generate`, transformers' own continuous batching
(`hf_cb`) and padded `generate` (`hf_padded`), checks that they all produce the same tokens, and
draws the throughput plot. With a model this small, per-step overhead dominates: every system stays
far below the forward-only bound (the dashed line). The full workloads take minutes:
`make bench BENCH_ARGS="--workload uniform"`."""),
    ("code", """\
import tempfile

from IPython.display import Image

from hf_paged_attn.bench import run

report = run(["--smoke", "--out", tempfile.mkdtemp(), "--threads", "1"])
Image(report["plot"])"""),
]

METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"},
}


def build(name: str, cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook(metadata=METADATA)
    for i, (kind, source) in enumerate(cells):
        cell = new_markdown_cell(source) if kind == "md" else new_code_cell(source)
        cell["id"] = f"{name[:2]}-{i:02d}"  # fixed ids: regenerating changes nothing
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the notebooks are up to date")
    args = parser.parse_args(argv)
    stale = []
    for name, cells in NOTEBOOKS.items():
        path = HERE / f"{name}.ipynb"
        text = render(build(name, cells))
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date (run python examples/make_notebooks.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
