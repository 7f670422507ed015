"""Model coverage: a representative slice of the compatibility matrix, through the same code as
``python -m hf_paged_attn_tools.compat`` (tiny random model saved and reloaded, ragged left-padded greedy
generate compared with sdpa/eager). The full matrix is the slow test at the bottom."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import BertConfig, BertLMHeadModel

from hf_paged_attn import PagedConfig
from hf_paged_attn.attention import model_checks as model_checks
from hf_paged_attn_tools.compat import candidates, check_model

PASSING = {
    "llama": "grouped-query attention, head_dim 32 != hidden 64 / 4 heads",
    "qwen3": "q/k norms",
    "gemma3_text": "alternating sliding/full layers, q/k norms",
    "phi3": "fused qkv projection, partial rotary",
    "mixtral": "mixture of experts, sliding window",
    "olmo2": "q/k norms after projection",
    "cohere2": "alternating sliding layers without rotary on full layers",
    "gpt_neox": "parallel attention + MLP, partial rotary",
    "mistral": "one sliding window (8) on every layer",
    "gemma2": "attention softcap + alternating sliding/full layers (eager reference)",
    "qwen2": "q/k/v bias",
    "gpt_oss": "attention sinks (s_aux), alternating windows, MoE (eager reference)",
    "qwen2_moe": "mixture of experts with a shared expert",
    "mimo_v2_flash": "value head dim != query/key head dim (pages zero-padded)",
    "phimoe": "sliding window given only through the mask, not the attention call",
    "nemotron": "decoder layers drop **kwargs: the step reaches attention through the cache",
}

REFUSED = {  # model type -> words the reason must contain
    "minimax": "linear_attention layers",
    "llama4_text": "chunked attention",
    "deepseek_v3": "multi-head latent attention",
    "diffllama": "differential attention",
}


@pytest.mark.parametrize("model_type", list(PASSING))
def test_passes(model_type):
    # block size 16 (one block spans the whole window), then a budget of 5 tokens per step: every
    # prompt is prefilled in chunks that cross the sliding-window boundary, and decode runs far past it
    configs = (PagedConfig(block_size=16), PagedConfig(block_size=4, max_batch_tokens=5))
    result = check_model(model_type, timeout=120, paged_configs=configs)
    assert result.result == "pass", f"{model_type} ({PASSING[model_type]}): {result.note}"


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_refused_up_front(model_type):
    result = check_model(model_type, timeout=120)
    assert result.result == "refused", result.note
    assert result.class_name in result.note and f"model_type {model_type!r}" in result.note
    assert "is not supported by the paged engine" in result.note
    assert REFUSED[model_type] in result.note
    assert not result.note.startswith("at the first step")  # refused before any step ran


def test_unknown_incompatibility_is_caught_at_the_first_step(monkeypatch):
    # Without its entry in KNOWN_UNSUPPORTED, DiffLlama (which splits and repeats V after
    # cache.update) passes every up-front check; the per-call guard must refuse it at its first
    # step instead of letting the decode kernel read other values than the model's.
    monkeypatch.delitem(model_checks.KNOWN_UNSUPPORTED, "diffllama")
    result = check_model("diffllama", timeout=120)
    assert result.result == "refused", result.note
    assert result.note.startswith("at the first step: DiffLlamaAttention (model_type 'diffllama')")
    assert "does not use the K/V that PagedAttentionCache.update returned" in result.note


def test_bidirectional_attention_is_refused():
    # BERT as a causal LM needs is_decoder=True; without it its self-attention sees later tokens.
    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    bidirectional = r"BertLMHeadModel .*BertSelfAttention is bidirectional"
    with pytest.raises(model_checks.UnsupportedModelError, match=bidirectional):
        model_checks.check_model_supported(BertLMHeadModel(BertConfig(**sizes)))
    model_checks.check_model_supported(BertLMHeadModel(BertConfig(**sizes, is_decoder=True)))


@pytest.mark.slow
def test_full_matrix_matches_docs():
    """The whole matrix still gives what docs/compatibility.md records (regenerate it if not)."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
    recorded = dict(re.findall(r"^\| `([^`]+)` \| `[^`]+` \| (\w+) \|", doc.read_text(), flags=re.M))
    assert set(recorded) == set(candidates())
    measured = {t: check_model(t) for t in recorded}
    changed = {t: (recorded[t], r.result, r.note) for t, r in measured.items() if r.result != recorded[t]}
    assert not changed, changed


@pytest.fixture(scope="module")
def sliding_pair(tmp_path_factory):
    """A tiny Mistral: every layer slides the same 8-token window."""
    from transformers import MistralConfig

    from hf_paged_attn_tools.testing import load_pair, save_random_model, tiny_llama_config

    base = tiny_llama_config().to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        base.pop(key, None)
    config = MistralConfig(**{**base, "sliding_window": 8, "head_dim": 16})
    return load_pair(save_random_model(config, tmp_path_factory.mktemp("mistral")))


def sdpa_greedy(ref, prompt: list[int], new: int) -> list[int]:
    import torch

    return ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt) :].tolist()


def test_sliding_window_model_keeps_bounded_blocks(sliding_pair):
    """Generating 4x the window holds at most window/block_size + 2 blocks per request."""
    from hf_paged_attn import ContinuousBatchingEngine

    ref, paged = sliding_pair
    prompt = list(range(10, 22))
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64, enable_prefix_caching=False))
    (out,) = engine.generate([prompt], max_new_tokens=32)
    assert engine.layers.uniform_window == 8
    assert engine.stats.peak_used_blocks <= 8 // 4 + 2 + 1  # + the prompt's blocks before the first release
    assert out.output_ids == sdpa_greedy(ref, prompt, 32)
    assert engine.allocator.num_used_blocks == 0


def test_preemption_of_a_sliding_window_model(sliding_pair):
    """Preempted requests of a sliding-window model recompute the right window and match sdpa."""
    import torch

    from hf_paged_attn import ContinuousBatchingEngine

    ref, paged = sliding_pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (11, 17, 20, 14, 19, 16, 21, 12)]
    from hf_paged_attn.core.scheduler import SchedulerOutput

    # Freed out-of-window blocks leave so much room that a small cache rarely preempts by itself,
    # so preempt the newest running request by hand once every prompt has slid past its window.
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=40))
    ids = [engine.add_request(p, max_new_tokens=24) for p in prompts]
    for _ in range(4):
        engine.step()
    assert any(b < 0 for r in engine.scheduler.running for b in r.block_ids)  # blocks were freed early
    engine.scheduler._preempt(engine.scheduler.running[-1], SchedulerOutput())
    finals = {o.request_id: o for o in engine.stream() if o.finished}
    outs = [finals[i] for i in ids]
    for prompt, out in zip(prompts, outs):
        assert out.output_ids == sdpa_greedy(ref, prompt, 24)
    assert engine.allocator.num_used_blocks == 0
    engine.allocator.check_invariants()
