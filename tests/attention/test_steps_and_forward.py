"""Logits of packed paged steps equal sdpa on the unpacked inputs; plain forward equals sdpa."""

from __future__ import annotations

import pytest
import torch

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.attention.step import build_step
from hf_paged_attn.runtime.executor import LocalExecutor
from hf_paged_attn_tools.testing import left_padded, load_pair, ragged_prompts, save_random_model
from hf_paged_attn_tools.tiny_configs import tiny_config


def run_step(engine: ContinuousBatchingEngine):
    """Schedule and run one step by hand, returning (scheduled, metadata, logits of every row)."""
    engine._take_intake()
    plan = engine.scheduler.schedule()
    meta = build_step(plan.scheduled, engine.config.block_size, engine.device, engine.layers,
                      block_copies=plan.block_copies)  # fmt: skip
    executor = LocalExecutor(engine.model, engine.cache, engine.backend)
    executor.prepare(meta)
    logits = executor.logits(meta, 0)  # every row, to compare all of them
    return plan.scheduled, meta, logits


def reference_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0]


def advance(scheduled, logits, meta) -> None:
    """Commit a step: tokens computed, greedy token appended where the chunk reached the end."""
    for i, s in enumerate(scheduled):
        s.request.num_computed_tokens += s.num_new_tokens
        if s.request.num_computed_tokens == s.request.num_tokens:
            s.request.output_ids.append(int(logits[int(meta.cu_seq_lens_q[i + 1]) - 1].argmax()))


def test_mixed_prefill_decode_step_and_decode_step(llama_pair):
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64, max_batch_tokens=64))
    prompts = ragged_prompts(3, 5, 19, seed=3)
    for p in prompts[:2]:
        engine.add_request(p, max_new_tokens=8)
    scheduled, meta, logits = run_step(engine)  # prefill of two prompts
    assert not meta.is_decode
    advance(scheduled, logits, meta)
    engine.add_request(prompts[2], max_new_tokens=8)
    scheduled, meta, logits = run_step(engine)  # two decodes + one prefill, packed
    assert not meta.is_decode and [s.num_new_tokens for s in scheduled] == [1, 1, len(prompts[2])]
    for i, s in enumerate(scheduled):
        rows = slice(int(meta.cu_seq_lens_q[i]), int(meta.cu_seq_lens_q[i + 1]))
        want = reference_logits(ref, s.request.all_ids)[-s.num_new_tokens :]
        torch.testing.assert_close(logits[rows], want, atol=1e-4, rtol=1e-4)
    advance(scheduled, logits, meta)
    scheduled, meta, logits = run_step(engine)  # decode only: the paged decode kernel
    assert meta.is_decode and len(scheduled) == 3
    for i, s in enumerate(scheduled):
        want = reference_logits(ref, s.request.all_ids)[-1]
        torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4)


def test_plain_forward_equals_sdpa(llama_pair):
    ref, paged = llama_pair
    ids, mask = left_padded(ragged_prompts(4, 3, 30, seed=5))
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
        got = paged(input_ids=ids, attention_mask=mask, labels=labels)
        unmasked = paged(input_ids=ids[:, -3:]).logits
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unmasked, ref(input_ids=ids[:, -3:]).logits, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def gemma2_pair(tmp_path_factory):
    """Gemma 2 softcaps its attention scores: outside a step "paged" computes that itself (sdpa lacks it)."""
    return load_pair(save_random_model(tiny_config("gemma2"), tmp_path_factory.mktemp("gemma2")), reference="eager")


@pytest.mark.parametrize("pair, low", [("llama_pair", 4), ("gemma2_pair", 20)])
def test_training_forward_loss_and_gradients_equal_the_reference(pair, low, request):
    """A training step through "paged" (TRL trains through it): the loss and every parameter's
    gradient equal transformers' own attention's (sdpa; eager for Gemma 2's softcap) on the same
    weights, in fp32 to 1e-5 relative; Llama on a left-padded batch, Gemma 2 on unpadded rows: a
    padded Gemma 2 batch is not a reference, since under eager itself the padding tokens' ids move
    the loss (5.929 with pad id 0, 5.879 with 5, same mask), so what the whole-masked padding rows
    compute reaches the gradients, and those rows are where the two attentions may differ."""
    ref, paged = request.getfixturevalue(pair)
    ids, mask = left_padded(ragged_prompts(3, low, 20, seed=9))
    labels = ids.masked_fill(mask == 0, -100)
    losses, grads = [], []
    for model in (ref, paged):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad for name, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    want, got = grads
    assert set(got) == set(want) and all(g is not None for g in got.values())
    for name, g in want.items():
        # atol: a gradient entry near zero is a sum of larger terms that cancel; 1e-5 of the largest entry
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def test_a_left_padded_softcapped_forward_is_finite_and_equals_eager(gemma2_pair):
    """A padding query row is masked whole: "paged"'s own softcap path must not turn it into NaN (0/0
    softmax), which the next layer's 0 * NaN would spread to every row and the loss."""
    ref, paged = gemma2_pair
    ids, mask = left_padded(ragged_prompts(3, 4, 20, seed=9))
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
        got = paged(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], rtol=1e-5, atol=1e-5)
