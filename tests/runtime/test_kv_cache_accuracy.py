"""fp8 and int8 pages on real text: teacher-forced perplexity of the bundled model, every prompt chunked so that
most of each row's keys are read back from the pages (``max_batch_tokens=64``: a 1,000-token text runs
as 16 chunks), against the unquantized cache's. Thresholds of issue #53, pinned on one text."""

from __future__ import annotations

import math
from pydoc_data.topics import topics

import pytest

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig

# perplexity ratio at most, top-1 kept at least. int8 (per token and head) measured x1.00018 and 99.1%, pinned with
# a margin at x1.002 and 98%: tighter than fp8 e4m3's measured x1.0053 / 96.2%, so a regression to fp8's
# accuracy fails.
LIMITS = {"fp8_e4m3": (1.01, 0.94), "fp8_e5m2": (1.02, 0.88), "int8": (1.002, 0.98)}


def score(model, ids: list[int], kv_cache_dtype: str) -> tuple[list[float], list[int]]:
    """Each prompt token's log-probability and the model's top-1 token at its position."""
    config = PagedConfig(kv_cache_dtype=kv_cache_dtype, max_batch_tokens=64, num_blocks=160, compile=False,
                         enable_prefix_caching=False)  # fmt: skip
    engine = ContinuousBatchingEngine(model, config)
    engine.add_request(ids, max_new_tokens=1, prompt_logprobs=1)
    (out,) = [o for o in engine.stream() if o.finished]
    scored = out.prompt_logprobs[1:]
    return [e.logprob for e in scored], [e.top[0][0] for e in scored]


@pytest.fixture(scope="module")
def text_and_base(demo):
    tokenizer, paged, _ = demo
    ids = tokenizer(topics["typesseq"]).input_ids[:1000]  # real text of the model's own domain
    return ids, score(paged, ids, "auto")


@pytest.mark.parametrize("dtype", list(LIMITS))
def test_perplexity_and_top1_through_quantized_pages(demo, text_and_base, dtype):
    _, paged, _ = demo
    ids, (base_logprobs, base_top) = text_and_base
    assert len(ids) == 1000
    logprobs, top = score(paged, ids, dtype)
    ratio = math.exp((sum(base_logprobs) - sum(logprobs)) / len(logprobs))
    kept = sum(a == b for a, b in zip(base_top, top)) / len(top)
    max_ratio, min_kept = LIMITS[dtype]
    print(f"{dtype}: perplexity x{ratio:.5f}, top-1 kept {kept:.2%}")
    assert ratio <= max_ratio and kept >= min_kept, (ratio, kept)
    assert logprobs != base_logprobs  # the pages really were rounded
