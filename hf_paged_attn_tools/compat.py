"""Measured compatibility matrix: which causal-LM architectures run on ``attn_implementation="paged"``.

``python -m hf_paged_attn_tools.compat [--only NAMES] [--out FILE.md]`` walks every architecture of
transformers' causal-LM auto mapping whose model class claims attention-interface support, builds
a tiny random model of it (``tiny_configs``), saves and reloads it, and records one result:

* ``pass``: greedy ``generate`` of a ragged left-padded batch equals the reference attention's
  (``sdpa``, or ``eager`` where the model refuses sdpa) by ``testing.compare_greedy``, and the
  reference's tokens vary (a model repeating one token would prove nothing);
* ``refused``: the plugin raised ``UnsupportedModelError`` naming the architecture and the reason;
* ``fail``: anything else, with the first line of the error or of the parity problem.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import transformers
from transformers import PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_paged_attn import register
from hf_paged_attn.attention.model_checks import UnsupportedModelError, check_config_supported, check_model_supported
from hf_paged_attn.runtime.config import PagedConfig
from hf_paged_attn_tools.testing import compare_greedy, left_padded, unpadded_rows
from hf_paged_attn_tools.tiny_configs import VOCAB, tiny_config

PROMPT_LENGTHS = (5, 11, 17, 23)  # ragged, all but one longer than the tiny sliding window
NEW_TOKENS = 32
MIN_DISTINCT = 8  # the reference must produce more distinct tokens than this
INITIALIZER_RANGES = (0.1, 0.3, 1.0)  # tried in turn while the reference's tokens don't vary
# Small blocks and a small token budget: prompts are prefilled in chunks next to decode tokens,
# so the varlen path with cached keys, the decode path and block boundaries all run.
PAGED_CONFIG = PagedConfig(block_size=4, max_batch_tokens=24)


@dataclass(slots=True)
class CompatResult:
    model_type: str
    class_name: str
    result: str  # "pass" | "refused" | "fail"
    note: str = ""
    seconds: float = 0.0


class _Timeout(BaseException):
    """A BaseException so that the engine's per-step ``except Exception`` doesn't swallow it."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise ``_Timeout`` after ``seconds`` of this process's CPU time (not wall time, so that a
    busy shared machine doesn't fail models; SIGPROF: main thread only, elsewhere no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGPROF, on_alarm)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def candidates() -> dict[str, str]:
    """model_type -> class name, for every causal LM whose class claims attention-interface support."""
    return {t: c for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if _model_class(c)._supports_attention_backend}


def not_claiming() -> dict[str, str]:
    """The causal LMs left out of the matrix: their class doesn't claim attention-interface support."""
    return {t: c for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if t not in candidates()}


def _model_class(name: str) -> type:
    return getattr(transformers, name)


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _parity(
    model_type: str, class_name: str, directory: str, paged_configs: tuple[PagedConfig, ...]
) -> tuple[str, str]:
    """(result, note) of one architecture; exceptions propagate to ``check_model``."""
    model_class = _model_class(class_name)
    reference = "sdpa" if model_class._supports_sdpa else "eager"
    batch = prompts()
    ids, mask = left_padded(batch)
    generate_kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    for initializer_range in INITIALIZER_RANGES:  # larger weights until greedy tokens vary
        config = tiny_config(model_type, initializer_range)
        check_config_supported(config, model_class)  # refuse before building anything
        _save(model_class, config, directory)
        paged = _load(model_class, directory, "paged")
        check_model_supported(paged)  # refuse before spending time on the reference
        ref = _load(model_class, directory, reference)
        expected = unpadded_rows(ref.generate(**generate_kwargs), ids.shape[1])
        distinct = len({t for row in expected for t in row})
        if distinct > MIN_DISTINCT:
            break
    else:
        return "fail", f"degenerate reference ({distinct} distinct tokens)"
    for paged_config in paged_configs:
        actual = unpadded_rows(paged.generate(**generate_kwargs, paged_config=paged_config), ids.shape[1])
        problems = compare_greedy(ref, batch, expected, actual)
        if problems:
            where = f"block_size {paged_config.block_size}, budget {paged_config.max_batch_tokens}"
            return "fail", f"parity vs {reference} ({where}): {problems[0]} ({len(problems)}/{len(batch)} rows differ)"
    return "pass", f"vs {reference}, {distinct} distinct tokens, initializer_range {initializer_range}"


def _save(model_class: type, config: PreTrainedConfig, directory: str) -> None:
    """A random-weight ``model_class`` saved with ``save_pretrained`` (the class itself, not the auto
    class: a few mappings pair a composite config with a text-only class, e.g. Emu3)."""
    if not isinstance(config, model_class.config_class):
        config = config.get_text_config()
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory)


def _load(model_class: type, directory: str, attn: str) -> torch.nn.Module:
    return model_class.from_pretrained(directory, attn_implementation=attn, dtype=torch.float32).eval()


def check_model(
    model_type: str, timeout: float = 60.0, paged_configs: tuple[PagedConfig, ...] = (PAGED_CONFIG,)
) -> CompatResult:
    """Build, save, reload and compare one architecture under each of ``paged_configs``; never raises."""
    register()
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"compat_{model_type}_") as directory:
        try:
            with _time_limit(timeout):
                result, note = _parity(model_type, class_name, directory, paged_configs)
        except UnsupportedModelError as exc:  # up front, or by the per-call guard inside the first step
            at_step = any(frame.name == "check_attention_call" for frame in traceback.extract_tb(exc.__traceback__))
            result, note = "refused", ("at the first step: " if at_step else "") + str(exc)
        except _Timeout:
            result, note = "fail", f"timed out after {timeout:g} CPU seconds"
        except Exception as exc:  # the matrix records every failure and moves on
            # the engine reports an error raised inside a step as a failed request (RuntimeError)
            guard = f"{UnsupportedModelError.__name__}: "
            if guard in str(exc):
                result, note = "refused", "at the first step: " + str(exc).split(guard, 1)[1]
            else:
                result, note = "fail", _first_line(exc)
    return CompatResult(model_type, class_name, result, note, time.perf_counter() - start)



def result_table(results: list) -> list[str]:
    """The counts line and the Markdown table of ``results`` (each with ``model_type``, ``class_name``,
    ``result``, ``note``), as both compatibility pages show them."""
    counts = Counter(r.result for r in results)
    lines = [
        f"**{counts['pass']} pass, {counts['refused']} refused, {counts['fail']} fail** of {len(results)}.",
        "",
        "| model type | class | result | note |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        note = r.note.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{r.model_type}` | `{r.class_name}` | {r.result} | {note} |")
    return lines

def render(results: list[CompatResult]) -> str:
    """The Markdown document: a table, the counts, and the architectures left out."""
    lines = [
        "# Model compatibility",
        "",
        "Generated by `python -m hf_paged_attn_tools.compat --out docs/compatibility.md`; do not edit by hand.",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, float32. Each architecture: a "
        f"tiny random model (`hf_paged_attn_tools/tiny_configs.py`) saved and reloaded, greedy `generate` of "
        f"{len(PROMPT_LENGTHS)} left-padded prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens, "
        f"{NEW_TOKENS} new tokens, `PagedConfig(block_size={PAGED_CONFIG.block_size}, "
        f"max_batch_tokens={PAGED_CONFIG.max_batch_tokens})`, compared with `sdpa` (or `eager` where the "
        "model refuses sdpa) by `hf_paged_attn_tools.testing.compare_greedy`.",
        "",
        *result_table(results),
    ]
    left_out = not_claiming()
    lines += [
        "",
        f"Not in the matrix ({len(left_out)}): their class does not set `_supports_attention_backend`, "
        "so their attention never reaches the paged kernels and the engine refuses them: "
        + ", ".join(f"`{t}`" for t in left_out)
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hf_paged_attn_tools.compat", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--only", help="comma-separated model types (default: every candidate)")
    parser.add_argument("--out", help="write the Markdown table here (default: print it)")
    parser.add_argument("--timeout", type=float, default=60.0, help="CPU seconds per architecture")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(candidates())
    unknown = [n for n in names if n not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        parser.error(f"not causal-LM model types: {', '.join(unknown)}")
    results = []
    for name in names:
        results.append(check_model(name, args.timeout))
        r = results[-1]
        print(f"{r.model_type:28} {r.result:8} {r.seconds:5.1f}s  {r.note[:150]}", file=sys.stderr, flush=True)
    text = render(results)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    counts = Counter(r.result for r in results)
    summary = f"pass {counts['pass']}, refused {counts['refused']}, fail {counts['fail']} (of {len(results)})"
    print(summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
