"""Adaptive intra-op threads (``hf_paged_attn/runtime/cpu/threads.py``): the tuner measures every candidate
of a step-size bucket alternately, keeps the faster median, checks it again after ``remeasure_steps`` (the
other counts against the choice's recent steps) and starts over on ``reset``; the executor runs each step with
the chosen count, restores the caller's after it (a failing step too), starts over when the compiled graph
takes over; a model's later engines keep its measurements; the config switch; and greedy parity with sdpa of an
engine whose steps run on one thread or two."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu import attention as cpu_attention
from hf_paged_attn.runtime.cpu import threads as threads_module
from hf_paged_attn.runtime.cpu.threads import (
    EARLY_HOLD_STEPS,
    EARLY_TRIALS,
    RARE_STEPS,
    ThreadTunedExecutor,
    ThreadTuner,
    bucket,
    candidates,
    tuner_for,
)
from hf_paged_attn_tools.testing import compare_greedy, load_pair, ragged_prompts, reference_greedy

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_buckets_are_powers_of_two() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 64, 65, 512)] == [0, 0, 1, 2, 2, 3, 3, 4, 6, 7, 9]
    assert candidates(1) == (1,) and candidates(2) == (1, 2) and candidates(16) == (1, 16)


def test_the_tuner_alternates_then_keeps_the_faster_median() -> None:
    tuner = ThreadTuner((1, 2), trials=3, remeasure_steps=4)
    cost = {1: [1.0, 9.0, 1.0], 2: [2.0, 2.0, 2.0]}  # one slow outlier on 1 thread: the median ignores it
    seen = []
    for i in range(6):
        threads = tuner.choose(64)
        seen.append(threads)
        tuner.record(64, threads, cost[threads][i // 2])
    assert seen == [1, 2, 1, 2, 1, 2]
    assert tuner.choices() == {6: 1} and tuner.choose(64) == 1 and tuner.choose(33) == 1
    assert tuner.choose(65) == 1 and tuner.choices() == {6: 1}  # another bucket measures on its own
    tuner.record(65, 1, 5.0)
    assert tuner.choose(65) == 2
    for _ in range(4):  # after remeasure_steps steps on its choice, the bucket checks it again
        tuner.record(64, tuner.choose(64), 1.0)
    assert 6 not in tuner.choices()
    assert tuner.buckets[6].samples == {1: [1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2: []}  # the choice's own steps
    for _ in range(EARLY_TRIALS):  # the other count runs EARLY_TRIALS steps; the load changed: it wins now
        assert tuner.choose(64) == 2
        tuner.record(64, 2, 0.5)
    assert tuner.choices()[6] == 2
    tuner.reset()
    assert tuner.choices() == {} and tuner.buckets == {}


def test_a_clear_winner_decides_after_two_steps_each() -> None:
    """One thread 1.8x faster in every step (two threads on a loaded machine): the bucket decides after
    EARLY_TRIALS steps of each, not TRIALS; a choice of fewer threads than the most holds for EARLY_HOLD_STEPS
    timed steps (a moment's load on the other core may have made it), then the other count runs EARLY_TRIALS
    steps and the medians confirm or overturn it."""
    tuner = ThreadTuner((1, 2), trials=5)
    for threads, seconds in ((1, 0.20), (2, 0.36), (1, 0.19), (2, 0.35)):
        assert tuner.choose(200) == threads
        tuner.record(200, threads, seconds)
    assert tuner.choices() == {8: 1} and tuner.buckets[8].early
    for _ in range(EARLY_HOLD_STEPS - 1):
        tuner.record(200, tuner.choose(200), 0.2)
    assert tuner.choices() == {8: 1}
    tuner.record(200, 1, 0.2)  # the early choice has held long enough: the other count runs again
    assert tuner.choices() == {} and tuner.choose(200) == 2
    assert tuner.buckets[8].samples == {1: [0.2] * EARLY_HOLD_STEPS, 2: []}  # the held steps' timings
    tuner.record(200, 2, 0.1)  # the other core is free again: after EARLY_TRIALS steps the medians overturn it
    assert tuner.choices() == {} and tuner.choose(200) == 2
    tuner.record(200, 2, 0.15)
    assert tuner.choices() == {8: 2} and not tuner.buckets[8].early  # holds for remeasure_steps now
    kept = ThreadTuner((1, 2), trials=5)  # the same, with two threads still slower: confirmed
    for threads, seconds in ((1, 0.20), (2, 0.36), (1, 0.19), (2, 0.35)):
        kept.record(200, threads, seconds)
    for _ in range(EARLY_HOLD_STEPS):
        kept.record(200, kept.choose(200), 0.2)
    for _ in range(EARLY_TRIALS):
        assert kept.choose(200) == 2
        kept.record(200, 2, 0.3)
    assert kept.choices() == {8: 1} and not kept.buckets[8].early
    close = ThreadTuner((1, 2), trials=5)  # within the margin: it keeps measuring
    for threads, seconds in ((1, 0.22), (2, 0.20), (1, 0.21), (2, 0.19)):
        close.record(200, threads, seconds)
    assert close.choices() == {}


def test_a_clear_win_for_the_most_threads_holds_until_the_check() -> None:
    """Two threads 1.8x faster in every step: another process's load slows steps on more threads, not fewer, so
    the early choice holds for remeasure_steps at once; then the other count runs EARLY_TRIALS steps against the
    choice's last EARLY_HOLD_STEPS steps, and the choice stands (or falls) on their medians."""
    tuner = ThreadTuner((1, 2), trials=5, remeasure_steps=100)
    for threads, seconds in ((1, 0.36), (2, 0.20), (1, 0.35), (2, 0.19)):
        assert tuner.choose(200) == threads
        tuner.record(200, threads, seconds)
    assert tuner.choices() == {8: 2} and not tuner.buckets[8].early
    for i in range(99):  # far past EARLY_HOLD_STEPS, no step on one thread
        assert tuner.choose(200) == 2
        tuner.record(200, 2, 0.2 + i / 1e4)
    tuner.record(200, 2, 0.25)
    assert tuner.choices() == {} and tuner.choose(200) == 1
    held = tuner.buckets[8].samples
    assert held[1] == [] and len(held[2]) == EARLY_HOLD_STEPS and held[2][-1] == 0.25  # the recent ones only
    for _ in range(EARLY_TRIALS):
        assert tuner.choose(200) == 1
        tuner.record(200, 1, 0.4)
    assert tuner.choices() == {8: 2}  # confirmed after two steps on one thread, not TRIALS


def test_a_close_call_is_checked_again_after_the_early_hold() -> None:
    """Medians within CLEAR_MARGIN (a moment of load can tip them): the choice holds EARLY_HOLD_STEPS, not
    remeasure_steps, then the other count runs EARLY_TRIALS steps against the held timings; once the load is
    gone the faster count wins, by a clear margin, and holds for remeasure_steps."""
    tuner = ThreadTuner((1, 2), trials=3, remeasure_steps=1000)
    for threads, seconds in ((1, 0.30), (2, 0.33), (1, 0.31), (2, 0.32), (1, 0.30), (2, 0.34)):  # 2: a busy core
        tuner.record(64, threads, seconds)
    assert tuner.choices() == {6: 1} and tuner.buckets[6].early
    for _ in range(EARLY_HOLD_STEPS):
        tuner.record(64, tuner.choose(64), 0.30)
    assert tuner.choices() == {} and tuner.choose(64) == 2
    for _ in range(EARLY_TRIALS):
        tuner.record(64, tuner.choose(64), 0.20)  # the core is free again
    assert tuner.choices() == {6: 2} and not tuner.buckets[6].early


def test_a_rare_step_size_runs_what_its_measured_neighbours_agree_on() -> None:
    """Buckets 6 and 9 decided on two threads: a 183-token step (bucket 8) runs on two at once, and so does
    a step larger than any measured; below the smallest measured bucket, which chose two, nothing is implied;
    a bucket seen RARE_STEPS times measures itself."""
    tuner = ThreadTuner((1, 2), trials=2)
    for tokens in (64, 512):
        for threads, seconds in ((1, 0.4), (2, 0.2), (1, 0.4), (2, 0.2)):
            tuner.record(tokens, threads, seconds)
    assert tuner.choices() == {6: 2, 9: 2}
    assert tuner.inferred(183) == 2 and tuner.choose(183) == 2 and tuner.choose(2048) == 2
    assert tuner.inferred(8) is None and tuner.choose(8) == 1  # measures: one thread first
    for _ in range(RARE_STEPS):
        tuner.record(183, 2, 0.15)
    assert tuner.choose(183) == 1  # seen often enough: it measures the other count too
    tuner.record(183, 1, 0.3)
    tuner.record(183, 1, 0.3)
    assert tuner.choices()[8] == 2
    ones = ThreadTuner((1, 2), trials=2)  # the smallest measured chose one thread: smaller steps too
    for threads, seconds in ((1, 0.1), (2, 0.2), (1, 0.1), (2, 0.2)):
        ones.record(16, threads, seconds)
    assert ones.inferred(4) == 1 and ones.inferred(64) is None
    disagree = ThreadTuner((1, 2), trials=1)
    disagree.record(8, 1, 0.1), disagree.record(8, 2, 0.2), disagree.record(512, 1, 0.4), disagree.record(512, 2, 0.2)
    assert disagree.choices() == {3: 1, 9: 2} and disagree.inferred(64) is None


def test_the_tuner_refuses_bad_candidates() -> None:
    for bad in ((), (0, 2), (1, 2.0)):
        with pytest.raises(ValueError, match="candidates must be positive ints"):
            ThreadTuner(bad)


class Inner:
    """A stand-in executor: records the thread count of each call; ``graph_ready`` is settable."""

    def __init__(self, fail: bool = False) -> None:
        self.threads: list[int] = []
        self.fail = fail
        self.graph_ready = False
        self.closed = False

    def execute(self, step: object) -> torch.Tensor:
        self.threads.append(torch.get_num_threads())
        if self.fail:
            raise RuntimeError("step failed")
        return torch.zeros(1, 4)

    def close(self) -> None:
        self.closed = True


class Step:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens


def test_the_executor_sets_and_restores_the_count(two_threads) -> None:
    ticks = iter(range(1000))
    inner = Inner()
    executor = ThreadTunedExecutor(inner, (1, 2), clock=lambda: float(next(ticks)))
    for _ in range(4):
        executor.execute(Step(64))
        assert torch.get_num_threads() == 2
    assert inner.threads == [1, 2, 1, 2]
    assert executor.graph_ready is False  # the inner executor's attributes show through
    inner.graph_ready = True  # the compiled graph took over: the eager timings are forgotten
    executor.execute(Step(64))
    assert sum(len(s) for s in executor.tuner.buckets[6].samples.values()) == 1
    executor.close()
    assert inner.closed


def test_executors_that_share_a_tuner_keep_its_choices_and_its_phase(two_threads) -> None:
    """A second executor handed the first one's tuner (a model's later engine) runs a decided bucket's choice
    from its first step, without measuring the other count again; an executor whose forward is another one
    (eager where the tuner's timings are of the graph) starts the tuner over."""
    ticks = iter(range(1000))
    tuner = ThreadTuner((1, 2), trials=2)
    first_inner = Inner()
    first = ThreadTunedExecutor(first_inner, (1, 2), clock=lambda: float(next(ticks)), tuners=lambda _: tuner)
    first_inner.graph_ready = True
    for _ in range(4):
        first.execute(Step(64))
    assert first_inner.threads == [1, 2, 1, 2] and tuner.choices() == {6: 1}  # equal medians: the first wins
    later_inner = Inner()
    later_inner.graph_ready = True
    later = ThreadTunedExecutor(later_inner, (1, 2), tuners=lambda _: tuner)
    assert later.tuner is tuner
    for _ in range(3):
        later.execute(Step(64))
    assert later_inner.threads == [1, 1, 1] and tuner.choices() == {6: 1} and tuner.phase is True
    eager_inner = Inner()  # graph_ready False: its timings would be of the eager forward
    eager = ThreadTunedExecutor(eager_inner, (1, 2), tuners=lambda _: tuner)
    eager.execute(Step(64))
    assert tuner.choices() == {} and tuner.phase is False


def test_a_model_keeps_one_tuner_per_count_set_for_its_engines() -> None:
    """``tuner_for``: the same tuner for the same model and counts, another for other counts or another model;
    it goes with the model."""
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    tuner = tuner_for(model, (1, 2))
    assert tuner_for(model, (1, 2)) is tuner and tuner.candidates == (1, 2)
    assert tuner_for(model, (1, 4)) is not tuner and tuner_for(model, (1, 4)).candidates == (1, 4)
    assert tuner_for(other, (1, 2)) is not tuner
    held = len(threads_module._TUNERS)
    gone = weakref.ref(model)
    del model, tuner
    gc.collect()
    assert gone() is None and len(threads_module._TUNERS) == held - 1  # the registry held neither


def test_a_models_later_engine_starts_with_its_choices(llama_dir, two_threads) -> None:
    """``model.generate`` makes an engine per call: the second engine on a model takes the tuner the first
    measured with (a decided bucket's steps run its choice at once) and an engine on another model does not."""
    _, paged = load_pair(llama_dir)
    _, other = load_pair(llama_dir)
    prompts = ragged_prompts(6, 3, 30, seed=13)
    config = PagedConfig(num_blocks=64, compile=False)
    with ContinuousBatchingEngine(paged, config) as engine:
        engine.generate(prompts, max_new_tokens=12)
        tuner = engine.executor.tuner
        decided = tuner.choices()
    assert decided  # the decode bucket decided
    with ContinuousBatchingEngine(paged, config) as later:
        assert later.executor.tuner is tuner and tuner.choices() == decided
        samples = {k: {c: len(s) for c, s in b.samples.items()} for k, b in tuner.buckets.items() if k in decided}
        chosen: list[int] = []
        execute = later.executor.inner.execute

        def counting(step):  # noqa: ANN001, ANN202
            if bucket(step.num_tokens) in decided:
                chosen.append((decided[bucket(step.num_tokens)], torch.get_num_threads()))
            return execute(step)

        later.executor.inner.execute = counting
        later.generate(prompts, max_new_tokens=4)
    assert chosen and all(want == got for want, got in chosen)  # no measuring of the other count
    others = {k: {c: len(s) for c, s in b.samples.items() if c != decided[k]} for k, b in tuner.buckets.items()
              if k in decided}  # fmt: skip
    assert others == {k: {c: n for c, n in counts.items() if c != decided[k]} for k, counts in samples.items()}
    with ContinuousBatchingEngine(other, config) as fresh:
        assert fresh.executor.tuner is not tuner and fresh.executor.tuner.choices() == {}


def test_a_failing_step_restores_the_count(two_threads) -> None:
    executor = ThreadTunedExecutor(Inner(fail=True), (1, 2))
    with pytest.raises(RuntimeError, match="step failed"):
        executor.execute(Step(8))
    assert torch.get_num_threads() == 2


def test_config() -> None:
    with pytest.raises(ValueError, match="adaptive_threads must be None or a bool"):
        PagedConfig(adaptive_threads=1)
    with pytest.raises(ValueError, match="adaptive_threads=True is for models on the CPU; the model is on cuda"):
        PagedConfig(kernel="torch", adaptive_threads=True).resolved(torch.device("cuda"))
    assert PagedConfig().resolved(CPU).adaptive_threads is True
    assert PagedConfig(kernel="torch").resolved(torch.device("cuda")).adaptive_threads is False
    assert PagedConfig(adaptive_threads=False).resolved(CPU).adaptive_threads is False


def test_engine_greedy_equals_sdpa_on_one_thread_or_two(llama_dir, two_threads) -> None:
    """Every step runs on the count the tuner chose (both counts run while it measures), and the
    tokens equal sdpa's; with one thread, or switched off, there is no tuner."""
    ref, paged = load_pair(llama_dir)
    prompts = ragged_prompts(6, 3, 30, seed=11)
    expected = [reference_greedy(ref, p, 12) for p in prompts]
    with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, compile=False)) as engine:
        assert isinstance(engine.executor, ThreadTunedExecutor)
        got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=12)]
        tuner = engine.executor.tuner
        assert all(len(b.samples[1]) and len(b.samples[2]) for b in tuner.buckets.values() if b.choice is not None)
        assert tuner.choices()  # the decode bucket decided
    assert torch.get_num_threads() == 2
    assert not compare_greedy(ref, prompts, expected, got)
    with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, compile=False, adaptive_threads=False)) as engine:
        assert not isinstance(engine.executor, ThreadTunedExecutor)
    torch.set_num_threads(1)
    with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, compile=False)) as engine:
        assert not isinstance(engine.executor, ThreadTunedExecutor)


def test_compiled_engine_runs_every_count_on_one_graph(llama_dir, two_threads) -> None:
    """Dynamo guards on the thread count, so a one-thread step would compile its own graph on the
    engine's thread (seconds, with the loop stalled): instead the background compile makes one graph,
    at two threads, and every step enters it at that count while its body runs at the step's own
    (``compiled.STEP_THREADS``): the attention op, called from inside the graph, sees 1 and 2; no step
    compiles a graph; the tokens equal sdpa's."""
    from hf_paged_attn.runtime.cpu.compiled import CompiledExecutor

    ref, paged = load_pair(llama_dir)
    prompts = ragged_prompts(5, 3, 30, seed=12)
    expected = [reference_greedy(ref, p, 12) for p in prompts]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with ContinuousBatchingEngine(paged, PagedConfig(num_blocks=64, compile=True)) as engine:
        assert isinstance(engine.executor, ThreadTunedExecutor)
        inner = engine.executor.inner
        assert isinstance(inner, CompiledExecutor) and inner.thread_counts == (1, 2)
        assert engine.executor.wait(timeout=600) and engine.executor.failed is None
        assert inner.compiled.threads == 2
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        # one graph; none new when an earlier model of this shape made it (its weights are graph inputs
        # where they are not frozen, so its graph serves this model too). What matters is below.
        assert 0 <= compiled - graphs <= 1
        seen: list[int] = []
        cache = inner.eager.cache
        update = cache.update

        def counting_update(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            seen.append(torch.get_num_threads())
            return update(*args, **kwargs)

        lean = cpu_attention._lean_decode  # a decode step's layers skip cache.update

        def counting_lean(*args):  # noqa: ANN002, ANN202
            seen.append(torch.get_num_threads())
            return lean(*args)

        cache.update = counting_update
        cpu_attention._lean_decode = counting_lean
        try:
            got = [o.output_ids for o in engine.generate(prompts, max_new_tokens=12)]
        finally:
            del cache.update
            cpu_attention._lean_decode = lean
        assert inner.num_compiled_steps > 5
        assert {1, 2} <= {c for b in engine.executor.tuner.buckets.values() for c, s in b.samples.items() if s}
        assert set(seen) == {1, 2}  # the graph's body ran at each step's count
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled  # no step compiled one
    assert torch.get_num_threads() == 2
    assert not compare_greedy(ref, prompts, expected, got)


def test_a_caller_that_changes_the_count_gets_it_back(two_threads) -> None:
    inner = Inner()
    executor = ThreadTunedExecutor(inner, (1, 2))
    executor.execute(Step(4))
    torch.set_num_threads(3)
    executor.execute(Step(4))
    assert torch.get_num_threads() == 3 and executor.max_threads == 3 and executor.tuner.candidates == (1, 3)
