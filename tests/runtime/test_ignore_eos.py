"""``add_request(ignore_eos=True)``: EOS no longer ends a request; processors still see it."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig

PROMPT = "A list is"  # the demo model's greedy output ends with EOS after 12 tokens


def greedy_continues(ref: torch.nn.Module, prompt: list[int], output: list[int]) -> None:
    """Each output token is the reference's argmax after what precedes it (one teacher-forced forward)."""
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]  # [len(output), vocab]
    top = logits.topk(2, dim=-1)
    for i, token in enumerate(output):
        if token != int(top.indices[i, 0]):
            gap = float(top.values[i, 0] - top.values[i, 1])
            assert gap <= 1e-4, f"token {i}: {token}, the reference's argmax {int(top.indices[i, 0])} (gap {gap:.3g})"


def run(engine: ContinuousBatchingEngine, requests: list[dict]) -> list:
    ids = [engine.add_request(**r) for r in requests]
    finals = {out.request_id: out for out in engine.stream() if out.finished}
    return [finals[i] for i in ids]


def test_ignore_eos_runs_to_max_new_tokens_past_eos(demo) -> None:
    tokenizer, paged, ref = demo
    prompt = tokenizer(PROMPT)["input_ids"]
    eos = tokenizer.eos_token_id
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=16, num_blocks=64))
    stopped, ignored, suppressed = run(engine, [
        {"input_ids": prompt, "max_new_tokens": 24},
        {"input_ids": prompt, "max_new_tokens": 24, "ignore_eos": True},
        {"input_ids": prompt, "max_new_tokens": 24, "ignore_eos": True,
         "generation_config": GenerationConfig(min_new_tokens=20)},
    ])  # fmt: skip
    assert stopped.finish_reason == "eos" and len(stopped.output_ids) < 24 and stopped.output_ids[-1] == eos
    assert ignored.finish_reason == "length" and len(ignored.output_ids) == 24
    assert ignored.output_ids[: len(stopped.output_ids)] == stopped.output_ids  # the EOS is kept in the output
    greedy_continues(ref, prompt, ignored.output_ids)
    # min_new_tokens still suppresses the EOS ignore_eos no longer stops at
    assert suppressed.finish_reason == "length" and eos not in suppressed.output_ids[:20]
    assert engine.allocator.num_free_blocks == 64


def test_ignore_eos_is_checked(demo) -> None:
    _, paged, _ = demo
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=16, num_blocks=16))
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.add_request([5, 6, 7], max_new_tokens=4, ignore_eos=1)
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.add_request([5, 6, 7], max_new_tokens=4, ignore_eos=True, structured={"regex": "a+"}, tokenizer=None)
    assert not engine.has_unfinished()
