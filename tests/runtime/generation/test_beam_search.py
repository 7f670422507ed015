"""Beam search through the engine: the same hypotheses, scores and beam indices as transformers' own
beam search (sdpa), on beams that share KV blocks and run in the continuous batch with other requests."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import GenerationConfig

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn_tools.testing import left_padded, load_pair, ragged_prompts, reference_greedy, save_random_model
from hf_paged_attn_tools.tiny_configs import tiny_config

NEW = 16
SCORE_TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3_text"])
def pair(request, tmp_path_factory):
    """(reference, paged, eos): eos is a token the reference's beams often emit, so that
    hypotheses end early and the finished-hypothesis bookkeeping is exercised."""
    ref, paged = load_pair(save_random_model(tiny_config(request.param), tmp_path_factory.mktemp(request.param)))
    ids, mask = left_padded(PROMPTS)
    out = ref.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=NEW, do_sample=False)
    counts = collections.Counter(out[:, ids.shape[1] + 1 :].flatten().tolist())
    return ref, paged, counts.most_common(1)[0][0]


PROMPTS = ragged_prompts(3, 3, 20, seed=3)


def check_beams(ref, expected, actual, prompts: list[list[int]], per_prompt: int) -> None:
    """Equal sequences and beam indices, scores within SCORE_TOLERANCE. Where hypotheses differ, the
    reference must hold two hypotheses of the same prompt whose scores are within the tolerance (a
    near-tie in the ranking: the beam-search form of DESIGN.md's near-tie rule)."""
    assert expected.sequences.shape == actual.sequences.shape
    torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, atol=SCORE_TOLERANCE, rtol=0)
    for row in range(expected.sequences.shape[0]):
        if torch.equal(expected.sequences[row], actual.sequences[row]):
            assert torch.equal(expected.beam_indices[row], actual.beam_indices[row]), f"row {row}"
            continue
        first = row - row % per_prompt
        scores = expected.sequences_scores[first : first + per_prompt]
        gaps = (scores - expected.sequences_scores[row]).abs()
        gaps[row - first] = float("inf")
        assert gaps.min() <= SCORE_TOLERANCE, (
            f"prompt {row // per_prompt} hypothesis {row % per_prompt}: "
            f"{actual.sequences[row].tolist()} != {expected.sequences[row].tolist()} and no near-tie"
        )


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(early_stopping=True),
        dict(early_stopping="never", length_penalty=2.0),
        dict(length_penalty=-0.5, num_return_sequences=3),
        dict(num_beams=3, num_return_sequences=3, no_repeat_ngram_size=2),
    ],
    ids=["default", "early_stopping", "never_lp2", "lp-0.5_nrs3", "ngram"],
)
def test_generate_beam_search_equals_sdpa(pair, options):
    ref, paged, eos = pair
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(num_beams=4, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                  return_dict_in_generate=True, output_scores=True)  # fmt: skip
    kwargs.update(options)
    expected = ref.generate(input_ids=ids, attention_mask=mask, **kwargs)
    actual = paged.generate(input_ids=ids, attention_mask=mask, paged_config=PagedConfig(block_size=4), **kwargs)
    check_beams(ref, expected, actual, PROMPTS, kwargs.get("num_return_sequences", 1))
    if options.get("length_penalty", 1.0) <= 1.0:  # a penalty above 1 may rightly prefer the longest
        new = expected.sequences[:, ids.shape[1] :]
        assert (new == eos).any(), "no hypothesis emitted EOS: the test would not exercise finished beams"
    # beam search returns only sequences_scores and beam_indices without output_scores
    plain = paged.generate(input_ids=ids, attention_mask=mask, **{**kwargs, "return_dict_in_generate": False})
    assert torch.equal(plain, actual.sequences)


def test_per_step_scores_equal_sdpa(pair):
    ref, paged, eos = pair
    ids, mask = left_padded(PROMPTS[:1])  # one search: transformers' loop ends exactly when it ends
    kwargs = dict(num_beams=3, max_new_tokens=8, eos_token_id=eos, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)  # fmt: skip
    expected = ref.generate(input_ids=ids, attention_mask=mask, **kwargs)
    actual = paged.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert len(actual.scores) == len(expected.scores) and len(actual.logits) == len(expected.logits)
    for a, e in zip(actual.scores + actual.logits, expected.scores + expected.logits):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=0)


def test_ragged_engine_requests_next_to_greedy_ones(pair):
    """Beam groups in the same continuous batch as greedy requests: each result equals that prompt
    alone through transformers (no padding)."""
    ref, paged, eos = pair
    prompts = ragged_prompts(4, 2, 30, seed=5)
    config = GenerationConfig(num_beams=3, num_return_sequences=2, eos_token_id=eos, do_sample=False)
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=256))
    beams = [engine.add_request(p, max_new_tokens=NEW, generation_config=config) for p in prompts]
    greedy = [engine.add_request(p, max_new_tokens=NEW) for p in prompts]
    finals = {o.request_id: o for o in engine.stream() if o.finished}
    for prompt, rid, gid in zip(prompts, beams, greedy):
        want = ref.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=2, max_new_tokens=NEW,
                            eos_token_id=eos, return_dict_in_generate=True, output_scores=True)  # fmt: skip
        for k, member in enumerate([rid, f"{rid}#1"]):
            out = finals[member]
            row = want.sequences[k, len(prompt) :].tolist()
            assert out.output_ids == row[: len(out.output_ids)] and set(row[len(out.output_ids) :]) <= {eos, 0}
            assert abs(out.score - float(want.sequences_scores[k])) <= SCORE_TOLERANCE
            assert out.finish_reason == ("eos" if out.output_ids[-1] == eos else "length")
        assert finals[gid].output_ids == reference_greedy(ref, prompt, NEW)[: len(finals[gid].output_ids)]
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks  # every beam's blocks came back
    engine.allocator.check_invariants()


def test_beams_share_blocks_and_copy_only_partial_blocks(pair):
    """4 beams over a 40-token prompt: at peak at most the prompt's blocks + 4 x (generated blocks + 1);
    a step copies at most num_beams - 1 blocks, each a partly filled last block."""
    ref, paged, _ = pair
    block, beams, prompt = 4, 4, ragged_prompts(1, 40, 40, seed=7)[0]
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=block, num_blocks=512))
    copies = []
    original = engine.cache.copy_blocks

    def record(pairs):
        running = engine.scheduler.running
        fill = {b: r.num_computed_tokens % block for r in running for t in r.block_tables for b in t[-1:]}
        copies.append([(src, fill.get(src)) for src, _ in pairs])
        return original(pairs)

    engine.cache.copy_blocks = record
    config = GenerationConfig(num_beams=beams, do_sample=False, eos_token_id=None)
    (out,) = engine.generate([prompt], max_new_tokens=NEW, generation_config=config)
    assert len(out.output_ids) == NEW
    groups = len(engine.layers.groups)  # a hybrid model's attention groups each hold a table
    bound = groups * (blocks_for(len(prompt), block) + beams * (blocks_for(NEW, block) + 1))
    assert engine.stats.peak_used_blocks <= bound, (engine.stats.peak_used_blocks, bound)
    assert engine.stats.peak_used_blocks < groups * beams * blocks_for(len(prompt) + NEW, block)  # < 4 copies
    assert any(copies) and all(len(step) <= groups * (beams - 1) for step in copies)
    assert all(fill for step in copies for _, fill in step), f"a full block was copied: {copies}"


def test_preemption_takes_the_whole_group_and_keeps_results(pair):
    ref, paged, eos = pair
    prompts = ragged_prompts(4, 8, 24, seed=9)
    config = GenerationConfig(num_beams=3, eos_token_id=eos, do_sample=False)

    def run(num_blocks: int):
        engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=num_blocks))
        preempt = engine.scheduler._preempt

        def whole_group(request, out):
            preempt(request, out)
            if request.group is not None:  # no beam of the victim's group may keep running
                assert not any(b in engine.scheduler.running for b in request.group.beams)

        engine.scheduler._preempt = whole_group
        ids = [engine.add_request(p, max_new_tokens=NEW, generation_config=config) for p in prompts[:2]]
        ids += [engine.add_request(p, max_new_tokens=NEW) for p in prompts[2:]]
        finals = {o.request_id: o for o in engine.stream() if o.finished}
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
        return [finals[i].output_ids for i in ids], engine.stats.num_preemptions

    roomy, none = run(512)
    tight, preemptions = run(3 * blocks_for(24 + NEW, 4))  # blocks of every layer: three beams at once
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_beam_sampling_is_reproducible_with_a_seed(pair):
    _, paged, _ = pair
    config = GenerationConfig(num_beams=3, do_sample=True, top_k=20, num_return_sequences=2)
    runs = []
    for _ in range(2):
        engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=128))
        rid = engine.add_request(PROMPTS[0], max_new_tokens=NEW, generation_config=config, seed=11)
        finals = {o.request_id: o for o in engine.stream() if o.finished}
        runs.append([(finals[i].output_ids, finals[i].score) for i in (rid, f"{rid}#1")])
    assert runs[0] == runs[1] and len(runs[0][0][0]) == NEW
    assert runs[0][0][1] >= runs[0][1][1]  # hypotheses come best first


def test_abort_frees_every_beam(pair):
    _, paged, _ = pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=128))
    rid = engine.add_request(PROMPTS[1], max_new_tokens=NEW, generation_config=GenerationConfig(num_beams=4))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 4
    engine.abort(rid)
    (out,) = engine.step()
    assert out.request_id == rid and out.finish_reason == "abort"
    assert not engine.has_unfinished() and engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_streamer_is_refused_with_beams(pair):
    _, paged, _ = pair
    ids, mask = left_padded(PROMPTS[:1])
    with pytest.raises(ValueError, match="beam search"):
        paged.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=2, streamer=object())


def test_a_group_split_by_the_token_budget_still_moves_in_lockstep(pair):
    """max_batch_tokens=3 < 4 beams: a step computes only some beams; the group decides once all
    its beams' logits are in, with the same result."""
    ref, paged, eos = pair
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(num_beams=4, num_return_sequences=2, max_new_tokens=NEW, eos_token_id=eos,
                  return_dict_in_generate=True, output_scores=True)  # fmt: skip
    expected = ref.generate(input_ids=ids, attention_mask=mask, **kwargs)
    config = PagedConfig(block_size=4, max_batch_tokens=3)
    actual = paged.generate(input_ids=ids, attention_mask=mask, paged_config=config, **kwargs)
    check_beams(ref, expected, actual, PROMPTS, 2)
