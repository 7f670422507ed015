"""The native CPU attention kernels (kernels/cpu_native.py, cpu_attention.c) against the float64 reference.

Every case runs on an instruction set drawn from those the kernels have (``isa=``: the portable C, AVX2,
AVX-512 with fp32 arithmetic, AVX-512 BF16 pair dot products); one above what this CPU has runs the best it has,
which ``test_the_best_isa_is_the_one_the_cpu_flags_name`` holds to what the CPU's flags offer. float32 is held to
1e-5; bfloat16 to one bf16 step of the largest reference value plus 2^-8 of the probability-weighted magnitude of
the values (inputs are bf16, the reference's maths float64; ``_assert_close``).
"""

from __future__ import annotations

import math
import platform
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_attn.kernels import cpu_native, reference
from hf_paged_attn.kernels.base import AttentionOptions

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or cpu_native.library() is None, reason="no native kernels on this machine"
)
ISAS = ["portable", "avx2", "avx512", "avx512bf16"]


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    """Heads, attention options and page layout shared by decode and prefill."""
    w = draw(st.integers(1, 40))
    return {
        "kv_heads": draw(st.sampled_from([1, 2])),
        "group": draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        "head_dim": draw(st.sampled_from([64, 80, 128, 256, 36, 72])),  # 36, 72: AVX2 tails
        "block_size": draw(st.sampled_from([8, 16, 32])),
        "window_left": draw(st.sampled_from([-1, -1, w])),
        "softcap": draw(st.sampled_from([0.0, 0.0, 5.0, 30.0])),
        "sinks": draw(st.booleans()),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "isa": draw(st.sampled_from(ISAS)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _pages(opts: dict, lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shuffled pages (non-contiguous block tables), -1 past each request's blocks. -> k, v, table."""
    bs, hk, d = opts["block_size"], opts["kv_heads"], opts["head_dim"]
    need = [max(1, math.ceil(n / bs)) for n in lens]
    width = max(need) + 1
    num_blocks = sum(need) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[at : at + n]
        at += n
    k = torch.randn(num_blocks, bs, hk, d, generator=gen).to(opts["dtype"])
    v = torch.randn(num_blocks, bs, hk, d, generator=gen).to(opts["dtype"])
    return k, v, table


def _sinks(opts: dict, gen: torch.Generator) -> torch.Tensor | None:
    heads = opts["kv_heads"] * opts["group"]
    return torch.randn(heads, generator=gen) * 2 if opts["sinks"] else None


class Expected(NamedTuple):
    values: torch.Tensor  # the float64 reference's output
    magnitude: torch.Tensor  # the same attention over |v|: sum_i p_i |v_i|, what the output's rounding scales with


def _expected(q, k_cache, v_cache, table_row, keys: int, opts: dict, sinks, scale: float,  # noqa: ANN001
              causal: bool = True) -> Expected:
    k = reference.gather_pages(k_cache, table_row, keys).double()
    v = reference.gather_pages(v_cache, table_row, keys).double()
    options = AttentionOptions(softmax_scale=scale, causal=causal, window_size=(opts["window_left"], -1),
                               softcap=opts["softcap"], sinks=sinks)  # fmt: skip
    return Expected(reference.attend_one(q.double(), k, v, options=options),
                    reference.attend_one(q.double(), k, v.abs(), options=options))  # fmt: skip


def _assert_close(out: torch.Tensor, expected: Expected, dtype: torch.dtype) -> None:
    """float32: 1e-5. bfloat16: one bf16 step (2^-7 relative) of the largest reference value for the output's own
    rounding, plus 2^-8 of ``sum_i p_i |v_i|`` per element for the probabilities the bf16 kernels round to bf16
    before they weigh the values (an output of small values averaged from large ones carries their rounding)."""
    values = expected.values
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), values, atol=1e-5, rtol=1e-5)
        return
    if not values.numel():
        return
    top = float(values.abs().max())
    step = 2.0 ** (math.floor(math.log2(top)) - 7) if top > 0 else 2.0**-133
    bound = step + 2.0**-8 * expected.magnitude
    err = (out.double() - values).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"bf16 error {float(err.flatten()[worst])} above its bound {float(bound.flatten()[worst])} (one step {step} "
        f"of the largest value {top}, 2^-8 of sum p|v| {float(expected.magnitude.flatten()[worst])})"
    )


@settings(max_examples=80, deadline=None)
@given(
    lens=st.lists(st.just(0) | st.integers(0, 90), min_size=1, max_size=5),  # 0: a request without keys
    opts=layouts(),
    append=st.booleans(),
)
def test_decode_matches_reference(lens: list[int], opts: dict, append: bool) -> None:
    gen = torch.Generator().manual_seed(opts["seed"])
    total = [n + append for n in lens]  # keys attended, the appended one included
    k_cache, v_cache, table = _pages(opts, total, gen)
    b, hk, d = len(lens), opts["kv_heads"], opts["head_dim"]
    h = hk * opts["group"]
    q = torch.randn(b, 1, h, d, generator=gen).to(opts["dtype"])
    new = [torch.randn(b, 1, hk, d, generator=gen).to(opts["dtype"]) for _ in range(2)] if append else [None, None]
    sinks, scale = _sinks(opts, gen), d**-0.5
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = cpu_native.paged_decode(q, k_cache, v_cache, *new, seqlens, table, scale, opts["window_left"],
                                  opts["softcap"], sinks, max(total), isa=opts["isa"])  # fmt: skip
    assert out is not None
    for r, n in enumerate(total):
        _assert_close(out[r], _expected(q[r], k_cache, v_cache, table[r], n, opts, sinks, scale), opts["dtype"])


@settings(max_examples=80, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 100)).map(lambda s: (min(s[0], s[1]) if s[1] else s[0], s[1])),
        min_size=1, max_size=4,
    ),  # (q_len, k_len): the queries are the last q_len of the k_len keys; k_len 0: no keys (zeros)
    opts=layouts(),
    causal=st.booleans(),
)  # fmt: skip
def test_prefill_matches_reference(shapes: list[tuple[int, int]], opts: dict, causal: bool) -> None:
    gen = torch.Generator().manual_seed(opts["seed"])
    q_lens, k_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    k_cache, v_cache, table = _pages(opts, k_lens, gen)
    hk, d = opts["kv_heads"], opts["head_dim"]
    h = hk * opts["group"]
    q = torch.randn(sum(q_lens), h, d, generator=gen).to(opts["dtype"])  # [total_q, H, D]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    sinks, scale = _sinks(opts, gen), d**-0.5
    out = cpu_native.paged_prefill(q, k_cache, v_cache, cu_q, torch.tensor(k_lens, dtype=torch.int32), table,
                                   scale, opts["window_left"], opts["softcap"], sinks, max(q_lens), causal=causal,
                                   isa=opts["isa"])  # fmt: skip
    assert out is not None and out.shape == q.shape
    for r, (q0, q1) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
        expected = _expected(q[q0:q1], k_cache, v_cache, table[r], k_lens[r], opts, sinks, scale, causal=causal)
        _assert_close(out[q0:q1], expected, opts["dtype"])


def _shared_case(opts: dict, groups: list[tuple[int, int]], alone: int, tail: int, gen: torch.Generator) -> tuple:
    """Requests in ``groups`` of (members, shared blocks) whose leading blocks are the same physical blocks,
    then ``alone`` requests of their own; each request has up to ``tail`` more tokens in blocks of its own."""
    bs, hk, d = opts["block_size"], opts["kv_heads"], opts["head_dim"]
    rows, lens, next_block = [], [], 0
    for members, shared in groups:
        prefix = list(range(next_block, next_block + shared))
        next_block += shared
        for _ in range(members):
            extra = int(torch.randint(0, tail + 1, (1,), generator=gen))
            own = math.ceil(extra / bs)
            rows.append(prefix + list(range(next_block, next_block + own)))
            next_block += own
            lens.append(shared * bs + extra)
    for _ in range(alone):
        n = int(torch.randint(1, 3 * bs + tail, (1,), generator=gen))
        rows.append(list(range(next_block, next_block + math.ceil(n / bs))))
        next_block += math.ceil(n / bs)
        lens.append(n)
    width = max(len(r) for r in rows) + 1
    table = torch.full((len(rows), width), -1, dtype=torch.int32)
    for b, r in enumerate(rows):
        table[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
    perm = torch.randperm(len(rows), generator=gen)  # group members need not be neighbours
    k = torch.randn(next_block + 1, bs, hk, d, generator=gen).to(opts["dtype"])
    v = torch.randn(next_block + 1, bs, hk, d, generator=gen).to(opts["dtype"])
    return k, v, table[perm].contiguous(), [lens[i] for i in perm.tolist()]


@settings(max_examples=40, deadline=None)
@given(
    opts=layouts(),
    groups=st.lists(st.tuples(st.integers(2, 9), st.integers(4, 12)), min_size=1, max_size=3),
    alone=st.integers(0, 3),
    tail=st.integers(0, 40),
)
def test_shared_prefix_decode_equals_the_plain_one(
    opts: dict, groups: list[tuple[int, int]], alone: int, tail: int
) -> None:
    """Requests sharing leading blocks (forks, prefix caching) read them once per group: the same attention as
    without grouping (up to fp32 summation order) and as the reference; the groups are found."""
    opts = {**opts, "window_left": -1}  # a window turns grouping off
    gen = torch.Generator().manual_seed(opts["seed"])
    k_cache, v_cache, table, lens = _shared_case(opts, groups, alone, tail, gen)
    b, hk, d = len(lens), opts["kv_heads"], opts["head_dim"]
    q = torch.randn(b, 1, hk * opts["group"], d, generator=gen).to(opts["dtype"])
    sinks, scale = _sinks(opts, gen), d**-0.5
    seqlens = torch.tensor(lens, dtype=torch.int32)
    info: dict = {}
    args = (q, k_cache, v_cache, None, None, seqlens, table, scale, -1, opts["softcap"], sinks, max(lens))
    grouped = cpu_native.paged_decode(*args, isa=opts["isa"], info=info)
    assert info["groups"] >= (1 if any(s * opts["block_size"] >= 32 for _, s in groups) else 0)
    plain = cpu_native.paged_decode(*args, isa=opts["isa"], shared_prefix=False, info=info)
    assert info["groups"] == 0 and grouped is not None and plain is not None
    for r, n in enumerate(lens):
        expected = _expected(q[r], k_cache, v_cache, table[r], n, opts, sinks, scale)
        _assert_close(grouped[r], expected, opts["dtype"])
        _assert_close(plain[r], expected, opts["dtype"])


def test_shared_prefix_groups_are_found_as_the_torch_backend_finds_them() -> None:
    """Three forks of one prompt and two requests on another cached prefix form two groups; a chat template's
    common first block alone (under 32 tokens) does not tie requests together."""
    opts = {"block_size": 16, "kv_heads": 1, "head_dim": 64, "dtype": torch.float32}
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, table, lens = _shared_case(opts, [(3, 4), (2, 2)], 2, 20, gen)
    q = torch.randn(len(lens), 1, 2, 64, generator=gen)
    info: dict = {}
    cpu_native.paged_decode(q, k_cache, v_cache, None, None, torch.tensor(lens, dtype=torch.int32), table, 0.125,
                            -1, 0.0, None, max(lens), info=info)  # fmt: skip
    assert info["groups"] == 2
    table[:, 1:] = torch.arange(1, table.shape[1]).view(1, -1) + 100 * torch.arange(len(lens)).view(-1, 1)
    table[:, 0] = 0  # one shared 16-token block only
    big = torch.randn(int(table.max()) + 1, 16, 1, 64)
    cpu_native.paged_decode(q, big, big, None, None, torch.tensor(lens, dtype=torch.int32), table, 0.125, -1, 0.0,
                            None, max(lens), info=info)  # fmt: skip
    assert info["groups"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_split_prefill_and_shared_prefix_work_exactly(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's workers take tasks dynamically; each task is one thread's, so outputs are bit-identical."""
    opts = {"block_size": 16, "kv_heads": 2, "head_dim": 64, "dtype": dtype}
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, table, lens = _shared_case(opts, [(6, 4)], 3, 30, gen)
    q = torch.randn(len(lens), 1, 8, 64, generator=gen).to(dtype)
    used = torch.tensor(lens, dtype=torch.int32)
    cu_q = torch.arange(0, 4 * len(lens) + 1, 4, dtype=torch.int32)
    qp = torch.randn(4 * len(lens), 8, 64, generator=gen).to(dtype)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        dec = cpu_native.paged_decode(q, k_cache, v_cache, None, None, used, table, 0.125, -1, 0.0, None, max(lens))
        pre = cpu_native.paged_prefill(qp, k_cache, v_cache, cu_q, used, table, 0.125, -1, 0.0, None, 4)
        return dec, pre

    one = both()
    monkeypatch.setattr(cpu_native, "_THREADED_WORK", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    many = both()
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_kernels_share_torchs_openmp_runtime_and_build_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built with -fopenmp, the library runs its threads on the OpenMP runtime torch loaded (one libgomp in the
    process: the loader matches the soname); built without OpenMP (a compiler without it), on a pool of its
    own, with the same answers."""
    if cpu_native.library() is None:
        pytest.skip("the native kernels are unavailable here")
    gomp = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    if not gomp:
        pytest.skip("this torch does not run on GNU OpenMP")
    assert len(gomp) == 1, gomp
    opts = {"block_size": 16, "kv_heads": 2, "head_dim": 64, "dtype": torch.float32}
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, table, lens = _shared_case(opts, [(6, 4)], 3, 30, gen)
    q = torch.randn(len(lens), 1, 8, 64, generator=gen)
    used = torch.tensor(lens, dtype=torch.int32)
    monkeypatch.setattr(cpu_native, "_THREADED_WORK", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)

    def decode() -> torch.Tensor:
        return cpu_native.paged_decode(q, k_cache, v_cache, None, None, used, table, 0.125, -1, 0.0, None, max(lens))

    with_openmp = decode()
    monkeypatch.setattr(cpu_native, "FLAGS", tuple(cpu_native.NO_OPENMP if f == "-fopenmp" else f
                                                   for f in cpu_native.FLAGS))  # fmt: skip
    monkeypatch.setattr(cpu_native, "_library", cpu_native.load(cpu_native.build(directory=tmp_path)))
    assert torch.equal(decode(), with_openmp)


def _isa_from_cpu_flags() -> str:
    """The instruction set the kernels should pick here, from the flags Linux reports (it hides AVX-512 when the
    OS does not save the zmm state, as the kernels' own xgetbv check requires)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if not {"avx2", "fma"} <= flags:
        return "portable"
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx2"
    return "avx512bf16" if "avx512_bf16" in flags else "avx512"


@pytest.mark.skipif(platform.machine() != "x86_64" or not sys.platform.startswith("linux"), reason="x86 Linux flags")
def test_the_best_isa_is_the_one_the_cpu_flags_name() -> None:
    """The cap draws above run the best the CPU has; that best must be what the CPU offers, not a fallback."""
    assert cpu_native.best_isa() == _isa_from_cpu_flags()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_this_cpu_runs_matches_the_reference(dtype: torch.dtype) -> None:
    """One fixed decode and prefill case on each instruction set up to the best: the float64 reference within
    ``_assert_close`` (fp32: 1e-5; outputs are softmax-weighted means of unit-normal values, so of order 1, and
    fp32 sums over 90 keys and 128 dims round by about sqrt(128) * 6e-8 ~ 1e-6: a tenfold margin; bf16: one bf16
    step of the largest value), and the paths differ in their rounding, so each really ran."""
    best = cpu_native.best_isa()
    opts = {"kv_heads": 2, "group": 4, "head_dim": 128, "block_size": 16, "window_left": -1, "softcap": 0.0,
            "dtype": dtype}  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    lens = [90, 33, 1]
    k_cache, v_cache, table = _pages(opts, lens, gen)
    q = torch.randn(len(lens), 1, 8, 128, generator=gen).to(dtype)
    seqlens, scale = torch.tensor(lens, dtype=torch.int32), 128**-0.5
    outs = {}
    for isa in ISAS[: ISAS.index(best) + 1]:
        out = cpu_native.paged_decode(q, k_cache, v_cache, None, None, seqlens, table, scale, -1, 0.0, None,
                                      max(lens), isa=isa)  # fmt: skip
        for r, n in enumerate(lens):
            _assert_close(out[r], _expected(q[r], k_cache, v_cache, table[r], n, opts, None, scale), dtype)
        outs[isa] = out
    if len(outs) > 1:  # a cap silently ignored would give the portable kernel's bits everywhere
        assert any(not torch.equal(outs["portable"], out) for isa, out in outs.items() if isa != "portable")
