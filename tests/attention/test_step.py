"""Batch building, including the spec's varlen worked example."""

import torch

from hf_paged_attn.attention.step import build_step, varlen_lengths
from hf_paged_attn.core.request import Request
from hf_paged_attn.core.scheduler import ScheduledRequest

CPU = torch.device("cpu")


def test_spec_varlen_example():
    cu_q, cu_k, max_q, max_k = varlen_lengths([10, 3, 1], [0, 1, 7], CPU)
    assert cu_q.tolist() == [0, 10, 13, 14] and cu_q.dtype == torch.int32
    assert cu_k.tolist() == [0, 0, 1, 8] and cu_k.dtype == torch.int32
    assert (max_q, max_k) == (10, 7)


def request(prompt, output=(), computed=0, blocks=()):
    r = Request("r", list(prompt), max_new_tokens=10, sampling=None, arrival=0)
    r.output_ids = list(output)
    r.num_computed_tokens = computed
    r.block_ids = list(blocks)
    return r


def test_mixed_step_tensors():
    block_size = 4
    a = request(range(10, 16), blocks=[5, 2])  # prefill of 6 tokens, blocks not contiguous
    b = request([1, 2, 3], output=[4, 5], computed=4, blocks=[7, 0])  # decode of token 5 at position 4
    c = request(range(20, 29), computed=4, blocks=[3, 6, 1])  # second prefill chunk: 3 of 5 tokens
    step = build_step([ScheduledRequest(a, 6), ScheduledRequest(b, 1), ScheduledRequest(c, 3)], block_size, CPU)
    assert step.input_ids.tolist() == [[10, 11, 12, 13, 14, 15, 5, 24, 25, 26]]
    assert step.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 4, 4, 5, 6]]
    assert step.cu_seq_lens_q.tolist() == [0, 6, 7, 10]
    assert step.cu_seq_lens_k.tolist() == [0, 6, 11, 18]
    assert (step.max_length_q, step.max_length_k) == (6, 7)
    # slot = block * block_size + offset
    assert step.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9, 0, 24, 25, 26]
    assert step.seqused_k.tolist() == [6, 5, 7]
    assert step.block_table.tolist() == [[5, 2, -1], [7, 0, -1], [3, 6, 1]]
    assert step.cache_seqlens.tolist() == [0, 4, 4]
    # a and b reach their last known token and are sampled; c is mid-prompt and is not
    assert step.logits_indices.tolist() == [5, 6]
    assert not step.is_decode


def test_decode_step_uses_decode_path():
    r1 = request([1, 2, 3], output=[9], computed=3, blocks=[4])
    r2 = request([1] * 8, output=[2], computed=8, blocks=[0, 1, 2])
    step = build_step([ScheduledRequest(r1, 1), ScheduledRequest(r2, 1)], 4, CPU)
    assert step.is_decode and step.seqused_k.tolist() == [4, 9]
    assert step.cache_seqlens.tolist() == [3, 8]
    assert step.slot_mapping.tolist() == [19, 8]
    assert step.logits_indices.tolist() == [0, 1]


def test_token_slice_is_a_slice_of_all_ids():
    r = request([1, 2, 3, 4], output=[5, 6, 7])
    for start in range(8):
        for n in range(0, 8 - start):
            assert r.token_slice(start, n) == r.all_ids[start : start + n], (start, n)
