"""Grammar masks filled ahead (``runtime/generation/mask_prefill.py``): the rows it filled are the ones a
synchronous fill gives, a matcher changed or made since is filled anew, a failed fill leaves every row to the
synchronous one, and an engine's constrained requests take them (its tokens as without)."""

from __future__ import annotations

import torch

from hf_paged_attn.runtime.generation import mask_prefill
from hf_paged_attn.runtime.generation.mask_prefill import MaskPrefill
from hf_paged_attn.runtime.generation.structured import GrammarCompiler, StructuredSpec

from .test_structured import REGEXES, SCHEMAS, VOCAB, advanced
from .test_structured import compiler as compiler  # noqa: F401  (its fixtures)
from .test_structured import tok as tok  # noqa: F401


def masked(compiler: GrammarCompiler, matchers, rows, logits: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The logits masked synchronously, as the sampler did without masks filled ahead."""
    out = logits.clone()
    compiler.mask_logits(out, matchers, rows)
    return out


def test_prefilled_masks_equal_a_fill_now_and_stale_ones_are_filled_anew(compiler) -> None:  # noqa: ANN001
    specs = [StructuredSpec(json=s) for s in SCHEMAS.values()] + [StructuredSpec(regex=r) for r in REGEXES]
    matchers = [advanced(compiler, spec, steps=i % 5, seed=i)[0] for i, spec in enumerate(specs)]
    prefill = MaskPrefill()
    prefill.start(matchers)
    prefilled = prefill.take()
    assert len(prefilled) == len(matchers) and all(prefilled.row_of(m) is not None for m in matchers)
    # in the order filled, every one: the step's usual case, applied whole
    logits = torch.randn(len(matchers), VOCAB, generator=torch.Generator().manual_seed(2))
    got = logits.clone()
    mask_prefill.mask_rows(got, matchers, range(len(matchers)), prefilled)
    assert torch.equal(got, masked(compiler, matchers, range(len(matchers)), logits))
    logits = torch.randn(len(matchers) + 3, VOCAB, generator=torch.Generator().manual_seed(0))
    rows = [2, 0, *range(3, len(matchers) + 1)]  # not the order they were filled in; row 1 unconstrained
    got = logits.clone()
    mask_prefill.mask_rows(got, matchers, rows, prefilled)
    assert torch.equal(got, masked(compiler, matchers, rows, logits))
    # one matcher advanced since the fill, one made since: theirs are filled now, the others' taken
    moved = next(m for m in matchers if not m.is_terminated())
    allowed = masked(compiler, [moved], [0], torch.zeros(1, VOCAB))[0]
    assert moved.accept(int(torch.nonzero(allowed == 0)[0]))
    assert prefilled.row_of(moved) is None
    fresh = compiler.matcher(specs[0])
    both = [*matchers, fresh]
    rows = list(range(len(both)))
    logits = torch.randn(len(both), VOCAB, generator=torch.Generator().manual_seed(1))
    got = logits.clone()
    mask_prefill.mask_rows(got, both, rows, prefilled)
    assert torch.equal(got, masked(compiler, both, rows, logits))
    # every matcher in the order filled, one of them advanced since: not applied whole
    got = logits[: len(matchers)].clone()
    mask_prefill.mask_rows(got, matchers, range(len(matchers)), prefilled)
    assert torch.equal(got, masked(compiler, matchers, range(len(matchers)), logits[: len(matchers)]))
    prefill.close()


def test_a_failed_fill_leaves_every_row_to_the_sampler(compiler, monkeypatch) -> None:  # noqa: ANN001
    matcher = compiler.matcher(StructuredSpec(json=SCHEMAS["enum"]))

    def broken(*args: object) -> None:
        raise RuntimeError("the fill failed")

    monkeypatch.setattr(mask_prefill, "_fill", broken)
    prefill = MaskPrefill()
    prefill.start([matcher])
    assert len(prefill.take()) == 0
    assert len(prefill.take()) == 0  # nothing pending after a take
    prefill.start([matcher])  # the thread goes on after a failed fill
    assert len(prefill.take()) == 0
    monkeypatch.undo()
    prefill.start([matcher])
    assert prefill.take().row_of(matcher) is not None
    prefill.close()


def test_the_fill_thread_ends_with_its_prefill_dropped_unclosed(compiler) -> None:  # noqa: ANN001
    import gc

    prefill = MaskPrefill()
    matcher = compiler.matcher(StructuredSpec(json=SCHEMAS["enum"]))
    prefill.start([matcher])
    assert prefill.take().row_of(matcher) is not None
    thread = prefill._thread
    assert thread.is_alive()
    del prefill
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
