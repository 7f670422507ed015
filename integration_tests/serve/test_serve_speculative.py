"""``hf-paged-attn serve --speculative ngram:K`` / ``--draft-model PATH``: the flags become the
engine's ``SpeculativeConfig``; ``/metrics`` counts proposed and accepted tokens."""

from __future__ import annotations

import prometheus_client  # noqa: F401  (a [dev] dependency: its absence fails the suite)
import pytest

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.serve.cli import load, paged_config, parse_args
from hf_paged_attn.serve.metrics import ServeMetrics


def test_speculative_flags_become_a_speculative_config():
    config = paged_config(parse_args(["m", "--speculative", "ngram:5:3"]))
    spec = config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.max_matching_ngram_size) == ("ngram", 5, 3)
    assert paged_config(parse_args(["m"])).speculative is None
    for bad in (["--speculative", "draft:3"], ["--speculative", "ngram:3", "--draft-model", "d"]):
        with pytest.raises(SystemExit):
            parse_args(["m", *bad])
    with pytest.raises(ValueError, match="speculative spec"):
        paged_config(parse_args(["m", "--speculative", "ngram:x"]))
    model = str(DEMO_MODEL)
    args = parse_args([model, "--draft-model", model, "--speculative", "draft:2", "--num-blocks", "32"])
    engine, _ = load(args)
    assert engine.config.speculative.method == "draft" and engine.config.speculative.num_speculative_tokens == 2
    assert engine.speculator.draft is not None


def test_metrics_count_proposed_and_accepted_tokens(llama_pair):
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64))
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, prompt_lookup_num_tokens=3)
    engine.generate([[5, 6, 7, 5, 6, 7, 5, 6]], max_new_tokens=16, generation_config=config)
    stats = engine.stats
    text = ServeMetrics(lambda: stats).render().decode()
    drafted = f"hf_paged_attn_spec_decode_num_draft_tokens_total {float(stats.num_draft_tokens)}"
    accepted = f"hf_paged_attn_spec_decode_num_accepted_tokens_total {float(stats.num_accepted_tokens)}"
    assert drafted in text and accepted in text
    assert stats.num_draft_tokens > 0
