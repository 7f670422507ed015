"""Prefill straight from the pages: with the Triton backend the varlen path writes the step's K/V
with the backend's ``write_kv`` and the paged prefill kernel reads every key through the block
table (the cache has no gather path at all). Greedy parity against transformers' own attention, on CPU tensors under
the Triton interpreter (slow: prompts and token counts are kept small)."""

from __future__ import annotations

import importlib
import os

# Must precede the first `import triton`: kernels are built as interpreted functions (numpy on the
# CPU) when the backend module is imported with this set.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn.kernels import BACKENDS  # noqa: E402
from hf_paged_attn.kernels import triton_ops as tb  # noqa: E402
from hf_paged_attn_tools.testing import (  # noqa: E402
    compare_greedy,
    load_pair,
    reference_greedy,  # noqa: E402
    save_random_model,
)
from hf_paged_attn_tools.tiny_configs import tiny_config  # noqa: E402

if not isinstance(tb._decode_kernel, triton.runtime.interpreter.InterpretedFunction):
    # Imported before TRITON_INTERPRET was set: rebuild it interpreted (the engine imports the
    # module by name, so it gets this one).
    tb = importlib.reload(tb)

NEW = 3


@pytest.fixture
def calls(monkeypatch):
    """Triton runs on CPU tensors; counts its paged prefill calls."""
    monkeypatch.setattr(BACKENDS["triton"], "is_available", lambda device: True)
    counts = {"paged_prefill_attention": 0}
    original = tb.paged_prefill_attention

    def counted(*args, **kwargs):
        counts["paged_prefill_attention"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(tb, "paged_prefill_attention", counted)
    return counts


def run(paged, prompts: list[list[int]], kernel: str, block_size: int = 16) -> tuple[list, list]:
    """Greedy outputs of ``prompts`` through the engine (with each token's log-probability), and
    every step's metadata. 24 tokens a step: prompts of 23-50 tokens prefill in chunks."""
    config = PagedConfig(kernel=kernel, block_size=block_size, num_blocks=64, max_batch_tokens=24)
    engine = ContinuousBatchingEngine(paged, config)
    steps = []
    open_forward = engine.cache.forward
    engine.cache.forward = lambda context: steps.append(context.step) or open_forward(context)
    ids = engine.add_all([dict(input_ids=p, max_new_tokens=NEW, logprobs=0) for p in prompts])
    return engine.collect(ids), steps


def assert_same_as_torch_backend(paged, prompts: list[list[int]], outs: list) -> None:
    """Same tokens as the torch backend, and log-probabilities within fp32 noise:
    stricter than greedy parity, which a small attention error rarely flips."""
    want, _ = run(paged, prompts, "torch")
    assert [o.output_ids for o in outs] == [o.output_ids for o in want]
    got_lp = torch.tensor([t.logprob for o in outs for t in o.logprobs])
    want_lp = torch.tensor([t.logprob for o in want for t in o.logprobs])
    torch.testing.assert_close(got_lp, want_lp, atol=1e-4, rtol=0)


def shared_head_prompts(high: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(1, high, (20,), generator=gen).tolist()  # a common head: prefix hits
    return [shared + torch.randint(1, high, (n,), generator=gen).tolist() for n in (3, 17, 30)]


def test_llama_prefix_hits_chunks_and_mixed_steps(llama_pair, calls):
    ref, paged = llama_pair
    prompts = shared_head_prompts(256)
    outs, steps = run(paged, prompts, "triton")
    expected = [reference_greedy(ref, p, NEW) for p in prompts]
    problems = compare_greedy(ref, prompts, expected, [o.output_ids for o in outs])
    assert not problems, problems

    varlen = [m for m in steps if not m.is_decode]
    q_lens = [(m.cu_seq_lens_q[1:] - m.cu_seq_lens_q[:-1]).tolist() for m in varlen]
    assert any(1 in lens and max(lens) > 1 for lens in q_lens), f"no mixed step: {q_lens}"
    chunked = [(m.cache_seqlens > 0) & (m.cu_seq_lens_q[1:] - m.cu_seq_lens_q[:-1] > 1) for m in varlen]
    assert any(bool(c.any()) for c in chunked), "no prefill chunk after cached tokens"
    assert sum(o.num_cached_tokens for o in outs) > 0, "no prefix hit"
    num_layers = paged.config.num_hidden_layers
    assert calls["paged_prefill_attention"] == len(varlen) * num_layers, calls
    assert_same_as_torch_backend(paged, prompts, outs)


def two_layers(model_type: str, **overrides):
    """A sliding and a full layer (two attention groups): the smallest hybrid model."""
    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.num_hidden_layers, config.layer_types = 2, ["sliding_attention", "full_attention"]
    if getattr(config, "mlp_layer_types", None):  # MiMo: one MLP kind per layer
        config.mlp_layer_types = config.mlp_layer_types[:2]
    return config


# model type -> (what it adds, config overrides); each also has two attention groups. The reference
# is eager: sdpa has neither sinks nor softcap.
MODELS = {
    "gpt_oss": ("attention sinks", {}),
    "gemma2": ("attention softcap", {"attn_logit_softcapping": 0.5}),  # Gemma's 50 would never bite
    "mimo_v2_flash": ("value head dim 16 != key head dim 32: zero-padded pages and query", {}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_hybrid_models_with_sinks_softcap_or_unequal_head_dims(name, calls, tmp_path):
    ref, paged = load_pair(save_random_model(two_layers(name, **MODELS[name][1]), tmp_path), reference="eager")
    prompts = shared_head_prompts(200)
    outs, steps = run(paged, prompts, "triton")
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        expected.append(out[0, len(p) :].tolist())
    problems = compare_greedy(ref, prompts, expected, [o.output_ids for o in outs])
    assert not problems, f"{name}: {problems}"
    assert calls["paged_prefill_attention"] > 0, calls
    assert all(len(m.groups) == 2 for m in steps), "expected two attention groups"
    # a block that left the window was released (-1) while later chunks still prefilled from the pages
    groups = [g for m in steps if not m.is_decode for g in m.groups]
    assert any(bool((g.block_table[:, 0] == -1).any()) for g in groups), f"{name}: no block was released"
    assert_same_as_torch_backend(paged, prompts, outs)


def test_flash_prefills_through_its_block_table(llama_dir, calls, monkeypatch):
    """The flash backend (against the flash_attn stand-in of tests/kernels/fake_flash_attn.py: flash-attn's
    signatures, its checks, the float64 reference) gets every varlen step as a paged
    ``flash_attn_varlen_func`` call; tokens match the torch backend's."""
    from hf_paged_attn.kernels import flash_backend
    from tests.kernels.fake_flash_attn import FakeFlashAttn

    fake = FakeFlashAttn()
    monkeypatch.setattr(flash_backend, "_load_flash_attn", lambda: fake)
    monkeypatch.setattr(BACKENDS["flash"], "is_available", lambda device: True)
    ref, paged = load_pair(llama_dir, dtype=torch.bfloat16)  # flash-attn 2 has no fp32
    prompts = shared_head_prompts(256)
    outs, steps = run(paged, prompts, "flash", block_size=256)
    varlen = [m for m in steps if not m.is_decode]
    paged_calls = [args for kind, args in fake.calls if kind == "varlen" and args["block_table"] is not None]
    assert len(paged_calls) == len(varlen) * paged.config.num_hidden_layers
    want, _ = run(paged, prompts, "torch", block_size=256)
    problems = compare_greedy(ref, prompts, [o.output_ids for o in want], [o.output_ids for o in outs], 2e-2)
    assert not problems, problems
