"""transformers' continuous-batching API on a "paged" model runs on our engine: ``generate_batch``,
``init_continuous_batching`` and its manager, with transformers' return types; weights changed
between calls (and during a pause) are honoured with prefix caching on; the model is left as found."""

from __future__ import annotations

import runpy
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

import hf_paged_attn.runtime.engine as engine_module
from hf_paged_attn.integration.cb_config import paged_config_from
from hf_paged_attn.integration.manager import PagedContinuousBatchingManager
from hf_paged_attn_tools.testing import load_pair, save_random_model, tiny_llama_config

TEXTS = ["The for statement", "A list is", "Exceptions are raised when", "The import statement", "Python is"]
GREEDY = GenerationConfig(max_new_tokens=12, do_sample=False)


@pytest.fixture(scope="module")
def prompts(demo) -> list[list[int]]:
    tokenizer, _, _ = demo
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def sdpa_greedy(ref: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int = 12) -> list[list[int]]:
    outs = []
    for p in prompts:
        out = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=max_new_tokens, do_sample=False)  # fmt: skip
        outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.fixture
def engine_spy(monkeypatch):
    """Counts our engine's steps: proves a call ran on the paged engine."""
    calls = []
    step = engine_module.ContinuousBatchingEngine.step
    monkeypatch.setattr(engine_module.ContinuousBatchingEngine, "step", lambda self: calls.append(1) or step(self))
    return calls


def test_generate_batch_greedy_equals_sdpa_generate(demo, prompts, engine_spy) -> None:  # noqa: ANN001
    _, paged, ref = demo
    out = paged.generate_batch(prompts, generation_config=GREEDY)
    assert list(out) == [f"req_{i}" for i in range(len(prompts))] and engine_spy
    assert all(isinstance(o, GenerationOutput) and o.status == RequestStatus.FINISHED for o in out.values())
    assert [o.prompt_ids for o in out.values()] == prompts
    assert [o.generated_tokens for o in out.values()] == sdpa_greedy(ref, prompts)
    assert all(o.logprobs == [] and o.error is None and o.lifespan[1] >= o.lifespan[0] > 0 for o in out.values())


def test_logprobs_are_log_softmax_of_sdpas_logits(demo, prompts) -> None:  # noqa: ANN001
    _, paged, ref = demo
    out = paged.generate_batch(prompts[:3], generation_config=GREEDY, max_new_tokens=8,
                               continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True))  # fmt: skip
    for o in out.values():
        ids = torch.tensor([o.prompt_ids + o.generated_tokens])
        with torch.no_grad():
            logits = ref(ids).logits[0, len(o.prompt_ids) - 1 : -1].float()  # [new, vocab]: each token's logits
        want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(o.generated_tokens)[:, None])[:, 0]
        assert len(o.logprobs) == len(o.generated_tokens)
        torch.testing.assert_close(torch.tensor(o.logprobs), want, atol=1e-5, rtol=0)


def test_sampling_with_num_return_sequences(demo, prompts) -> None:  # noqa: ANN001
    _, paged, _ = demo
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.9, num_return_sequences=3)
    cb = ContinuousBatchingConfig(seed=7)
    out = paged.generate_batch(prompts[:2], generation_config=config, continuous_batching_config=cb)
    assert list(out) == ["req_0__child#0", "req_0__child#1", "req_0", "req_1__child#0", "req_1__child#1", "req_1"]
    assert all(len(o.generated_tokens) == 6 for o in out.values())
    assert out["req_0__child#0"].prompt_ids == prompts[0] and out["req_1"].prompt_ids == prompts[1]
    assert len({tuple(o.generated_tokens) for o in out.values()}) > 2  # the sequences sample apart
    again = paged.generate_batch(prompts[:2], generation_config=config, continuous_batching_config=cb)
    assert {k: o.generated_tokens for k, o in again.items()} == {k: o.generated_tokens for k, o in out.items()}


def test_manager_start_add_iterate_cancel_stop(demo, prompts) -> None:  # noqa: ANN001
    _, paged, ref = demo
    manager = paged.init_continuous_batching(generation_config=GREEDY)
    assert isinstance(manager, PagedContinuousBatchingManager) and not manager.is_running()
    manager.start()
    try:
        assert manager.is_running()
        ids = manager.add_requests(prompts[:3])
        streamed = manager.add_request(prompts[3], request_id="mine", streaming=True)
        doomed = manager.add_request(prompts[4], max_new_tokens=500)
        manager.cancel_request(doomed)
        steps = list(manager.request_id_iter(streamed))
        assert [len(s.generated_tokens) for s in steps] == list(range(1, 13))
        assert [s.status for s in steps] == [RequestStatus.DECODING] * 11 + [RequestStatus.FINISHED]
        finals = {}
        while len(finals) < 3:
            result = manager.get_result(timeout=10)
            assert result is not None and result.request_id != doomed
            finals[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True, timeout=30)
    assert not manager.is_running() and manager.get_result(timeout=0.1) is None  # the cancelled one gave nothing
    want = sdpa_greedy(ref, prompts[:4])
    assert [finals[i] for i in ids] == want[:3] and steps[-1].generated_tokens == want[3]
    assert manager.add_request(prompts[0]) is None  # a stopped manager drops requests until it starts again
    manager.destroy()



def test_a_hard_stop_fails_what_is_still_running(demo, prompts) -> None:  # noqa: ANN001
    """``stop(hard_stop=True)``: every request not finished gets a FAILED output with transformers' message,
    and its blocks go back (the engine closes with the session)."""
    _, paged, _ = demo
    manager = paged.init_continuous_batching(generation_config=GREEDY)
    manager.start()
    try:
        with manager.pause():  # none can finish before the stop: the loop is held, and a stop overrides the hold
            ids = manager.add_requests(prompts[:3], max_new_tokens=500)
            other = threading.Thread(target=manager.stop, kwargs={"block": False, "hard_stop": True})
            other.start()
            other.join(timeout=30)
    finally:
        manager.stop(block=True, timeout=30, hard_stop=True)
    results = {}
    while (result := manager.get_result(timeout=0.1)) is not None:
        results[result.request_id] = result
    assert sorted(results) == sorted(ids)
    for result in results.values():
        assert result.status == RequestStatus.FAILED and "finished before this request completed" in result.error
    manager.destroy()

def test_context_manager_and_persistent_manager(demo, prompts) -> None:  # noqa: ANN001
    _, paged, ref = demo
    with paged.continuous_batching_context_manager(generation_config=GREEDY) as manager:
        rid = manager.add_request(prompts[0])
        result = next(r for r in manager.request_id_iter(rid) if r.is_finished())
    assert not manager.is_running() and result.generated_tokens == sdpa_greedy(ref, prompts[:1])[0]
    first = paged.generate_batch(prompts[:2], generation_config=GREEDY, persistent_manager=True)
    cached = paged.init_continuous_batching()
    assert isinstance(cached, PagedContinuousBatchingManager) and cached.engine is None  # no engine kept
    second = paged.generate_batch(prompts[:2], generation_config=GREEDY)  # runs on the cached manager
    assert [o.generated_tokens for o in second.values()] == [o.generated_tokens for o in first.values()]
    paged.destroy_cached_continuous_batching_manager()
    assert paged.init_continuous_batching() is not cached


@pytest.fixture
def fresh_pair(tmp_path):
    """A tiny Llama whose weights the test changes (not the session-wide models)."""
    return load_pair(save_random_model(tiny_llama_config(), tmp_path))


def _perturb(models: tuple[torch.nn.Module, ...], scale: float, data: bool) -> None:
    """The same in-place weight update on each model: through the version counter (an optimizer's
    way) or through ``.data`` (invisible to it)."""
    for model in models:
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in model.parameters():
                noise = torch.randn(p.shape, generator=gen) * scale
                (p.data if data else p).add_(noise)


@pytest.mark.parametrize("data", [False, True], ids=["optimizer-like", "through-data"])
def test_weights_updated_between_calls_are_honoured(fresh_pair, data) -> None:  # noqa: ANN001
    ref, paged = fresh_pair
    prompts = [list(range(1, 40)), list(range(1, 40)) + [7, 8], list(range(1, 40)) + [9]]  # shared prefix
    cb = ContinuousBatchingConfig(allow_block_sharing=True, page_size=8)
    before = paged.generate_batch(prompts, generation_config=GREEDY, continuous_batching_config=cb,
                                  persistent_manager=True)  # fmt: skip
    assert [o.generated_tokens for o in before.values()] == sdpa_greedy(ref, prompts)
    _perturb((ref, paged), 0.05, data)
    after = paged.generate_batch(prompts, generation_config=GREEDY, continuous_batching_config=cb)
    want = sdpa_greedy(ref, prompts)
    assert want != [o.generated_tokens for o in before.values()], "the update changed nothing: the test cannot fail"
    assert [o.generated_tokens for o in after.values()] == want
    plain = paged.generate(torch.tensor(prompts[:1]), max_new_tokens=12, do_sample=False)
    assert plain[0, len(prompts[0]) :].tolist() == want[0]
    paged.destroy_cached_continuous_batching_manager()


def test_weights_updated_in_a_pause_are_honoured(fresh_pair) -> None:  # noqa: ANN001
    ref, paged = fresh_pair
    prefix = list(range(1, 40))
    manager = paged.init_continuous_batching(
        generation_config=GREEDY, continuous_batching_config=ContinuousBatchingConfig(page_size=8)
    )
    manager.start()
    try:
        first = manager.add_request(prefix + [5])
        before = next(r for r in manager.request_id_iter(first) if r.is_finished()).generated_tokens
        with manager.pause(), manager.pause():  # pauses nest
            _perturb((ref, paged), 0.05, data=True)
            with pytest.raises(RuntimeError, match="inside a pause"):
                manager.stop()
        second = manager.add_request(prefix + [5])  # the same prompt: its prefix was cached before the pause
        after = next(r for r in manager.request_id_iter(second) if r.is_finished()).generated_tokens
    finally:
        manager.stop(timeout=30)
    want = sdpa_greedy(ref, [prefix + [5]])[0]
    assert want != before and after == want


def test_the_model_is_left_as_found(demo, prompts) -> None:  # noqa: ANN001
    _, paged, _ = demo
    paged.train()
    try:
        seen = []
        hook = paged.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(m.training))
        paged.generate_batch(prompts[:2], generation_config=GREEDY)
        paged.generate(torch.tensor(prompts[:1]), max_new_tokens=3)
        with paged.continuous_batching_context_manager(generation_config=GREEDY) as manager:
            rid = manager.add_request(prompts[0])
            next(r for r in manager.request_id_iter(rid) if r.is_finished())
        hook.remove()
        assert seen and not any(seen)  # generation ran in eval mode (dropout off), as transformers' engine
        assert paged.training and all(m.training for m in paged.modules())
        assert paged.config._attn_implementation == "paged"
    finally:
        paged.eval()


def test_other_attention_keeps_transformers_engine(tmp_path) -> None:
    model = AutoModelForCausalLM.from_pretrained(save_random_model(tiny_llama_config(), tmp_path),
                                                 attn_implementation="sdpa")  # fmt: skip
    manager = model.init_continuous_batching(generation_config=GREEDY)
    assert isinstance(manager, ContinuousBatchingManager)


def test_continuous_batching_config_maps_or_refuses_by_name() -> None:
    config, options = paged_config_from(ContinuousBatchingConfig(
        page_size=16, num_blocks=99, max_batch_tokens=128, max_requests_per_batch=7, max_memory_percent=0.3,
        allow_block_sharing=False, scheduler_type="fifo", seed=5, use_cuda_graph=(True, False), return_logprobs=True,
        use_async_batching=True, default_compile_level=2, cpu_offload_space=1.0,
    ))  # fmt: skip
    assert (config.block_size, config.num_blocks, config.max_batch_tokens, config.max_num_seqs) == (16, 99, 128, 7)
    assert (config.memory_fraction, config.enable_prefix_caching, config.scheduling_policy) == (0.3, False, "fcfs")
    assert (config.seed, config.cuda_graphs, options.return_logprobs) == (5, False, True)
    assert paged_config_from(ContinuousBatchingConfig())[0].block_size is None  # transformers' default: the kernel's
    with pytest.raises(NotImplementedError, match="scheduler_type='prefill_first'"):
        paged_config_from(ContinuousBatchingConfig(scheduler_type="prefill_first"))


def test_rl_loop_example_runs(monkeypatch, capsys) -> None:  # noqa: ANN001
    example = Path(__file__).parents[1] / "examples" / "rl_loop.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--steps", "2", "--samples", "2"])
    runpy.run_path(str(example), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"] and all("training=True" in x for x in lines)


def test_generate_batch_takes_generation_options_and_refuses_the_rest(demo, prompts) -> None:  # noqa: ANN001
    _, paged, ref = demo
    out = paged.generate_batch(prompts[:2], max_new_tokens=3, do_sample=False)
    assert [o.generated_tokens for o in out.values()] == sdpa_greedy(ref, prompts[:2], 3)
    with pytest.raises(TypeError, match="not_an_option"):
        paged.generate_batch(prompts[:2], not_an_option=1)
    with pytest.raises(NotImplementedError, match="scheduler_type"):
        refused = ContinuousBatchingConfig(scheduler_type="prefill_first")
        paged.generate_batch(prompts[:2], continuous_batching_config=refused)
    assert paged.generate_batch([]) == {}
