"""The native CPU attention kernels (hf_paged_attn/kernels/cpu_native.py): that they are built and really
run, their threads, guards and fallbacks. Their numerics against the float64 reference, on every
instruction set this CPU has, are in test_kernels_cpu_native_numerics.py; test_kernels_torch.py runs the
torch backend's decode with and without them."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from hf_paged_attn.kernels import cpu_native, reference, torch_backend
from hf_paged_attn.kernels.base import AttentionOptions

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


def _case(seed: int = 0, batch: int = 5, block_size: int = 8, dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    h_kv, group, d = 2, 3, 64
    lens = torch.randint(0, 40, (batch,), generator=gen).int()  # tokens before the new one
    width = int(lens.max()) // block_size + 2
    num_blocks = batch * width + 3
    table = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width).int()
    return {
        "q": torch.randn(batch, 1, h_kv * group, d, generator=gen).to(dtype),
        "k_cache": torch.randn(num_blocks, block_size, h_kv, d, generator=gen).to(dtype),
        "v_cache": torch.randn(num_blocks, block_size, h_kv, d, generator=gen).to(dtype),
        "k": torch.randn(batch, 1, h_kv, d, generator=gen).to(dtype),
        "v": torch.randn(batch, 1, h_kv, d, generator=gen).to(dtype),
        "cache_seqlens": lens,
        "block_table": table,
    }


def _native(case: dict, **options: object) -> torch.Tensor | None:
    options = {"softmax_scale": 0.125, "window_left": -1, "softcap": 0.0, "sinks": None, **options}
    max_len = int(case["cache_seqlens"].max()) + 1
    return cpu_native.paged_decode(*case.values(), max_len=max_len, **options)


@needs_compiler
def test_the_kernel_builds_and_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built into the cache directory once; the decode really goes through it and equals the reference."""
    monkeypatch.setenv("HF_PAGED_ATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setattr(cpu_native, "_failed", False)
    case = _case()
    pages = {name: case[name].clone() for name in ("k_cache", "v_cache")}
    out = _native(case)
    assert out is not None and len(list(tmp_path.glob("cpu_attention-*.so"))) == 1
    built = next(tmp_path.glob("cpu_attention-*.so"))
    assert cpu_native.build() == built and built.stat().st_mtime_ns == next(tmp_path.glob("*.so")).stat().st_mtime_ns
    for b, n in enumerate(case["cache_seqlens"].tolist()):
        keys = reference.gather_pages(case["k_cache"], case["block_table"][b], n + 1)
        values = reference.gather_pages(case["v_cache"], case["block_table"][b], n + 1)
        assert torch.equal(keys[-1], case["k"][b, 0]) and torch.equal(values[-1], case["v"][b, 0])
        expected = reference.attend_one(case["q"][b], keys, values, options=AttentionOptions(softmax_scale=0.125))
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(pages["k_cache"], case["k_cache"])  # the new tokens were written in place


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_split_the_work_exactly(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the work threshold the (request, kv head) tasks go to several threads: same output, bit for bit."""
    sinks = torch.linspace(-2, 2, 6)
    one = _native(_case(1, batch=9, dtype=dtype), window_left=11, softcap=20.0, sinks=sinks)
    monkeypatch.setattr(cpu_native, "_THREADED_WORK", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    many = _native(_case(1, batch=9, dtype=dtype), window_left=11, softcap=20.0, sinks=sinks)
    assert one is not None and torch.equal(one, many)


@pytest.mark.parametrize(("isa", "vendor", "bound"), [
    ("avx512bf16", "GenuineIntel", 1 << 21), ("avx512", "GenuineIntel", 1 << 21), ("avx512", None, 1 << 21),
    ("avx512bf16", "AuthenticAMD", 1 << 18), ("avx2", "GenuineIntel", 1 << 18), ("avx2", "AuthenticAMD", 1 << 18),
    ("portable", None, 1 << 18), (None, None, 1 << 18)])  # fmt: skip
def test_the_threading_bound_follows_the_kernels_speed(
    isa: str | None, vendor: str | None, bound: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slower kernels (AVX2, portable, none, AMD's AVX-512) go to the thread pool at less work; a set bound wins."""
    monkeypatch.setattr(cpu_native, "best_isa", lambda: isa)
    monkeypatch.setattr(cpu_native, "_cpu_vendor", lambda: vendor)
    cpu_native._threaded_work_by_isa.cache_clear()
    try:
        assert cpu_native.threaded_work() == bound
        monkeypatch.setattr(cpu_native, "_THREADED_WORK", 7)
        assert cpu_native.threaded_work() == 7
    finally:
        cpu_native._threaded_work_by_isa.cache_clear()


@needs_compiler
def test_a_missing_block_for_the_new_token_raises_and_writes_nothing() -> None:
    case = _case(2)
    case["block_table"][1, :] = -1
    pages = case["k_cache"].clone()
    with pytest.raises(ValueError, match="no cache block"):
        _native(case)
    assert torch.equal(pages, case["k_cache"])


def test_unavailable_or_unsupported_calls_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """No library, float16 and non-contiguous pages go to the torch ops, which still match."""
    assert _native(_case(3, dtype=torch.float16)) is None
    case = _case(3)
    case["k_cache"] = case["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, other layout
    assert _native(case) is None
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    assert _native(_case(3)) is None
    case = _case(3)
    out = torch_backend.paged_decode_attention(*case.values(), options=AttentionOptions(softmax_scale=0.125))
    b, n = 0, int(case["cache_seqlens"][0]) + 1
    keys = reference.gather_pages(case["k_cache"], case["block_table"][b], n)
    values = reference.gather_pages(case["v_cache"], case["block_table"][b], n)
    expected = reference.attend_one(case["q"][b], keys, values, options=AttentionOptions(softmax_scale=0.125))
    torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)


def test_no_compiler_warns_once_and_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-hf-paged")
    monkeypatch.setenv("HF_PAGED_ATTN_CACHE", str(tmp_path))  # nothing cached there
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setattr(cpu_native, "_failed", False)
    with pytest.raises(RuntimeError, match="no-such-compiler-hf-paged"):
        cpu_native.build()
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.library() is None and cpu_native.library() is None
    assert sum("no-such-compiler-hf-paged" in r.getMessage() for r in caplog.records) == 1
    case = _case(4)
    assert _native(case) is None
    out = torch_backend.paged_decode_attention(*case.values(), options=AttentionOptions(softmax_scale=0.125))
    assert out.shape == case["q"].shape and torch.isfinite(out).all()


@needs_compiler
def test_shapes_that_do_not_agree_raise_before_the_c_code_runs() -> None:
    case = _case(6)
    case["block_table"] = case["block_table"][:-1]  # one row short: the kernel would read past it
    with pytest.raises(ValueError, match="block_table"):
        _native(case)
    case = _case(6)
    case["k"] = case["k"][:, :, :1]  # one KV head instead of two
    with pytest.raises(ValueError, match="new K/V"):
        _native(case)


@needs_compiler
def test_an_unknown_isa_is_refused() -> None:
    with pytest.raises(ValueError, match="isa must be one of"):
        _native(_case(7), isa="avx9000")


@needs_compiler
def test_the_best_isa_follows_the_cpu_flags() -> None:
    """cpuid in the C code agrees with the kernel's flags in /proc/cpuinfo (where there is one)."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    words = set(flags.split(":", 1)[1].split())
    avx2 = {"fma", "avx2"} <= words
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= words
    expected = "avx2" if avx2 else "portable"
    if avx512:
        expected = "avx512bf16" if "avx512_bf16" in words else "avx512"
    assert cpu_native.best_isa() == expected


@needs_compiler
def test_a_compiler_without_the_x86_kernels_still_builds_the_portable_ones(tmp_path: Path) -> None:
    """``-DHF_PAGED_ATTN_PORTABLE_ONLY`` (the retry when the AVX-512 intrinsics do not compile) builds a library
    that runs the portable kernels, with the same answers."""
    import ctypes
    import subprocess

    target = tmp_path / "portable.so"
    subprocess.run(["cc", cpu_native.PORTABLE_ONLY, *cpu_native.FLAGS, "-o", str(target), str(cpu_native.SOURCE),
                    "-lm", "-lpthread"], check=True, capture_output=True, timeout=120)  # fmt: skip
    lib = ctypes.CDLL(str(target))
    assert lib.attention_best_isa() == cpu_native.ISAS["portable"]


def test_prefill_refuses_what_it_cannot_read() -> None:
    q = torch.randn(5, 4, 64)
    pages = torch.randn(6, 8, 2, 64)
    cu_q, used, table = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), torch.zeros(1, 2)
    args = (0.125, -1, 0.0, None, 5)
    assert cpu_native.paged_prefill(q.half(), pages.half(), pages.half(), cu_q, used, table.int(), *args) is None
    assert cpu_native.paged_prefill(q, pages, pages, cu_q, used, table.long(), *args) is None  # int64 table
    strided = pages.transpose(1, 2).contiguous().transpose(1, 2)
    assert cpu_native.paged_prefill(q, strided, strided, cu_q, used, table.int(), *args) is None
    with pytest.raises(ValueError, match="block_table"):
        cpu_native.paged_prefill(q, pages, pages, cu_q, used, table.int()[:0], *args)


def _model_layout(case: dict, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``case``'s query and new K/V as a layer of a compiled step hands them over, [1, heads, M, D] (M = ``rows``
    >= B, the rows past B padding): query and value views of one fused projection output [1, M, H + 2 H_kv, D]
    transposed, the key a tensor of its own ([1, M, H_kv, D] transposed, as a rotary embedding returns it), so
    that K and V have different strides and none of the three is contiguous."""
    q, k, v = case["q"][:, 0], case["k"][:, 0], case["v"][:, 0]  # [B, heads, D]
    batch, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
    fused = torch.full((1, rows, heads + 2 * kv_heads, q.shape[-1]), float("nan"), dtype=q.dtype)
    fused[0, :batch] = torch.cat([q, torch.zeros_like(k), v], dim=1)
    query, _, value = fused.split([heads, kv_heads, kv_heads], dim=2)
    key = torch.full((1, rows, kv_heads, q.shape[-1]), float("nan"), dtype=q.dtype)
    key[0, :batch] = k
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layers_equal_the_general_call_on_views_with_padding_rows(dtype: torch.dtype) -> None:
    """``DecodeLayers`` (one argument block per step, each layer's pointers set per call) gives the general
    ``paged_decode``'s output and pages, bit for bit, reading the model's strided views (K and V with
    different strides) and zeroing the padding rows, layer after layer."""
    layers = [_case(seed, batch=5, dtype=dtype) for seed in (3, 4)]
    for case in layers:  # one step: every layer shares the lengths and the block table
        case["cache_seqlens"], case["block_table"] = layers[0]["cache_seqlens"], layers[0]["block_table"]
    general = [{name: t.clone() for name, t in case.items()} for case in layers]
    expected = [_native(case) for case in general]  # [B, 1, H, D]
    views = [_model_layout(case, rows=7) for case in layers]
    assert views[0][1].stride() != views[0][2].stride()
    first, seqlens, table = layers[0], layers[0]["cache_seqlens"], layers[0]["block_table"]
    max_len = int(seqlens.max()) + 1
    calls = cpu_native.DecodeLayers.make(*views[0], first["k_cache"], seqlens, table, max_len, 0.125)
    assert calls is not None
    for case, (query, key, value), want, pages in zip(layers, views, expected, general):
        out = calls(query, key, value, case["k_cache"], case["v_cache"], 0.125)
        assert out is not None and out.shape == (1, 7, 6, 64) and out.is_contiguous()
        assert torch.equal(out[0, :5], want[:, 0]) and not out[0, 5:].any()
        assert torch.equal(case["k_cache"], pages["k_cache"]) and torch.equal(case["v_cache"], pages["v_cache"])


@needs_compiler
def test_decode_layers_refuse_a_layer_unlike_the_first() -> None:
    """Another scale, dtype, stride or page shape than the step's first layer: None, nothing written."""
    case = _case(5)
    query, key, value = _model_layout(case, rows=5)
    args = (case["k_cache"], case["cache_seqlens"], case["block_table"], int(case["cache_seqlens"].max()) + 1, 0.125)
    calls = cpu_native.DecodeLayers.make(query, key, value, *args)
    assert calls is not None
    pages = case["k_cache"].clone()
    assert calls(query, key, value, case["k_cache"], case["v_cache"], 0.25) is None
    assert calls(query.contiguous(), key, value, case["k_cache"], case["v_cache"], 0.125) is None
    assert calls(query, key, value, case["k_cache"][:-1], case["v_cache"][:-1], 0.125) is None
    bf16 = [t.bfloat16() for t in (query, key, value, case["k_cache"], case["v_cache"])]
    assert calls(*bf16, 0.125) is None
    assert torch.equal(pages, case["k_cache"])
    wider = torch.zeros(1, 6, 5, 128)  # a head dim the pages do not have: not prepared at all
    assert cpu_native.DecodeLayers.make(wider, wider[:, :2], wider[:, :2], *args) is None
