"""Engine behaviour: abort, sampling, num_return_sequences, streaming, bad input."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import GenerationConfig

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn_tools.testing import (
    load_pair,
    ragged_prompts,
    reference_greedy,
    save_random_model,
    tiny_llama_config,
)

from .test_speculative_units import assert_distributed


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    # 16 tokens, weights large enough that the probabilities spread (0.2 down to 0.006): a thousand
    # draws pin the distribution down
    config = tiny_llama_config(vocab_size=16, initializer_range=0.15)
    return load_pair(save_random_model(config, tmp_path_factory.mktemp("vocab16")))


def test_abort_frees_blocks_and_others_finish(llama_pair):
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64))
    prompts = ragged_prompts(3, 4, 12, seed=11)
    ids = [engine.add_request(p, max_new_tokens=10) for p in prompts]
    engine.step()
    engine.step()
    assert engine.abort(ids[1])
    finals = {}
    for out in engine.stream():
        if out.finished:
            finals[out.request_id] = out
    assert finals[ids[1]].finish_reason == "abort"
    assert len(finals[ids[1]].output_ids) < 10
    for i in (0, 2):
        assert finals[ids[i]].output_ids == reference_greedy(ref, prompts[i], 10)
    assert engine.allocator.num_free_blocks == 64
    with pytest.raises(ValueError, match="unknown request_id"):
        engine.abort(ids[1])


def test_abort_of_waiting_request(llama_pair):
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64))
    rid = engine.add_request([1, 2, 3], max_new_tokens=5)
    engine.abort(rid)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")]
    assert not engine.has_unfinished()


def sample(paged, seed: int, n: int = 6):
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=128, seed=seed))
    config = GenerationConfig(do_sample=True, temperature=1.3, top_k=50, top_p=0.95)
    outs = engine.generate(ragged_prompts(n, 3, 10, seed=2), max_new_tokens=12, generation_config=config)
    return [o.output_ids for o in outs]


def test_sampling_is_reproducible(llama_pair):
    _, paged = llama_pair
    assert sample(paged, 123) == sample(paged, 123)
    assert sample(paged, 123) != sample(paged, 124)


def test_generate_sampling_follows_torch_manual_seed(llama_pair):
    _, paged = llama_pair
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.manual_seed(0)
    a = paged.generate(ids, do_sample=True, max_new_tokens=10)
    torch.manual_seed(0)
    b = paged.generate(ids, do_sample=True, max_new_tokens=10)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "options",
    [dict(temperature=0.7), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2), dict(temperature=1.5, top_k=5)],
)
def test_sampling_distribution_matches_processors(tiny_vocab_pair, options):
    """First-token frequencies over many requests match the distribution that transformers'
    own processors define for the same logits (Pearson's chi-square at p ~ 3e-5)."""
    ref, paged = tiny_vocab_pair
    prompt = [7, 8, 9, 10]
    config = GenerationConfig(do_sample=True, **options)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[:, -1].float()
    processors = ref._get_logits_processor(generation_config=config, input_ids_seq_length=len(prompt))
    expected = torch.softmax(processors(torch.tensor([prompt]), logits.clone()), dim=-1)[0]
    n = 1000
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=n, max_num_seqs=512, seed=0))
    outs = engine.generate([prompt] * n, max_new_tokens=1, generation_config=config)
    counts = torch.bincount(torch.tensor([o.output_ids[0] for o in outs]), minlength=expected.numel())
    assert_distributed(counts, expected)  # filtered tokens never appear, the others as often as expected
    assert (expected > 0).sum() > 1  # the options leave a real choice: the test can fail


def test_num_return_sequences_share_prompt_blocks(llama_pair):
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64, seed=0))
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + a partial one
    config = GenerationConfig(do_sample=True, num_return_sequences=4, max_new_tokens=6)
    rid = engine.add_request(prompt, generation_config=config)
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted([rid, f"{rid}#1", f"{rid}#2", f"{rid}#3"])
    family = [engine.intake.live[o.request_id] for o in outs]
    full_blocks = family[0].block_ids[:2]
    assert all(r.block_ids[:2] == full_blocks for r in family)
    assert all(engine.allocator.ref_count(b) == 4 for b in full_blocks)
    finals = [o for o in engine.stream() if o.finished]
    assert len(finals) == 4 and all(len(o.output_ids) == 6 for o in finals)
    assert engine.allocator.num_free_blocks == 64


def test_num_return_sequences_through_generate(llama_pair):
    _, paged = llama_pair
    torch.manual_seed(0)
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    out = paged.generate(ids, do_sample=True, num_return_sequences=3, max_new_tokens=5)
    assert out.shape == (6, 10)
    assert torch.equal(out[:3, :5], ids[0].expand(3, 5)) and torch.equal(out[3:, :5], ids[1].expand(3, 5))


def test_requests_added_from_threads_while_streaming(llama_pair):
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=256))
    prompts = ragged_prompts(24, 2, 8, seed=4)
    first = engine.add_request(prompts[0], max_new_tokens=30)
    added = [first]
    lock = threading.Lock()

    def producer(chunk):
        for p in chunk:
            rid = engine.add_request(p, max_new_tokens=4)
            with lock:
                added.append(rid)

    threads = [threading.Thread(target=producer, args=(prompts[1 + i :: 3],)) for i in range(3)]
    for t in threads:
        t.start()
    finals = [o.request_id for o in engine.stream() if o.finished]  # producers add meanwhile
    for t in threads:
        t.join()
    finals += [o.request_id for o in engine.stream() if o.finished]  # whatever came after the first drain
    assert sorted(finals) == sorted(added) and len(added) == 24


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "empty"),
        ([1, 2, 999], {}, "outside the vocabulary"),
        ([1, -2], {}, "outside the vocabulary"),
        ([1.5, 2], {}, "must be ints"),
        (torch.tensor([1.0, 2.0]), {}, "dtype"),
        (list(range(1, 256)) * 3, {}, "max_position_embeddings"),
        ([1, 2], {"max_new_tokens": 0}, "positive"),
        ([1, 2], {"max_new_tokens": -3}, "positive"),
        ([1, 2], {"max_new_tokens": 500}, "blocks"),
        ([1, 2], {"max_new_tokens": 2.5}, "positive int"),
        ([1, 2], {"max_new_tokens": True}, "positive int"),
        ([True, 2], {}, "must be ints"),
        ("hello", {}, "must be ints"),
        (torch.tensor([[1, 2], [3, 4]]), {}, "1-D"),
        (torch.tensor([True, False]), {}, "dtype"),
        ([1, 2], {"request_id": "taken"}, "already in use"),
        ([1, 2], {"generation_config": GenerationConfig(num_beams=4, num_beam_groups=2)}, "group_beam_search"),
        ([1, 2], {"max_new_tokens": 40, "generation_config": GenerationConfig(num_beams=4)}, "44 blocks"),
        ([1, 2], {"generation_config": GenerationConfig(stop_strings=["x"])}, "needs the tokenizer"),
        ([1, 2], {"logprobs": -1}, "logprobs"),
        ([1, 2], {"priority": 1.5}, "priority"),
        ([1, 2], {"seed": "s"}, "seed"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(llama_pair, prompt, kwargs, message):
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    good = engine.add_request([3, 4, 5], max_new_tokens=5, request_id="taken")
    error = NotImplementedError if "num_beam_groups" in str(kwargs) else ValueError
    with pytest.raises(error, match=message):
        engine.add_request(prompt, **kwargs)
    outs = [o for o in engine.stream() if o.finished]
    assert [o.request_id for o in outs] == [good]
    assert outs[0].output_ids == reference_greedy(ref, [3, 4, 5], 5)


def test_a_forked_sequence_id_is_reserved_when_its_parent_is_added(llama_pair):
    """Request "a" with num_return_sequences=2 will fork "a#1": nobody else may take that id."""
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32, seed=0))
    config = GenerationConfig(do_sample=True, num_return_sequences=2)
    engine.add_request([1, 2, 3], max_new_tokens=3, generation_config=config, request_id="a")
    with pytest.raises(ValueError, match="'a#1' is already in use"):
        engine.add_request([4, 5], max_new_tokens=3, request_id="a#1")
    engine.add_request([4, 5], max_new_tokens=3, request_id="b#1")
    with pytest.raises(ValueError, match="forked sequence 'b#1'"):  # and the other way round
        engine.add_request([1, 2], max_new_tokens=3, generation_config=config, request_id="b")
    finals = [o for o in engine.stream() if o.finished]
    assert sorted((o.request_id, o.parent_id, o.index) for o in finals) == [
        ("a", None, 0), ("a#1", "a", 1), ("b#1", None, 0)
    ]


def test_automatic_ids_count_one_by_one(llama_pair):
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    assert [engine.add_request([1, 2], max_new_tokens=1) for _ in range(3)] == ["req-0", "req-1", "req-2"]


def test_duplicate_request_id(llama_pair):
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    engine.add_request([1, 2], max_new_tokens=2, request_id="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request([1, 2], max_new_tokens=2, request_id="a")


def test_failing_forward_fails_only_that_step(llama_pair, monkeypatch):
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    bad = engine.add_request([1, 2, 3], max_new_tokens=4)
    original = engine.executor.execute

    def boom(meta):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(engine.executor, "execute", boom)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(bad, "error")]
    assert "simulated device failure" in outs[0].error
    assert engine.allocator.num_free_blocks == 32
    monkeypatch.setattr(engine.executor, "execute", original)
    good = engine.add_request([3, 4, 5], max_new_tokens=5)
    finals = [o for o in engine.stream() if o.finished]
    assert [o.request_id for o in finals] == [good]
    assert finals[0].output_ids == reference_greedy(ref, [3, 4, 5], 5)


def test_engine_refuses_non_paged_model(llama_pair):
    ref, _ = llama_pair
    with pytest.raises(ValueError, match="attn_implementation=\"paged\""):
        ContinuousBatchingEngine(ref)


def test_failing_logits_processor_fails_only_its_request(llama_pair):
    from transformers import LogitsProcessor, LogitsProcessorList

    class Explode(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > 6:
                raise ValueError("processor exploded")
            return scores

    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64))
    bad = engine.add_request([1, 2, 3, 4], max_new_tokens=8, logits_processor=LogitsProcessorList([Explode()]))
    good = engine.add_request([5, 6, 7], max_new_tokens=8)
    finals = {o.request_id: o for o in engine.stream() if o.finished}
    assert finals[bad].finish_reason == "error" and "processor exploded" in finals[bad].error
    assert finals[good].output_ids == reference_greedy(ref, [5, 6, 7], 8)
    assert engine.allocator.num_used_blocks == 0


def test_cache_sized_from_memory_when_num_blocks_is_none(llama_pair):
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=16, max_num_seqs=4))
    # capped at what max_num_seqs full-length (512-token) sequences can use
    assert engine.allocator.num_blocks == 4 * 512 // 16
    assert len(engine.generate([[1, 2, 3]], max_new_tokens=3)[0].output_ids) == 3


def test_stopping_criteria_see_their_own_row(llama_pair):
    """Each request's criterion gets its own raw logits row: for greedy requests without processors, the row whose
    argmax is the token just appended (requests in one step sit in different rows of the step's logits)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Record(StoppingCriteria):
        def __init__(self) -> None:
            self.calls: list[tuple[int, int, tuple[int, ...]]] = []  # (last id, argmax of scores, scores' shape)

        def __call__(self, input_ids, scores, **kwargs):  # noqa: ANN001, ANN003
            self.calls.append((int(input_ids[0, -1]), int(scores.argmax(-1)), tuple(scores.shape)))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64))
    criteria = {engine.add_request(prompt, max_new_tokens=6, stopping_criteria=StoppingCriteriaList([c])): c
                for prompt, c in (([1, 2, 3, 4], Record()), ([9, 8, 7], Record()), ([5, 11, 6, 2, 13], Record()))}
    finals = {o.request_id: o for o in engine.stream() if o.finished}
    vocab = paged.config.vocab_size
    for request_id, criterion in criteria.items():
        assert len(criterion.calls) == len(finals[request_id].output_ids) == 6
        assert all(shape == (1, vocab) for _, _, shape in criterion.calls)
        assert [last for last, _, _ in criterion.calls] == finals[request_id].output_ids
        assert all(last == best for last, best, _ in criterion.calls), criterion.calls


def test_generate_emits_only_final_outputs(llama_pair):
    """``engine.generate`` collects finished requests only: its requests make no output object while they run
    (``Request.final_only``), their final outputs hold every token (``new_ids`` too), the same as streamed
    requests' tokens; a request streamed beside them still gets one output a step."""
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=128))
    prompts = ragged_prompts(5, 3, 9, seed=7)
    streamed_ids = [engine.add_request(p, max_new_tokens=6) for p in prompts]
    streamed = {o.request_id: o for o in engine.stream() if o.finished}
    seen = []
    step = engine.step

    def recording():
        outputs = step()
        seen.extend(outputs)
        return outputs

    engine.step = recording
    beside = engine.add_request(prompts[0], max_new_tokens=4, ignore_eos=True)
    outs = engine.generate(prompts, max_new_tokens=6)
    generated = {o.request_id for o in outs}
    assert seen and all(o.finished for o in seen if o.request_id in generated)
    assert len([o for o in seen if o.request_id == beside]) == 4  # one output a step for the streamed one
    assert [o.output_ids for o in outs] == [streamed[rid].output_ids for rid in streamed_ids]
    assert all(o.new_ids == o.output_ids and o.output_ids for o in outs)
