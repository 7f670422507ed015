"""The flash-attn adapter, run against a stand-in ``flash_attn`` module (no GPU, no flash-attn).

The stand-in (``fake_flash_attn.py``) has flash-attn 2's exact Python signatures, raises where its C++
side raises and computes what its kernels compute with the float64 reference, so the adapter's
results must equal the reference's bit for bit. Its availability, graph safety and head-dim rules
are tested with the GPU, the version and the installed modules faked.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from hf_paged_attn import PagedConfig
from hf_paged_attn.kernels import BACKENDS, reference, resolve_kernel
from hf_paged_attn.kernels import flash_backend as fb
from hf_paged_attn.kernels.base import AttentionOptions
from hf_paged_attn.runtime.config import page_head_dim
from hf_paged_attn_tools.testing import shuffled_block_table
from tests.kernels.fake_flash_attn import FakeFlashAttn, readable_keys

CUDA = torch.device("cuda")  # only inspected, never allocated on
SCALE = 0.3  # not head_dim ** -0.5 (0.25 for 16), so a scale that fails to arrive shows


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


def test_decode_appends_and_attends(fake: FakeFlashAttn) -> None:
    lens = [0, 255, 300]
    k_cache, v_cache, table, gen = paged_case([n + 1 for n in lens])
    q = torch.randn(3, 1, 4, 16, generator=gen).bfloat16()
    k_new = torch.randn(3, 1, 2, 16, generator=gen).bfloat16()
    v_new = torch.randn(3, 1, 2, 16, generator=gen).bfloat16()
    seqlens = torch.tensor(lens)  # int64 on purpose
    table_before = table.clone()
    out = fb.paged_decode_attention(
        q, k_cache, v_cache, k_new, v_new, seqlens, table,
        options=AttentionOptions(softmax_scale=SCALE, window_size=(100, 0))
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
        ref = reference.attend_one(q[b], keys, values,
                                   options=AttentionOptions(softmax_scale=SCALE, window_size=(100, 0)))
        assert torch.equal(out[b], ref)


def test_decode_without_new_kv_attends_cache_seqlens_keys(fake: FakeFlashAttn) -> None:
    k_cache, v_cache, table, gen = paged_case([11, 4])
    q = torch.randn(2, 1, 2, 16, generator=gen).bfloat16()
    seqlens = torch.tensor([11, 4], dtype=torch.int32)  # every key, the new token included
    out = fb.paged_decode_attention(q, k_cache, v_cache, None, None, seqlens, table,
                                    options=AttentionOptions(softmax_scale=SCALE))
    (_, args), = fake.calls  # fmt: skip
    assert args["k"] is None and args["v"] is None
    assert args["cache_seqlens"].tolist() == [11, 4]
    for b, n in enumerate([11, 4]):
        keys = reference.gather_pages(k_cache, table[b], n)
        values = reference.gather_pages(v_cache, table[b], n)
        assert torch.equal(out[b], reference.attend_one(q[b], keys, values,
                                                        options=AttentionOptions(softmax_scale=SCALE)))


def test_paged_prefill_uses_the_block_table(fake: FakeFlashAttn) -> None:
    k_lens, q_lens = [300, 20, 5], [40, 20, 1]
    k_cache, v_cache, table, gen = paged_case(k_lens)
    cu_q = torch.tensor([0, 40, 60, 61], dtype=torch.int32)
    q = torch.randn(61, 4, 16, generator=gen).bfloat16()
    out = fb.paged_prefill_attention(
        q, k_cache, v_cache, cu_q, torch.tensor(k_lens), table, 40,
        options=AttentionOptions(softmax_scale=SCALE, softcap=3.0)
    )
    (kind, args), = fake.calls  # fmt: skip
    assert kind == "varlen" and args["k"] is k_cache and args["v"] is v_cache
    assert args["cu_seqlens_k"].dtype == torch.int32 and args["cu_seqlens_k"].tolist() == [0, 300, 320, 325]
    assert args["max_seqlen_q"] == 40 and args["max_seqlen_k"] == table.shape[1] * 256  # the table's capacity
    assert args["block_table"].dtype == torch.int32 and int(args["block_table"].min()) >= 0
    for b in range(3):
        keys = reference.gather_pages(k_cache, table[b], k_lens[b])
        values = reference.gather_pages(v_cache, table[b], k_lens[b])
        q_b = q[int(cu_q[b]) : int(cu_q[b + 1])]
        ref = reference.attend_one(q_b, keys, values, options=AttentionOptions(softmax_scale=SCALE, softcap=3.0))
        assert torch.equal(out[int(cu_q[b]) : int(cu_q[b + 1])], ref)
    assert q_lens == (cu_q[1:] - cu_q[:-1]).tolist()


@pytest.mark.parametrize("block_size", [16, 128, 384])
def test_block_size_must_be_a_multiple_of_256(fake: FakeFlashAttn, block_size: int) -> None:
    k_cache = torch.zeros(2, block_size, 1, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
    seqlens, table = torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"block_size={block_size}"):
        fb.paged_decode_attention(q, k_cache, k_cache.clone(), None, None, seqlens, table,
                                  options=AttentionOptions(softmax_scale=1.0))
    with pytest.raises(ValueError, match=f"block_size={block_size}"):
        fb.paged_prefill_attention(
            q[0], k_cache, k_cache.clone(), torch.tensor([0, 1]), seqlens + 1, table, 1,
            options=AttentionOptions(softmax_scale=1.0)
        )
    assert not fake.calls


@pytest.mark.parametrize("block_size", [256, 512])
def test_block_sizes_multiple_of_256_pass(fake: FakeFlashAttn, block_size: int) -> None:
    k_cache, v_cache, table, gen = paged_case([3], block_size=block_size, h_kv=1)
    q = torch.randn(1, 1, 1, 16, generator=gen).bfloat16()
    fb.paged_decode_attention(q, k_cache, v_cache, None, None, torch.tensor([2]), table,
                              options=AttentionOptions(softmax_scale=1.0))
    assert len(fake.calls) == 1


def test_sinks_are_not_supported(fake: FakeFlashAttn) -> None:
    k_cache, v_cache, table, gen = paged_case([3])
    sinks = torch.zeros(2)
    q = torch.randn(1, 1, 2, 16, generator=gen).bfloat16()
    seqlens = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="sinks"):
        fb.paged_decode_attention(
            q, k_cache, v_cache, None, None, seqlens, table, options=AttentionOptions(softmax_scale=1.0, sinks=sinks)
        )
    with pytest.raises(NotImplementedError, match="sinks"):
        fb.paged_prefill_attention(
            q[0], k_cache, v_cache, torch.tensor([0, 1]), seqlens + 1, table, 1,
            options=AttentionOptions(softmax_scale=1.0, sinks=sinks)
        )
    assert not fake.calls


def test_fp32_is_not_supported(fake: FakeFlashAttn) -> None:
    k_cache, v_cache, table, _ = paged_case([3])
    q = torch.zeros(1, 2, 16)
    with pytest.raises(NotImplementedError, match="float32"):
        fb.paged_prefill_attention(
            q, k_cache.float(), v_cache.float(), torch.tensor([0, 1]), torch.tensor([3]), table, 1,
            options=AttentionOptions(softmax_scale=1.0)
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


# ------------------------------------------------------------------ max_seqlen_k (issue: sliding windows)
def test_the_stand_in_reads_no_key_past_max_seqlen_k(fake: FakeFlashAttn) -> None:
    """The stand-in itself, called as the old adapter called it for a sliding layer (max_seqlen_k = the
    window's keys): rows whose keys lie past ceil(max_seqlen_k / kBlockN) blocks differ, rows with none are 0."""
    k_cache, v_cache, table, gen = paged_case([700])
    table = table.clamp(min=0)  # the adapter's job, done here by hand
    q = torch.randn(20, 4, 16, generator=gen).bfloat16()
    cu_q, cu_k = torch.tensor([0, 20], dtype=torch.int32), torch.tensor([0, 700], dtype=torch.int32)
    options = dict(softmax_scale=SCALE, causal=True, window_size=(63, 63))
    out = fake.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 20, 83, block_table=table, **options)
    assert readable_keys(83, 16) == 256  # kBlockN is 256 for head dim 16: one block of keys
    assert torch.equal(out, torch.zeros_like(q)), "every row's window (from key 617) lies past key 256"
    full = fake.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 20, 700, block_table=table, **options)
    keys, values = (reference.gather_pages(c, table[0], 700) for c in (k_cache, v_cache))
    assert torch.equal(full, reference.attend_one(q, keys, values,
                                                  options=AttentionOptions(softmax_scale=SCALE, window_size=(63, 0))))


def test_prefill_reads_every_key_whatever_max_seqlen_k_the_caller_gives(fake: FakeFlashAttn) -> None:
    """A sliding layer's step: the caller's bound counts the window (64 keys + the chunk), the requests'
    keys count from position 0. flash-attn gets the block table's capacity, so nothing is cut."""
    k_lens, q_lens = [700, 300, 2], [40, 1, 2]
    k_cache, v_cache, table, gen = paged_case(k_lens)
    cu_q = torch.tensor([0, 40, 41, 43], dtype=torch.int32)
    q = torch.randn(43, 4, 16, generator=gen).bfloat16()
    window = (63, 63)
    out = fb.paged_prefill_attention(
        q, k_cache, v_cache, cu_q, torch.tensor(k_lens), table, 40, 64 + 40 - 1,
        options=AttentionOptions(softmax_scale=SCALE, window_size=window),
    )  # fmt: skip
    (_, args), = fake.calls  # fmt: skip
    assert args["max_seqlen_k"] == table.shape[1] * 256 >= max(k_lens)
    for b in range(3):
        keys, values = (reference.gather_pages(c, table[b], k_lens[b]) for c in (k_cache, v_cache))
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert torch.equal(out[rows], reference.attend_one(q[rows], keys, values,
                                                           options=AttentionOptions(softmax_scale=SCALE,
                                                                                    window_size=window)))  # fmt: skip
    assert q_lens == cu_q.diff().tolist()


# ------------------------------------------------------------------ one query per request (max_seqlen_q == 1)
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 0, 1], [0, 0, 1]])
def test_prefill_with_at_most_one_query_per_request(fake: FakeFlashAttn, q_lens: list[int]) -> None:
    """flash-attn reshapes q to [batch, H_kv, groups, D] at max_seqlen_q == 1 (grouped heads, no window):
    a request without a query must not send it there."""
    k_lens = [5, 3, 260]
    k_cache, v_cache, table, gen = paged_case(k_lens)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 4, 16, generator=gen).bfloat16()  # 4 query heads over 2 KV heads
    out = fb.paged_prefill_attention(q, k_cache, v_cache, cu_q, torch.tensor(k_lens), table, 1,
                                     options=AttentionOptions(softmax_scale=SCALE))
    (_, args), = fake.calls  # fmt: skip
    assert args["max_seqlen_q"] == (1 if sum(q_lens) == len(q_lens) else 2)
    for b in range(3):
        keys, values = (reference.gather_pages(c, table[b], k_lens[b]) for c in (k_cache, v_cache))
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert torch.equal(out[rows], reference.attend_one(q[rows], keys, values,
                                                           options=AttentionOptions(softmax_scale=SCALE)))


def test_the_stand_in_refuses_one_query_per_request_with_a_request_short(fake: FakeFlashAttn) -> None:
    k_cache, v_cache, table, gen = paged_case([5, 3])
    q = torch.randn(1, 4, 16, generator=gen).bfloat16()
    cu_q, cu_k = torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([0, 5, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        fake.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 1, 512, softmax_scale=SCALE, causal=True,
                                    block_table=table)  # fmt: skip


# ------------------------------------------------------------------ head dims and dtypes flash-attn refuses
@pytest.mark.parametrize("head_dim", [12, 264, 512])
def test_head_dims_flash_attn_refuses_are_refused(fake: FakeFlashAttn, head_dim: int) -> None:
    k_cache, v_cache, table, gen = paged_case([3], d=head_dim)
    q = torch.randn(1, 1, 2, head_dim, generator=gen).bfloat16()
    seqlens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=f"got {head_dim}"):
        fb.paged_decode_attention(q, k_cache, v_cache, None, None, seqlens, table,
                                  options=AttentionOptions(softmax_scale=SCALE))
    with pytest.raises(NotImplementedError, match=f"got {head_dim}"):
        fb.paged_prefill_attention(q[0], k_cache, v_cache, torch.tensor([0, 1]), seqlens, table, 1,
                                   options=AttentionOptions(softmax_scale=SCALE))
    assert not fake.calls
    with pytest.raises(RuntimeError, match="head"):  # the stand-in refuses them too
        fake.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    assert not fb.accepts_head_dim(head_dim) and not fb.FlashBackend.suits(CUDA, 256, torch.bfloat16, False, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_stand_in_refuses_what_flash_attn_refuses(fake: FakeFlashAttn, dtype: torch.dtype) -> None:
    k_cache, v_cache, table, gen = paged_case([3])
    q = torch.randn(1, 1, 2, 16, generator=gen)
    seqlens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        fake.flash_attn_with_kvcache(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), cache_seqlens=seqlens,
                                     block_table=table)  # fmt: skip


@pytest.mark.parametrize("head_dim, expected", [(128, "flash"), (256, "flash"), (264, "triton"), (80, "flash"),
                                                (36, "triton"), (None, "flash")])  # fmt: skip
def test_auto_falls_back_from_head_dims_flash_attn_refuses(monkeypatch, head_dim, expected) -> None:
    monkeypatch.setattr(BACKENDS["flash"], "is_available", lambda device: device.type == "cuda")
    monkeypatch.setattr(BACKENDS["triton"], "is_available", lambda device: device.type == "cuda")
    assert resolve_kernel("auto", CUDA, None, torch.bfloat16, False, head_dim) == expected
    assert PagedConfig().resolved(CUDA, torch.bfloat16, head_dim=head_dim).kernel == expected


def test_page_head_dim_is_the_widest_attention_head_dim(llama_pair) -> None:
    _, paged = llama_pair
    assert page_head_dim(paged) == paged.config.hidden_size // paged.config.num_attention_heads
    assert page_head_dim(torch.nn.Linear(2, 2)) is None


# ------------------------------------------------------------------ availability
@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The top-level modules find_spec finds (add names to it); a GPU of compute capability 8.0."""
    found: set[str] = set()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in found else real(name, *a))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    return found


def test_available_with_the_fa2_extension_on_ampere(installed: set[str]) -> None:
    assert not fb.FlashBackend.is_available(CUDA)
    installed |= {"flash_attn", "flash_attn_2_cuda"}
    assert fb.FlashBackend.is_available(CUDA)
    assert not fb.FlashBackend.is_available(torch.device("cpu"))


@pytest.mark.parametrize("capability, available", [((7, 0), False), ((7, 5), False), ((8, 0), True),
                                                   ((8, 9), True), ((9, 0), True), ((10, 0), True)])  # fmt: skip
def test_gpus_before_ampere_are_refused(installed, monkeypatch, capability, available) -> None:
    installed |= {"flash_attn", "flash_attn_2_cuda", "triton"}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fb.FlashBackend.is_available(CUDA) is available
    # auto then falls back: triton needs 8.0 too, so a T4 or V100 gets torch
    assert resolve_kernel("auto", CUDA, None, torch.bfloat16) == ("flash" if available else "torch")


def test_a_flash_attn_4_only_install_is_not_flash_attn_2(installed: set[str], monkeypatch) -> None:
    """flash-attn 4 installs ``flash_attn`` as a namespace package (only ``flash_attn.cute``): find_spec
    finds it, yet it has neither the FA2 extension nor the FA2 functions."""
    installed.add("flash_attn")
    assert not fb.FlashBackend.is_available(CUDA)
    namespace = types.ModuleType("flash_attn")
    namespace.__path__ = []  # a package without __init__ code
    monkeypatch.setitem(sys.modules, "flash_attn", namespace)
    with pytest.raises(ImportError, match="lacks its functions"):
        fb._load_flash_attn()


# ------------------------------------------------------------------ CUDA graphs by version
@pytest.mark.parametrize("version, safe", [("2.6.0", True), ("2.7.4.post1", True), ("2.8.3", True),
                                           ("2.8.3.post1", True), ("2.8.4", False), ("2.8.4.dev0", False),
                                           ("2.9.0", False), ("3.0.0", False), (None, False)])  # fmt: skip
def test_graph_safe_follows_the_installed_version(monkeypatch, version, safe) -> None:
    monkeypatch.setattr(fb, "installed_version", lambda: version)
    assert fb.FlashBackend.graph_safe is safe and fb.FlashBackend().graph_safe is safe
    monkeypatch.setattr(BACKENDS["flash"], "is_available", lambda device: device.type == "cuda")
    assert PagedConfig(kernel="flash").resolved(CUDA, torch.bfloat16).cuda_graphs is safe
    if not safe:
        with pytest.raises(ValueError, match="cuda_graphs=True"):
            PagedConfig(kernel="flash", cuda_graphs=True).resolved(CUDA, torch.bfloat16)
