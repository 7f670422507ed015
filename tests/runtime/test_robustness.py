"""Engine robustness beyond test_engine.py: abort of finished ids, refused generation options,
failures while sampling (batched rows, forked children), and many threads adding and aborting
while one thread streams. Every request gets exactly one terminal output and no block leaks."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.core.request import RequestOutput
from hf_paged_attn_tools.testing import ragged_prompts, reference_greedy


class RaiseOnCalls(LogitsProcessor):
    """A custom logits processor that raises on the given call numbers (1-based; None: always)."""

    def __init__(self, calls: set[int] | None = None) -> None:
        self.calls = calls
        self.num_calls = 0

    def __call__(self, input_ids, scores):
        self.num_calls += 1
        if self.calls is None or self.num_calls in self.calls:
            raise RuntimeError(f"processor failed on call {self.num_calls}")
        return scores


def finals_of(engine: ContinuousBatchingEngine) -> dict[str, RequestOutput]:
    return {o.request_id: o for o in engine.stream() if o.finished}


def assert_no_leak(engine: ContinuousBatchingEngine) -> None:
    engine.allocator.check_invariants()
    assert engine.allocator.num_used_blocks == 0, f"{engine.allocator.num_used_blocks} blocks leaked"
    assert not engine.has_unfinished() and not engine.intake.live


# ------------------------------------------------------------------------------------------- abort
def test_abort_of_an_id_whose_final_output_was_emitted_raises(llama_pair):
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    rid = engine.add_request([3, 4, 5], max_new_tokens=3, request_id="done")
    assert finals_of(engine)[rid].finish_reason == "length"
    with pytest.raises(ValueError, match="unknown request_id 'done'"):
        engine.abort(rid)
    # the engine forgot it: the id may be used again, and the new request runs normally
    engine.add_request([3, 4, 5], max_new_tokens=3, request_id="done")
    out = finals_of(engine)["done"]
    assert out.finish_reason == "length" and out.output_ids == reference_greedy(ref, [3, 4, 5], 3)
    assert_no_leak(engine)


def test_abort_of_a_finished_but_not_yet_emitted_request_returns_false(llama_pair, monkeypatch):
    """The window another thread can hit: finished in this step, final output not emitted yet."""
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    rid = engine.add_request([3, 4, 5], max_new_tokens=1)
    answers = []
    emit = engine.updater._emit

    def abort_then_emit(request):
        answers.append(engine.abort(request.request_id))
        return emit(request)

    monkeypatch.setattr(engine.updater, "_emit", abort_then_emit)
    outs = list(engine.stream())
    assert answers == [False]
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "length")]  # one terminal output
    assert_no_leak(engine)


def test_stale_abort_does_not_cancel_a_new_request_reusing_the_id(llama_pair, monkeypatch):
    """abort() lands while the step that finishes the request runs; the id is then reused. The
    pending abort belongs to the old request and must not cancel the new one."""
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    engine.add_request([3, 4, 5], max_new_tokens=1, request_id="x")
    forward = engine.executor.execute

    def abort_during_forward(meta):
        assert engine.abort("x")  # another thread's abort, while this step finishes "x"
        return forward(meta)

    monkeypatch.setattr(engine.executor, "execute", abort_during_forward)
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("x", "length")]
    monkeypatch.setattr(engine.executor, "execute", forward)
    engine.add_request([6, 7, 8], max_new_tokens=4, request_id="x")
    out = finals_of(engine)["x"]
    assert out.finish_reason == "length", f"the new 'x' was cancelled by the old one's abort ({out.finish_reason})"
    assert out.output_ids == reference_greedy(ref, [6, 7, 8], 4)
    assert_no_leak(engine)


def test_abort_of_forked_children_and_parent(llama_pair):
    """num_return_sequences children share the parent's blocks: aborting the parent and one child
    frees only their references; the last child finishes and then nothing is left."""
    _, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32, seed=0))
    config = GenerationConfig(do_sample=True, num_return_sequences=3, max_new_tokens=6)
    rid = engine.add_request(list(range(1, 11)), generation_config=config)
    engine.step()  # prefill + first token: parent and two children share the prompt's blocks
    assert engine.abort(rid) and engine.abort(f"{rid}#1")
    finals = finals_of(engine)
    assert finals[rid].finish_reason == "abort" and finals[f"{rid}#1"].finish_reason == "abort"
    assert finals[f"{rid}#2"].finish_reason == "length" and len(finals[f"{rid}#2"].output_ids) == 6
    assert_no_leak(engine)


# ---------------------------------------------------------------------------- unsupported options
def test_stop_strings_without_a_tokenizer_queue_nothing(llama_pair):
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    with pytest.raises(ValueError, match="stop_strings=.* needs the tokenizer"):
        engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=3, generation_config=GenerationConfig(stop_strings=["x"]))
    assert not engine.has_unfinished() and not engine.intake.live


@pytest.mark.parametrize(
    "options, name",
    [
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "group_beam_search"),
        (dict(penalty_alpha=0.6, top_k=4), "contrastive_search"),
        (dict(dola_layers="high"), "dola"),
        (dict(assistant_early_exit=1), "assisted"),
        (dict(force_words_ids=[[5, 6]], num_beams=2), "constrained"),
        (dict(guidance_scale=1.5), "guidance_scale"),
        (dict(encoder_repetition_penalty=1.3), "encoder_repetition_penalty"),
    ],
)
def test_unsupported_generation_option_at_add_request_queues_nothing(llama_pair, options, name):
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    with pytest.raises(NotImplementedError, match=name):
        engine.add_request([1, 2, 3], max_new_tokens=3, generation_config=GenerationConfig(**options))
    assert not engine.has_unfinished() and not engine.intake.live and engine.stats.num_waiting == 0
    with pytest.raises(NotImplementedError, match=name):  # engine.generate: refused before any step
        engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=3, generation_config=GenerationConfig(**options))
    assert not engine.has_unfinished() and not engine.intake.live
    good = engine.add_request([3, 4, 5], max_new_tokens=4)
    assert finals_of(engine)[good].output_ids == reference_greedy(ref, [3, 4, 5], 4)
    assert_no_leak(engine)


def test_engine_generate_with_one_bad_prompt_queues_none_of_them(llama_pair):
    """engine.generate refuses the whole batch: the prompts before the bad one must not stay queued
    (they would run, unseen, inside the next stream() or generate())."""
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 2, 3], [4, 5], []], max_new_tokens=3)
    assert not engine.has_unfinished() and not engine.intake.live, "prompts before the bad one stayed queued"
    (out,) = engine.generate([[6, 7]], max_new_tokens=3)
    assert out.output_ids == reference_greedy(ref, [6, 7], 3)
    assert_no_leak(engine)


# --------------------------------------------------------------------------- failures in sampling
def test_sampling_failure_leaves_other_rows_scores_intact(llama_pair):
    """When one row's processor raises, the step samples again row by row; the rows sampled before
    the failure must not record their scores/logits twice."""
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32))
    config = GenerationConfig(return_dict_in_generate=True, output_scores=True, output_logits=True)
    good = engine.add_request([1, 2, 3], max_new_tokens=4, generation_config=config)
    bad = engine.add_request(
        [4, 5, 6], max_new_tokens=4, generation_config=config, logits_processor=LogitsProcessorList([RaiseOnCalls()])
    )
    finals = finals_of(engine)
    assert finals[bad].finish_reason == "error" and "processor failed" in finals[bad].error
    out = finals[good]
    assert out.finish_reason == "length" and out.output_ids == reference_greedy(ref, [1, 2, 3], 4)
    assert len(out.scores) == len(out.logits) == 4, f"{len(out.scores)} scores for 4 tokens"
    assert_no_leak(engine)


def test_sampling_failure_of_a_forked_child_fails_only_that_child(llama_pair):
    """num_return_sequences: the parent samples fine, its child's first sample raises. The child
    finishes with "error"; the parent, its other requests in the step and the engine go on."""
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32, seed=0))
    config = GenerationConfig(do_sample=True, num_return_sequences=2, max_new_tokens=4)
    family = engine.add_request(
        [1, 2, 3, 4, 5], generation_config=config, logits_processor=LogitsProcessorList([RaiseOnCalls({2})])
    )
    other = engine.add_request([7, 8, 9], max_new_tokens=4)
    finals = finals_of(engine)  # the exception must not escape stream(), nor lose the step's state
    assert finals[f"{family}#1"].finish_reason == "error" and "call 2" in finals[f"{family}#1"].error
    assert finals[family].finish_reason == "length" and len(finals[family].output_ids) == 4
    assert finals[other].output_ids == reference_greedy(ref, [7, 8, 9], 4)
    assert_no_leak(engine)


def test_failing_block_copy_fails_that_step_not_the_engine(llama_pair, monkeypatch):
    """A failure while preparing a step (the copy-on-write block copy, building the batch) must
    fail that step's requests like a failing forward does, not escape step(): a retried step
    would read the never-copied block."""
    ref, paged = llama_pair
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=32, seed=0))
    config = GenerationConfig(do_sample=True, num_return_sequences=2, max_new_tokens=4)
    family = engine.add_request(list(range(1, 7)), generation_config=config)  # 6 tokens: a partial 2nd block
    engine.step()  # prefill and first tokens: parent and child share the partial block

    def broken_copy(pairs):
        if pairs:
            raise RuntimeError("simulated copy failure")

    monkeypatch.setattr(engine.cache, "copy_blocks", broken_copy)
    outs = engine.step()  # both write position 6, in the shared block: one copies it first
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [(family, "error"), (f"{family}#1", "error")]
    assert "simulated copy failure" in outs[0].error
    monkeypatch.undo()
    good = engine.add_request([3, 4, 5], max_new_tokens=5)
    assert finals_of(engine)[good].output_ids == reference_greedy(ref, [3, 4, 5], 5)
    assert_no_leak(engine)


def test_model_generate_raises_the_processors_own_error(llama_pair):
    _, paged = llama_pair
    with pytest.raises(RuntimeError, match=r"^processor failed on call 1$"):
        paged.generate(
            torch.tensor([[1, 2, 3]]), max_new_tokens=3, logits_processor=LogitsProcessorList([RaiseOnCalls()])
        )


# ------------------------------------------------------------------------------------------- threads
def test_threads_add_and_abort_while_one_thread_streams(llama_pair):
    """4 producer threads add 10 requests each and abort random ones (their own and others'),
    while this thread streams on a cache small enough to preempt, with prefix caching on.

    Every added request gets exactly one terminal output, which is its last; its streamed new ids
    add up to its final ids; finished requests match sdpa's greedy tokens and aborted ones are a
    prefix of them; and no block leaks."""
    ref, paged = llama_pair
    config = PagedConfig(block_size=4, num_blocks=16, max_num_seqs=6, max_batch_tokens=32, enable_prefix_caching=True)
    engine = ContinuousBatchingEngine(paged, config)
    shared = ragged_prompts(1, 8, 8, seed=31)[0]
    tails = ragged_prompts(40, 1, 10, seed=32)
    prompts = [(shared[: i % 9] + tail) for i, tail in enumerate(tails)]  # prefix hits on the shared head
    lock = threading.Lock()
    added: dict[str, tuple[list[int], int]] = {}
    abort_answers: dict[str, list[bool | str]] = defaultdict(list)
    errors: list[Exception] = []

    def producer(worker: int) -> None:
        rng = random.Random(worker)
        try:
            for i in range(worker, len(prompts), 4):
                max_new = rng.randint(1, 12)
                rid = engine.add_request(prompts[i], max_new_tokens=max_new)
                with lock:
                    added[rid] = (prompts[i], max_new)
                    known = list(added)
                if rng.random() < 0.4:
                    victim = rng.choice(known)
                    try:
                        answer: bool | str = engine.abort(victim)
                    except ValueError:
                        answer = "unknown"
                    with lock:
                        abort_answers[victim].append(answer)
                time.sleep(rng.random() * 0.01)
        except Exception as exc:  # reported by the streaming thread
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) or engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in engine.stream():
            outputs[out.request_id].append(out)
        time.sleep(0.001)
    for t in threads:
        t.join()
    assert not errors, errors

    assert set(outputs) == set(added) and len(added) == len(prompts)
    for rid, (prompt, max_new) in added.items():
        outs = outputs[rid]
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished, f"{rid}: terminal outputs"
        final = outs[-1]
        assert [t for o in outs for t in o.new_ids] == final.output_ids, f"{rid}: streamed ids disagree"
        want = reference_greedy(ref, prompt, max_new)
        if final.finish_reason == "abort":
            assert True in abort_answers[rid], f"{rid} aborted though no abort() returned True"
            assert final.output_ids == want[: len(final.output_ids)]
        else:
            assert final.finish_reason == "length", (rid, final.finish_reason, final.error)
            assert final.output_ids == want, f"{rid}: greedy tokens differ from sdpa"
        if "unknown" in abort_answers[rid]:  # abort() came after the final output
            assert final.finish_reason == "length" or True in abort_answers[rid]
    assert_no_leak(engine)


def test_seeded_sequences_draw_the_same_whatever_runs_beside_them(llama_pair):
    """``seed=`` with ``num_return_sequences``: each sequence has a generator of its own, so its
    tokens do not depend on the siblings or strangers the scheduler runs (or preempts) beside it."""
    _, paged = llama_pair
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, num_return_sequences=3)
    prompt = ragged_prompts(1, 9, 9, seed=21)[0]

    def run(engine: ContinuousBatchingEngine, crowd: int) -> list[list[int]]:
        ids = [engine.add_request(p, max_new_tokens=12) for p in ragged_prompts(crowd, 5, 20, seed=22)]
        mine = engine.add_request(prompt, max_new_tokens=12, generation_config=config, seed=5)
        outs = engine.collect([mine, *ids])
        return [o.output_ids for o in outs[:3]]

    alone = run(ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=256)), crowd=0)
    tight = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=24, max_batch_tokens=16))
    crowded = run(tight, crowd=6)
    assert tight.stats.num_preemptions > 0, "the crowd did not force a preemption"
    assert crowded == alone
    assert len({tuple(s) for s in alone}) > 1, "the sequences drew the same tokens: not independent"


def test_a_failing_neighbour_does_not_redraw_a_seeded_request(llama_pair):
    """A caller's processor that raises in a step fails its request alone: the seeded requests
    sampled in that step draw once, as they would alone (the whole step used to be resampled row by
    row after a failure, drawing their generators twice)."""
    _, paged = llama_pair

    class Boom(LogitsProcessor):
        def __call__(self, input_ids, scores):
            raise RuntimeError("boom")

    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0)
    prompt = ragged_prompts(1, 7, 7, seed=31)[0]
    alone = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64))
    want = alone.collect([alone.add_request(prompt, max_new_tokens=6, generation_config=config, seed=9)])[0]
    engine = ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=64))
    mine = engine.add_request(prompt, max_new_tokens=6, generation_config=config, seed=9)
    bad = engine.add_request(prompt, max_new_tokens=6, logits_processor=LogitsProcessorList([Boom()]))
    got, failed = engine.collect([mine, bad])
    assert failed.finish_reason == "error" and "boom" in failed.error
    assert got.output_ids == want.output_ids
