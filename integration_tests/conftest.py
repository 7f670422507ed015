"""Shared tiny models: random weights, saved with save_pretrained and loaded back with
from_pretrained(..., attn_implementation=...), so the real loading code runs (no hub access here)."""

from __future__ import annotations

import pytest
import torch

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn_tools.testing import load_pair, save_random_model, tiny_llama_config

VOCAB = 256


@pytest.fixture(scope="session")
def demo():
    """(tokenizer, paged model, sdpa model) of the bundled demo model: real text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged_attn.demo import DEMO_MODEL

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL, padding_side="left")
    paged = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged").eval()
    ref = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa").eval()
    return tokenizer, paged, ref


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def llama_pair(llama_dir):
    return load_pair(llama_dir)


def ragged_prompts(num: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (num,), generator=gen).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()
