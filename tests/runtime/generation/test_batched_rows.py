"""The engine's row state for processors that read the ids (``TokenHistory`` in the sampler) and its
lockstep batches: kept right through preemption and forks, released when requests finish, and a
failing caller's processor fails its batch instead of hanging it."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn_tools.testing import left_padded, load_pair, ragged_prompts, save_random_model, tiny_llama_config

PAD = 3
PROMPTS = ragged_prompts(6, 5, 40, seed=9)
OPTIONS = dict(repetition_penalty=1.4, no_repeat_ngram_size=2, min_new_tokens=6)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("llama")))


def _generate(model, paged_config: PagedConfig | None = None, **kwargs) -> torch.Tensor:  # noqa: ANN001, ANN003
    ids, mask = left_padded(PROMPTS, pad=PAD)
    extra = {"paged_config": paged_config} if paged_config is not None else {}
    return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=16, **extra, **kwargs)


def test_batched_processors_survive_preemption(pair) -> None:  # noqa: ANN001
    ref, paged = pair
    want = _generate(ref, do_sample=False, **OPTIONS)
    tight = PagedConfig(num_blocks=14, block_size=8, max_batch_tokens=64)  # a few rows at a time: preemptions
    engine_runs = []
    original = ContinuousBatchingEngine.collect

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = original(self, *args, **kwargs)
        self.sampler.release_finished()  # what its next step would do first
        engine_runs.append((self.scheduler.num_preemptions, len(self.sampler.history)))
        return out

    ContinuousBatchingEngine.collect = spy
    try:
        got = _generate(paged, tight, do_sample=False, **OPTIONS)
    finally:
        ContinuousBatchingEngine.collect = original
    (num_preemptions, num_tracked), = engine_runs
    assert num_preemptions > 0, "nothing was preempted: the test cannot fail"
    assert num_tracked == 0  # every finished request released its row
    assert torch.equal(got, want)


def test_batched_processors_with_forked_siblings(pair) -> None:  # noqa: ANN001
    ref, paged = pair
    kwargs = dict(do_sample=True, top_k=1, num_return_sequences=2, **OPTIONS)  # top_k=1 sampling: greedy draws
    assert torch.equal(_generate(paged, **kwargs), _generate(ref, **kwargs))


def test_history_rows_are_released_by_the_engine(pair) -> None:  # noqa: ANN001
    _, paged = pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64))
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, repetition_penalty=1.3)
    ids = engine.add_all([dict(input_ids=p, max_new_tokens=5, generation_config=config) for p in PROMPTS[:3]])
    doomed = engine.add_request(PROMPTS[3], max_new_tokens=50, generation_config=config)
    engine.step()
    engine.step()
    assert len(engine.sampler.history) == 4
    engine.abort(doomed)
    engine.step()  # the sampler gives back the aborted request's row at its next step
    assert len(engine.sampler.history) == 3
    engine.collect(ids)
    engine.sampler.release_finished()  # what its next step would do first
    assert len(engine.sampler.history) == 0


class Explodes(LogitsProcessor):
    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom")
        return scores


def test_a_failing_callers_processor_fails_the_lockstep_batch(pair) -> None:  # noqa: ANN001
    _, paged = pair
    with pytest.raises(RuntimeError, match="boom"):
        _generate(paged, do_sample=False, logits_processor=LogitsProcessorList([Explodes(at=3)]))


class Recorder(LogitsProcessor):
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.seen.append(input_ids.clone())
        return scores


def test_an_aborted_lockstep_row_is_padded_and_the_batch_goes_on(pair) -> None:  # noqa: ANN001
    from transformers import GenerationConfig

    from hf_paged_attn.integration.generate import _lockstep
    from hf_paged_attn.transformers_private import prepare_generation_config, prepare_special_tokens

    _, paged = pair
    ids, mask = left_padded(PROMPTS[:3], pad=PAD)
    config = prepare_generation_config(paged, GenerationConfig(do_sample=False, eos_token_id=255, pad_token_id=PAD))[0]
    prepare_special_tokens(paged, config, True, torch.device("cpu"))
    recorder = Recorder()
    batch = _lockstep(paged, config, ids, mask, 8, LogitsProcessorList([recorder]), None, None)
    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64), config)
    rids = engine.add_all([dict(input_ids=p, max_new_tokens=8, lockstep=batch) for p in PROMPTS[:3]])
    batch.bind([[engine.intake.live[rid]] for rid in rids])
    while len(recorder.seen) < 2:  # two steps of the batch
        engine.step()
    engine.abort(rids[1])  # between two steps of the batch
    finals = engine.collect(rids)
    assert [o.finish_reason for o in finals] == ["length", "abort", "length"]
    assert [len(o.output_ids) for o in finals] == [8, 2, 8]
    last = recorder.seen[-1]  # the batch's last step: the aborted row padded after its 2 tokens
    width = ids.shape[1]
    assert last.shape == (3, width + 7) and (last[1, width + 2 :] == PAD).all()
    assert last[1, width : width + 2].tolist() == finals[1].output_ids


def test_aborting_the_row_a_lockstep_batch_waits_for_does_not_hang_it(pair) -> None:  # noqa: ANN001
    from transformers import GenerationConfig

    from hf_paged_attn.integration.generate import _lockstep
    from hf_paged_attn.transformers_private import prepare_generation_config, prepare_special_tokens

    _, paged = pair
    prompts = [PROMPTS[0][:6], PROMPTS[1][:6], list(range(1, 41))]  # the long one prefills in chunks
    ids, mask = left_padded(prompts, pad=PAD)
    # EOS set (never emitted here): a finished row is padded (without EOS an aborted row fails its batch)
    config = prepare_generation_config(paged, GenerationConfig(do_sample=False, eos_token_id=0, pad_token_id=PAD))[0]
    prepare_special_tokens(paged, config, True, torch.device("cpu"))
    batch = _lockstep(paged, config, ids, mask, 6, LogitsProcessorList([Recorder()]), None, None)
    engine = ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, max_batch_tokens=16), config)
    rids = engine.add_all([dict(input_ids=p, max_new_tokens=6, lockstep=batch) for p in prompts])
    batch.bind([[engine.intake.live[rid]] for rid in rids])
    engine.step()
    assert set(batch.pending) == {0, 1} and not batch.ready()  # rows 0 and 1 wait for row 2
    engine.abort(rids[2])
    finals = {}
    for _ in range(50):  # bounded: a hung batch would step forever
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert [finals[r].finish_reason for r in rids] == ["length", "length", "abort"]
