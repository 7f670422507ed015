#!/usr/bin/env python
"""Train the tiny demo causal LM that ships in ``hf_paged_attn/assets/demo-model/``.

Everything is offline and reproducible (fixed seed, deterministic data order, one CPU thread):

* data: the Python documentation topics shipped with CPython (``pydoc_data.topics``) plus the
  docstrings of the public stdlib modules, classes and functions, in sorted order;
* tokenizer: byte-level BPE (``tokenizers``) wrapped as a ``PreTrainedTokenizerFast``;
* model: a small ``LlamaForCausalLM`` trained with AdamW (linear warmup + cosine decay).

The number of optimizer steps is either given with ``--steps`` or calibrated from a wall-clock
budget (``--minutes``): a few timed steps estimate the step time and fix the total number of steps
before the schedule starts. The resulting step count is written to ``TRAINING.md``, so a run can be
repeated exactly with ``--steps N``.

Usage::

    python scripts/train_demo_model.py                      # ~20 minute budget
    python scripts/train_demo_model.py --steps 1500          # fixed number of steps
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import math
import os
import platform
import random
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "hf_paged_attn" / "assets" / "demo-model"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# stdlib modules that are skipped: side effects on import, GUI toolkits, platform-specific, tests.
_SKIP_MODULES = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "venv",
    "test",
    "msvcrt",
    "winreg",
    "winsound",
    "nt",
    "msilib",
    "pydoc_data",
}


# ----------------------------------------------------------------------------------------------- data
def _stdlib_docstrings() -> list[tuple[str, str]]:
    """(name, docstring) for public stdlib modules, their classes/functions and class methods."""
    docs: list[tuple[str, str]] = []
    names = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in _SKIP_MODULES)
    for modname in names:
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                mod = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - platform-specific modules simply do not exist here
            continue
        doc = inspect.getdoc(mod)
        if doc:
            docs.append((modname, doc))
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc:
                docs.append((f"{modname}.{name}", doc))
            if inspect.isclass(obj):
                for attr, val in sorted(vars(obj).items()):
                    if attr.startswith("_"):
                        continue
                    if inspect.isfunction(val) or inspect.ismethoddescriptor(val):
                        doc = inspect.getdoc(val)
                        if doc:
                            docs.append((f"{modname}.{name}.{attr}", doc))
    return docs


def load_corpus(use_docstrings: bool) -> list[str]:
    from pydoc_data.topics import topics

    texts = [topics[k].strip() for k in sorted(topics)]
    if use_docstrings:
        seen: set[str] = set()
        for _, doc in _stdlib_docstrings():
            doc = doc.strip()
            # Skip duplicates (inherited/aliased docstrings) and tiny fragments.
            if len(doc) < 40 or doc in seen:
                continue
            seen.add(doc)
            texts.append(doc)
    return [t for t in texts if t]


# ------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: prepend <s> when encoding with add_special_tokens=True.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    return hf_tok


# ---------------------------------------------------------------------------------------------- model
def build_model(tokenizer, args):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )
    return model


# ------------------------------------------------------------------------------------------- training
def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, batch: int, max_batches: int = 50) -> float:
    model.eval()
    n = (len(data) - 1) // seq_len
    starts = torch.arange(n) * seq_len
    losses = []
    for i in range(0, min(n, max_batches * batch), batch):
        s = starts[i : i + batch]
        x = torch.stack([data[j : j + seq_len] for j in s])
        y = torch.stack([data[j + 1 : j + seq_len + 1] for j in s])
        logits = model(input_ids=x).logits
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / max(1, len(losses))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--minutes", type=float, default=20.0, help="wall-clock training budget (ignored with --steps)"
    )
    p.add_argument("--steps", type=int, default=None, help="fixed number of optimizer steps")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--heldout-frac", type=float, default=0.02)
    p.add_argument("--no-docstrings", action="store_true", help="train on pydoc topics only")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--no-autocast",
        action="store_true",
        help="train in plain fp32 (default: bf16 autocast on CPU, fp32 master weights)",
    )
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    # ---- data
    texts = load_corpus(use_docstrings=not args.no_docstrings)
    order = list(range(len(texts)))
    random.Random(args.seed).shuffle(order)
    n_held = max(1, int(len(texts) * args.heldout_frac))
    held_idx, train_idx = sorted(order[:n_held]), sorted(order[n_held:])
    train_texts = [texts[i] for i in train_idx]
    held_texts = [texts[i] for i in held_idx]
    n_chars = sum(map(len, texts))
    print(
        f"corpus: {len(texts)} documents, {n_chars / 1e6:.2f} M chars "
        f"({len(train_texts)} train / {len(held_texts)} held-out)",
        flush=True,
    )

    # ---- tokenizer (trained on the training split only)
    tokenizer = train_tokenizer(train_texts, args.vocab)

    def encode(docs: list[str]) -> torch.Tensor:
        ids: list[int] = []
        tokenizer.model_max_length = 10**9  # documents are chunked below; silence the length warning
        for enc in tokenizer(docs, add_special_tokens=True)["input_ids"]:  # <s> text
            ids.extend(enc)
            ids.append(tokenizer.eos_token_id)  # </s>
        tokenizer.model_max_length = 1024
        return torch.tensor(ids, dtype=torch.long)

    train_data, held_data = encode(train_texts), encode(held_texts)
    print(
        f"tokenizer: vocab {len(tokenizer)}; train tokens {len(train_data):,}; "
        f"held-out tokens {len(held_data):,}",
        flush=True,
    )

    # ---- model
    model = build_model(tokenizer, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    L = args.seq_len
    hi = len(train_data) - L - 1

    def batch():
        idx = torch.randint(0, hi, (args.batch,), generator=gen)
        x = torch.stack([train_data[i : i + L] for i in idx])
        y = torch.stack([train_data[i + 1 : i + L + 1] for i in idx])
        return x, y

    def train_step(step: int, total: int) -> float:
        lr = lr_at(step, total, args.warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_autocast):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    model.train()
    total = args.steps
    step = 0
    calib_steps = 20
    t_train = time.time()
    ema = None
    budget_s = args.minutes * 60.0
    while total is None or step < total:
        if total is None and step == calib_steps:
            # Calibrate: fix the number of steps from the measured step time so that training ends
            # within the budget (keeping ~4% for evaluation and saving).
            per_step = (time.time() - t_train) / calib_steps
            remaining = budget_s * 0.96 - (time.time() - t_start)
            total = max(step + 1, step + int(remaining / per_step))
            print(f"calibration: {per_step:.3f} s/step -> {total} total steps", flush=True)
        # During calibration the schedule uses a provisional total (it only matters for warmup).
        loss = train_step(step, total if total is not None else 10**9)
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        step += 1
        if step % args.log_every == 0 or step == 1 or step == total:
            el = time.time() - t_train
            print(
                f"step {step:5d}/{total if total else '?'}  loss {loss:.4f}  ema {ema:.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {el / 60:.1f} min",
                flush=True,
            )
    train_time = time.time() - t_train
    tokens_seen = step * args.batch * L

    final_train_loss = evaluate(model, train_data, L, args.batch, max_batches=20)
    held_loss = evaluate(model, held_data, L, args.batch, max_batches=50)
    print(
        f"final: train loss (last step) {loss:.4f}, ema {ema:.4f}; eval train loss {final_train_loss:.4f}; "
        f"held-out loss {held_loss:.4f} (ppl {math.exp(held_loss):.1f})",
        flush=True,
    )

    # ---- samples
    model.eval()
    prompts = ["The for statement", "A list is", "The return value of", "Exceptions are", "A dictionary"]
    samples = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=30, do_sample=False)
        text = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        samples.append((prompt, text))
        print(f"  {prompt!r} -> {text!r}", flush=True)

    # ---- save
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    if args.save_dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    wall = time.time() - t_start

    cmd = " ".join(["python scripts/train_demo_model.py", *sys.argv[1:]]).strip()
    changed = [
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items()
        if k not in ("steps", "minutes", "log_every", "out") and v != p.get_default(k)
    ]
    repro = " ".join(["python scripts/train_demo_model.py", f"--steps {step}", *changed])
    hparams = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}

    def _cell(t: str) -> str:
        return t.replace("|", "\\|").replace("\n", " ")

    data_desc = f"`pydoc_data.topics` (CPython {platform.python_version()})"
    if not args.no_docstrings:
        data_desc += (
            " + docstrings of public stdlib modules, classes, functions and methods"
            " (sorted, de-duplicated, >= 40 chars)"
        )
    precision = "fp32" if args.no_autocast else "bf16 autocast (fp32 master weights, fp32 loss)"
    setup = [
        ("seed", args.seed),
        ("data", data_desc),
        (
            "documents",
            f"{len(texts)} ({n_chars / 1e6:.2f} M chars); held-out {len(held_texts)} documents "
            f"({args.heldout_frac:.0%}, random split with the seed)",
        ),
        (
            "tokenizer",
            f"byte-level BPE (`tokenizers`) trained on the train split, vocab {len(tokenizer)}, "
            f"specials `{BOS}` `{EOS}` `{PAD}`; `{BOS}` is prepended on encode",
        ),
        ("tokens", f"train {len(train_data):,}, held-out {len(held_data):,}"),
        (
            "model",
            f"`LlamaForCausalLM`, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
            f"{args.kv_heads} kv heads, intermediate {args.intermediate}, max positions 1024, "
            f"tied embeddings; {n_params:,} parameters, saved as {args.save_dtype}",
        ),
        (
            "optimizer",
            f"AdamW (betas 0.9/0.95, wd {args.weight_decay} on matrices), peak lr {args.lr}, "
            f"{args.warmup} warmup steps, cosine to {args.min_lr_ratio} x peak, grad clip 1.0",
        ),
        ("batch", f"{args.batch} x {L} tokens (random windows over the concatenated `<s> doc </s>` stream)"),
        ("steps", f"{step} ({tokens_seen / 1e6:.1f} M tokens, {tokens_seen / len(train_data):.1f} epochs)"),
        ("precision", precision),
        ("hardware", f"CPU, torch {torch.__version__}, {args.threads} thread(s)"),
        (
            "training time",
            f"{train_time / 60:.1f} min (total wall time incl. data, tokenizer, eval, save: "
            f"{wall / 60:.1f} min)",
        ),
    ]
    n_eval_train = min(20 * args.batch, (len(train_data) - 1) // L)
    results = [
        ("final train, last-step batch / EMA", f"{loss:.4f} / {ema:.4f}", f"{math.exp(ema):.1f}"),
        (
            f"train, eval mode, {n_eval_train} windows",
            f"{final_train_loss:.4f}",
            f"{math.exp(final_train_loss):.1f}",
        ),
        ("held-out", f"{held_loss:.4f}", f"{math.exp(held_loss):.1f}"),
    ]
    setup_md = "\n".join(f"| {k} | {v} |" for k, v in setup)
    results_md = "\n".join(f"| {k} | {v} | {ppl} |" for k, v, ppl in results)
    sample_md = "\n".join(f"| `{p}` | `{_cell(t)}` |" for p, t in samples)
    md = f"""# Demo model

A tiny Llama-architecture causal LM for the `hf_paged_attn` demos and tests. It is trained from
scratch, offline, on CPU, by `scripts/train_demo_model.py`. It produces English-looking text about
Python; it is **not** a useful language model.

## Reproduce

```
{cmd}
```

This run used **{step} optimizer steps**; to repeat it (up to floating-point differences across
machines and library versions) run `{repro}`.

## Setup

| | |
|---|---|
{setup_md}

## Results

| | loss | ppl |
|---|---|---|
{results_md}

Greedy continuations (30 new tokens):

| prompt | continuation |
|---|---|
{sample_md}

## Hyperparameters

```json
{json.dumps(hparams, indent=2)}
```
"""
    (out / "TRAINING.md").write_text(md)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved to {out} ({size / 1e6:.2f} MB); wall time {wall / 60:.1f} min", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
