"""Sliding-window and hybrid models on the flash backend, against transformers' own attention, through
the flash_attn stand-in (``tests/kernels/fake_flash_attn.py``: flash-attn's signatures and checks, and
its split-KV kernel's cut at ``max_seqlen_k``).

Pages of 256 (flash-attn 2's paged multiple), prompts longer than the window + 256 and prefilled in
chunks: a chunk past the first page attends keys that a windowed ``max_seqlen_k`` would cut.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.kernels import BACKENDS, flash_backend
from hf_paged_attn_tools.testing import compare_greedy, load_pair, save_random_model
from hf_paged_attn_tools.tiny_configs import tiny_config
from tests.kernels.fake_flash_attn import FakeFlashAttn

WINDOW = 48
BLOCK = 256
NEW = 6


def sliding_mistral():
    """Every layer sliding (Mistral v0.1)."""
    config = tiny_config("mistral")
    config.num_hidden_layers, config.sliding_window, config.max_position_embeddings = 2, WINDOW, 1024
    return config


def hybrid_gemma2():
    """Gemma 2's shape: a sliding and a full layer (two attention groups), attention softcap."""
    config = tiny_config("gemma2")
    config.num_hidden_layers, config.sliding_window, config.max_position_embeddings = 2, WINDOW, 1024
    config.layer_types = ["sliding_attention", "full_attention"]
    return config


# model -> (config, reference attention: sdpa lacks Gemma 2's softcap)
MODELS = {"mistral": (sliding_mistral, "sdpa"), "gemma2": (hybrid_gemma2, "eager")}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashAttn:
    module = FakeFlashAttn()
    monkeypatch.setattr(flash_backend, "_load_flash_attn", lambda: module)
    monkeypatch.setattr(BACKENDS["flash"], "is_available", lambda device: True)
    return module


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    lengths = (BLOCK + WINDOW + 40, BLOCK + WINDOW + 9, 21)  # the short one decodes beside the others' chunks
    return [torch.randint(1, 200, (n,), generator=gen).tolist() for n in lengths]


def reference_tokens(ref: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", list(MODELS))
def test_windowed_models_match_the_reference_on_flash(name, fake, tmp_path):
    make_config, reference = MODELS[name]
    ref, paged = load_pair(save_random_model(make_config(), tmp_path), reference=reference, dtype=torch.bfloat16)
    config = PagedConfig(kernel="flash", block_size=BLOCK, num_blocks=12, max_batch_tokens=64)
    engine = ContinuousBatchingEngine(paged, config)
    batch = prompts()
    got = [out.output_ids for out in engine.generate(batch, max_new_tokens=NEW)]
    problems = compare_greedy(ref, batch, [reference_tokens(ref, p) for p in batch], got)
    assert not problems, f"{name}: {problems}"
    varlen = [args for kind, args in fake.calls if kind == "varlen"]
    windowed = [a for a in varlen if a["window_size"] == (WINDOW - 1, WINDOW - 1)]
    assert windowed, "no sliding layer ran through flash_attn_varlen_func"
    # a chunk past the first page (keys beyond what a windowed bound reaches) and a decode row beside it
    assert any(int(a["cu_seqlens_k"].diff().max()) > BLOCK + WINDOW for a in windowed)
    assert any(1 in a["cu_seqlens_q"].diff().tolist() for a in windowed)
