"""The pure-torch backend against the float64 reference (hf_paged_attn.kernels.reference).

Its decode runs the native CPU kernel (kernels/cpu_native.py) when it can; decode tests run both
that and the torch-ops path (``native=False``: ``cpu_native.library`` patched to return None)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn.kernels import cpu_native, reference, torch_backend
from hf_paged_attn.kernels.base import AttentionOptions
from hf_paged_attn.kernels.torch_backend import decode as torch_decode
from hf_paged_attn.kernels.torch_backend import dense as torch_dense

TOL = {"atol": 1e-5, "rtol": 1e-5}


@contextlib.contextmanager
def native_kernel(on: bool) -> Iterator[None]:
    """The torch backend's decode with (on) or without the native CPU kernel."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not on:  # the backend asks cpu_native.library() at every call: None sends it to its torch ops
            monkeypatch.setattr(cpu_native, "library", lambda: None)
        yield


@st.composite
def attn_options(draw: st.DrawFn) -> dict:
    """Head layout and attention options shared by both entry points."""
    causal = draw(st.booleans())
    w = draw(st.integers(1, 16))
    window = draw(st.sampled_from([(-1, -1), (w - 1, w - 1), (w - 1, 0)]))
    return {
        "num_kv_heads": draw(st.sampled_from([1, 2])),
        "group": draw(st.sampled_from([1, 2, 4, 8])),
        "head_dim": draw(st.sampled_from([64, 80, 128])),
        "causal": causal,
        "window_size": window,
        "softcap": draw(st.sampled_from([0.0, 0.0, 5.0, 30.0])),
        "sinks": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@st.composite
def varlen_shapes(draw: st.DrawFn) -> list[tuple[int, int]]:
    """(q_len, k_len) per request: decode rows, full prefills, shorter chunks, empty queries or keys."""

    def one() -> tuple[int, int]:
        if draw(st.integers(0, 9)) == 0:
            return draw(st.integers(0, 3)), 0  # no keys at all: those queries output zeros
        k_len = draw(st.integers(1, 48))
        kind = draw(st.sampled_from(["decode", "full", "chunk"]))
        q_len = {"decode": 1, "full": k_len}.get(kind) or draw(st.integers(0, k_len))
        return q_len, k_len

    n = draw(st.integers(1, 6))
    if draw(st.booleans()):  # uniform batch: exercises the single-call, view-only fast path
        return [one()] * n
    return [one() for _ in range(n)]


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def _kwargs(opts: dict, num_heads: int, gen: torch.Generator) -> dict:
    sinks = _randn(gen, num_heads) * 2 if opts["sinks"] else None
    options = AttentionOptions(
        softmax_scale=1 / math.sqrt(opts["head_dim"]),
        causal=opts["causal"],
        window_size=opts["window_size"],
        softcap=opts["softcap"],
        sinks=sinks,
    )
    return {"options": options}


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _run_varlen(shapes: list[tuple[int, int]], opts: dict, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(opts["seed"])
    h_kv, d = opts["num_kv_heads"], opts["head_dim"]
    h = h_kv * opts["group"]
    q_lens, k_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    q = _randn(gen, sum(q_lens), h, d, dtype=dtype)  # [total_q, H, D]
    k = _randn(gen, sum(k_lens), h_kv, d, dtype=dtype)  # [total_k, H_kv, D]
    v = _randn(gen, sum(k_lens), h_kv, d, dtype=dtype)
    kw = _kwargs(opts, h, gen)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    out = torch_backend.varlen_attention(
        q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), **kw
    )  # [total_q, H, D]
    expected = reference.varlen_reference(q, k, v, cu_q, cu_k, **kw)
    return out, expected


@settings(max_examples=60, deadline=None)
@given(shapes=varlen_shapes(), opts=attn_options())
def test_varlen_matches_reference(shapes: list[tuple[int, int]], opts: dict) -> None:
    out, expected = _run_varlen(shapes, opts, torch.float32)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **TOL)


@settings(max_examples=30, deadline=None)
@given(shapes=varlen_shapes(), opts=attn_options())
def test_varlen_memo_across_layers(shapes: list[tuple[int, int]], opts: dict) -> None:
    """Layers of one step share a memo (StepMetadata.memo): the first builds the buckets, the others
    reuse them with their own q/k/v, and every layer equals the reference."""
    gen = torch.Generator().manual_seed(opts["seed"])
    h_kv, d = opts["num_kv_heads"], opts["head_dim"]
    h = h_kv * opts["group"]
    q_lens, k_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    kw, memo = _kwargs(opts, h, gen), {}
    for _ in range(3):
        q = _randn(gen, sum(q_lens), h, d)  # [total_q, H, D]
        k, v = _randn(gen, sum(k_lens), h_kv, d), _randn(gen, sum(k_lens), h_kv, d)
        out = torch_backend.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), **kw, memo=memo)
        torch.testing.assert_close(out, reference.varlen_reference(q, k, v, cu_q, cu_k, **kw), **TOL)
    assert len(memo) == 1  # one plan, made once


def test_varlen_explicit_path_chunks_long_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The softcap/sinks path chunks queries to bound its score matrix; results must not change."""
    monkeypatch.setattr(torch_dense, "_MAX_SCORES", 500)
    opts = {"num_kv_heads": 2, "group": 2, "head_dim": 64, "causal": True, "window_size": (7, 0),
            "softcap": 10.0, "sinks": True, "seed": 0}  # fmt: skip
    out, expected = _run_varlen([(40, 40), (13, 50), (1, 9)], opts, torch.float32)
    torch.testing.assert_close(out, expected, **TOL)


def _paged_case(
    gen: torch.Generator, lens: list[int], bs: int, h_kv: int, d: int, extra_cols: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Random per-request K/V stored in shuffled pages of ``bs`` tokens -> caches, block table, K and V."""
    need = [blocks_for(n, bs) for n in lens]  # blocks per request
    width = max(need) + extra_cols
    num_blocks = sum(need) + 3  # a few spare blocks that nobody owns
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    k_cache = _randn(gen, num_blocks, bs, h_kv, d, dtype=dtype)  # garbage everywhere
    v_cache = _randn(gen, num_blocks, bs, h_kv, d, dtype=dtype)
    ks, vs = [], []
    for b, n in enumerate(lens):
        table[b, : need[b]] = torch.tensor([ids.pop() for _ in range(need[b])], dtype=torch.int32)
        ks.append(_randn(gen, n, h_kv, d, dtype=dtype))  # [n, H_kv, D]
        vs.append(_randn(gen, n, h_kv, d, dtype=dtype))
        pos = torch.arange(n)
        k_cache[table[b].long()[pos // bs], pos % bs] = ks[b]
        v_cache[table[b].long()[pos // bs], pos % bs] = vs[b]
    return k_cache, v_cache, table, ks, vs


def _check_decode(
    lens: list[int], block_size: int, opts: dict, append: bool, dtype: torch.dtype, tol: dict
) -> None:
    gen = torch.Generator().manual_seed(opts["seed"])
    h_kv, d = opts["num_kv_heads"], opts["head_dim"]
    h, batch = h_kv * opts["group"], len(lens)
    total = [n + append for n in lens]  # tokens attended per request
    k_cache, v_cache, table, ks, vs = _paged_case(gen, total, block_size, h_kv, d, 1, dtype)
    k_new = _randn(gen, batch, 1, h_kv, d, dtype=dtype) if append else None  # [B, 1, H_kv, D]
    v_new = _randn(gen, batch, 1, h_kv, d, dtype=dtype) if append else None
    if append:  # the kernel must write these itself: replace them in the cache with junk first
        for b, n in enumerate(lens):
            k_cache[table[b, n // block_size].long(), n % block_size] = 1e4
            ks[b][n], vs[b][n] = k_new[b, 0], v_new[b, 0]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = _randn(gen, batch, 1, h, d, dtype=dtype)  # [B, 1, H, D]
    kw = _kwargs(opts, h, gen)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = torch_backend.paged_decode_attention(q, k_cache, v_cache, k_new, v_new, seqlens, table, **kw)
    assert out.shape == (batch, 1, h, d) and out.dtype == dtype
    for b in range(batch):
        expected = reference.attend_one(q[b], ks[b], vs[b], **kw)  # [1, H, D]
        torch.testing.assert_close(out[b], expected, **tol)
        n = total[b]
        torch.testing.assert_close(reference.gather_pages(k_cache, table[b], n), ks[b], atol=0, rtol=0)
        torch.testing.assert_close(reference.gather_pages(v_cache, table[b], n), vs[b], atol=0, rtol=0)
    if append:  # nothing but the B new slots changed
        for b, n in enumerate(lens):
            blk, slot = int(table[b, n // block_size]), n % block_size
            before_k[blk, slot], before_v[blk, slot] = k_new[b, 0], v_new[b, 0]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.just(0) | st.integers(0, 70), min_size=1, max_size=6),  # 0: empty request
    block_size=st.sampled_from([1, 4, 16, 32]),
    opts=attn_options(),
    append=st.booleans(),
    split=st.booleans(),
    native=st.booleans(),
)
def test_decode_matches_reference(
    lens: list[int], block_size: int, opts: dict, append: bool, split: bool, native: bool
) -> None:
    """``split``: a bucket costs nothing, so requests of different lengths go to separate length buckets."""
    with pytest.MonkeyPatch.context() as monkeypatch, native_kernel(native):
        if split:
            monkeypatch.setattr(torch_decode, "BUCKET_OVERHEAD_BYTES", 0)
        _check_decode(lens, block_size, opts, append, torch.float32, TOL)


def test_length_buckets() -> None:
    """Rows sorted by length are cut where padding to each bucket's longest costs the least."""
    buckets = torch_decode._length_buckets
    assert buckets([3, 3, 3], 0) is None  # equal lengths: nothing to save
    assert buckets([1, 9, 1, 1], 0) == [[0, 2, 3], [1]]
    assert buckets([1, 9, 1, 1], 24.0) is None  # saves 24 blocks of padding: not worth a bucket of 24
    assert buckets([1, 9, 1, 1], 23.0) == [[0, 2, 3], [1]]
    assert buckets([20, 1, 10, 1, 10, 20], 0) == [[1, 3], [2, 4], [0, 5]]  # three buckets at most
    assert buckets([5], 0) is None


@pytest.mark.parametrize("native", [True, False])
def test_decode_worked_example(native: bool) -> None:
    """The spec's example: block size 32, lengths [30, 32, 70], 8 blocks, a new token per request."""
    with native_kernel(native):
        _worked_example()


def _worked_example() -> None:
    gen = torch.Generator().manual_seed(0)
    h, h_kv, d, bs = 4, 2, 64, 32
    lens = [30, 32, 70]
    table = torch.tensor([[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]], dtype=torch.int32)
    k_cache, v_cache = _randn(gen, 8, bs, h_kv, d), _randn(gen, 8, bs, h_kv, d)  # [8, 32, H_kv, D]
    ks = [_randn(gen, n, h_kv, d) for n in lens]  # contiguous K of each request
    vs = [_randn(gen, n, h_kv, d) for n in lens]
    k_cache[2, :30], v_cache[2, :30] = ks[0], vs[0]
    k_cache[0], v_cache[0] = ks[1], vs[1]
    for i, blk in enumerate([3, 5]):
        k_cache[blk], v_cache[blk] = ks[2][32 * i : 32 * i + 32], vs[2][32 * i : 32 * i + 32]
    k_cache[6, :6], v_cache[6, :6] = ks[2][64:], vs[2][64:]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q, k_new, v_new = _randn(gen, 3, 1, h, d), _randn(gen, 3, 1, h_kv, d), _randn(gen, 3, 1, h_kv, d)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = torch_backend.paged_decode_attention(
        q, k_cache, v_cache, k_new, v_new, seqlens, table, options=AttentionOptions(softmax_scale=d**-0.5)
    )  # [3, 1, H, D]
    for b in range(3):
        k_full = torch.cat([ks[b], k_new[b]])  # [lens[b] + 1, H_kv, D], stored contiguously
        v_full = torch.cat([vs[b], v_new[b]])
        expected = reference.attend_one(q[b], k_full, v_full, options=AttentionOptions(softmax_scale=d**-0.5))
        torch.testing.assert_close(out[b], expected, **TOL)
    # request 0 -> block 2 slot 30; 1 -> position 32, its second block (1), slot 0; 2 -> block 6 slot 6
    for b, (blk, slot) in enumerate([(2, 30), (1, 0), (6, 6)]):
        assert torch.equal(k_cache[blk, slot], k_new[b, 0]) and torch.equal(v_cache[blk, slot], v_new[b, 0])
        before_k[blk, slot], before_v[blk, slot] = k_new[b, 0], v_new[b, 0]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)  # blocks 4, 7 etc. untouched


@pytest.mark.parametrize("native", [True, False])
def test_decode_writes_only_new_slots(native: bool) -> None:
    """Block size 4, shuffled pages: the cache after the call is the cache before plus exactly B slots."""
    with native_kernel(native):
        _writes_only_new_slots()


def _writes_only_new_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    h_kv, d, bs, num_blocks = 2, 64, 4, 12
    table = torch.tensor([[7, 2, -1], [11, -1, -1], [0, 9, 4]], dtype=torch.int32)
    lens = torch.tensor([5, 3, 8], dtype=torch.int32)  # new tokens at (2, 1), (11, 3), (4, 0)
    k_cache, v_cache = _randn(gen, num_blocks, bs, h_kv, d), _randn(gen, num_blocks, bs, h_kv, d)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    k_new, v_new = _randn(gen, 3, 1, h_kv, d), _randn(gen, 3, 1, h_kv, d)
    for b, (blk, slot) in enumerate([(2, 1), (11, 3), (4, 0)]):
        expected_k[blk, slot], expected_v[blk, slot] = k_new[b, 0], v_new[b, 0]
    q = _randn(gen, 3, 1, 4, d)
    torch_backend.paged_decode_attention(q, k_cache, v_cache, k_new, v_new, lens, table,
                                         options=AttentionOptions(softmax_scale=0.1))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 4, 8]),
    opts=attn_options(),
    append=st.booleans(),
    num_steps=st.integers(1, 3),
)
def test_decode_memo_across_layers_and_steps(
    lens: list[int], block_size: int, opts: dict, append: bool, num_steps: int
) -> None:
    """As the engine calls it: one memo per step (StepMetadata.memo) shared by every layer, each layer
    with its own pages. Every layer of every step equals the reference, and all layers' pages point to
    one gather workspace that the steps reuse (the torch-ops path: the native kernel gathers nothing)."""
    with native_kernel(False):
        _memo_across_layers_and_steps(lens, block_size, opts, append, num_steps)


def _memo_across_layers_and_steps(lens: list[int], block_size: int, opts: dict, append: bool, num_steps: int) -> None:
    gen = torch.Generator().manual_seed(opts["seed"])
    h_kv, d = opts["num_kv_heads"], opts["head_dim"]
    h, batch, num_layers = h_kv * opts["group"], len(lens), 3
    final = [n + append * num_steps for n in lens]  # room for every appended token
    k_cache, v_cache, table, _, _ = _paged_case(gen, final, block_size, h_kv, d, 1, torch.float32)
    caches = [(k_cache, v_cache)]
    for _ in range(num_layers - 1):  # same block table, other contents
        caches.append((_randn(gen, *k_cache.shape), _randn(gen, *k_cache.shape)))
    kw = _kwargs(opts, h, gen)
    workspaces = []
    for step in range(num_steps):
        before = [n + append * step for n in lens]  # tokens cached before this step
        seqlens, memo = torch.tensor(before, dtype=torch.int32), {}
        for k_cache, v_cache in caches:
            q = _randn(gen, batch, 1, h, d)
            k_new = _randn(gen, batch, 1, h_kv, d) if append else None
            v_new = _randn(gen, batch, 1, h_kv, d) if append else None
            out = torch_backend.paged_decode_attention(
                q, k_cache, v_cache, k_new, v_new, seqlens, table, **kw, memo=memo
            )
            for b, n in enumerate(before):
                keys = reference.gather_pages(k_cache, table[b], n + append)
                values = reference.gather_pages(v_cache, table[b], n + append)
                if append:
                    assert torch.equal(keys[-1], k_new[b, 0]) and torch.equal(values[-1], v_new[b, 0])
                torch.testing.assert_close(out[b], reference.attend_one(q[b], keys, values, **kw), **TOL)
        workspaces += [getattr(k_cache, "_hf_paged_workspace", None) for k_cache, _ in caches]
    if max(final) > 0:  # some step gathered keys: one workspace, shared by all layers and steps
        assert workspaces[0] is not None and all(w is workspaces[0] for w in workspaces)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap_and_sinks", [False, True])
@pytest.mark.parametrize("native", [True, False])
def test_half_precision_smoke(dtype: torch.dtype, softcap_and_sinks: bool, native: bool) -> None:
    opts = {"num_kv_heads": 2, "group": 4, "head_dim": 64, "causal": True, "window_size": (-1, -1),
            "softcap": 20.0 if softcap_and_sinks else 0.0, "sinks": softcap_and_sinks, "seed": 3}  # fmt: skip
    out, expected = _run_varlen([(17, 17), (1, 30), (5, 40), (0, 3)], opts, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    with native_kernel(native):
        _check_decode([0, 31, 64], 16, opts, True, dtype, {"atol": 2e-2, "rtol": 2e-2})


@st.composite
def prefix_trees(draw: st.DrawFn) -> list[list[int]]:
    """Block paths of requests that share prefixes like a tree: groups share a trunk, sub-groups a
    branch after it, each request its own tail. Returns per request [trunk, branch, own] block counts
    plus ids (trunk id, branch id), as [trunk_blocks, trunk_id, branch_blocks, branch_id, own_blocks]."""
    rows = []
    for trunk_id in range(draw(st.integers(1, 3))):
        trunk = draw(st.integers(0, 4))
        for branch_id in range(draw(st.integers(1, 3))):
            branch = draw(st.integers(0, 3))
            for _ in range(draw(st.integers(1, 3))):
                rows.append([trunk, trunk_id, branch, branch_id, draw(st.integers(0, 3))])
    return rows


@settings(max_examples=80, deadline=None)
@given(
    tree=prefix_trees(),
    cut=st.lists(st.integers(0, 7), min_size=27, max_size=27),  # tokens left unfilled in a request's last block
    block_size=st.sampled_from([1, 4, 8]),
    opts=attn_options(),
    append=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
)
def test_decode_cascade_over_shared_blocks(
    tree: list, cut: list, block_size: int, opts: dict, append: bool, dtype: torch.dtype
) -> None:
    """Requests whose block tables start with the same physical blocks (prefix caching, forks), in
    trees of shared trunks and branches, some ending inside a shared block they have not filled:
    the cascade path (shared part once per group, own part per request, lse merge; unshared rows
    through SDPA) equals the reference (the torch-ops path: the native kernel has no cascade)."""
    with pytest.MonkeyPatch.context() as monkeypatch, native_kernel(False):
        _check_cascade(monkeypatch, tree, cut, block_size, opts, append, dtype)


def _check_cascade(
    monkeypatch: pytest.MonkeyPatch, tree: list, cut: list, block_size: int, opts: dict, append: bool, dtype
) -> None:
    monkeypatch.setattr(torch_decode, "CASCADE_MIN_TOKENS", 1)
    if opts["seed"] % 2:  # the unshared rows in length buckets of their own
        monkeypatch.setattr(torch_decode, "BUCKET_OVERHEAD_BYTES", 0)
    opts = {**opts, "window_size": (-1, opts["window_size"][1])}  # the cascade needs no left window
    gen = torch.Generator().manual_seed(opts["seed"])
    h_kv, d = opts["num_kv_heads"], opts["head_dim"]
    h = h_kv * opts["group"]
    num_blocks = 400
    k_cache = _randn(gen, num_blocks, block_size, h_kv, d, dtype=dtype)
    v_cache = _randn(gen, num_blocks, block_size, h_kv, d, dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    trunks: dict[int, list[int]] = {}
    branches: dict[tuple[int, int], list[int]] = {}
    rows, lens = [], []  # block ids, and tokens before the new one, per request
    for i, (trunk, trunk_id, branch, branch_id, own) in enumerate(tree):
        path = trunks.setdefault(trunk_id, [free.pop() for _ in range(trunk)])
        path = path + branches.setdefault((trunk_id, branch_id), [free.pop() for _ in range(branch)])
        shared = len(path)
        # The new token goes to a block of the request's own (shared blocks are copied on write);
        # without one, a request may end inside a shared block it has not filled.
        path = path + [free.pop() for _ in range(max(own, append, 1 if not path else 0))]
        total = len(path) * block_size - cut[i % len(cut)] % block_size
        if append:
            total = max(total, shared * block_size + 1)
        rows.append(path[: blocks_for(total, block_size)] if total else path[:1])
        lens.append(total - append)
    width = max(map(len, rows)) + 1
    table = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)
    k_new = _randn(gen, len(rows), 1, h_kv, d, dtype=dtype) if append else None
    v_new = _randn(gen, len(rows), 1, h_kv, d, dtype=dtype) if append else None
    q = _randn(gen, len(rows), 1, h, d, dtype=dtype)
    kw = _kwargs(opts, h, gen)
    calls = []
    plan = torch_decode._cascade_plan
    monkeypatch.setattr(torch_decode, "_cascade_plan", lambda *a, **k: calls.append(a[2]) or plan(*a, **k))
    seqlens, memo = torch.tensor(lens, dtype=torch.int32), {}
    out = torch_backend.paged_decode_attention(q, k_cache, v_cache, k_new, v_new, seqlens, table, **kw, memo=memo)
    # A second layer of the same step (same memo): the plan is reused, not rebuilt, and the output is the same.
    again = torch_backend.paged_decode_attention(q, k_cache, v_cache, k_new, v_new, seqlens, table, **kw, memo=memo)
    assert len(calls) <= 1 and torch.equal(again, out)
    tol = TOL if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for b, n in enumerate(lens):
        keys = reference.gather_pages(k_cache, table[b], n + append)  # after the append, if any
        values = reference.gather_pages(v_cache, table[b], n + append)
        if append:
            assert torch.equal(keys[-1], k_new[b, 0])
        torch.testing.assert_close(out[b], reference.attend_one(q[b], keys, values, **kw), **tol)
    # The cascade ran exactly when two requests fully fill a common first block.
    filled = [tuple(r[: (n + append) // block_size][:1]) for r, n in zip(rows, lens, strict=True)]
    sharing = any(f and filled.count(f) > 1 for f in filled)
    assert bool(calls) == sharing
    for groups in calls:  # every group: >= 2 rows, each filling the shared blocks it claims
        for members, shared in groups:
            assert len(members) >= 2 and shared >= 1
            assert all((lens[r] + append) // block_size >= shared for r in members)
            assert all(rows[r][:shared] == rows[members[0]][:shared] for r in members)


@settings(max_examples=60, deadline=None)
@given(
    shapes=varlen_shapes(),
    block_size=st.sampled_from([1, 4, 16]),
    opts=attn_options(),
    native=st.booleans(),
    released=st.booleans(),
)
def test_paged_prefill_matches_reference(
    shapes: list[tuple[int, int]], block_size: int, opts: dict, native: bool, released: bool
) -> None:
    """The varlen path read from the pages (``PREFILL_FROM_PAGES``): one-query requests attended in
    place by the native kernel (``native``), the others gathered from their first visible key, equals
    the reference on packed K/V. ``released``: blocks wholly before a request's first visible key
    (a sliding window's) are -1 in its table, as the engine frees them, and are never read."""
    gen = torch.Generator().manual_seed(opts["seed"])
    h_kv, d = opts["num_kv_heads"], opts["head_dim"]
    h = h_kv * opts["group"]
    q_lens, k_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    k_cache, v_cache, table, ks, vs = _paged_case(gen, k_lens, block_size, h_kv, d, 1, torch.float32)
    q = _randn(gen, sum(q_lens), h, d)  # [total_q, H, D]
    kw = _kwargs(opts, h, gen)
    left = opts["window_size"][0]
    if released and left >= 0:
        for b, (q_len, k_len) in enumerate(shapes):
            first_visible = k_len - q_len - left
            table[b, : max(first_visible, 0) // block_size] = -1
    cu_q, seqused, memo = _cu(q_lens), torch.tensor(k_lens, dtype=torch.int32), {}
    with native_kernel(native):
        out = torch_backend.paged_prefill_attention(q, k_cache, v_cache, cu_q, seqused, table, **kw, memo=memo)
        again = torch_backend.paged_prefill_attention(q, k_cache, v_cache, cu_q, seqused, table, **kw, memo=memo)
    assert torch.equal(out, again)  # a second layer of the step reuses the plan
    expected = reference.varlen_reference(q, torch.cat(ks), torch.cat(vs), cu_q, _cu(k_lens), **kw)
    torch.testing.assert_close(out, expected, **TOL)


def test_write_kv_writes_exactly_the_slots() -> None:
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = _randn(gen, 6, 4, 2, 8), _randn(gen, 6, 4, 2, 8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v, slots = _randn(gen, 3, 2, 8), _randn(gen, 3, 2, 8), torch.tensor([5, 0, 23])
    torch_backend.write_kv(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        before_k[slot // 4, slot % 4], before_v[slot // 4, slot % 4] = k[i], v[i]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def test_sdpa_prefill_wins_only_with_the_portable_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule of ``cpu_native.sdpa_prefill_wins``: with the portable kernels a call goes to SDPA when
    requests of at least 16 queries and 64 x 64 query-key pairs hold most of its work; never with AVX2 or
    AVX-512 kernels (unless capped at portable), nor without the library."""
    from hf_paged_attn.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "best_isa", lambda: "portable")
    wins = cpu_native.sdpa_prefill_wins
    assert wins([64], [2048]) and wins([16], [1024]) and wins([64], [64]) and wins([512], [512])
    assert wins([17, 60, 128, 200, 311, 90], [17, 60, 128, 200, 311, 90])
    assert not wins([16] * 32, [16] * 32)  # small requests: SDPA's per-request cost dominates
    assert not wins([8], [4096])  # too few queries: decode-like rows stay native
    assert wins([2048, 16, 1], [2048, 16, 900])  # the long prompt holds most of the work
    assert not wins([64, 4], [64, 2048])  # 4K favoured against 8K not
    assert not wins([], [])
    for best in ("avx2", "avx512"):
        monkeypatch.setattr(cpu_native, "best_isa", lambda best=best: best)
        assert not wins([2048], [2048]) and not wins([64], [2048])
        assert wins([2048], [2048], isa="portable")
    monkeypatch.setattr(cpu_native, "best_isa", lambda: None)
    assert not wins([2048], [2048])


@pytest.mark.parametrize(("q_len", "k_len", "native_calls"), [(96, 1024, 0), (8, 200, 2)])
def test_paged_prefill_sends_large_requests_to_sdpa_with_portable_kernels(
    q_len: int, k_len: int, native_calls: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the portable kernels a 96-query chunk over 1,024 keys is gathered into SDPA (once decided, for
    every layer of the step), an 8-query chunk runs natively; both equal the reference, and a window counts
    only the keys it lets the queries see."""
    from hf_paged_attn.kernels import cpu_native

    if cpu_native.library() is None:
        pytest.skip("the native kernels are unavailable here")
    monkeypatch.setattr(cpu_native, "best_isa", lambda: "portable")
    calls = []
    native = cpu_native.paged_prefill
    monkeypatch.setattr(cpu_native, "paged_prefill", lambda *a, **k: calls.append(1) or native(*a, **k))
    gen = torch.Generator().manual_seed(3)
    h_kv, d, h = 2, 32, 4
    k_cache, v_cache, table, ks, vs = _paged_case(gen, [k_len], 16, h_kv, d, 1, torch.float32)
    q = _randn(gen, q_len, h, d)  # [total_q, H, D]
    cu_q, seqused, memo = _cu([q_len]), torch.tensor([k_len], dtype=torch.int32), {}
    for _ in range(2):  # two layers of one step
        out = torch_backend.paged_prefill_attention(q, k_cache, v_cache, cu_q, seqused, table,
                                                    options=AttentionOptions(softmax_scale=d**-0.5),
                                                    memo=memo)  # fmt: skip
    assert len(calls) == native_calls
    expected = reference.varlen_reference(q, torch.cat(ks), torch.cat(vs), cu_q, _cu([k_len]),
                                          options=AttentionOptions(softmax_scale=d**-0.5))
    torch.testing.assert_close(out, expected, **TOL)
    # a window of 128 keys: the rule is asked about the keys the chunk sees, at most q_len + 128 of them
    asked = []
    rule = cpu_native.sdpa_prefill_wins
    monkeypatch.setattr(cpu_native, "sdpa_prefill_wins", lambda q, k: asked.append(k) or rule(q, k))
    torch_backend.paged_prefill_attention(q, k_cache, v_cache, cu_q, seqused, table,
                                          options=AttentionOptions(softmax_scale=d**-0.5,
                                                                   window_size=(128, 0)), memo={})  # fmt: skip
    assert asked == [[min(k_len, q_len + 128)]]
