"""The Triton LoRA kernels (``kernels/lora_triton.py``) against the float64 reference, on CPU tensors under
the Triton interpreter.

Each tolerance is the rounding error bound of the kernel's arithmetic, elementwise (``lora_shrink_bound``,
``lora_expand_bound`` in ``kernels/lora_reference.py``): a float32 sum of k products is within
``gamma_k = k u / (1 - k u)`` (u = 2^-24) of the exact one, relative to the sum of the products' magnitudes,
and each later rounding (the scaling, adding y, the cast to y's dtype) adds its unit roundoff of the value.
The casts the kernels make on purpose (x to A's dtype, t to B's) the reference makes too. Under the
interpreter the dots run in IEEE fp32 whatever the dtype (its bf16 dot is wrong); on a GPU the
half-precision dots take tensor cores with float32 sums, under the same bound
(``scripts/gpu_check/checks/lora.py``).
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first `import triton`: the kernels are built interpreted

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from hf_paged_attn.kernels import lora_triton as lt  # noqa: E402
from hf_paged_attn.kernels.lora_reference import (  # noqa: E402
    lora_expand_bound,
    lora_expand_reference,
    lora_shrink_bound,
    lora_shrink_reference,
)

if not isinstance(lt._shrink_kernel, triton.runtime.interpreter.InterpretedFunction):
    lt = importlib.reload(lt)  # imported before TRITON_INTERPRET was set: rebuild it interpreted


def cast_roundoff(dtype: torch.dtype) -> float:
    """The error bound of the kernel's cast of a float32 value to ``dtype``, relative: the interpreter truncates
    to bfloat16 (its cast passes no rounding mode), one ulp; a GPU, and numpy's float16 cast, round to nearest."""
    eps = torch.finfo(dtype).eps
    return eps if dtype == torch.bfloat16 else eps / 2


def rows_of(slots: list[int], lora_ids: list[int] | None) -> torch.Tensor:
    """[N]: each row's index in the stacks (-1: none), what the reference takes."""
    if lora_ids is None:
        return torch.tensor(slots)
    return torch.tensor([-1 if s < 0 else lora_ids[s] for s in slots])


def random_slots(gen: torch.Generator, num_rows: int, num_slots: int, empty: int | None) -> list[int]:
    """Slots in -1..num_slots-1, shuffled (segments are not runs), ``empty`` given no row."""
    choices = [s for s in range(-1, num_slots) if s != empty]
    picks = torch.randint(len(choices), (num_rows,), generator=gen).tolist()
    return [choices[i] for i in picks]


def adapters(gen, ranks: list[int], num_in: int, num_out: int, dtype: torch.dtype):
    """(A stack [L, R, in], B stack [L, out, R]) of random adapters of ``ranks``, padded to the largest."""
    a = [torch.randn(r, num_in, generator=gen) / num_in**0.5 for r in ranks]
    b = [torch.randn(num_out, r, generator=gen) for r in ranks]
    return lt.stack_padded(a, 0, dtype), lt.stack_padded(b, 1, dtype)


# (N, in, out, ranks, slots, lora_ids, empty slot): N=1; ragged segments with one adapter given no rows;
# ranks padded to the largest (8 and 4 to 16, 33 to a 64-wide tile); a layer lacking an adapter (lora_ids
# -1) and more slots than stacked adapters; in and out not multiples of the tiles; rows with no adapter.
SHAPES = {
    "one-row": (1, 32, 48, [8], 1, None, None),
    "ragged": (37, 100, 72, [8, 4, 16], 3, None, 1),
    "lacking": (21, 64, 130, [4, 33], 3, [1, -1, 0], None),
    "decode": (5, 48, 16, [2, 2, 2, 2], 4, [3, 2, 1, 0], 2),
}
# (x, weights, y): one dtype throughout, and PEFT's float32 adapters under a half-precision base.
DTYPES = {
    "fp32": (torch.float32, torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16, torch.float16),
    "bf16-base-fp32-lora": (torch.bfloat16, torch.float32, torch.bfloat16),
}


def case(shape: str, dtypes: str, seed: int = 0):
    num_rows, num_in, num_out, ranks, num_slots, lora_ids, empty = SHAPES[shape]
    x_dtype, w_dtype, y_dtype = DTYPES[dtypes]
    gen = torch.Generator().manual_seed(seed + 52)
    a_stack, b_stack = adapters(gen, ranks, num_in, num_out, w_dtype)
    slots = random_slots(gen, num_rows, num_slots, empty)
    ids = None if lora_ids is None else torch.tensor(lora_ids, dtype=torch.int32)
    x = torch.randn(num_rows, num_in, generator=gen).to(x_dtype)
    y = torch.randn(num_rows, num_out, generator=gen).to(y_dtype)
    scalings = torch.rand(len(ranks), generator=gen) * 4
    segments = lt.lora_segments(torch.tensor(slots), num_slots)
    return x, y, a_stack, b_stack, scalings, segments, ids, rows_of(slots, lora_ids)


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_shrink_matches_reference(shape, dtypes):
    x, _, a_stack, _, _, segments, ids, token_lora = case(shape, dtypes)
    got = lt.lora_shrink(x, a_stack, segments, ids)
    want = lora_shrink_reference(x, a_stack, token_lora)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs()
    assert (err <= lora_shrink_bound(x, a_stack, token_lora)).all(), err.max()
    assert (got[token_lora < 0] == 0).all()  # rows without an adapter
    ranks = SHAPES[shape][3]
    for row, lora in enumerate(token_lora.tolist()):  # a smaller rank's padded columns stay zero
        assert lora < 0 or (got[row, ranks[lora] :] == 0).all()


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_expand_matches_reference(shape, dtypes):
    x, y, _, b_stack, scalings, segments, ids, token_lora = case(shape, dtypes, seed=1)
    # [N, R] float32, each value one of B's dtype: the kernel's cast of t to it (PEFT's) is then exact, whichever
    # rounding the interpreter makes
    t = torch.randn(y.shape[0], b_stack.shape[2], generator=torch.Generator().manual_seed(3)).to(b_stack.dtype).float()
    want = lora_expand_reference(y, t, b_stack, scalings, token_lora)
    before = y.clone()
    lt.lora_expand(y, t, b_stack, scalings, segments, ids)
    err = (y.double() - want).abs()
    bound = lora_expand_bound(before, t, b_stack, scalings, token_lora, want, cast_roundoff(y.dtype))
    assert (err <= bound).all(), err.max()
    assert torch.equal(y[token_lora < 0], before[token_lora < 0])  # untouched, bit for bit


def test_shrink_then_expand_is_scaling_times_b_a_x_per_adapter():
    """The pair against each adapter's own unpadded weights: the padding adds nothing."""
    gen = torch.Generator().manual_seed(7)
    ranks, num_in, num_out = [3, 8, 5], 40, 24
    a = [torch.randn(r, num_in, generator=gen) for r in ranks]
    b = [torch.randn(num_out, r, generator=gen) for r in ranks]
    scalings = torch.tensor([0.5, 2.0, 1.25])
    slots = [1, -1, 0, 2, 2, 1, 0, -1, 1]
    x = torch.randn(len(slots), num_in, generator=gen)
    y = torch.randn(len(slots), num_out, generator=gen)
    want = y.double().clone()
    for row, s in enumerate(slots):
        if s >= 0:
            want[row] += scalings[s].item() * (b[s].double() @ (a[s].double() @ x[row].double()))
    segments = lt.lora_segments(torch.tensor(slots), len(ranks))
    t = lt.lora_shrink(x, lt.stack_padded(a, 0), segments)
    lt.lora_expand(y, t, lt.stack_padded(b, 1), scalings, segments)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_segments_group_rows_by_slot():
    segments = lt.lora_segments(torch.tensor([2, -1, 0, 2, 0, -1, 2]), 4)
    assert segments.rows.tolist() == [1, 5, 2, 4, 0, 3, 6]  # stable: each slot's rows in order
    assert segments.counts.tolist() == [2, 0, 3, 0]
    assert segments.starts.tolist() == [2, 4, 4, 7]


def test_no_rows_and_no_adapter_rows():
    x, y = torch.randn(0, 32), torch.randn(0, 16)
    a, b = torch.randn(1, 4, 32), torch.randn(1, 16, 4)
    segments = lt.lora_segments(torch.zeros(0, dtype=torch.long), 1)
    t = lt.lora_shrink(x, a, segments)
    lt.lora_expand(y, t, b, torch.ones(1), segments)
    assert t.shape == (0, 4)
    x, y = torch.randn(3, 32), torch.randn(3, 16)
    segments = lt.lora_segments(torch.full((3,), -1), 1)
    before = y.clone()
    lt.lora_expand(y, lt.lora_shrink(x, a, segments), b, torch.ones(1), segments)
    assert torch.equal(y, before)


def test_bad_shapes_are_refused():
    segments = lt.lora_segments(torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match="a_stack"):
        lt.lora_shrink(torch.randn(2, 8), torch.randn(2, 4, 9), segments)
    with pytest.raises(ValueError, match="lora_ids"):
        lt.lora_shrink(torch.randn(2, 8), torch.randn(2, 4, 8), segments, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="slots"):
        lt.lora_shrink(torch.randn(2, 8), torch.randn(3, 4, 8), segments)
