"""Logits processors that read the ids, per step, for 64 rows: per row (the engine today), batched
(``runtime/processors/``) and transformers on the padded batch.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/processors_cpu.py [--rows 64] [--steps 32] [--repeats 3] [--threads 1]

One ``model.generate``-like batch of ``--rows`` prompts (random lengths 8-64, left-padded) of the
bundled demo model (vocab 4,096) decodes ``--steps`` tokens greedily from random logits with
``repetition_penalty=1.3, min_new_tokens=64, no_repeat_ngram_size=3``, starting after ``--start``
generated tokens. Each step, each system processes the step's logits and appends the argmax:

* ``per_row``: what ``sampling._sample_row`` does today: each row's ``[1, seq]`` ids from its
  Python list, then its own ``LogitsProcessorList`` (from ``make_sampling_params``);
* ``batched``: ``TokenHistory.rows`` + ``run_plans`` on the stacked rows, then ``TokenHistory.append``;
* ``hf_padded``: transformers' list built for the batch, on the padded ``[rows, len]`` ids, then a
  ``torch.cat`` of the new column (what ``generate`` does).

The three must pick the same tokens (checked). Printed: median ms per step over the steps of
``--repeats`` runs, per start length, and the ratios. Steps are timed alternating between systems.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.runtime.processors import TokenHistory, plan_processors, run_plans
from hf_paged_attn.runtime.sampling import make_sampling_params, padding_mask

OPTIONS = dict(repetition_penalty=1.3, min_new_tokens=64, no_repeat_ngram_size=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--start", type=int, nargs="+", default=[0, 256], help="generated tokens before timing")
    parser.add_argument("--repeats", type=int, default=3, help="runs per start length (other random rows), pooled")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa")
    vocab = model.config.vocab_size
    config = model._prepare_generation_config(GenerationConfig(**OPTIONS))[0]
    model._prepare_special_tokens(config, True)
    print(f"rows={args.rows} vocab={vocab} steps={args.steps} threads={args.threads} {OPTIONS}")
    print(f"{'start':>6} {'len':>5} {'per_row ms':>11} {'batched ms':>11} {'hf_padded ms':>13} "
          f"{'per_row/batched':>16} {'hf_padded/batched':>18}")  # fmt: skip
    for start in args.start:
        times: dict[str, list] = {}
        for seed in range(args.repeats):
            for name, values in run(model, config, vocab, args.rows, start, args.steps, seed).items():
                times.setdefault(name, []).extend(values)
        med = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        width = statistics.median(times["width"])
        print(f"{start:>6} {width:>5.0f} {med['per_row']:>11.2f} {med['batched']:>11.2f} {med['hf_padded']:>13.2f} "
              f"{med['per_row'] / med['batched']:>15.1f}x {med['hf_padded'] / med['batched']:>17.2f}x")  # fmt: skip


def run(  # noqa: ANN001
    model, config: GenerationConfig, vocab: int, num_rows: int, start: int, steps: int, seed: int
) -> dict[str, list]:
    gen = torch.Generator().manual_seed(seed * 1000 + start)
    lengths = torch.randint(8, 65, (num_rows,), generator=gen).tolist()
    width = max(lengths)
    pad = int(config._pad_token_tensor)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    prefixes = [[pad] * (width - n) for n in lengths]
    # Tokens already generated: from a small alphabet, so that n-grams repeat and get banned
    outputs = [torch.randint(3, 40, (start,), generator=gen).tolist() for _ in range(num_rows)]
    logits = torch.randn(steps, num_rows, vocab, generator=gen)

    # per_row: each request's own list, as make_sampling_params builds it
    params = [
        make_sampling_params(model, config, len(p), prefix=pre, max_new_tokens=start + steps)
        for p, pre in zip(prompts, prefixes)
    ]
    lists = [pre + p + o for pre, p, o in zip(prefixes, prompts, outputs)]  # prefix + request.all_ids
    # batched: the same lists as plans, rows in a TokenHistory
    plans = [plan_processors(s.processors) for s in params]
    assert len({plan.key for plan in plans}) == 1
    history = TokenHistory()
    for i, row in enumerate(lists):
        history.add(i, row, num_prompt=width)
    keys = list(range(num_rows))
    # hf_padded: the list generate builds for the whole batch, on the padded ids
    mask = torch.cat([padding_mask(width - n, width, config) for n in lengths])  # [rows, width]
    batch_list = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=width, model_kwargs={"attention_mask": mask}, device="cpu"
    )
    padded = torch.tensor(lists)

    def per_row(step: int) -> torch.Tensor:
        tokens = []
        for i, s in enumerate(params):
            history_ids = torch.tensor([lists[i]])  # [1, seq]
            tokens.append(int(s.processors(history_ids, logits[step, i : i + 1].clone()).argmax(dim=-1)))
        for row, token in zip(lists, tokens):
            row.append(token)
        return torch.tensor(tokens)

    def batched(step: int) -> torch.Tensor:
        tokens = run_plans(plans, history.rows(keys), logits[step].clone()).argmax(dim=-1)
        history.append(keys, tokens)
        return tokens

    def hf_padded(step: int) -> torch.Tensor:
        nonlocal padded
        tokens = batch_list(padded, logits[step].clone()).argmax(dim=-1)
        padded = torch.cat([padded, tokens[:, None]], dim=-1)
        return tokens

    systems = {"per_row": per_row, "batched": batched, "hf_padded": hf_padded}
    times: dict[str, list] = {name: [] for name in systems}
    for step in range(steps):
        picked = {}
        for name, fn in systems.items():
            begin = time.perf_counter()
            picked[name] = fn(step)
            times[name].append(time.perf_counter() - begin)
        assert torch.equal(picked["per_row"], picked["batched"]) and torch.equal(picked["per_row"], picked["hf_padded"])
    times["width"] = [width + start]
    return times


if __name__ == "__main__":
    main()
