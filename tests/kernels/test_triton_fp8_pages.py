"""The Triton kernels on fp8 pages, under ``TRITON_INTERPRET=1`` on CPU tensors (as ``test_triton_backend.py``):
write_kv rounds like the torch backend (saturating), decode (with and without the appended token, split-K
included) and prefill read the pages widened, against the float64 reference on the values as stored. Tiny
cases: the interpreter is slow. Not run on a GPU here."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first ``import triton``, as test_triton_backend.py

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from hf_paged_attn.kernels import reference, torch_backend  # noqa: E402
from hf_paged_attn.kernels import triton_ops as tb  # noqa: E402
from hf_paged_attn.kernels.base import AttentionOptions  # noqa: E402

if not isinstance(tb._decode_kernel, triton.runtime.interpreter.InterpretedFunction):
    tb = importlib.reload(tb)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
TOL = {"atol": 1e-4, "rtol": 1e-4}  # fp32 kernels against float64, as test_triton_backend.py


def pages(dtype: torch.dtype, lens: list[int], gen: torch.Generator, h_kv: int = 1, d: int = 16, block: int = 16):
    """fp8 pages [num_blocks, block, H_kv, D] holding random K/V for ``lens`` tokens, blocks shuffled."""
    need = [-(-n // block) + 1 for n in lens]  # a spare block each: room for an appended token
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used : used + n]
        used += n
    k_cache = (torch.randn(num_blocks, block, h_kv, d, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen).to(dtype)
    return k_cache, v_cache, table


@pytest.mark.parametrize("dtype", FP8)
def test_write_kv_rounds_as_the_torch_backend(dtype: torch.dtype) -> None:
    x = torch.tensor([[[0.3, -1.7, 1e6, -1e6, 1e-9, 0.0, 3.3, -0.01] * 2]])  # [1, 1, 16]
    got, want = torch.zeros(2, 16, 1, 16, dtype=dtype), torch.zeros(2, 16, 1, 16, dtype=dtype)
    tb.write_kv(x, -x, got, got.clone(), torch.tensor([21]))
    torch_backend.write_kv(x, -x, want, want.clone(), torch.tensor([21]))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # saturated: no NaN from 1e6
    assert got.float().isfinite().all()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_reads_fp8_pages(dtype: torch.dtype, append: bool, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(5)
    lens, h_kv, group, d = [3, 20], 1, 2, 16
    k_cache, v_cache, table = pages(dtype, lens, gen, h_kv, d)
    q = torch.randn(len(lens), 1, h_kv * group, d, generator=gen)
    k_new = torch.randn(len(lens), 1, h_kv, d, generator=gen) if append else None
    v_new = torch.randn(len(lens), 1, h_kv, d, generator=gen) if append else None
    seqlens = torch.tensor(lens, dtype=torch.int32)
    kw = {"options": AttentionOptions(softmax_scale=d**-0.5, softcap=0.0)}
    out = tb.paged_decode_attention(q, k_cache, v_cache, k_new, v_new, seqlens, table, num_splits=num_splits, **kw)
    for b, n in enumerate(lens):
        total = n + append
        k8 = reference.gather_pages(k_cache.float(), table[b], total)  # [total, H_kv, D] as stored
        v8 = reference.gather_pages(v_cache.float(), table[b], total)
        if append:  # the new token went in rounded (saturating) to fp8
            assert torch.equal(k8[-1], k_new[b, 0].to(dtype).float())
        torch.testing.assert_close(out[b], reference.attend_one(q[b], k8, v8, **kw).float(), **TOL)


@pytest.mark.parametrize("dtype", FP8)
def test_prefill_reads_fp8_pages(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    shapes = [(4, 4), (3, 21), (0, 5)]  # (queries, keys)
    h_kv, group, d = 1, 2, 16
    k_cache, v_cache, table = pages(dtype, [k for _, k in shapes], gen, h_kv, d)
    q_lens = [n for n, _ in shapes]
    q = torch.randn(sum(q_lens), h_kv * group, d, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seqused = torch.tensor([k for _, k in shapes], dtype=torch.int32)
    out = tb.paged_prefill_attention(q, k_cache, v_cache, cu_q, seqused, table,
                                     options=AttentionOptions(softmax_scale=d**-0.5))
    for b, (_, n_k) in enumerate(shapes):
        rows, q_b = out[int(cu_q[b]) : int(cu_q[b + 1])], q[int(cu_q[b]) : int(cu_q[b + 1])]
        k8 = reference.gather_pages(k_cache.float(), table[b], n_k)
        v8 = reference.gather_pages(v_cache.float(), table[b], n_k)
        expected = reference.attend_one(q_b, k8, v8, options=AttentionOptions(softmax_scale=d**-0.5))
        torch.testing.assert_close(rows, expected.float(), **TOL)


def test_triton_is_offered_for_fp8_pages_only_where_it_compiles(monkeypatch) -> None:
    from hf_paged_attn.kernels.triton_backend import TritonBackend

    cuda = torch.device("cuda")  # only inspected
    monkeypatch.setattr(TritonBackend, "is_available", staticmethod(lambda device: device.type == "cuda"))
    for capability, e4m3 in (((8, 0), False), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert TritonBackend.suits(cuda, 16, torch.bfloat16, False, 64, torch.float8_e4m3fn) is e4m3
        assert TritonBackend.suits(cuda, 16, torch.bfloat16, False, 64, torch.float8_e5m2)
