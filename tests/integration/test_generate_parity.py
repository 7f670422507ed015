"""Greedy parity: model.generate on a "paged" model returns what sdpa's generate returns."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn_tools.testing import compare_greedy, left_padded, ragged_prompts, reference_greedy, unpadded_rows

NEW = 48


@pytest.fixture(scope="module")
def batch():
    prompts = ragged_prompts(12, 2, 90, seed=1)
    ids, mask = left_padded(prompts)
    return prompts, ids, mask


@pytest.fixture(scope="module")
def expected(llama_pair, batch):
    ref, _ = llama_pair
    _, ids, mask = batch
    out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    return out


def check(ref, prompts, expected_rows, actual_rows):
    problems = compare_greedy(ref, prompts, expected_rows, actual_rows)
    assert not problems, "\n".join(problems)


def test_reference_tokens_vary(expected, batch):
    # A parity test on a model that repeats one token proves nothing.
    new = expected[:, batch[1].shape[1] :]
    assert len(set(new.flatten().tolist())) > 40
    assert all(len(set(row.tolist())) > 5 for row in new)


@pytest.mark.parametrize(
    "paged_config",
    [
        PagedConfig(block_size=1),
        PagedConfig(block_size=4),
        PagedConfig(block_size=16),
        PagedConfig(block_size=4, max_batch_tokens=1),  # every prompt prefilled one token at a time
        PagedConfig(block_size=4, max_batch_tokens=4),
        PagedConfig(block_size=16, max_batch_tokens=16),
    ],
    ids=["bs1", "bs4", "bs16", "chunk1", "chunk4", "chunk16"],
)
def test_generate_equals_sdpa(llama_pair, batch, expected, paged_config):
    ref, paged = llama_pair
    prompts, ids, mask = batch
    out = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, paged_config=paged_config)
    assert out.shape == expected.shape
    assert torch.equal(out[:, : ids.shape[1]], ids)
    check(ref, prompts, unpadded_rows(expected, ids.shape[1]), unpadded_rows(out, ids.shape[1]))


def test_right_padding(llama_pair, batch, expected):
    ref, paged = llama_pair
    prompts, ids, _ = batch
    rids, rmask = left_padded(prompts, side="right")
    out = paged.generate(input_ids=rids, attention_mask=rmask, max_new_tokens=NEW)
    got = unpadded_rows(out, rids.shape[1])
    check(ref, prompts, unpadded_rows(expected, ids.shape[1]), got)


def test_preemption_keeps_results(llama_pair, batch, expected):
    ref, paged = llama_pair
    prompts, ids, _ = batch
    # 40 blocks of 4 tokens: the longest request alone needs 35, so requests must preempt each other.
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=40))
    outs = engine.generate(prompts, max_new_tokens=NEW)
    assert engine.stats.num_preemptions > 0
    check(ref, prompts, unpadded_rows(expected, ids.shape[1]), [o.output_ids for o in outs])
    assert engine.allocator.num_free_blocks == 40
    engine.allocator.check_invariants()


def test_engine_generate_100_ragged_prompts(llama_pair):
    ref, paged = llama_pair
    prompts = ragged_prompts(100, 1, 40, seed=7)
    limits = [1 + (i * 7) % 12 for i in range(len(prompts))]
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=8, num_blocks=200, max_num_seqs=32))
    outs = engine.generate(prompts, max_new_tokens=limits)
    assert [len(o.output_ids) for o in outs] == limits
    assert all(o.finish_reason == "length" for o in outs)
    expected = [reference_greedy(ref, p, n) for p, n in zip(prompts, limits)]
    check(ref, prompts, expected, [o.output_ids for o in outs])
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    engine.allocator.check_invariants()


def test_eos_and_padding_after_it(llama_dir, batch, expected):
    from hf_paged_attn_tools.testing import load_pair

    prompts, ids, mask = batch
    new = expected[:, ids.shape[1] :]
    eos = int(new[0, 5])  # a token the reference emits early in row 0
    ref, paged = load_pair(llama_dir)
    ref.generation_config.eos_token_id = eos
    paged.generation_config.eos_token_id = eos
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
    got = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
    assert torch.equal(want, got)
    assert (got[0, ids.shape[1] + 6 :] == 0).all()


def test_sdpa_model_unaffected(llama_pair, batch, expected):
    ref, paged = llama_pair
    _, ids, mask = batch
    paged.generate(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=4)
    again = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(again, expected)


def test_streamer_batch_of_one(llama_pair, batch):
    _, paged = llama_pair
    prompts, _, _ = batch

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = paged.generate(torch.tensor([prompts[0]]), max_new_tokens=10, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == prompts[0]
    assert sum(streamer.chunks[1:], []) == out[0, len(prompts[0]) :].tolist()


def test_return_dict_with_scores(llama_pair, batch):
    ref, paged = llama_pair
    _, ids, mask = batch
    kwargs = dict(max_new_tokens=6, return_dict_in_generate=True, output_scores=True, output_logits=True)
    want = ref.generate(input_ids=ids[:3], attention_mask=mask[:3], **kwargs)
    got = paged.generate(input_ids=ids[:3], attention_mask=mask[:3], **kwargs)
    assert torch.equal(want.sequences, got.sequences)
    assert len(got.scores) == len(want.scores) == 6
    for a, b in zip(want.logits, got.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "group_beam_search"),
        (dict(penalty_alpha=0.6, top_k=4), "contrastive_search"),
        (dict(dola_layers="low"), "dola"),
    ],
)
def test_unsupported_options_are_refused(llama_pair, kwargs, name):
    _, paged = llama_pair
    with pytest.raises(NotImplementedError, match=name):
        paged.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, **kwargs)


def test_assisted_decoding_with_another_tokenizer_refused(llama_pair):
    ref, paged = llama_pair
    with pytest.raises(NotImplementedError, match="assistant_tokenizer"):
        paged.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, assistant_model=ref, assistant_tokenizer=object())


def test_one_prompt_without_a_mask_warns_as_little_as_sdpa(tmp_path):
    """A model with EOS but no pad token: transformers warns about a missing attention mask only for
    batches; one prompt through the paged generate must not print it either."""
    import logging

    from hf_paged_attn_tools.testing import load_pair, save_random_model, tiny_llama_config

    ref, paged = load_pair(save_random_model(tiny_llama_config(pad_token_id=None, eos_token_id=1), tmp_path))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformers.generation.utils")
    logger.addHandler(handler)
    try:
        want = ref.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3)
        got = paged.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3)
        assert torch.equal(got, want)
        assert not [r for r in records if "attention mask" in r], records
        paged.generate(torch.tensor([[3, 4, 5], [6, 7, 8]]), max_new_tokens=3)  # a batch still warns, as sdpa does
        assert [r for r in records if "attention mask" in r]
    finally:
        logger.removeHandler(handler)
