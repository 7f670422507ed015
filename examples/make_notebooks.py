"""Write the example notebooks of this folder from the cells below, execute them, store them with outputs.

    python examples/make_notebooks.py               # (re)write and execute examples/*.ipynb (make notebooks)
    python examples/make_notebooks.py 02 04         # only the notebooks whose names start with these
    python examples/make_notebooks.py --check       # exit 1 if a stored notebook is stale or not cleanly executed

Edit the cells here, not in the .ipynb files, and run the script. The notebooks are stored executed,
so a reader browsing the repository sees the printed results and the figures; their cells have fixed
ids, so a diff shows what changed. The kernel runs on this interpreter (this checkout's package and
pinned versions) with OMP_WAIT_POLICY=PASSIVE unless the environment sets it, and without tqdm's
"IProgress not found" warning (ipywidgets is not installed here). A stored notebook must
be free of noise: no error, nothing on stderr (warnings, progress bars). ``integration_tests/test_notebooks.py``
checks the stored notebooks and executes every one again.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

# Every notebook loads the bundled demo model this way.
LOAD = """\
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

import hf_paged_attn  # importing it registers attn_implementation="paged" with transformers
{engine}from hf_paged_attn.demo import DEMO_MODEL{prompts}  # the 4.2M-parameter Llama that ships with the package

logging.disable_progress_bar()  # the 17 MB model loads in a blink: no "Loading weights" bar
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

## 3. Watch requests join and leave the batch

Twelve requests of different lengths, at most four running at once (`max_num_seqs=4`), and three
more arriving while the others run. Each time a request finishes, a waiting one takes its slot at the
next step. The loop records, after each step (`engine.stats.num_steps`), how many requests run and
wait and how many KV blocks they hold: a finished request gives its blocks back at once."""),
    ("code", """\
import random

from hf_paged_attn.demo import PROMPTS

engine = ContinuousBatchingEngine(model, PagedConfig(max_num_seqs=4))
rng = random.Random(0)
added, first, last = {}, {}, {}  # request id -> step count when it was added / gave its first / last token


def add(i):
    request_id = f"r{i}"
    ids = tokenizer(PROMPTS[i])["input_ids"]
    engine.add_request(ids, max_new_tokens=rng.randint(4, 24), request_id=request_id)
    added[request_id] = engine.stats.num_steps


for i in range(12):
    add(i)
per_step = {}  # step -> (running, waiting, KV blocks in use) after it
for out in engine.stream():
    stats = engine.stats
    step = stats.num_steps
    first.setdefault(out.request_id, step)
    last[out.request_id] = step
    per_step[step] = (stats.num_running, stats.num_waiting, stats.num_blocks - stats.num_free_blocks)
    if step == 20 and len(added) == 12:  # three late arrivals
        for i in range(12, 15):
            add(i)
print(f"{len(added)} requests in {engine.stats.num_steps} steps, "
      f"at most {engine.stats.peak_used_blocks} KV blocks of {engine.config.block_size} tokens in use")"""),
    ("code", """\
%matplotlib inline
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(7, 6.5), sharex=True, height_ratios=[3, 1.3, 1.3])
for row, request_id in enumerate(added):
    # Step k runs in [k - 1, k]: a request waits from when it was added, then runs steps first..last.
    top.barh(row, first[request_id] - 1 - added[request_id], left=added[request_id], color="lightgrey")
    top.barh(row, last[request_id] - first[request_id] + 1, left=first[request_id] - 1, color="C0")
top.set_yticks(range(len(added)), list(added))
top.invert_yaxis()
top.set_title("grey: waiting, blue: running (max_num_seqs=4)")

steps = sorted(per_step)
running, waiting, blocks = zip(*(per_step[s] for s in steps))
middle.plot(steps, running, drawstyle="steps-mid", label="running")
middle.plot(steps, waiting, drawstyle="steps-mid", label="waiting")
middle.set_ylabel("requests")
middle.yaxis.set_major_locator(MaxNLocator(integer=True))
middle.legend(fontsize=8, loc="upper right")
bottom.plot(steps, blocks, drawstyle="steps-mid", color="C3")
bottom.set_ylabel("KV blocks\\nin use")
bottom.set_ylim(bottom=0)
bottom.set_xlabel("engine step")
fig.tight_layout()
plt.show()"""),
    ("md", """\
## 4. Batch convenience and statistics

`engine.generate` queues a list of prompts, runs them to the end and returns their final outputs in
input order. `engine.stats` covers everything the engine has run (here the requests of section 3
too)."""),
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
    ("code", """\
%matplotlib inline
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(8, 3), sharey=True)
for ax, (wave, outs) in zip(axes, [("first wave", outputs), ("second wave", second_wave)]):
    cached = [out.num_cached_tokens for out in outs]
    computed = [len(out.prompt_ids) - c for out, c in zip(outs, cached)]
    ax.bar(range(len(outs)), cached, label="from the cache")
    ax.bar(range(len(outs)), computed, bottom=cached, label="computed")
    ax.set_title(wave)
    ax.set_xlabel("request")
axes[0].set_ylabel("prompt tokens")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()"""),
    ("md", """\
## 2. On vs off

The same requests with caching on and off, on a fresh engine each time: same tokens (it is an
optimization, not an approximation), less prefill work with it on. The loop records each request's
**time to first token** (TTFT): every prompt is queued at once, and a step's token budget
(`max_batch_tokens`) takes the prompts' uncomputed tokens only, so with the cache more prompts fit in
the first steps. Each setting runs three times; the chart shows the median TTFT per request.
**Timings are noisy**, on a shared CPU especially; with this tiny model the saving is modest, and it
grows with the length of the shared prefix and the cost of the model."""),
    ("code", """\
import statistics
import time


def run(enable_prefix_caching):
    engine = ContinuousBatchingEngine(model, PagedConfig(enable_prefix_caching=enable_prefix_caching))
    start = time.perf_counter()
    ids = [engine.add_request(p, max_new_tokens=16, request_id=f"q{i}") for i, p in enumerate(prompts)]
    ttft, tokens = {}, {}
    for out in engine.stream():
        ttft.setdefault(out.request_id, time.perf_counter() - start)
        if out.finished:
            tokens[out.request_id] = out.output_ids
    return time.perf_counter() - start, [ttft[i] for i in ids], [tokens[i] for i in ids], engine.stats


seconds, ttft, tokens = {}, {}, {}
for enabled in (True, False):
    runs = [run(enabled) for _ in range(3)]
    seconds[enabled] = statistics.median(r[0] for r in runs)
    ttft[enabled] = [statistics.median(r[1][i] for r in runs) for i in range(len(prompts))]
    tokens[enabled], stats = runs[0][2], runs[0][3]
    print(f"enable_prefix_caching={enabled!s:5}: median of 3 {seconds[enabled]:.2f} s, "
          f"median TTFT {1000 * statistics.median(ttft[enabled]):.0f} ms, "
          f"hit rate {stats.prefix_hit_rate:.0%}, {stats.num_steps} steps")

assert tokens[True] == tokens[False], "prefix caching changed the output"
print(f"same tokens either way; caching off took {seconds[False] / seconds[True]:.2f}x the time of caching on")"""),
    ("code", """\
fig, ax = plt.subplots(figsize=(7, 3))
width = 0.4
for shift, enabled in [(-width / 2, True), (width / 2, False)]:
    label = f"prefix caching {'on' if enabled else 'off'}"
    ax.bar([i + shift for i in range(len(prompts))], [1000 * t for t in ttft[enabled]], width, label=label)
ax.set_xticks(range(len(prompts)), [f"q{i}" for i in range(len(prompts))])
ax.set_xlabel("request (all queued at once)")
ax.set_ylabel("time to first token (ms)")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()"""),
]

NOTEBOOKS["05_benchmark"] = [
    ("md", """\
# Throughput: continuous batching vs padded `generate`

A small throughput experiment: the same requests served by
- the paged **engine** (continuous batching, up to `max_num_seqs` requests at once), and
- transformers' **padded `generate`** with `sdpa` attention, in static batches of the same size.

Then the package's own benchmark, `hf_paged_attn_tools.bench`, in its smoke configuration, and
speculative decoding (prompt lookup) by batch size. Numbers from a tiny model on a CPU say little
about a real model on a GPU; see `docs/performance.md` for the full workloads (`make bench`)."""),
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

`hf_paged_attn_tools.bench.run` takes the command line of `python -m hf_paged_attn_tools.bench` and returns the
report it writes as JSON. `--smoke` is its tiny configuration (a random-weight model, 6 requests):
it compares the engine, the routed `model.generate`, transformers' own continuous batching
(`hf_cb`) and padded `generate` (`hf_padded`), and checks that they all produce the same tokens.
With a model this small, per-step overhead dominates: every system stays far below the
forward-only bound (the model's forward alone on the same tokens, without any engine). The left
panel compares the systems; the right one puts them next to the bound, on a log scale. The full
workloads take minutes: `make bench BENCH_ARGS="--workload uniform"`."""),
    ("code", """\
import tempfile

from hf_paged_attn_tools.bench import run

report = run(["--smoke", "--out", tempfile.mkdtemp(), "--threads", "1", "--no-plot"])"""),
    ("code", """\
from matplotlib.ticker import NullFormatter

bound = report["bound"]["tokens_per_second"]
levels = sorted({c for points in report["sweep"].values() for c, _ in points})
best = {system: max(tps for _, tps in points) for system, points in report["sweep"].items()}

fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2), width_ratios=[3, 2])
for system, points in report["sweep"].items():
    xs, ys = zip(*points)
    left.plot(xs, ys, marker="o", label=system)
left.set_xscale("log", base=2)
left.set_xticks(levels, [str(c) for c in levels])
left.set_xlabel("concurrent requests")
left.set_ylabel("new tokens / s")
left.set_ylim(bottom=0)
left.set_title("smoke run: the systems")
left.legend(fontsize=8)
values = {**best, "forward-only bound": bound}
right.scatter(list(values.values()), list(values), color=[f"C{i}" for i in range(len(best))] + ["grey"], zorder=2)
for name, value in values.items():
    right.annotate(f"{value:,.0f}", (value, name), textcoords="offset points", xytext=(6, 4), fontsize=8)
right.set_xscale("log")
right.set_xlim(min(values.values()) / 3, bound * 5)
right.xaxis.set_minor_formatter(NullFormatter())  # decades only: the minor labels overlap
right.invert_yaxis()
right.grid(True, axis="x", alpha=0.3)
right.set_xlabel("new tokens / s (best level, log scale)")
right.set_title("against the bound")
fig.tight_layout()
plt.show()"""),
    ("md", """\
## 4. Speculative decoding: prompt lookup by batch size

`prompt_lookup_num_tokens=4`: each decoding request proposes up to 4 tokens copied from an earlier
occurrence of its last tokens, and one forward verifies them (greedy: exactly the plain tokens).
The demo model repeats itself, as documentation does, so some proposals are accepted. A verify step
costs its extra rows, so the engine picks every request's number of proposals per step from its
acceptance so far and the batch size: at batch 1 it speculates, in a big batch it stops by itself
(see the README's *Speculative decoding*; `benchmarks/speculative.py` measures it at length).
128 new tokens per request, EOS ignored; batch 1 runs 4 prompts one after the other. The clock is
the process's CPU time, steadier than wall time on a shared machine; medians of 5 rounds that
alternate the two. Still noisy: a few percent either way is noise."""),
    ("code", """\
import statistics

batch_sizes = [1, 4, 16]
new_tokens = 128
speculative = {"plain": {}, "prompt lookup (k=4)": {"prompt_lookup_num_tokens": 4}}
rates = {name: [] for name in speculative}


def run_batch(size, options):
    \"\"\"CPU seconds and new tokens of generate on the first ``size`` prompts (batch 1: 4 calls of one).\"\"\"
    groups = [PROMPTS[i : i + 1] for i in range(4)] if size == 1 else [PROMPTS[:size]]
    start, tokens = time.process_time(), []
    for group in groups:
        batch = tokenizer(group, padding=True, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=new_tokens, eos_token_id=None, do_sample=False, **options)
        tokens += out[:, batch["input_ids"].shape[1] :].tolist()
    return time.process_time() - start, tokens


_ = run_batch(1, speculative["prompt lookup (k=4)"])  # warm-up
for size in batch_sizes:
    seconds, outputs = {name: [] for name in speculative}, {}
    for r in range(5):
        for name in list(speculative)[:: 1 if r % 2 else -1]:
            elapsed, outputs[name] = run_batch(size, speculative[name])
            seconds[name].append(elapsed)
    assert outputs["plain"] == outputs["prompt lookup (k=4)"]  # greedy: the same tokens
    for name in speculative:
        rates[name].append(sum(map(len, outputs[name])) / statistics.median(seconds[name]))
    print(f"batch {size:>2}: " + ", ".join(f"{name} {rates[name][-1]:5.0f} tok/s" for name in speculative))

fig, ax = plt.subplots(figsize=(6, 3.5))
for name, values in rates.items():
    ax.plot(batch_sizes, values, marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
ax.set_xlabel("requests in one generate call")
ax.set_ylabel("new tokens / CPU second")
ax.set_ylim(bottom=0)
ax.set_title("bundled demo model, greedy, with and without prompt lookup")
ax.grid(True, alpha=0.3)
ax.legend()
plt.show()"""),
]

NOTEBOOKS["06_structured_outputs"] = [
    ("md", """\
# Structured outputs and tool calls

A request can say what its output must look like: a JSON schema, any JSON object, a regular
expression, one of a list of choices, or a grammar. The engine compiles it (with
[llguidance](https://github.com/guidance-ai/llguidance), the `[structured]` extra) and, at every
step, masks the logits of the tokens that would break it, so **every** output matches, whatever the
model. The bundled demo model knows nothing of JSON or tools; everything valid below is the
grammar's doing (the *values* are the model's: doc-like nonsense).

This notebook uses the Python API first, then the OpenAI-compatible server through the official
`openai` client: JSON extracted into a pydantic model, vLLM's `structured_outputs`, and a tool-call
round trip."""),
    ("code", load(padding_side="left", engine=True)),
    ("md", """\
## 1. In Python: `generate(structured=...)` and `add_request(structured=...)`

`structured` takes a dict with one of `json` (a schema), `json_object`, `regex`, `choice` or
`grammar` (Lark or GBNF); it needs the `tokenizer`. A request ends with `finish_reason="stop"` as
soon as its output is a complete match. JSON comes without free whitespace, with `json.dumps`'s
separators."""),
    ("code", """\
import json

schema = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "version": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["name", "version"],
    "additionalProperties": False,
}
batch = tokenizer(["A Python module, as JSON:", "Another module:"], padding=True, return_tensors="pt")
out = model.generate(**batch, max_new_tokens=60, tokenizer=tokenizer, structured={"json": schema})
for row in out[:, batch["input_ids"].shape[1] :]:
    text = tokenizer.decode(row, skip_special_tokens=True)
    print(text, "->", json.loads(text))

engine = ContinuousBatchingEngine(model, PagedConfig(seed=0))
ids = [
    engine.add_request(tokenizer("Is a tuple mutable?")["input_ids"], max_new_tokens=8, tokenizer=tokenizer,
                       structured={"choice": ["yes", "no"]}),
    engine.add_request(tokenizer("A release:")["input_ids"], max_new_tokens=12, tokenizer=tokenizer,
                       structured={"regex": r"3\\.1[0-4]\\.[0-9]"}),
    engine.add_request(tokenizer("A free one:")["input_ids"], max_new_tokens=12),  # in the same batch, unconstrained
]
for out in engine.collect(ids):
    text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
    print(f"{out.request_id}: {text!r} ({out.finish_reason})")"""),
    ("md", """\
A schema the library cannot enforce is refused up front with the keyword it lacks, never silently
ignored:"""),
    ("code", """\
try:
    engine.add_request([1, 2, 3], tokenizer=tokenizer, structured={"json": {"type": "array", "uniqueItems": True}})
except ValueError as exc:
    print("ValueError:", exc)"""),
    ("md", """\
## 2. Over HTTP: a server on the bundled model

`ServerProcess` starts `hf-paged-attn serve` in a child process on a free port of 127.0.0.1 (the
same as running `hf-paged-attn serve DEMO_MODEL --chat-template FILE` by hand). The demo model's
own chat template does not show tools to the model, so this one, in the Hermes / Qwen style, is
given with `--chat-template`: it lists the tools and writes calls as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, which is also the format the server parses
(`--tool-call-parser auto` reads it from the template)."""),
    ("code", """\
from pathlib import Path

import openai
from pydantic import BaseModel, Field

import hf_paged_attn_tools
from hf_paged_attn_tools.launch import ServerProcess

template = Path(hf_paged_attn_tools.__file__).parent / "hermes_tools_template.jinja"
server = ServerProcess(DEMO_MODEL, ["--served-model-name", "demo", "--chat-template", str(template)]).start()
client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
print("server ready at", server.url)"""),
    ("md", """\
### JSON into a pydantic model

`client.chat.completions.parse(response_format=Model)` sends the model's JSON schema as
`response_format={"type": "json_schema", ...}` and parses the answer back into the model."""),
    ("code", """\
class Module(BaseModel):
    name: str = Field(max_length=16)
    stdlib: bool
    since: int = Field(ge=2, le=3)


question = [{"role": "user", "content": "Describe the json module."}]
completion = client.chat.completions.parse(model="demo", messages=question, response_format=Module, temperature=1)
print(completion.choices[0].message.content)
print(repr(completion.choices[0].message.parsed))"""),
    ("md", """\
### vLLM's `structured_outputs`

Clients written for vLLM send `structured_outputs` (or the older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`) in the extra body; both endpoints take them, as they take
`response_format`. A schema is enforced as written: an object it does not close with
`"additionalProperties": false` may get properties it does not name, as JSON Schema allows
(OpenAI's strict schemas, like pydantic's above, close every object)."""),
    ("code", """\
for body in ({"structured_outputs": {"choice": ["list", "tuple", "dict"]}},
             {"structured_outputs": {"regex": r"[a-z]+_[a-z]+\\(\\)"}},
             {"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}):
    out = client.completions.create(model="demo", prompt="The answer:", max_tokens=20, extra_body=body)
    print(f"{list(body.values())[0]} -> {out.choices[0].text!r}")"""),
    ("md", """\
## 3. A tool-call round trip

The tools are OpenAI function tools. `tool_choice="required"` (or a named function) makes the
output a call, enforced by a grammar over the tools' parameter schemas; with `"auto"` (the
default when tools are given) the server parses calls out of whatever the model writes. The call
comes back as `message.tool_calls` with `finish_reason="tool_calls"`; we run the function here,
send its result back as a `tool` message, and the model answers in text."""),
    ("code", """\
def word_count(text: str) -> int:
    return len(text.split())


tools = [{"type": "function", "function": {
    "name": "word_count", "description": "Count the words of a text",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40}},
                   "required": ["text"], "additionalProperties": False}}}]
messages = [{"role": "user", "content": "How many words are in 'the zen of python'?"}]
first = client.chat.completions.create(model="demo", messages=messages, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1, seed=1)
call = first.choices[0].message.tool_calls[0]
print(first.choices[0].finish_reason, call.function.name, call.function.arguments)

result = word_count(**json.loads(call.function.arguments))
messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
second = client.chat.completions.create(model="demo", messages=messages, tools=tools, max_tokens=24)
print(second.choices[0].finish_reason, repr(second.choices[0].message.content))"""),
    ("md", """\
Streamed, a call arrives as OpenAI streams it: a first delta with the call's `id`, `type` and
`function.name`, then fragments of `function.arguments`, each with the call's `index`."""),
    ("code", """\
stream = client.chat.completions.create(model="demo", messages=messages[:1], tools=tools, stream=True,
                                        tool_choice={"type": "function", "function": {"name": "word_count"}})
for chunk in stream:
    choice = chunk.choices[0]
    for delta in choice.delta.tool_calls or []:
        print(f"index {delta.index}: id={delta.id} name={delta.function.name} arguments={delta.function.arguments!r}")
    if choice.finish_reason:
        print("finish_reason:", choice.finish_reason)"""),
    ("code", """\
print("server exit status:", server.stop())"""),
]

METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"},
}


# Figures each notebook must show once executed (image/png outputs).
FIGURES = {"02_streaming_engine": 1, "04_prefix_caching": 2, "05_benchmark": 3}
TIMEOUT_S = 180  # per cell


def build(name: str, cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """The notebook as this script writes it, without outputs."""
    nb = new_notebook(metadata=copy.deepcopy(METADATA))
    for i, (kind, source) in enumerate(cells):
        cell = new_markdown_cell(source) if kind == "md" else new_code_cell(source)
        cell["id"] = f"{name[:2]}-{i:02d}"  # fixed ids: regenerating changes only what changed
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def stripped(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy without outputs: what :func:`build` wrote before execution."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = TIMEOUT_S) -> nbformat.NotebookNode:
    """Run every cell of ``nb`` in place, in a fresh kernel on this interpreter and this checkout."""
    import nbclient
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import KernelManager

    class ThisPythonKernels(KernelSpecManager):
        """Every kernel name maps to an ipykernel on this interpreter, whatever kernels are installed."""

        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            return KernelSpec(
                argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                display_name=f"Python ({sys.executable})",
                language="python",
                name=kernel_name,
            )

    env = dict(os.environ)
    # OpenMP threads that spin while waiting make a busy 2-core machine up to 10x slower.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # tqdm.auto warns on import when ipywidgets is missing, as in this headless kernel (Jupyter with
    # ipywidgets does not); the notebooks themselves switch transformers' progress bars off.
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), "ignore:IProgress not found") if w)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ThisPythonKernels())
    client = nbclient.NotebookClient(
        nb, km=km, timeout=timeout, resources={"metadata": {"path": str(HERE)}},
        record_timing=False, coalesce_streams=True,  # no timestamps in the stored file; one output per stream
    )
    # cleanup_kc: shut the kernel down afterwards. Raises CellExecutionError naming the cell if one fails.
    client.execute(env=env, cleanup_kc=True)
    nb.metadata = copy.deepcopy(METADATA)  # not the kernel's versions: the stored file stays machine-independent
    return nb


def problems(name: str, nb: nbformat.NotebookNode) -> list[str]:
    """What is wrong with an executed notebook: unexecuted cells, errors, stderr noise, missing figures."""
    found, figures, count = [], 0, 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        count += 1
        if cell.execution_count != count:
            found.append(f"{name}: cell {cell.id} not executed in order (execution_count {cell.execution_count})")
        for output in cell.outputs:
            if output.output_type == "error":
                found.append(f"{name}: cell {cell.id} raised {output.ename}")
            elif output.output_type == "stream" and output.name == "stderr":
                found.append(f"{name}: cell {cell.id} wrote to stderr: {output.text.strip()[:120]!r}")
            elif "image/png" in output.get("data", {}):
                figures += 1
    if figures != FIGURES.get(name, 0):
        found.append(f"{name}: {figures} figures, expected {FIGURES.get(name, 0)}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="name prefixes of the notebooks to write (default: all)")
    parser.add_argument("--check", action="store_true", help="only check the stored notebooks; write nothing")
    args = parser.parse_args(argv)
    selected = {n: c for n, c in NOTEBOOKS.items() if not args.names or any(n.startswith(p) for p in args.names)}
    if not selected:
        parser.error(f"no notebook starts with {args.names}; notebooks: {', '.join(NOTEBOOKS)}")
    found = []
    for name, cells in selected.items():
        path = HERE / f"{name}.ipynb"
        nb = build(name, cells)
        if args.check:
            if not path.exists():
                found.append(f"{name}: missing")
                continue
            stored = nbformat.read(path, as_version=4)
            if render(stripped(stored)) != render(nb):
                found.append(f"{name}: cells differ from examples/make_notebooks.py")
            found += problems(name, stored)
            continue
        start = time.perf_counter()
        execute(nb)
        found += problems(name, nb)
        path.write_text(render(nb))
        print(f"wrote {path.relative_to(HERE.parent)} ({time.perf_counter() - start:.1f} s)")
    for line in found:
        print(line, file=sys.stderr)
    if found and args.check:
        print("regenerate them with: make notebooks (python examples/make_notebooks.py)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
