"""Data-parallel generation with accelerate: one engine per process, prompts split, results gathered.

    # one process per GPU
    accelerate launch --num_processes 2 examples/data_parallel.py --out results.jsonl
    # CPU only: accelerate's torchrun launcher and gloo (``--cpu`` alone starts ONE process unless
    # mpirun and a hostfile are set up, accelerate#2741), and PartialState(cpu=True) via --cpu below
    accelerate launch --multi_gpu --num_processes 2 examples/data_parallel.py --cpu --out results.jsonl

Every process loads its own copy of the model and runs its contiguous share of the prompts through
its own ``ContinuousBatchingEngine``; ``gather_object`` concatenates the shares in rank order,
which is input order. Greedy decoding gives the same tokens however the prompts are split; sampled
runs need a seed per request (not per process) for that.
"""

from __future__ import annotations

import argparse
import json

from accelerate import PartialState
from accelerate.utils import gather_object
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_paged_attn  # noqa: F401  (registers attn_implementation="paged")
from hf_paged_attn import ContinuousBatchingEngine
from hf_paged_attn.demo import DEMO_MODEL, PROMPTS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_MODEL), help="local path or hub id (default: bundled model)")
    parser.add_argument("--prompts", help="a text file, one prompt per line (default: the demo's prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cpu", action="store_true", help="processes on the CPU, gloo between them")
    parser.add_argument("--out", help="write one JSON object per prompt here, in input order")
    args = parser.parse_args(argv)

    # Without cpu=True, PartialState on a machine without GPUs ignores the launcher and every
    # process believes it is alone (and generates everything).
    state = PartialState(cpu=args.cpu)
    prompts = PROMPTS
    if args.prompts:
        with open(args.prompts) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="paged").to(state.device).eval()
    engine = ContinuousBatchingEngine(model)

    # Contiguous shares in rank order (uneven when the count does not divide): rank 0 gets the first.
    with state.split_between_processes(prompts) as share:
        outputs = engine.generate([tokenizer(p)["input_ids"] for p in share], max_new_tokens=args.max_new_tokens)
        rows = [
            {
                "prompt": prompt,
                "completion": tokenizer.decode(out.output_ids, skip_special_tokens=True),
                "output_ids": out.output_ids,
                "finish_reason": out.finish_reason,
                "rank": state.process_index,
            }
            for prompt, out in zip(share, outputs)
        ]
    rows = gather_object(rows)  # every process must call it, even with an empty share

    if state.is_main_process:
        print(f"{len(rows)} prompts over {state.num_processes} processes on {state.device.type}")
        if args.out:
            with open(args.out, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        else:
            for row in rows:
                print(f"[rank {row['rank']}] {row['prompt']}\033[1m{row['completion']}\033[0m")
    state.wait_for_everyone()


if __name__ == "__main__":
    main()
