"""Triton kernels against the float64 reference, on CPU tensors under the Triton interpreter.

The default selection is a small, derandomised set of property tests (the interpreter runs each
program in numpy, so it is slow); ``-m slow`` runs many more and larger cases, bf16 included.
fp32 results agree with the reference to ~1e-6; the tests allow 1e-4 (bf16: 3e-2).
Under the interpreter the kernels compute their dot products in fp32 even for bf16 inputs (the
interpreter's bf16 dot is broken), so bf16 here tests storage and masking, not tensor-core maths.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

# Must precede the first `import triton`: the kernels are built as interpreted functions when the
# backend module is imported with this set (it is also the only way to run Triton without a GPU).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hf_paged_attn.core.blocks import blocks_for  # noqa: E402
from hf_paged_attn.kernels import reference  # noqa: E402
from hf_paged_attn.kernels import triton_ops as tb  # noqa: E402
from hf_paged_attn.kernels.base import AttentionOptions  # noqa: E402

if not isinstance(tb._decode_kernel, triton.runtime.interpreter.InterpretedFunction):
    # Another test imported the backend before TRITON_INTERPRET was set: rebuild it interpreted.
    tb = importlib.reload(tb)

FP32_TOL = 1e-4
BF16_TOL = 3e-2

FAST = settings(
    max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
SLOW = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------
# Case builders
# ----------------------------------------------------------------------------------------------


def make_pages(
    lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random pages with room for ``lens[b]`` tokens of request b under a shuffled block table.

    Returns k_cache, v_cache [num_blocks, block_size, H_kv, D] and block_table int32 [B, max_blocks]
    with at least one trailing -1 column, and spare blocks no request owns (they must never be read).
    """
    per_request = [blocks_for(n, block_size) for n in lens]
    max_blocks = max(per_request, default=0) + 1
    num_blocks = sum(per_request) + 2
    order = torch.randperm(num_blocks, generator=gen).int()  # shuffled: logical != physical order
    table = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_request):
        table[b, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return k_cache, v_cache, table


def cumulative(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def attn_options(draw: st.DrawFn, num_heads: int, gen: torch.Generator, causal_only: bool = True) -> dict:
    """Window / softcap / sinks / causal as the engine may pass them."""
    causal = True if causal_only else draw(st.booleans())
    left = draw(st.sampled_from([-1, -1, 0, 3, 17]))
    right = -1 if causal_only else draw(st.sampled_from([-1, 0, 2]))
    softcap = draw(st.sampled_from([0.0, 0.0, 2.5]))
    sinks = torch.randn(num_heads, generator=gen) * 2 if draw(st.booleans()) else None
    return dict(causal=causal, window_size=(left, right), softcap=softcap, sinks=sinks)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    if out.dtype == torch.bfloat16 and out.numel():
        # Never below one bf16 step of the largest output: a value of 4-8 rounds to steps of
        # 2^-5 (0.03125 > BF16_TOL), and the interpreter's fp32 -> bf16 cast may take either neighbour.
        largest = ref.double().abs().max().item()
        tol = max(tol, 2.0 ** (math.floor(math.log2(largest)) - 7) if largest > 0 else 0.0)
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol}"


# ----------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------


@st.composite
def decode_cases(draw: st.DrawFn, big: bool = False) -> dict:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    batch = draw(st.integers(1, 4 if not big else 8))
    num_kv_heads = draw(st.integers(1, 2 if not big else 4))
    group = draw(st.sampled_from([1, 2, 3, 4] if not big else [1, 3, 4, 8]))
    head_dim = draw(st.sampled_from([16, 24] if not big else [16, 40, 64, 128]))
    block_size = draw(st.sampled_from([16, 32] if not big else [16, 32, 64, 128]))
    max_len = 70 if not big else 400
    lens = draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    dtype = torch.float32 if not big else draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return dict(
        gen=gen, lens=lens, num_kv_heads=num_kv_heads, num_heads=num_kv_heads * group, head_dim=head_dim,
        block_size=block_size, dtype=dtype,
        num_splits=draw(st.sampled_from([None, 1, 2, 3, 5])),
        write_new=draw(st.booleans()),
        opts=attn_options(draw, num_kv_heads * group, gen, causal_only=True),
    )  # fmt: skip


@st.composite
def prefill_cases(draw: st.DrawFn, big: bool = False) -> dict:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    batch = draw(st.integers(1, 3 if not big else 6))
    num_kv_heads = draw(st.integers(1, 2 if not big else 4))
    group = draw(st.sampled_from([1, 2, 3] if not big else [1, 3, 4, 8]))
    head_dim = draw(st.sampled_from([16, 24] if not big else [16, 40, 64, 128]))
    block_size = draw(st.sampled_from([16, 32] if not big else [16, 32, 64, 128]))
    # q_lens may be 0 (a request with nothing new this step); prefix = tokens cached before.
    q_lens = draw(st.lists(st.integers(0, 20 if not big else 150), min_size=batch, max_size=batch))
    prefix = draw(st.lists(st.integers(0, 40 if not big else 300), min_size=batch, max_size=batch))
    dtype = torch.float32 if not big else draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return dict(
        gen=gen, q_lens=q_lens, prefix=prefix, num_kv_heads=num_kv_heads, num_heads=num_kv_heads * group,
        head_dim=head_dim, block_size=block_size, dtype=dtype,
        opts=attn_options(draw, num_kv_heads * group, gen, causal_only=draw(st.booleans())),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def check_decode(case: dict) -> None:
    gen, lens, bs = case["gen"], case["lens"], case["block_size"]
    h, h_kv, d, dtype = case["num_heads"], case["num_kv_heads"], case["head_dim"], case["dtype"]
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    batch = len(lens)
    # Room for the new token at position lens[b].
    k_cache, v_cache, table = make_pages([n + 1 for n in lens], bs, h_kv, d, dtype, gen)
    q = torch.randn(batch, 1, h, d, generator=gen).to(dtype)
    k_new = torch.randn(batch, 1, h_kv, d, generator=gen).to(dtype)
    v_new = torch.randn(batch, 1, h_kv, d, generator=gen).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lens):  # where the new token must land
        expected_k[table[b, n // bs], n % bs] = k_new[b, 0]
        expected_v[table[b, n // bs], n % bs] = v_new[b, 0]
    if not case["write_new"]:
        # The caller wrote the token already; cache_seqlens then counts it (flash-attn semantics).
        k_cache, v_cache = expected_k.clone(), expected_v.clone()
        seqlens = seqlens + 1
    scale = d**-0.5
    out = tb.paged_decode_attention(
        q, k_cache, v_cache, k_new if case["write_new"] else None, v_new if case["write_new"] else None,
        seqlens, table, options=AttentionOptions(softmax_scale=scale, **case["opts"]), num_splits=case["num_splits"],
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), "pages written wrongly"
    for b, n in enumerate(lens):
        keys = reference.gather_pages(k_cache, table[b], n + 1)  # [n + 1, H_kv, D]
        values = reference.gather_pages(v_cache, table[b], n + 1)
        ref = reference.attend_one(q[b], keys, values, options=AttentionOptions(softmax_scale=scale, **case["opts"]))
        assert_close(out[b], ref, tol, f"decode request {b} (len {n})")


def check_prefill(case: dict) -> None:
    """The engine's flow: write the step's K/V through a slot mapping, then attend from the pages.
    Reference K/V are built independently of the pages."""
    gen, bs = case["gen"], case["block_size"]
    h, h_kv, d, dtype = case["num_heads"], case["num_kv_heads"], case["head_dim"], case["dtype"]
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    q_lens, prefix = case["q_lens"], case["prefix"]
    k_lens = [p + n for p, n in zip(prefix, q_lens, strict=True)]
    k_cache, v_cache, table = make_pages(k_lens, bs, h_kv, d, dtype, gen)
    cu_q, cu_k = cumulative(q_lens), cumulative(k_lens)
    q = torch.randn(int(cu_q[-1]), h, d, generator=gen).to(dtype)
    k_all = torch.randn(int(cu_k[-1]), h_kv, d, generator=gen).to(dtype)  # packed, every key
    v_all = torch.randn(int(cu_k[-1]), h_kv, d, generator=gen).to(dtype)
    scale = d**-0.5
    slots = torch.cat(
        [table[b].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs for b, n in enumerate(k_lens)]
    )  # [total_k]
    tb.write_kv(k_all, v_all, k_cache, v_cache, slots)
    out = tb.paged_prefill_attention(
        q, k_cache, v_cache, cu_q, torch.tensor(k_lens, dtype=torch.int32), table, max(q_lens),
        options=AttentionOptions(softmax_scale=scale, **case["opts"]),
    )  # fmt: skip
    ref = reference.varlen_reference(q, k_all, v_all, cu_q, cu_k,
                                     options=AttentionOptions(softmax_scale=scale, **case["opts"]))
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref, tol, f"paged prefill q_lens={q_lens} k_lens={k_lens}")


# ----------------------------------------------------------------------------------------------
# Default selection: small and derandomised
# ----------------------------------------------------------------------------------------------


@FAST
@given(decode_cases())
def test_decode_matches_reference(case: dict) -> None:
    check_decode(case)


@FAST
@given(prefill_cases())
def test_paged_prefill_matches_reference(case: dict) -> None:
    check_prefill(case)


def test_queries_past_their_keys_output_zeros() -> None:
    """q_len > k_len: bottom-right causal leaves the first rows with no key; they must be 0, not nan."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 16, generator=gen)
    k = torch.randn(2, 1, 16, generator=gen)
    v = torch.randn(2, 1, 16, generator=gen)
    k_cache, v_cache = torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 16)
    tb.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 1]))
    table = torch.zeros(1, 1, dtype=torch.int32)
    out = tb.paged_prefill_attention(
        q, k_cache, v_cache, cumulative([5]), torch.tensor([2], dtype=torch.int32), table, 5,
        options=AttentionOptions(softmax_scale=0.25)
    )
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    ref = reference.varlen_reference(q, k, v, cumulative([5]), cumulative([2]),
                                     options=AttentionOptions(softmax_scale=0.25))
    assert_close(out, ref, FP32_TOL, "q_len > k_len")


def test_decode_split_k_with_a_long_context() -> None:
    """The split-K path on a context of many tiles, uneven splits, with a window and sinks."""
    case = dict(
        gen=torch.Generator().manual_seed(1), lens=[300, 5, 129], num_kv_heads=2, num_heads=8, head_dim=32,
        block_size=16, dtype=torch.float32, num_splits=7, write_new=True,
        opts=dict(causal=True, window_size=(200, 0), softcap=0.0, sinks=torch.randn(8)),
    )  # fmt: skip
    check_decode(case)


def _decode_with_append(lens, block_size, num_splits, *, unallocated=(), num_kv_heads=2, group=3, head_dim=16):
    """paged_decode_attention with k/v on fresh pages. Returns the request lengths, the pages before
    the call and after it, the expected pages, and the output against the reference.

    ``unallocated``: requests whose new token starts a block that is -1 in the table (lens[b] a multiple
    of the block size): their store is skipped."""
    gen = torch.Generator().manual_seed(11)
    h_kv, h, d, bs = num_kv_heads, num_kv_heads * group, head_dim, block_size
    k_cache, v_cache, table = make_pages([n + 1 for n in lens], bs, h_kv, d, torch.float32, gen)
    for b in unallocated:
        assert lens[b] % bs == 0, "only a new block can be unallocated"
        table[b, lens[b] // bs] = -1
    q = torch.randn(len(lens), 1, h, d, generator=gen)
    # transformers hands K/V over as transposed views: [B, 1, H_kv, D] with non-contiguous strides
    k_new = torch.randn(h_kv, len(lens), d, generator=gen).transpose(0, 1).unsqueeze(1)
    v_new = torch.randn(h_kv, len(lens), d, generator=gen).transpose(0, 1).unsqueeze(1)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lens):
        if b not in unallocated:
            expected_k[table[b, n // bs], n % bs] = k_new[b, 0]
            expected_v[table[b, n // bs], n % bs] = v_new[b, 0]
    out = tb.paged_decode_attention(
        q, k_cache, v_cache, k_new, v_new, torch.tensor(lens, dtype=torch.int32), table,
        options=AttentionOptions(softmax_scale=d**-0.5), num_splits=num_splits,
    )  # fmt: skip
    assert torch.equal(k_cache, expected_k), "K pages other than the new slots changed"
    assert torch.equal(v_cache, expected_v), "V pages other than the new slots changed"
    for b, n in enumerate(lens):
        row = table[b].clone()
        row[row < 0] = 0  # an unallocated block's key comes from k_new below, never from the pages
        keys = torch.cat([reference.gather_pages(expected_k, row, n), k_new[b]])  # [n + 1, H_kv, D]
        values = torch.cat([reference.gather_pages(expected_v, row, n), v_new[b]])
        ref = reference.attend_one(q[b], keys, values, options=AttentionOptions(softmax_scale=d**-0.5))
        assert_close(out[b], ref, FP32_TOL, f"decode request {b} (len {n}, splits {num_splits})")


@pytest.mark.parametrize("block_size", [16, 128])  # tiles spanning pages, and tiles inside one page
def test_fused_append_writes_exactly_the_new_slots_under_split_k(block_size: int) -> None:
    """The append runs inside the decode kernel, in one split of each request: with many splits,
    every page but the new tokens' slots is left bit for bit, and each query sees its own new key
    exactly once (lengths at tile and page edges, 0, and a request whose new block is unallocated)."""
    _decode_with_append([0, 63, 64, 200, 128], block_size, num_splits=6, unallocated=(4,))


def test_auto_split_k_on_a_long_context_and_a_short_one() -> None:
    """The automatic rule picks split-K for a long request; the kernel keeps the short request of the
    same batch on few splits (each >= _MIN_TOKENS_PER_SPLIT), and the result matches the reference."""
    lens, bs = [1100, 7], 16
    width = max(blocks_for(n + 1, bs) for n in lens) + 1  # make_pages' table width
    assert tb._choose_num_splits(len(lens), 1, width * bs, tb._num_sms(torch.device("cpu"))) > 1
    _decode_with_append(lens, bs, num_splits=None, num_kv_heads=1)


def test_choose_num_splits_fills_the_gpu_with_long_splits() -> None:
    choose = tb._choose_num_splits
    assert choose(1, 8, 32768, 132) == 66  # one long request: 528 programs of ~500 tokens
    assert choose(64, 8, 4096, 132) == 2  # a full batch already nearly fills the SMs
    assert choose(512, 8, 4096, 132) == 1
    assert choose(1, 8, 300, 132) == 1  # too short to split
    assert choose(1, 1, 1 << 20, 132) == tb._MAX_SPLITS
    for batch in (1, 2, 3, 8, 33, 64, 256):
        for max_len in (16, 255, 256, 1000, 4096, 32768, 131072):
            splits = choose(batch, 8, max_len, 132)
            assert 1 <= splits <= tb._MAX_SPLITS
            assert splits == 1 or splits * tb._MIN_TOKENS_PER_SPLIT <= max_len  # no split too short
            programs = batch * 8 * splits
            # Under-filled only when the context (or the cap) forbids more splits.
            capped = splits == min(max(1, max_len // tb._MIN_TOKENS_PER_SPLIT), tb._MAX_SPLITS)
            assert programs >= tb._PROGRAMS_PER_SM * 132 or capped
            assert splits == 1 or batch * 8 * (splits - 1) < tb._PROGRAMS_PER_SM * 132  # no more than needed


def test_paged_prefill_long_chunks_with_a_window() -> None:
    """Several query tiles per request, a prefix of many pages, and a window that skips pages."""
    case = dict(
        gen=torch.Generator().manual_seed(4), q_lens=[70, 33], prefix=[50, 0], num_kv_heads=1, num_heads=2,
        head_dim=16, block_size=16, dtype=torch.float32,
        opts=dict(causal=True, window_size=(20, -1), softcap=0.0, sinks=None),
    )  # fmt: skip
    check_prefill(case)


def test_bf16_decode_and_prefill() -> None:
    """bf16 storage (the common GPU case); fp32 accumulation keeps the error at bf16 rounding."""
    gen = torch.Generator().manual_seed(5)
    opts = dict(causal=True, window_size=(-1, -1), softcap=2.5, sinks=torch.randn(4, generator=gen))
    check_decode(dict(
        gen=gen, lens=[90, 3], num_kv_heads=1, num_heads=4, head_dim=32, block_size=32,
        dtype=torch.bfloat16, num_splits=2, write_new=True, opts=opts,
    ))  # fmt: skip
    check_prefill(dict(
        gen=gen, q_lens=[9, 20], prefix=[30, 0], num_kv_heads=1, num_heads=4, head_dim=32,
        block_size=16, dtype=torch.bfloat16, opts=opts,
    ))  # fmt: skip


def test_write_kv_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, _ = make_pages([32], 16, 3, 24, torch.float32, gen)
    k = torch.randn(4, 3, 24, generator=gen)
    v = torch.randn(4, 3, 24, generator=gen)
    slots = torch.tensor([5, -1, 17, 0])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expected_k[s // 16, s % 16], expected_v[s // 16, s % 16] = k[i], v[i]
    tb.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_accepts_strided_inputs() -> None:
    """transformers hands K/V over as transposed views: no copy needed, strides are honoured."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, _ = make_pages([32], 16, 2, 16, torch.float32, gen)
    k = torch.randn(2, 3, 16, generator=gen).transpose(0, 1)  # [3, 2, 16], non-contiguous
    v = torch.randn(2, 3, 16, generator=gen).transpose(0, 1)
    tb.write_kv(k, v, k_cache, v_cache, torch.tensor([1, 2, 31], dtype=torch.int32))
    assert torch.equal(k_cache.view(-1, 2, 16)[[1, 2, 31]], k)
    assert torch.equal(v_cache.view(-1, 2, 16)[[1, 2, 31]], v)


@pytest.mark.parametrize("block_size", [8, 24, 48])
def test_block_size_must_be_a_power_of_two_from_16(block_size: int) -> None:
    k_cache = torch.zeros(2, block_size, 1, 16)
    with pytest.raises(ValueError, match=f"block_size={block_size}"):
        tb.write_kv(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), k_cache, k_cache.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match=f"block_size={block_size}"):
        tb.paged_decode_attention(
            torch.zeros(1, 1, 1, 16), k_cache, k_cache.clone(), None, None,
            torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
            options=AttentionOptions(softmax_scale=1.0),
        )  # fmt: skip


def test_import_without_triton_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.delitem(sys.modules, "hf_paged_attn.kernels.triton_ops", raising=False)
    with pytest.raises(ImportError, match="pip install triton"):
        importlib.import_module("hf_paged_attn.kernels.triton_ops")


# ----------------------------------------------------------------------------------------------
# Slow selection: many more and larger cases, bf16 included
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@SLOW
@given(decode_cases(big=True))
def test_decode_matches_reference_slow(case: dict) -> None:
    check_decode(case)


@pytest.mark.slow
@SLOW
@given(prefill_cases(big=True))
def test_paged_prefill_matches_reference_slow(case: dict) -> None:
    check_prefill(case)
