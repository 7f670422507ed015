"""Sampling on stacked rows: which requests share a draw (``batch_key``), the inverse-CDF draw, and
that stacked rows keep their own tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn.core.request import Request
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.runtime.generation.sampling import draw, make_sampling_params, sample_tokens, stacked_scores


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged")


def _request(model, processors: LogitsProcessorList | None = None, seed: int | None = None, logprobs=None, **options):  # noqa: ANN001, ANN003
    config = model._prepare_generation_config(GenerationConfig(**options))[0]
    params = make_sampling_params(model, config, 5, processors, seed=seed, logprobs=logprobs, max_new_tokens=4)
    return Request("r", [3, 4, 5, 6, 7], 4, params, arrival=0)


class _Shift(LogitsProcessor):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores + 1.0


def test_batch_key_groups_equal_row_free_sampling(model) -> None:  # noqa: ANN001
    a = _request(model, do_sample=True, temperature=0.8, top_p=0.9, top_k=50).sampling.batch_key
    b = _request(model, do_sample=True, temperature=0.8, top_p=0.9, top_k=50).sampling.batch_key
    c = _request(model, do_sample=True, temperature=0.7, top_p=0.9, top_k=50).sampling.batch_key
    assert a is not None and a == b and a != c
    # processors that read the ids stack too (their plans' keys), per-row settings left out of the key
    def key(**options) -> tuple | None:  # noqa: ANN003
        return _request(model, do_sample=True, **options).sampling.batch_key

    d = key(repetition_penalty=1.2, min_new_tokens=3)
    assert d is not None and d == key(repetition_penalty=1.2, min_new_tokens=7)
    assert d != key(repetition_penalty=1.3, min_new_tokens=3)
    # a caller's processor stacks only with its very instance
    shift = LogitsProcessorList([_Shift()])
    assert _request(model, shift).sampling.batch_key == _request(model, shift).sampling.batch_key
    other = LogitsProcessorList([_Shift()])
    assert _request(model, shift).sampling.batch_key != _request(model, other).sampling.batch_key
    # rows that need their own work: a seed, log-probs
    assert _request(model, seed=3, do_sample=True).sampling.batch_key is None
    assert _request(model, logprobs=2, do_sample=True).sampling.batch_key is None


def test_draw_follows_the_distribution_and_never_draws_a_zero() -> None:
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.stack([draw(probs, gen) for _ in range(20_000)])  # [20000, 2]
    freq = torch.bincount(tokens[:, 0], minlength=4).float() / len(tokens)
    assert freq[1] == 0 and torch.allclose(freq, probs[0], atol=0.015)
    assert (tokens[:, 1] == 3).all()
    assert torch.equal(draw(probs, torch.Generator().manual_seed(5)), draw(probs, torch.Generator().manual_seed(5)))


def test_stacked_rows_keep_their_own_tokens(model) -> None:  # noqa: ANN001
    """top_k=1 sampling is greedy: each stacked row must get its own row's argmax, mixed with greedy
    rows and a row that samples on its own (repetition penalty)."""
    logits = torch.randn(6, 4096, generator=torch.Generator().manual_seed(1))
    requests = [
        _request(model, do_sample=True, top_k=1),
        _request(model),  # greedy
        _request(model, do_sample=True, top_k=1),
        _request(model, do_sample=True, top_k=1, repetition_penalty=1.0001),  # its own row
        _request(model, do_sample=True, top_k=1),
        _request(model, do_sample=True, top_k=1, temperature=0.5),  # another stack
    ]
    assert requests[0].sampling.batch_key == requests[2].sampling.batch_key != requests[5].sampling.batch_key
    samples = sample_tokens(logits, requests, torch.Generator().manual_seed(0))
    assert [s.token for s in samples] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.7, top_k=50, top_p=0.9),
        dict(top_k=20, min_p=0.05),
        dict(top_k=30, typical_p=0.8),
        dict(temperature=1.3, top_p=0.5),  # generation config's default top_k=50 joins in
        dict(top_k=10, repetition_penalty=1.0),  # a no-op penalty is dropped by transformers
        dict(top_k=0, top_p=0.7),  # no top-k: the whole vocabulary
    ],
)
def test_stacked_scores_on_top_k_candidates_equal_the_full_vocabulary(model, options) -> None:  # noqa: ANN001
    """Running the processors after top-k on the k candidates alone gives each token the same
    probability as running them on the whole vocabulary; a row that ties at its k-th score takes
    the whole vocabulary."""
    processors = _request(model, do_sample=True, **options).sampling.processors
    raw = torch.randn(5, 4096, generator=torch.Generator().manual_seed(2)) * 3
    top_k = options.get("top_k", 50)
    if top_k:  # row 4: its (k+1)-th best score ties its k-th, so top-k keeps k + 1 tokens
        order = raw[4].argsort(descending=True)
        raw[4, order[top_k]] = raw[4, order[top_k - 1]]
    full = torch.softmax(processors(torch.empty(5, 0, dtype=torch.long), raw.clone()), dim=-1)  # [5, vocab]
    for rows in (slice(0, 4), slice(4, 5)):
        scores, ids = stacked_scores(processors, raw[rows])
        probs = torch.softmax(scores, dim=-1)
        if ids is not None:
            probs = torch.zeros_like(full[rows]).scatter(1, ids, probs)
        torch.testing.assert_close(probs, full[rows], atol=1e-6, rtol=1e-5)
        reduced = ids is not None
        assert reduced == (top_k > 0 and rows.start == 0), (rows, top_k, reduced)
