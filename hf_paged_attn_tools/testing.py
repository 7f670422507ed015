"""Helpers for parity checks against transformers' own attention (used by tests and scripts).

Greedy parity means equal tokens; a difference is accepted only where the reference's top-2
logits at the first differing position are within ``tie_tolerance`` (a numerical near-tie, as
vLLM's ``check_logprobs_close`` allows). The gap is always computed, never assumed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedConfig

from hf_paged_attn.core.blocks import blocks_for


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A 2-layer GQA Llama (vocab 256) whose random greedy tokens vary; no EOS by default."""
    values = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,  # larger weights than default so greedy tokens vary
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def left_padded(rows: list[list[int]], pad: int = 0, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``rows`` padded to the longest, as tokenizers do: on the left
    by default (what ``generate`` wants), on the right with ``side="right"``."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, cols] = torch.tensor(row, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def save_random_model(config: PreTrainedConfig, directory: str | Path | None = None, seed: int = 0) -> str:
    """Build a random-weight model from ``config``, ``save_pretrained`` it, return the directory."""
    directory = str(directory or tempfile.mkdtemp(prefix="hf_paged_attn_"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


def load_pair(directory: str, reference: str = "sdpa", dtype: torch.dtype = torch.float32):
    """(reference model, paged model) loaded from the same weights with ``from_pretrained``."""
    ref = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=reference, dtype=dtype).eval()
    paged = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged", dtype=dtype).eval()
    return ref, paged


def top2_gap(model: torch.nn.Module, prefix: list[int]) -> float:
    """Gap between the two largest next-token logits of ``model`` after ``prefix``."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare_greedy(
    reference_model: torch.nn.Module,
    prompts: list[list[int]],
    expected: list[list[int]],
    actual: list[list[int]],
    tie_tolerance: float = 1e-4,
) -> list[str]:
    """Problems found comparing generated token lists; empty when they agree (up to near-ties)."""
    problems = []
    for i, (prompt, exp, act) in enumerate(zip(prompts, expected, actual)):
        if exp == act:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(exp, act)) if a != b), min(len(exp), len(act)))
        if pos == min(len(exp), len(act)):
            problems.append(f"row {i}: lengths differ ({len(exp)} expected, {len(act)} got)")
            continue
        gap = top2_gap(reference_model, prompt + exp[:pos])
        if gap > tie_tolerance:
            problems.append(
                f"row {i}: first difference at new token {pos}: expected {exp[pos]}, got {act[pos]} "
                f"(reference top-2 gap {gap:.3g} > {tie_tolerance})"
            )
    return problems


def unpadded_rows(sequences: torch.Tensor, input_len: int) -> list[list[int]]:
    return [row[input_len:].tolist() for row in sequences]


def shuffled_block_table(
    lens: list[int], block_size: int, gen: torch.Generator, spare: int = 0
) -> tuple[torch.Tensor, int]:
    """A block table giving request b room for lens[b] tokens in shuffled blocks, -1 past each
    request's blocks and in one trailing column; returns (table int32 [B, max_blocks + 1], num_blocks
    including ``spare`` blocks nobody owns)."""
    per = [blocks_for(n, block_size) for n in lens]  # blocks per request
    num_blocks = sum(per) + spare
    order = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((len(lens), max(per) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per):
        table[b, :n] = order[used : used + n]
        used += n
    return table, num_blocks


VOCAB = 256  # tiny_llama_config's vocabulary


def ragged_prompts(num: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (num,), generator=gen).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()
