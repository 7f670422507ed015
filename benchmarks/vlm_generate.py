"""32 image+text requests: the paged model's ``generate`` against sdpa's padded ``generate``, side by side.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/vlm_generate.py [--rounds 3] [--family llava] [--new 32]

Tiny random models (``hf_paged_attn_tools.tiny_vlms``), fp32 on the CPU: the figure measures the engine's
batching of ragged image+text prompts against padding, not a real model's speed. Prompts: one image each,
then 2-60 words (seeded); ``--new`` new tokens each, EOS ignored (every system does the same work), greedy.
Each round runs, alternating: paged ``generate`` with all 32 prompts in one call (the default config, which
compiles the text model's forward in the background, then ``PagedConfig(compile=False)``), sdpa's padded
``generate`` in batches of 8, and all 32 at once. Prints every round, the medians, their ratios, and whether the paged
tokens equal sdpa's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hf_paged_attn import PagedConfig
from hf_paged_attn_tools.tiny_vlms import BUILDERS, random_image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(BUILDERS), default="llava")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    vlm = BUILDERS[args.family]()
    rng = random.Random(0)
    texts = [f"{vlm.image_text} " + " ".join(["word"] * rng.randint(2, 60)) for _ in range(args.requests)]
    images = [random_image(i) for i in range(args.requests)]
    options = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)

    eager = {"paged_config": PagedConfig(compile=False)}

    def run(attn: str, batch: int, extra: dict | None = None) -> tuple[float, list[list[int]]]:
        vlm.model.set_attn_implementation(attn)
        rows, start = [], time.perf_counter()
        for i in range(0, args.requests, batch):
            inputs = vlm.inputs(texts[i : i + batch], images[i : i + batch])
            out = vlm.model.generate(**inputs, **options, **(extra or {}))
            rows += out[:, inputs["input_ids"].shape[1] :].tolist()
        return time.perf_counter() - start, rows

    systems = {"paged, all at once": ("paged", args.requests, None),
               "paged, eager": ("paged", args.requests, eager), "sdpa, batches of 8": ("sdpa", 8, None),
               f"sdpa, all {args.requests} padded": ("sdpa", args.requests, None)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, (attn, batch, extra) in systems.items():
                seconds, outputs[name] = run(attn, batch, extra)
                times[name].append(seconds)
                print(f"round {r}: {name:<22} {seconds:7.3f} s  {args.requests * args.new / seconds:8.1f} tok/s")
    vlm.model.set_attn_implementation("paged")
    medians = {name: statistics.median(t) for name, t in times.items()}
    paged = medians["paged, all at once"]
    for name, seconds in medians.items():
        print(f"median {name:<22} {seconds:7.3f} s  ({seconds / paged:.2f}x the paged time)")
    same = {name: outputs[name] == outputs["paged, all at once"] for name in systems}
    print(f"tokens equal to paged's: {same}")


if __name__ == "__main__":
    main()
