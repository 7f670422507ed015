"""32 image+text requests: the paged engine against sdpa's padded ``generate``, side by side.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/vlm_generate.py [--model small|tiny] [--rounds 3] [--threads 1]

``--model small`` (the default): a LLaVA whose text model is the text benchmarks' 30M Llama (hidden 512, 8
layers, vocab 8,192) and whose vision tower is a small CLIP (hidden 256, 4 layers, 224x224 images in 14x14
patches: 256 image tokens each; ``tiny_vlms.small_llava``), random weights, fp32 on the CPU. The workload is
``uniform``'s (``bench/workloads.py``): 16-256 text tokens and 8-128 new tokens per request (seeded), with one
random image before the text of every request but each eighth (those are text only); EOS never ends a
request, so every system does the same work. ``--model tiny``: the tiny random LLaVA of the tests
(``tiny_vlms.tiny_llava``: 16x16 images, 16 image tokens), one image and 2-60 words each, 32 new tokens
each: a quick run, where a forward costs about what the engine's per-step work costs.

Systems, alternating within each round:

- ``engine``: a ``ContinuousBatchingEngine`` (``PagedConfig(compile="startup")``), made, its forward
  compiled and two requests run before the timing starts, then the requests queued with
  ``add_request(ids, max_new_tokens=n, pixel_values=...)``, each ending at its own length;
- ``engine, eager``: the same with ``compile=False``;
- ``paged generate``: ``model.generate`` on the paged model, all requests in one call, timed whole (it makes
  its engine inside; ``PagedConfig(compile="startup")`` reuses the engine system's compiled graph, which runs
  before it in every round), every row run to the longest row's new tokens (``generate`` takes one
  ``max_new_tokens``) and cut;
- ``sdpa, batches of 8`` / ``sdpa, all 32``: transformers' padded ``generate``, each batch run to its longest
  row and cut, as the text benchmarks' static batches.

Prints every round, the medians and their ratios, the engine's step counters, and whether every system's
tokens equal sdpa's (all 32)'s, a difference at a near-tie (top-2 logit gap under 1e-4) not counted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn_tools.bench.workloads import FULL_MODEL, uniform
from hf_paged_attn_tools.tiny_vlms import random_image, small_llava, tiny_llava

TIE = 1e-4  # top-2 logit gap under which a differing greedy token is a near-tie, not a bug (compare_greedy's)


@dataclass
class Row:
    """One request: its prompt ids (image tokens included), its image's ``pixel_values`` [1, 3, H, W] or
    None (a text-only request), and its new tokens."""

    ids: list[int]
    pixels: torch.Tensor | None
    new: int


def small_rows(num: int, image_size: int, patch_size: int) -> tuple[torch.nn.Module, list[Row], int]:
    """The benchmark-size LLaVA and ``uniform``'s prompts, each but every eighth behind one image."""
    model = small_llava(image_size=image_size, patch_size=patch_size)
    work = uniform(num, model=FULL_MODEL)
    image_tokens = [model.config.image_token_index] * (image_size // patch_size) ** 2
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i, (prompt, new) in enumerate(zip(work.prompts, work.max_new_tokens)):
        if i % 8 == 7:
            rows.append(Row(prompt, None, new))
        else:
            pixels = torch.randn(1, 3, image_size, image_size, generator=gen)  # normalized pixels, as CLIP's
            rows.append(Row(image_tokens + prompt, pixels, new))
    return model, rows, FULL_MODEL.config().pad_token_id


def tiny_rows(num: int, new: int) -> tuple[torch.nn.Module, list[Row], int]:
    """The tests' tiny LLaVA, one image and 2-60 words each (its processor's output, one row at a time)."""
    vlm = tiny_llava()
    rng = random.Random(0)
    rows = []
    for i in range(num):
        text = f"{vlm.image_text} " + " ".join(["word"] * rng.randint(2, 60))
        one = vlm.inputs([text], [random_image(i)])
        rows.append(Row(one["input_ids"][0].tolist(), one["pixel_values"], new))
    return vlm.model, rows, vlm.tokenizer.pad_token_id


def padded(rows: list[Row], pad: int) -> dict[str, torch.Tensor]:
    """What a processor returns for ``rows``: left-padded ids, their mask, the images' ``pixel_values``."""
    width = max(len(r.ids) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r.ids)) + r.ids for r in rows])
    mask = torch.tensor([[0] * (width - len(r.ids)) + [1] * len(r.ids) for r in rows])
    batch = {"input_ids": ids, "attention_mask": mask}
    images = [r.pixels for r in rows if r.pixels is not None]
    if images:
        batch["pixel_values"] = torch.cat(images)
    return batch


def run_generate(model: torch.nn.Module, rows: list[Row], pad: int, batch: int, **extra: object) -> list[list[int]]:
    """``model.generate`` over batches of ``rows``, each run to its longest row's new tokens, rows cut."""
    out = []
    for i in range(0, len(rows), batch):
        part = rows[i : i + batch]
        inputs = padded(part, pad)
        longest = max(r.new for r in part)
        seqs = model.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest, do_sample=False, **extra)
        out += [s[inputs["input_ids"].shape[1] :][: r.new].tolist() for s, r in zip(seqs, part)]
    return out


def run_engine(engine: ContinuousBatchingEngine, rows: list[Row]) -> list[list[int]]:
    """Every request queued at once, each with its own ``max_new_tokens``; stepped until all finish."""
    ids = []
    for r in rows:
        images = {} if r.pixels is None else {"pixel_values": r.pixels}
        ids.append(engine.add_request(r.ids, max_new_tokens=r.new, **images))
    return [out.output_ids for out in engine.collect(ids, progress_bar=False)]


def near_tie(model: torch.nn.Module, row: Row, expected: list[int], pos: int) -> bool:
    """Whether sdpa's top-2 logits after ``expected[:pos]`` are within ``TIE`` (either token is greedy's)."""
    ids = torch.tensor([row.ids + expected[:pos]])
    images = {} if row.pixels is None else {"pixel_values": row.pixels}
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **images).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]) < TIE


def differences(model: torch.nn.Module, rows: list[Row], expected: list[list[int]], got: list[list[int]]) -> str:
    """``"equal"``, or how many rows differ beyond a near-tie (and how many at one)."""
    ties = bad = 0
    for row, exp, act in zip(rows, expected, got):
        if exp == act:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(exp, act)) if a != b), None)
        if pos is not None and near_tie(model, row, exp, pos):
            ties += 1
        else:
            bad += 1
    if not ties and not bad:
        return "equal"
    return f"{bad} rows differ, {ties} at a near-tie"


Timed = tuple[float, list[list[int]], str]  # wall seconds, each request's new tokens, a note to print


def time_engine(model: torch.nn.Module, rows: list[Row], config: PagedConfig) -> Timed:
    """``run_engine`` on a fresh engine, timed after its compile and a two-request warm-up."""
    engine = ContinuousBatchingEngine(model, config)
    try:
        run_engine(engine, rows[:2])  # pages allocated, kernels warm: not timed
        before, start = engine.stats, time.perf_counter()
        out = run_engine(engine, rows)
        seconds, after = time.perf_counter() - start, engine.stats
    finally:
        engine.shutdown()
    steps = after.num_steps - before.num_steps
    forward = after.forward_seconds - before.forward_seconds
    rest_ms = 1e3 * (after.busy_seconds - before.busy_seconds - forward) / max(steps, 1)
    return seconds, out, f"  ({steps} steps, forward {forward:.2f} s, the rest {rest_ms:.1f} ms a step)"


def time_generate(model: torch.nn.Module, rows: list[Row], pad: int, attn: str, batch: int, **extra: object) -> Timed:
    """``run_generate`` with the model's attention set to ``attn`` for the call, timed whole."""
    model.set_attn_implementation(attn)
    try:
        start = time.perf_counter()
        out = run_generate(model, rows, pad, batch, **extra)
        return time.perf_counter() - start, out, ""
    finally:
        model.set_attn_implementation("paged")


def systems(model: torch.nn.Module, rows: list[Row], pad: int) -> dict[str, tuple[str, Callable[[], Timed]]]:
    """Each system's ``--systems`` key: its printed name and its timed run."""
    n = len(rows)
    # compile="startup": the first engine compiles the forward while it is made (not timed); later engines on
    # the model, the paged generate's included, reuse its graph
    compiled, eager = PagedConfig(compile="startup", progress_bar=False), PagedConfig(compile=False, progress_bar=False)
    return {
        "engine": ("engine", lambda: time_engine(model, rows, compiled)),
        "eager": ("engine, eager", lambda: time_engine(model, rows, eager)),
        "generate": ("paged generate", lambda: time_generate(model, rows, pad, "paged", n, paged_config=compiled)),
        "sdpa8": ("sdpa, batches of 8", lambda: time_generate(model, rows, pad, "sdpa", 8)),
        "sdpa": (f"sdpa, all {n}", lambda: time_generate(model, rows, pad, "sdpa", n)),
    }


def report(model: torch.nn.Module, rows: list[Row], times: dict[str, list[float]], outputs: dict) -> None:
    """The medians, their ratios to the sdpa systems, and every system's tokens against sdpa's (all at once)."""
    new_tokens, reference = sum(r.new for r in rows), f"sdpa, all {len(rows)}"
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        ratios = "  ".join(f"{medians[o] / seconds:5.2f}x {o}" for o in medians if o.startswith("sdpa"))
        print(f"median {name:<20} {seconds:7.3f} s  {new_tokens / seconds:7.1f} new tok/s  is {ratios}")
    model.set_attn_implementation("sdpa")  # the near-tie check's logits are sdpa's
    try:
        for name in times:
            found = differences(model, rows, outputs[reference], outputs[name])
            print(f"tokens of {name} against {reference}'s: {found}")
    finally:
        model.set_attn_implementation("paged")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("small", "tiny"), default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--new", type=int, default=32, help="new tokens of each request (--model tiny)")
    parser.add_argument("--image-size", type=int, default=224, help="--model small: image side, pixels")
    parser.add_argument("--patch-size", type=int, default=14, help="--model small: patch side, pixels")
    parser.add_argument("--systems", default=None,
                        help="comma-separated subset of engine,eager,generate,sdpa8 (sdpa, all of them at once, "
                             "always runs: the tokens are checked against its)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "small":
        model, rows, pad = small_rows(args.requests, args.image_size, args.patch_size)
    else:
        model, rows, pad = tiny_rows(args.requests, args.new)
    lens, new = [len(r.ids) for r in rows], [r.new for r in rows]
    print(f"{len(rows)} requests ({sum(r.pixels is not None for r in rows)} with an image), {sum(lens)} prompt "
          f"tokens ({min(lens)}-{max(lens)}), {sum(new)} new tokens ({min(new)}-{max(new)}), "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    keep = set(args.systems.split(",")) | {"sdpa"} if args.systems else None
    chosen = {name: run for key, (name, run) in systems(model, rows, pad).items() if keep is None or key in keep}
    times: dict[str, list[float]] = {name: [] for name in chosen}
    outputs: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, run in chosen.items():  # alternating: the machine's load moves every system alike
                seconds, outputs[name], note = run()
                times[name].append(seconds)
                print(f"round {r}: {name:<20} {seconds:7.3f} s  {sum(new) / seconds:7.1f} new tok/s{note}", flush=True)
        report(model, rows, times, outputs)


if __name__ == "__main__":
    main()
