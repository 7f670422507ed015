"""The ``max_seqlen_k`` contract of ``kernels/base.py``, for every backend and for the caller.

A backend given the tightest bound the contract allows (the longest request's keys counted from
position 0, whatever the window leaves visible) must compute what the float64 reference computes;
the attention function must never pass less, sliding layers included. flash runs through its
stand-in, which reads no key past ``max_seqlen_k`` as flash-attn's split-KV kernel does; triton under
its interpreter (CPU tensors).
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first `import triton`: interpreted kernels on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn.kernels import BACKENDS, flash_backend, reference  # noqa: E402
from hf_paged_attn.kernels.base import AttentionOptions  # noqa: E402
from hf_paged_attn_tools.testing import load_pair, save_random_model, shuffled_block_table  # noqa: E402
from hf_paged_attn_tools.tiny_configs import tiny_config  # noqa: E402
from tests.kernels.fake_flash_attn import FakeFlashAttn  # noqa: E402

BLOCK = 256
WINDOW = 64
FP32_TOL = 1e-5  # fp32 arithmetic over a few hundred keys against float64
# dtype each backend runs here: flash-attn has no fp32; its stand-in computes with the reference itself
DTYPES = {"torch": torch.float32, "triton": torch.float32, "flash": torch.bfloat16}


@pytest.fixture
def backend(request, monkeypatch: pytest.MonkeyPatch):
    name = request.param
    if name == "triton":
        triton = pytest.importorskip("triton")
        from hf_paged_attn.kernels import triton_ops

        if not isinstance(triton_ops._decode_kernel, triton.runtime.interpreter.InterpretedFunction):
            importlib.reload(triton_ops)  # imported before TRITON_INTERPRET was set: rebuild it interpreted
    if name == "flash":
        monkeypatch.setattr(flash_backend, "_load_flash_attn", FakeFlashAttn)
    return BACKENDS[name]()


def pages(lens: list[int], dtype: torch.dtype, gen: torch.Generator):
    table, num_blocks = shuffled_block_table(lens, BLOCK, gen, spare=1)
    k_cache = torch.randn(num_blocks, BLOCK, 2, 16, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, 2, 16, generator=gen).to(dtype)
    return k_cache, v_cache, table


def assert_matches(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    if name == "flash":  # the stand-in computes with the reference: bit for bit
        assert torch.equal(out, ref)
    else:
        assert (out.double() - ref.double()).abs().max().item() < FP32_TOL


@pytest.mark.parametrize("backend", list(BACKENDS), indirect=True)
def test_prefill_with_the_tightest_key_bound(backend) -> None:
    """A window of 64 and keys up to 600: the bound is 600, not the 64 + 40 keys a window leaves."""
    name = backend.name
    dtype, gen = DTYPES[name], torch.Generator().manual_seed(0)
    k_lens, q_lens = [600, 290, 3], [40, 1, 3]
    k_cache, v_cache, table = pages(k_lens, dtype, gen)
    cu_q = torch.tensor([0, 40, 41, 44], dtype=torch.int32)
    q = torch.randn(44, 4, 16, generator=gen).to(dtype)
    options = AttentionOptions(softmax_scale=0.3, window_size=(WINDOW - 1, WINDOW - 1), softcap=2.5)
    out = backend.paged_prefill_attention(
        q, k_cache, v_cache, cu_q, torch.tensor(k_lens, dtype=torch.int32), table, max(q_lens), max(k_lens),
        options=options,
    )  # fmt: skip
    for b, (q0, q1) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        keys = reference.gather_pages(k_cache, table[b], k_lens[b])
        values = reference.gather_pages(v_cache, table[b], k_lens[b])
        assert_matches(out[q0:q1], reference.attend_one(q[q0:q1], keys, values, options=options), name)


@pytest.mark.parametrize("backend", list(BACKENDS), indirect=True)
def test_decode_with_the_tightest_key_bound(backend) -> None:
    name = backend.name
    dtype, gen = DTYPES[name], torch.Generator().manual_seed(1)
    cached = [599, 289]
    k_cache, v_cache, table = pages([n + 1 for n in cached], dtype, gen)
    q = torch.randn(2, 1, 4, 16, generator=gen).to(dtype)
    k_new, v_new = (torch.randn(2, 1, 2, 16, generator=gen).to(dtype) for _ in range(2))
    options = AttentionOptions(softmax_scale=0.3, window_size=(WINDOW - 1, WINDOW - 1), softcap=2.5)
    seqlens = torch.tensor(cached, dtype=torch.int32)
    out = backend.paged_decode_attention(
        q, k_cache, v_cache, k_new, v_new, seqlens, table, max(cached) + 1, options=options
    )
    for b, n in enumerate(cached):
        keys = reference.gather_pages(k_cache, table[b], n + 1)
        values = reference.gather_pages(v_cache, table[b], n + 1)
        assert torch.equal(keys[-1], k_new[b, 0]), "the new key was not appended at cache_seqlens[b]"
        assert_matches(out[b], reference.attend_one(q[b], keys, values, options=options), name)


def test_the_attention_function_passes_a_bound_of_every_request_keys(tmp_path, monkeypatch) -> None:
    """A hybrid model (a sliding and a full layer) through the engine, prompts longer than window + block:
    every call's max_seqlen_k is at least each request's keys from position 0, in both groups."""
    config = tiny_config("gemma2")
    config.num_hidden_layers, config.sliding_window, config.max_position_embeddings = 2, 8, 256
    config.layer_types = ["sliding_attention", "full_attention"]
    _, paged = load_pair(save_random_model(config, tmp_path), reference="eager")
    torch_backend = BACKENDS["torch"]
    seen = []

    def prefill(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, **kw):
        seen.append((max_seqlen_k, int(seqused_k.max()), kw["options"].window_size))
        return original_prefill(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q,
                                max_seqlen_k, **kw)  # fmt: skip

    def decode(q, k_cache, v_cache, k, v, cache_seqlens, block_table, max_seqlen_k, **kw):
        seen.append((max_seqlen_k, int(cache_seqlens.max()) + (k is not None), kw["options"].window_size))
        return original_decode(q, k_cache, v_cache, k, v, cache_seqlens, block_table, max_seqlen_k, **kw)

    original_prefill, original_decode = torch_backend.paged_prefill_attention, torch_backend.paged_decode_attention
    monkeypatch.setattr(torch_backend, "paged_prefill_attention", staticmethod(prefill))
    monkeypatch.setattr(torch_backend, "paged_decode_attention", staticmethod(decode))
    engine = ContinuousBatchingEngine(paged, PagedConfig(kernel="torch", block_size=16, max_batch_tokens=24))
    prompt = torch.randint(1, 200, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.generate([prompt, prompt[:5]], max_new_tokens=4)
    windowed = [s for s in seen if s[2] != (-1, -1)]
    assert windowed and any(keys > 8 + 24 for _, keys, _ in windowed), "no call had keys beyond the window"
    assert all(bound >= keys for bound, keys, _ in seen), [s for s in seen if s[0] < s[1]]
