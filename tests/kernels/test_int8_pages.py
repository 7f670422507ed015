"""int8 pages with a scale per (token, KV head) (``kernels/kv_dtype.py``): the torch backend writes them with
their scales and reads them back dequantized, on every path (prefill write, decode append, gathers). Two
checks per case, as for fp8 (``test_fp8_pages.py``): against the float64 reference on the values as stored
(fp32 tolerances), and against the reference on the unrounded K/V within int8's rounding bound."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_paged_attn.kernels import reference, torch_backend
from hf_paged_attn.kernels.base import AttentionOptions
from hf_paged_attn.kernels.kv_dtype import SCALE_DTYPE, dequantize_int8, quantize_int8

TOL = {"atol": 2e-5, "rtol": 2e-5}


def rounding_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Largest error of attention [Lq, H, D] when K/V [L, H_kv, D] are stored as int8 with a scale per token and
    head, per head [H]: an element moves by at most half its row's step ``max|row| / 254``, so a score by
    ``delta = scale * sum |q| step_k / 2``, each softmax weight by a factor within exp(±2 delta), and the output
    by at most ``max step_v / 2`` plus ``(exp(2 delta) - 1) max|v|``."""
    group = q.shape[1] // k.shape[1]
    half_k = (k.double().abs().amax(-1) / 254).repeat_interleave(group, dim=1)  # [L, H]
    half_v = (v.double().abs().amax(dim=(0, 2)) / 254).repeat_interleave(group)  # [H]
    vmax = v.double().abs().amax(dim=(0, 2)).repeat_interleave(group)  # [H]
    delta = scale * torch.einsum("qhd,kh->hqk", q.double().abs().sum(-1, keepdim=True), half_k).amax(dim=(1, 2))
    return 1.01 * (half_v + (torch.exp(2 * delta) - 1) * vmax) + 1e-5  # 1%: float16 scales, fp32 arithmetic


def paged_case(gen: torch.Generator, lens: list[int], block_size: int, h_kv: int, d: int):
    """int8 pages and their scales holding each request's K/V (the unrounded K/V returned too), blocks
    shuffled, written through ``write_kv``."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), max(need + [1])), -1, dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, h_kv, d, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    scales = {"k_scales": torch.zeros(num_blocks, block_size, h_kv, dtype=SCALE_DTYPE)}
    scales["v_scales"] = torch.zeros_like(scales["k_scales"])
    ks, vs = [], []
    for b, n in enumerate(lens):
        table[b, : need[b]] = torch.tensor([ids.pop() for _ in range(need[b])], dtype=torch.int32)
        ks.append(torch.randn(n, h_kv, d, generator=gen) * torch.rand(n, h_kv, 1, generator=gen) * 4)  # rows differ
        vs.append(torch.randn(n, h_kv, d, generator=gen))
        slots = table[b].long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        torch_backend.write_kv(ks[b], vs[b], k_cache, v_cache, slots, **scales)
    return k_cache, v_cache, scales, table, ks, vs


def stored(cache: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """[n, H_kv, D] as the pages hold them, dequantized."""
    q8 = reference.gather_pages(cache.float(), table, n)
    return q8 * reference.gather_pages(scales.float().unsqueeze(-1), table, n)


def test_quantize_rounds_each_row_by_its_own_scale() -> None:
    x = torch.tensor([[[0.3, -1.7, 100.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-6, -2e-6, 0.0, 0.0]]])  # [1, 3, 4]
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == SCALE_DTYPE and scale.shape == (1, 3)
    assert q[0, 0, 2] == 127 and q.abs().max() <= 127
    back = dequantize_int8(q, scale, torch.float32)
    assert ((back - x).abs() <= scale.float().unsqueeze(-1) / 2 * 1.001).all()
    assert torch.equal(back[0, 1], torch.zeros(4))  # a head of zeros stores zeros, not NaN
    assert torch.isclose(scale[0, 0].float(), torch.tensor(100.0 / 127), rtol=2**-10)


@pytest.mark.parametrize("append", [True, False])
@pytest.mark.parametrize("opts", [{}, {"softcap": 20.0}, {"window_size": (7, 0)}, {"sinks": True}])
def test_decode_matches_reference(append: bool, opts: dict) -> None:
    gen = torch.Generator().manual_seed(7)
    h_kv, group, d, block_size = 2, 2, 32, 8
    lens = [0, 5, 33]
    total = [n + append for n in lens]
    k_cache, v_cache, scales, table, ks, vs = paged_case(gen, total, block_size, h_kv, d)
    q = torch.randn(len(lens), 1, h_kv * group, d, generator=gen)
    k_new = torch.stack([k[-1:] for k in ks]) if append else None  # [B, 1, H_kv, D]: written by the call
    v_new = torch.stack([v[-1:] for v in vs]) if append else None
    if append:  # junk where the call must write, scales included
        for b, n in enumerate(lens):
            k_cache[table[b, n // block_size].long(), n % block_size] = 100
            scales["k_scales"][table[b, n // block_size].long(), n % block_size] = 9.0
    sinks = torch.randn(h_kv * group, generator=gen) if opts.get("sinks") else None
    kw = {"options": AttentionOptions(softmax_scale=d**-0.5, window_size=opts.get("window_size", (-1, -1)),
                                      softcap=opts.get("softcap", 0.0), sinks=sinks)}  # fmt: skip
    seqlens = torch.tensor(lens, dtype=torch.int32)
    with_scales = dataclasses.replace(kw["options"], **scales)  # the pages' scales, besides the layer's options
    out = torch_backend.paged_decode_attention(q, k_cache, v_cache, k_new, v_new, seqlens, table, options=with_scales)
    for b, n in enumerate(total):
        k8, v8 = stored(k_cache, scales["k_scales"], table[b], n), stored(v_cache, scales["v_scales"], table[b], n)
        torch.testing.assert_close(out[b], reference.attend_one(q[b], k8, v8, **kw), **TOL)
        if n:
            exact = reference.attend_one(q[b], ks[b], vs[b], **kw).double()  # [1, H, D]
            error = (out[b].double() - exact).abs().amax(dim=(0, 2))  # [H]
            assert (error <= rounding_bound(q[b], ks[b], vs[b], kw["options"].softmax_scale)).all()
            assert error.max() > 0  # rounded: the check can fail


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_reference(model_dtype: torch.dtype) -> None:
    """Prefill chunks, whole prompts and one-query rows in one call, read back from int8 pages."""
    gen = torch.Generator().manual_seed(3)
    h_kv, group, d, block_size = 2, 2, 32, 4
    shapes = [(9, 9), (5, 40), (1, 17), (0, 6)]  # (queries, keys)
    k_cache, v_cache, scales, table, ks, vs = paged_case(gen, [k for _, k in shapes], block_size, h_kv, d)
    q_lens = [n for n, _ in shapes]
    q = torch.randn(sum(q_lens), h_kv * group, d, generator=gen).to(model_dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seqused = torch.tensor([k for _, k in shapes], dtype=torch.int32)
    scale = d**-0.5
    out = torch_backend.paged_prefill_attention(q, k_cache, v_cache, cu_q, seqused, table,
                                                options=AttentionOptions(softmax_scale=scale, **scales))  # fmt: skip
    assert out.dtype == model_dtype
    tol = TOL if model_dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}  # bf16 output rounding
    for b, (n_q, n_k) in enumerate(shapes):
        rows, q_b = out[int(cu_q[b]) : int(cu_q[b + 1])], q[int(cu_q[b]) : int(cu_q[b + 1])].float()
        k8, v8 = stored(k_cache, scales["k_scales"], table[b], n_k), stored(v_cache, scales["v_scales"], table[b], n_k)
        expected = reference.attend_one(q_b, k8, v8, options=AttentionOptions(softmax_scale=scale))
        torch.testing.assert_close(rows.float(), expected, **tol)
        if n_q and model_dtype == torch.float32:
            exact = reference.attend_one(q_b, ks[b], vs[b],
                                         options=AttentionOptions(softmax_scale=scale)).double()  # [n_q, H, D]
            error = (rows.double() - exact).abs().amax(dim=(0, 2))  # [H]
            assert (error <= rounding_bound(q_b, ks[b], vs[b], scale)).all()


def test_copy_blocks_carries_the_scales() -> None:
    """A forked block (beams, copy-on-write) reads back the same values: its scales move with its bytes."""
    from hf_paged_attn.attention.cache import PagedAttentionCache
    from hf_paged_attn_tools.tiny_configs import tiny_config

    config = tiny_config("llama")
    cache = PagedAttentionCache(config, num_blocks=4, block_size=2, page_dtype=torch.int8)
    layer = cache.layers[0]
    h_kv, d = config.num_key_value_heads, config.head_dim
    layer.lazy_initialization(torch.zeros(1, h_kv, 1, d), torch.zeros(1, h_kv, 1, d))
    assert layer.k_scales is not None and layer.k_scales.shape == (4, 2, h_kv)
    k = torch.randn(2, h_kv, d) * 3
    torch_backend.write_kv(k, -k, layer.keys, layer.values, torch.tensor([2, 3]), **layer.scale_kwargs)
    cache.copy_blocks([(1, 3)])
    for pages, scales in ((layer.keys, layer.k_scales), (layer.values, layer.v_scales)):
        assert torch.equal(dequantize_int8(pages[3], scales[3], torch.float32),
                           dequantize_int8(pages[1], scales[1], torch.float32))  # fmt: skip
    assert (dequantize_int8(layer.keys[3], layer.k_scales[3], torch.float32) - k).abs().max() < k.abs().max() / 200
