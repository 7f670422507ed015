"""prompt_logprobs: every prompt token scored under the model's raw distribution, equal to the
log-softmax of transformers' own (sdpa) forward over the whole prompt, whatever the chunking,
prefix cache, preemption or neighbours; generation itself unchanged."""

from __future__ import annotations

import pytest
import torch

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn_tools.testing import ragged_prompts, reference_greedy

K = 3


def reference_scores(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] log-probabilities of tokens 1.. of ``prompt`` (sdpa, one forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_reference(ref, prompt: list[int], scored: list, k: int = K) -> None:
    assert len(scored) == len(prompt) and scored[0] is None
    expected = reference_scores(ref, prompt)  # [P - 1, vocab]
    for position, entry in enumerate(scored[1:]):
        assert entry.token_id == prompt[position + 1]
        assert entry.logprob == pytest.approx(float(expected[position, entry.token_id]), abs=1e-4)
        values, ids = expected[position].topk(k)
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        gaps = (values[:-1] - values[1:]).min()
        if gaps > 1e-3:  # ids in order unless two alternatives tie within float noise
            assert [t for t, _ in entry.top] == ids.tolist()


def finals(engine: ContinuousBatchingEngine) -> dict[str, object]:
    return {o.request_id: o for o in engine.stream() if o.finished}


@pytest.mark.parametrize("max_batch_tokens", [512, 7], ids=["whole", "chunked"])
def test_equal_to_sdpa_and_generation_unchanged(llama_pair, max_batch_tokens):
    ref, paged = llama_pair
    prompts = ragged_prompts(4, 5, 29, seed=3)
    config = PagedConfig(block_size=4, num_blocks=96, max_batch_tokens=max_batch_tokens)
    engine = ContinuousBatchingEngine(paged, config)
    ids = [engine.add_request(p, max_new_tokens=6, prompt_logprobs=K if i % 2 == 0 else None)
           for i, p in enumerate(prompts)]  # neighbours that do not score share every step
    out = finals(engine)
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        assert out[rid].output_ids == reference_greedy(ref, prompt, 6)
        if i % 2 == 0:
            check_against_reference(ref, prompt, out[rid].prompt_logprobs)
        else:
            assert out[rid].prompt_logprobs is None


def test_prefix_cache_never_skips_a_scored_position(llama_pair):
    ref, paged = llama_pair
    prompt = ragged_prompts(1, 22, 22, seed=5)[0]
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64, enable_prefix_caching=True))
    engine.add_request(prompt, max_new_tokens=2)
    finals(engine)  # the prompt's blocks are now cached
    rid = engine.add_request(prompt, max_new_tokens=2, prompt_logprobs=0)
    out = finals(engine)[rid]
    assert out.num_cached_tokens == 0
    check_against_reference_k0(ref, prompt, out.prompt_logprobs)
    again = engine.add_request(prompt, max_new_tokens=2)  # others still hit the cache
    assert finals(engine)[again].num_cached_tokens > 0


def check_against_reference_k0(ref, prompt, scored) -> None:
    expected = reference_scores(ref, prompt)
    assert scored[0] is None and len(scored) == len(prompt)
    got = torch.tensor([e.logprob for e in scored[1:]])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert all(e.top == [] for e in scored[1:])


def test_preemption_scores_each_token_once(llama_pair):
    ref, paged = llama_pair
    prompts = ragged_prompts(6, 14, 20, seed=8)
    # few blocks: requests are preempted and recomputed from their prompt
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=16, max_batch_tokens=9))
    ids = [engine.add_request(p, max_new_tokens=10, prompt_logprobs=1) for p in prompts]
    out = finals(engine)
    assert engine.stats.num_preemptions > 0
    for rid, prompt in zip(ids, prompts):
        assert out[rid].output_ids == reference_greedy(ref, prompt, 10)
        check_against_reference_k1(ref, prompt, out[rid].prompt_logprobs)


def check_against_reference_k1(ref, prompt, scored) -> None:
    expected = reference_scores(ref, prompt)
    assert len(scored) == len(prompt)
    for position, entry in enumerate(scored[1:]):
        assert entry.logprob == pytest.approx(float(expected[position, prompt[position + 1]]), abs=1e-4)
        assert entry.top[0][1] == pytest.approx(float(expected[position].max()), abs=1e-4)


def test_siblings_share_the_prompt_scores(llama_pair):
    ref, paged = llama_pair
    from transformers import GenerationConfig

    prompt = ragged_prompts(1, 11, 11, seed=2)[0]
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64))
    config = GenerationConfig(do_sample=True, num_return_sequences=3, max_new_tokens=4)
    engine.add_request(prompt, generation_config=config, prompt_logprobs=2, seed=0)
    out = list(finals(engine).values())
    assert len(out) == 3
    for o in out:
        assert [e and e.logprob for e in o.prompt_logprobs] == [e and e.logprob for e in out[0].prompt_logprobs]
    check_against_reference_k1(ref, prompt, out[0].prompt_logprobs)


def test_first_output_carries_them_and_a_one_token_prompt(llama_pair):
    """The first streamed output of each request already holds its whole prompt's scores, equal to
    sdpa's; a one-token prompt has nothing to score but its ``None``."""
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    prompts = [[17], list(range(1, 9))]
    ids = [engine.add_request(p, max_new_tokens=3, prompt_logprobs=2) for p in prompts]
    seen = {}
    for o in engine.stream():
        seen.setdefault(o.request_id, o)  # the first output with a token
    for rid, prompt in zip(ids, prompts):
        check_against_reference(ref, prompt, seen[rid].prompt_logprobs, k=2)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_bad_values(llama_pair, bad):
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=16))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request([1, 2, 3], max_new_tokens=2, prompt_logprobs=bad)
    assert not engine.has_unfinished()


def test_beam_search_refused(llama_pair):
    _, paged = llama_pair
    from transformers import GenerationConfig

    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    with pytest.raises(NotImplementedError, match="prompt_logprobs"):
        engine.add_request([1, 2, 3], generation_config=GenerationConfig(num_beams=2, max_new_tokens=2),
                           prompt_logprobs=1)


def test_with_speculative_decoding(llama_dir, llama_pair):
    """A draft model's feeds and prompt lookup's proposals around a scoring request: its scores and
    tokens unchanged (the draft never scores a prompt)."""
    from transformers import AutoModelForCausalLM

    from hf_paged_attn import SpeculativeConfig

    ref, paged = llama_pair
    twin = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged").eval()
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], ragged_prompts(1, 12, 12, seed=4)[0]]
    for draft in (twin, None):
        speculative = SpeculativeConfig(num_speculative_tokens=3, draft_model=draft)
        engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=96, speculative=speculative))
        ids = [engine.add_request(p, max_new_tokens=8, prompt_logprobs=1) for p in prompts]
        out = finals(engine)
        assert engine.stats.num_draft_tokens > 0
        for rid, prompt in zip(ids, prompts):
            assert out[rid].finish_reason == "length" and out[rid].output_ids == reference_greedy(ref, prompt, 8)
            check_against_reference_k1(ref, prompt, out[rid].prompt_logprobs)
