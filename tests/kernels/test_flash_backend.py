"""The flash-attn adapter, run against a stand-in ``flash_attn`` module (no GPU, no flash-attn).

The stand-in has flash-attn 2's exact Python signatures, so a misspelt or misplaced argument fails
to bind; it checks what flash-attn's C++ side checks (int32 lengths and table, contiguous last
dimension, page size multiple of 256, no negative block ids) and computes the result with the
float64 reference, so the adapter's semantics are tested too.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from hf_paged_attn.kernels import flash_backend as fb
from hf_paged_attn.kernels import reference
from hf_paged_attn_tools.testing import shuffled_block_table

BF16_TOL = 3e-2


class FakeFlashAttn(SimpleNamespace):
    """flash_attn stand-in: records every call's bound arguments in ``calls``."""

    def __init__(self) -> None:
        super().__init__(calls=[])

    @staticmethod
    def _check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        assert q.dtype in (torch.float16, torch.bfloat16), "flash-attn only takes fp16/bf16"
        assert q.dtype == k.dtype == v.dtype
        for t in (q, k, v):
            assert t.stride(-1) == 1, "flash-attn needs a contiguous last dimension"
            assert t.device == q.device

    @staticmethod
    def _check_table(block_table: torch.Tensor, k_cache: torch.Tensor, q: torch.Tensor) -> None:
        assert block_table.dtype == torch.int32 and block_table.device == q.device
        assert block_table.is_contiguous()
        assert int(block_table.min()) >= 0, "flash-attn would read block -1"
        assert int(block_table.max()) < k_cache.shape[0]
        assert k_cache.shape[1] % 256 == 0, "paged KV cache block size must be divisible by 256"

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),  # -1 means infinite context window
        softcap=0.0,  # 0.0 means deactivated
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        self.calls.append(("varlen", dict(locals())))
        self._check_common(q, k, v)
        for cu in (cu_seqlens_q, cu_seqlens_k):
            assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == q.device
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        assert max(q_lens) <= max_seqlen_q and max(k_lens) <= max_seqlen_k
        options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
        if block_table is None:
            return reference.varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
        self._check_table(block_table, k, q)
        out = torch.zeros_like(q)
        for b, (q0, n_k) in enumerate(zip(cu_seqlens_q[:-1].tolist(), k_lens, strict=True)):
            keys = reference.gather_pages(k, block_table[b], n_k)  # [n_k, H_kv, D]
            values = reference.gather_pages(v, block_table[b], n_k)
            out[q0 : q0 + q_lens[b]] = reference.attend_one(q[q0 : q0 + q_lens[b]], keys, values, **options)
        return out

    def flash_attn_with_kvcache(
        self,
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_seqlens=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),  # -1 means infinite context window
        softcap=0.0,  # 0.0 means deactivated
        rotary_interleaved=True,
        alibi_slopes=None,
        num_splits=0,
        return_softmax_lse=False,
    ):
        self.calls.append(("kvcache", dict(locals())))
        self._check_common(q, k_cache, v_cache)
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.device == q.device
        self._check_table(block_table, k_cache, q)
        block_size = k_cache.shape[1]
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            n = int(cache_seqlens[b])
            if k is not None:  # appended in place at cache_seqlens[b], as flash-attn does
                page, off = int(block_table[b, n // block_size]), n % block_size
                k_cache[page, off], v_cache[page, off] = k[b, 0], v[b, 0]
                n += 1
            keys = reference.gather_pages(k_cache, block_table[b], n)
            values = reference.gather_pages(v_cache, block_table[b], n)
            out[b] = reference.attend_one(
                q[b], keys, values, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap,
            )  # fmt: skip
        return out


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashAttn:
    module = FakeFlashAttn()
    monkeypatch.setattr(fb, "_load_flash_attn", lambda: module)
    return module


def paged_case(lens: list[int], block_size: int = 256, h_kv: int = 2, d: int = 16, seed: int = 0):
    """bf16 pages with room for lens[b] tokens under a shuffled table (trailing -1 column)."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = shuffled_block_table(lens, block_size, gen, spare=1)
    k_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=gen).bfloat16()
    return k_cache, v_cache, table, gen


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_decode_appends_and_attends(fake: FakeFlashAttn) -> None:
    lens = [0, 255, 300]
    k_cache, v_cache, table, gen = paged_case([n + 1 for n in lens])
    q = torch.randn(3, 1, 4, 16, generator=gen).bfloat16()
    k_new = torch.randn(3, 1, 2, 16, generator=gen).bfloat16()
    v_new = torch.randn(3, 1, 2, 16, generator=gen).bfloat16()
    seqlens = torch.tensor(lens)  # int64 on purpose
    table_before = table.clone()
    out = fb.paged_decode_attention(
        q, k_cache, v_cache, k_new, v_new, seqlens, table, softmax_scale=0.25, window_size=(100, 0)
    )
    (kind, args), = fake.calls  # fmt: skip
    assert kind == "kvcache"
    assert args["cache_seqlens"].dtype == torch.int32 and args["cache_seqlens"].tolist() == lens
    assert args["block_table"].dtype == torch.int32 and args["block_table"].is_contiguous()
    assert int(args["block_table"].min()) >= 0  # -1 made safe
    assert torch.equal(table, table_before), "the caller's block table must not be modified"
    assert args["k_cache"] is k_cache and args["v_cache"] is v_cache  # in place, never copied
    assert args["causal"] is True and args["window_size"] == (100, 0) and args["softcap"] == 0.0
    assert out.shape == q.shape
    for b, n in enumerate(lens):
        keys = reference.gather_pages(k_cache, table[b], n + 1)
        assert torch.equal(keys[-1], k_new[b, 0]), "new token not appended at cache_seqlens[b]"
        values = reference.gather_pages(v_cache, table[b], n + 1)
        ref = reference.attend_one(q[b], keys, values, softmax_scale=0.25, window_size=(100, 0))
        assert max_err(out[b], ref) < BF16_TOL


def test_decode_without_new_kv_attends_cache_seqlens_keys(fake: FakeFlashAttn) -> None:
    k_cache, v_cache, table, gen = paged_case([11, 4])
    q = torch.randn(2, 1, 2, 16, generator=gen).bfloat16()
    seqlens = torch.tensor([11, 4], dtype=torch.int32)  # every key, the new token included
    out = fb.paged_decode_attention(q, k_cache, v_cache, None, None, seqlens, table, softmax_scale=0.25)
    (_, args), = fake.calls  # fmt: skip
    assert args["k"] is None and args["v"] is None
    assert args["cache_seqlens"].tolist() == [11, 4]
    for b, n in enumerate([11, 4]):
        keys = reference.gather_pages(k_cache, table[b], n)
        values = reference.gather_pages(v_cache, table[b], n)
        assert max_err(out[b], reference.attend_one(q[b], keys, values, softmax_scale=0.25)) < BF16_TOL


def test_paged_prefill_uses_the_block_table(fake: FakeFlashAttn) -> None:
    k_lens, q_lens = [300, 20, 5], [40, 20, 1]
    k_cache, v_cache, table, gen = paged_case(k_lens)
    cu_q = torch.tensor([0, 40, 60, 61], dtype=torch.int32)
    q = torch.randn(61, 4, 16, generator=gen).bfloat16()
    out = fb.paged_prefill_attention(
        q, k_cache, v_cache, cu_q, torch.tensor(k_lens), table, 40, softmax_scale=0.25, softcap=3.0
    )
    (kind, args), = fake.calls  # fmt: skip
    assert kind == "varlen" and args["k"] is k_cache and args["v"] is v_cache
    assert args["cu_seqlens_k"].dtype == torch.int32 and args["cu_seqlens_k"].tolist() == [0, 300, 320, 325]
    assert args["max_seqlen_q"] == 40 and args["max_seqlen_k"] >= 300
    assert args["block_table"].dtype == torch.int32 and int(args["block_table"].min()) >= 0
    for b in range(3):
        keys = reference.gather_pages(k_cache, table[b], k_lens[b])
        values = reference.gather_pages(v_cache, table[b], k_lens[b])
        q_b = q[int(cu_q[b]) : int(cu_q[b + 1])]
        ref = reference.attend_one(q_b, keys, values, softmax_scale=0.25, softcap=3.0)
        assert max_err(out[int(cu_q[b]) : int(cu_q[b + 1])], ref) < BF16_TOL
    assert q_lens == (cu_q[1:] - cu_q[:-1]).tolist()


@pytest.mark.parametrize("block_size", [16, 128, 384])
def test_block_size_must_be_a_multiple_of_256(fake: FakeFlashAttn, block_size: int) -> None:
    k_cache = torch.zeros(2, block_size, 1, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
    seqlens, table = torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"block_size={block_size}"):
        fb.paged_decode_attention(q, k_cache, k_cache.clone(), None, None, seqlens, table, softmax_scale=1.0)
    with pytest.raises(ValueError, match=f"block_size={block_size}"):
        fb.paged_prefill_attention(
            q[0], k_cache, k_cache.clone(), torch.tensor([0, 1]), seqlens + 1, table, 1, softmax_scale=1.0
        )
    assert not fake.calls


@pytest.mark.parametrize("block_size", [256, 512])
def test_block_sizes_multiple_of_256_pass(fake: FakeFlashAttn, block_size: int) -> None:
    k_cache, v_cache, table, gen = paged_case([3], block_size=block_size, h_kv=1)
    q = torch.randn(1, 1, 1, 16, generator=gen).bfloat16()
    fb.paged_decode_attention(q, k_cache, v_cache, None, None, torch.tensor([2]), table, softmax_scale=1.0)
    assert len(fake.calls) == 1


def test_sinks_are_not_supported(fake: FakeFlashAttn) -> None:
    k_cache, v_cache, table, gen = paged_case([3])
    sinks = torch.zeros(2)
    q = torch.randn(1, 1, 2, 16, generator=gen).bfloat16()
    seqlens = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="sinks"):
        fb.paged_decode_attention(
            q, k_cache, v_cache, None, None, seqlens, table, softmax_scale=1.0, sinks=sinks
        )
    with pytest.raises(NotImplementedError, match="sinks"):
        fb.paged_prefill_attention(
            q[0], k_cache, v_cache, torch.tensor([0, 1]), seqlens + 1, table, 1, softmax_scale=1.0, sinks=sinks
        )
    assert not fake.calls


def test_fp32_is_not_supported(fake: FakeFlashAttn) -> None:
    k_cache, v_cache, table, _ = paged_case([3])
    q = torch.zeros(1, 2, 16)
    with pytest.raises(NotImplementedError, match="float32"):
        fb.paged_prefill_attention(
            q, k_cache.float(), v_cache.float(), torch.tensor([0, 1]), torch.tensor([3]), table, 1, softmax_scale=1.0
        )


def test_write_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(2, 256, 1, 4)
    v_cache = torch.zeros(2, 256, 1, 4)
    k, v = torch.ones(3, 1, 4), torch.full((3, 1, 4), 2.0)
    fb.write_kv(k, v, k_cache, v_cache, torch.tensor([300, -1, 7]))
    assert k_cache.sum() == 8 and v_cache.sum() == 16
    assert torch.equal(k_cache[1, 44], k[0]) and torch.equal(v_cache[0, 7], v[2])
    before = k_cache.clone()
    fb.write_kv(k, v, k_cache, v_cache, torch.tensor([-1, -1, -1]))  # nothing kept: nothing changes
    assert torch.equal(k_cache, before)
    k_cache[0, 0] = 5.0
    fb.write_kv(k, v, k_cache, v_cache, torch.tensor([-1, 9, -1]))  # slot 0 is left alone
    assert k_cache[0, 0].tolist() == [[5.0] * 4] and torch.equal(k_cache[0, 9], k[1])
    assert k_cache.sum() == 8 + 20 + 4


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_missing_flash_attn_names_the_fix() -> None:
    with pytest.raises(ImportError, match="pip install flash-attn"):
        fb._load_flash_attn()
