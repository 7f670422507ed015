"""fp8 pages (``kernels/kv_dtype.py``): every CPU path of the torch backend (native kernels and torch
gathers) reads and writes them. Two checks per case: against the float64 reference on the pages as
stored (the kernels' own arithmetic: fp32 tolerances), and against the reference on the unrounded K/V
within a bound derived from fp8's rounding (``rounding_bound``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from hf_paged_attn.kernels import cpu_native, reference, torch_backend
from hf_paged_attn.kernels.base import AttentionOptions
from hf_paged_attn.kernels.kv_dtype import to_pages

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
TOL = {"atol": 2e-5, "rtol": 2e-5}  # fp32 kernels against float64, as tests/kernels/test_torch_backend.py
# Relative rounding of a normal number (half a unit in the last place: 3 and 2 mantissa bits) and the
# absolute rounding of a subnormal (half the smallest subnormal: 2^-9 / 2, 2^-16 / 2).
UNIT = {torch.float8_e4m3fn: (2.0**-4, 2.0**-10), torch.float8_e5m2: (2.0**-3, 2.0**-17)}


@contextlib.contextmanager
def native_kernel(on: bool) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not on:  # the backend asks cpu_native.library() at every call: None sends it to its torch ops
            monkeypatch.setattr(cpu_native, "library", lambda: None)
        yield


def rounding_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Largest error of attention [Lq, H, D] when K/V [L, H_kv, D] are rounded to ``dtype``, per head [H]:
    each key element moves by at most ``u |k| + a``, so a score by ``delta = scale * sum |q| (u |k| + a)``,
    each softmax weight by a factor within exp(±2 delta), and the output by at most
    ``u max|v| + a`` (values) plus ``(exp(2 delta) - 1) max|v|`` (weights). Softcap only shrinks a score's move."""
    u, a = UNIT[dtype]
    group = q.shape[1] // k.shape[1]
    kd = k.double().repeat_interleave(group, dim=1).abs()  # [L, H, D]
    vmax = v.double().abs().amax(dim=(0, 2)).repeat_interleave(group)  # [H]
    delta = scale * torch.einsum("qhd,khd->hqk", q.double().abs(), u * kd + a).amax(dim=(1, 2))  # [H]
    return u * vmax + a + (torch.exp(2 * delta) - 1) * vmax + 1e-5


def paged_case(gen: torch.Generator, lens: list[int], block_size: int, h_kv: int, d: int, dtype: torch.dtype):
    """Pages of ``dtype`` holding each request's K/V (the unrounded K/V returned too), blocks shuffled."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), max(need + [1])), -1, dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, h_kv, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    ks, vs = [], []
    for b, n in enumerate(lens):
        table[b, : need[b]] = torch.tensor([ids.pop() for _ in range(need[b])], dtype=torch.int32)
        ks.append(torch.randn(n, h_kv, d, generator=gen) * 2)  # [n, H_kv, D]
        vs.append(torch.randn(n, h_kv, d, generator=gen))
        slots = table[b].long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        torch_backend.write_kv(ks[b], vs[b], k_cache, v_cache, slots)
    return k_cache, v_cache, table, ks, vs


def stored(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    return reference.gather_pages(cache.float(), table, n)  # [n, H_kv, D] as the pages hold them


@pytest.mark.parametrize("dtype", FP8)
def test_write_rounds_to_nearest_and_saturates(dtype: torch.dtype) -> None:
    x = torch.tensor([[[0.3, -1.7, 1e6, -1e6, 1e-9, 0.0]]])  # [1, 1, 6]
    pages = torch.zeros(2, 2, 1, 6, dtype=dtype)
    torch_backend.write_kv(x, x, pages, pages.clone(), torch.tensor([3]))
    got = pages.view(4, 1, 6)[3].float()
    limit = torch.finfo(dtype).max
    assert torch.equal(got, x.clamp(-limit, limit).to(dtype).float()[0])  # no NaN from an overflow
    assert got[0, 2] == limit and got[0, 3] == -limit
    assert torch.equal(to_pages(x, dtype), x.clamp(-limit, limit).to(dtype).view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
def test_native_kernel_reads_every_byte(dtype: torch.dtype) -> None:
    """One key per request: the output is its value exactly, so each of the 256 bytes (NaNs aside) must
    widen to torch's own conversion of it."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler")
    byte = torch.arange(256, dtype=torch.uint8)
    values = byte.view(dtype).float()
    byte[~torch.isfinite(values)] = 0  # NaN (and e5m2's infinities) would make the output NaN
    v_cache = byte.view(1, 1, 1, 256).view(dtype)  # [1 block, 1 slot, 1 head, D=256]
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(1, 1, 1, 256)
    lens, table = torch.tensor([1], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32)
    out = cpu_native.paged_decode(q, k_cache, v_cache, None, None, lens, table, 0.1, -1, 0.0, None, 1)
    assert out is not None
    assert torch.equal(out[0, 0, 0], byte.view(dtype).float())


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("opts", [{}, {"softcap": 20.0}, {"window_size": (7, 0)}, {"sinks": True}])
def test_decode_matches_reference(dtype: torch.dtype, native: bool, append: bool, opts: dict) -> None:
    gen = torch.Generator().manual_seed(7)
    h_kv, group, d, block_size = 2, 4, 64, 8
    lens = [0, 5, 33, 70]
    total = [n + append for n in lens]
    k_cache, v_cache, table, ks, vs = paged_case(gen, total, block_size, h_kv, d, dtype)
    q = torch.randn(len(lens), 1, h_kv * group, d, generator=gen)
    k_new = torch.stack([k[-1:] for k in ks]) if append else None  # [B, 1, H_kv, D]: written by the call
    v_new = torch.stack([v[-1:] for v in vs]) if append else None
    if append:  # junk where the call must write
        for b, n in enumerate(lens):
            k_cache[table[b, n // block_size].long(), n % block_size] = 100.0
    sinks = torch.randn(h_kv * group, generator=gen) if opts.get("sinks") else None
    kw = {"options": AttentionOptions(softmax_scale=d**-0.5, window_size=opts.get("window_size", (-1, -1)),
                                      softcap=opts.get("softcap", 0.0), sinks=sinks)}  # fmt: skip
    seqlens = torch.tensor(lens, dtype=torch.int32)
    with native_kernel(native):
        out = torch_backend.paged_decode_attention(q, k_cache, v_cache, k_new, v_new, seqlens, table, **kw)
    for b, n in enumerate(total):
        k8, v8 = stored(k_cache, table[b], n), stored(v_cache, table[b], n)
        assert torch.equal(k8, ks[b].to(dtype).float()) and torch.equal(v8, vs[b].to(dtype).float())
        torch.testing.assert_close(out[b], reference.attend_one(q[b], k8, v8, **kw), **TOL)
        exact = reference.attend_one(q[b], ks[b], vs[b], **kw).double()  # [1, H, D]
        error = (out[b].double() - exact).abs().amax(dim=(0, 2))  # [H]
        if n:
            assert (error <= rounding_bound(q[b], ks[b], vs[b], kw["options"].softmax_scale, dtype)).all()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_reference(dtype: torch.dtype, native: bool, model_dtype: torch.dtype) -> None:
    """Prefill chunks, whole prompts and one-query rows in one call, read back from fp8 pages."""
    gen = torch.Generator().manual_seed(3)
    h_kv, group, d, block_size = 2, 2, 64, 4
    shapes = [(9, 9), (5, 40), (1, 17), (0, 6)]  # (queries, keys)
    k_cache, v_cache, table, ks, vs = paged_case(gen, [k for _, k in shapes], block_size, h_kv, d, dtype)
    q_lens = [n for n, _ in shapes]
    q = torch.randn(sum(q_lens), h_kv * group, d, generator=gen).to(model_dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seqused = torch.tensor([k for _, k in shapes], dtype=torch.int32)
    scale = d**-0.5
    with native_kernel(native):
        out = torch_backend.paged_prefill_attention(q, k_cache, v_cache, cu_q, seqused, table,
                                                    options=AttentionOptions(softmax_scale=scale))
    assert out.dtype == model_dtype
    tol = TOL if model_dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}  # bf16 output rounding
    for b, (n_q, n_k) in enumerate(shapes):
        rows, q_b = out[int(cu_q[b]) : int(cu_q[b + 1])], q[int(cu_q[b]) : int(cu_q[b + 1])].float()
        k8, v8 = stored(k_cache, table[b], n_k), stored(v_cache, table[b], n_k)
        expected = reference.attend_one(q_b, k8, v8, options=AttentionOptions(softmax_scale=scale))
        torch.testing.assert_close(rows.float(), expected, **tol)
        if n_q and model_dtype == torch.float32:
            exact = reference.attend_one(q_b, ks[b], vs[b],
                                         options=AttentionOptions(softmax_scale=scale)).double()  # [n_q, H, D]
            error = (rows.double() - exact).abs().amax(dim=(0, 2))  # [H]
            assert (error <= rounding_bound(q_b, ks[b], vs[b], scale, dtype)).all()


def test_native_kernel_takes_fp8_pages() -> None:
    """The native kernels read fp8 pages themselves (no fall-back to gathers): they return an output."""
    if cpu_native.library() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, table, _, _ = paged_case(gen, [12, 3], 4, 1, 32, torch.float8_e4m3fn)
    q = torch.randn(2, 1, 2, 32, generator=gen)
    lens = torch.tensor([12, 3], dtype=torch.int32)
    assert cpu_native.paged_decode(q, k_cache, v_cache, None, None, lens, table, 0.2, -1, 0.0, None, 12) is not None
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert cpu_native.paged_prefill(q[:, 0], k_cache, v_cache, cu_q, lens, table, 0.2, -1, 0.0, None, 1) is not None
