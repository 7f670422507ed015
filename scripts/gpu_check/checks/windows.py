"""window/bf16/flash: a Gemma-2-shaped random model (sliding and full layers alternating, attention
softcap) with ``PagedConfig(kernel="flash")`` against transformers' ``"eager"`` (sdpa has no softcap),
greedy, up to the first near-tie. Window 128 over prompts of up to 600 tokens, pages of 256 and
prefill chunks of 128: a chunk past window + 256 attends keys that a windowed ``max_seqlen_k`` would
cut (flash-attn's split-KV kernel reads none past it), and the short prompt decodes beside the chunks.
It confirms on a GPU what ``tests/attention/test_flash_windows.py`` checks through a stand-in. Flash
only: SKIPPED without flash-attn (every CPU run).
"""

from __future__ import annotations

import time

import torch

from ..base import Check, Context
from ..helpers import NEW_TOKENS, TIE_TOLERANCE, compare_up_to_tie, load_model, sdpa_greedy, seconds_since

WINDOW = 128
BLOCK = 256
CHUNK = 128  # max_batch_tokens: prompts prefill in chunks
# Wider than the tiny Llama's 0.02: at 0.02 these prompts meet a bf16 near-tie (< 0.05) at their first token;
# at 0.1 the median top-2 gap is ~0.43 and 52 of 96 steps are compared (CPU, bf16, through the stand-in).
INIT = 0.1


def gemma2_dir(directory: str) -> str:
    """A 4-layer Gemma 2 shape (sliding, full, sliding, full), head dim 64, saved into ``directory``."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, sliding_window=WINDOW, max_position_embeddings=2048,
        layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=INIT,
        bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def window_parity(ctx: Context) -> str:
    """The detail line; raises ``Fail`` on a mismatch before a near-tie."""
    from hf_paged_attn import ContinuousBatchingEngine, PagedConfig

    dtype, directory = torch.bfloat16, gemma2_dir(ctx.subdir("gemma2_"))
    lengths, new = (600, BLOCK + WINDOW + 37, 7), NEW_TOKENS
    ref_model = load_model(directory, "eager", ctx.device, dtype)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, ref_model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    references = [sdpa_greedy(ref_model, p, new) for p in prompts]  # the helper runs whatever attention it is given
    del ref_model

    model = load_model(directory, "paged", ctx.device, dtype)
    config = PagedConfig(kernel="flash", block_size=BLOCK, max_batch_tokens=CHUNK)
    outs = ContinuousBatchingEngine(model, config).generate(prompts, max_new_tokens=new)
    tol = TIE_TOLERANCE[dtype]
    compared = sum(
        compare_up_to_tie(f"prompt {i} (len {len(p)})", out.output_ids, want, gaps, tol)
        for i, (p, out, (want, gaps)) in enumerate(zip(prompts, outs, references, strict=True))
    )
    return (
        f"window {WINDOW}, prompts {list(lengths)} in chunks of {CHUNK}, {compared}/{len(prompts) * new} steps "
        f"compared against eager (tie tol {tol})"
    )


def run(ctx: Context) -> str:
    ctx.backend("flash")  # Skip when it is unavailable here
    start = time.perf_counter()
    return f"{window_parity(ctx)}, {seconds_since(start)}"


USES = (
    "hf_paged_attn:PagedConfig(kernel, block_size, max_batch_tokens)",
    "hf_paged_attn:ContinuousBatchingEngine.generate(prompts, max_new_tokens)",
    "hf_paged_attn:RequestOutput.output_ids",
)
CHECKS = [Check("window/bf16/flash", run, 90, cpu=True, uses=USES)]
