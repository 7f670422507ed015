"""``row_argmax`` against ``torch.argmax``, its reference: the same index on every row, ties, NaN and infinities
included, for vocabularies shorter than a chunk, a whole number of chunks and a shorter last chunk, through each of
its paths (numpy's one pass, the threaded chunks)."""

from __future__ import annotations

import pytest
import torch
from numpy import argmax as np_argmax

from hf_paged_attn.runtime.generation import argmax
from hf_paged_attn.runtime.generation.argmax import CHUNK, row_argmax


@pytest.fixture(params=["numpy", "chunks"], autouse=True)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs through each path: numpy's (these shapes are all below ``NUMPY_MAX``) and the chunks'."""
    if request.param == "chunks":
        monkeypatch.setattr(argmax, "NUMPY_MAX", 0)
    return request.param


@pytest.mark.parametrize("vocab", [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 5, 8192, 32000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_torch_argmax(vocab: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=generator).to(dtype)
    last = vocab - 1
    logits[1, :] = 0.0  # every column tied: the first
    logits[2, :] = float("-inf")  # nothing finite: the first
    logits[3, [last, last // 2]] = 50.0  # a tie across chunks: the earlier
    logits[4, last] = float("inf")  # at the very end
    logits[5, [last // 3, last]] = float("nan")  # NaN is the largest: the first NaN
    logits[6, last // 2] = float("inf")
    logits[6, last] = float("nan")  # a NaN beats +inf
    logits[7] = logits[7].round()  # many ties inside chunks (bf16 rounds many values alike too)
    logits[8, :] = -1.0
    logits[8, last] = -0.5
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))


def test_strided_rows_and_one_row() -> None:
    wide = torch.randn(6, 3 * CHUNK + 7)
    rows = wide[::2, 3:]  # a view: every other row, columns from the fourth
    assert torch.equal(row_argmax(rows), rows.argmax(dim=-1))
    one = torch.randn(1, 1000)
    assert torch.equal(row_argmax(one), one.argmax(dim=-1))


def test_no_rows() -> None:
    assert row_argmax(torch.empty(0, 500)).shape == (0,)


def test_random_rows_many_shapes() -> None:
    generator = torch.Generator().manual_seed(0)
    for vocab in range(CHUNK - 3, 4 * CHUNK + 3, 7):
        logits = torch.randint(-3, 4, (16, vocab), generator=generator).float()  # small integers: ties everywhere
        assert torch.equal(row_argmax(logits), logits.argmax(dim=-1)), vocab


def test_the_bound_between_the_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows x vocabulary up to ``NUMPY_MAX`` take numpy's pass, larger ones the chunks: both give torch's index."""
    calls = []
    monkeypatch.setattr(argmax.np, "argmax", lambda *a, **k: calls.append(1) or np_argmax(*a, **k))
    small, large = torch.randn(4, 1000), torch.randn(4, 1001)
    monkeypatch.setattr(argmax, "NUMPY_MAX", 4000)
    assert torch.equal(row_argmax(small), small.argmax(dim=-1)) and len(calls) == 1
    assert torch.equal(row_argmax(large), large.argmax(dim=-1)) and len(calls) == 1
    bf16 = small.bfloat16()  # numpy has no bfloat16: the chunks
    assert torch.equal(row_argmax(bf16), bf16.argmax(dim=-1)) and len(calls) == 1
    assert row_argmax(small).dtype == torch.int64
