"""greedy/<dtype>/<kernel>: the tiny random Llama with ``attn_implementation="paged"`` and
``PagedConfig(kernel=...)`` against ``"sdpa"``, greedy, through the public API (one left-padded
``model.generate`` call, as a user makes it), up to the first near-tie (``helpers.TIE_TOLERANCE``).
``--device cpu``: 5 prompts of up to 40 tokens x 8 new tokens.
"""

from __future__ import annotations

import functools
import time

import torch

from ..base import Check, Context
from ..helpers import DTYPES, NEW_TOKENS, TIE_TOLERANCE, compare_up_to_tie, load_model, sdpa_greedy, seconds_since


def greedy_parity(ctx: Context, dtype: torch.dtype, kernel: str) -> str:
    """The detail line; raises ``Fail`` on a mismatch before a near-tie."""
    from hf_paged_attn import PagedConfig
    from hf_paged_attn_tools.testing import left_padded

    directory = ctx.tiny_llama()
    prompt_lens, new = ([1, 5, 17, 33, 40], 8) if ctx.tiny else ([1, 5, 17, 33, 40, 64, 120, 250], NEW_TOKENS)
    ref_model = load_model(directory, "sdpa", ctx.device, dtype)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, ref_model.config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    references = [sdpa_greedy(ref_model, p, new) for p in prompts]  # each prompt alone, no padding
    del ref_model

    model = load_model(directory, "paged", ctx.device, dtype)
    input_ids, attention_mask = left_padded(prompts)
    batch = {"input_ids": input_ids.to(ctx.device), "attention_mask": attention_mask.to(ctx.device)}
    # Block size 256: flash-attn's paged decode needs a multiple of 256; the others take any.
    paged_config = PagedConfig(kernel=kernel, block_size=256 if kernel == "flash" else 16)
    out = model.generate(**batch, max_new_tokens=new, do_sample=False, paged_config=paged_config)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    rows = sequences[:, input_ids.shape[1] :].tolist()  # [B, new]

    tol = TIE_TOLERANCE[dtype]
    compared = sum(
        compare_up_to_tie(f"prompt {i} (len {len(p)})", got, want, gaps, tol)
        for i, (p, got, (want, gaps)) in enumerate(zip(prompts, rows, references, strict=True))
    )
    return f"{len(prompts)} prompts x {new} tokens, {compared}/{len(prompts) * new} steps compared (tie tol {tol})"


def run(ctx: Context, dtype_name: str, kernel: str) -> str:
    ctx.backend(kernel)  # Skip when it is unavailable here
    start = time.perf_counter()
    return f"{greedy_parity(ctx, DTYPES[dtype_name], kernel)}, {seconds_since(start)}"


USES = ("hf_paged_attn:PagedConfig(kernel, block_size)",)
CHECKS = [
    Check(f"greedy/{dtype}/{kernel}", functools.partial(run, dtype_name=dtype, kernel=kernel), 60, cpu=True, uses=USES)
    for dtype, kernel in (
        ("fp32", "torch"),
        ("fp32", "triton"),
        ("bf16", "torch"),
        ("bf16", "triton"),
        ("bf16", "flash"),
    )  # fmt: skip
]
