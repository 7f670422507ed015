"""One model over its life, called the ways users call it: ``generate``, ``generate_batch`` and the engine
inside ``torch.inference_mode()`` and ``torch.no_grad()`` and outside, a training step between calls,
``save_pretrained`` after generating, dtype moves, two models in two threads, switching
``attn_implementation``, the model's ``generation_config`` defaults, a streamer or processor that raises,
and a model its caller drops. Each call is checked against transformers' own ``sdpa`` on the same weights.

Device moves (``model.to("cuda")`` between calls) need a GPU: ``scripts/gpu_check`` runs them there.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.cpu.compiled import wait_compiled
from hf_paged_attn_tools.testing import (
    compare_greedy,
    left_padded,
    ragged_prompts,
    reference_greedy,
    save_random_model,
    tiny_llama_config,
    unpadded_rows,
)

NEW = 10
PROMPTS = ragged_prompts(4, 3, 24, seed=5)
EAGER = PagedConfig(compile=False)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    return save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("everyday"))


def load(directory: str, attn: str = "paged", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn, dtype=dtype).eval()


@pytest.fixture
def pair(weights):
    """A fresh (sdpa, paged) pair: the tests below change their model."""
    return load(weights, "sdpa"), load(weights)


def sdpa_rows(ref: torch.nn.Module, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    return [reference_greedy(ref, p, new) for p in prompts]


def assert_same(ref: torch.nn.Module, prompts: list[list[int]], actual: list[list[int]], new: int = NEW) -> None:
    problems = compare_greedy(ref, prompts, sdpa_rows(ref, prompts, new), actual)
    assert not problems, "\n".join(problems)


def via_generate(model: torch.nn.Module, prompts: list[list[int]], config: PagedConfig = EAGER) -> list[list[int]]:
    ids, mask = left_padded(prompts)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, paged_config=config)
    return unpadded_rows(out, ids.shape[1])


def via_generate_batch(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=NEW, do_sample=False))
    return [o.generated_tokens for o in out.values()]


def via_engine(model: torch.nn.Module, prompts: list[list[int]], config: PagedConfig = EAGER) -> list[list[int]]:
    with ContinuousBatchingEngine(model, config) as engine:
        return [o.output_ids for o in engine.generate(prompts, max_new_tokens=NEW)]


def every_call(model: torch.nn.Module, config: PagedConfig = EAGER) -> dict[str, list[list[int]]]:
    return {
        "generate": via_generate(model, PROMPTS, config),
        "generate_batch": via_generate_batch(model, PROMPTS),
        "engine": via_engine(model, PROMPTS, config),
    }


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad], ids=["inference_mode", "no_grad"])
def test_calls_inside_a_grad_mode_then_outside_equal_sdpa(pair, mode) -> None:
    ref, paged = pair
    with mode():
        inside = every_call(paged)
    outside = every_call(paged)
    for name, rows in [*inside.items(), *outside.items()]:
        assert_same(ref, PROMPTS, rows), name
    assert not any(t.is_inference() for t in [*paged.parameters(), *paged.buffers()])


def test_compiled_forward_made_inside_inference_mode_serves_every_later_call(pair) -> None:
    """The issue's snippet: the compiled forward set up (and run) under ``inference_mode`` left an inference
    tensor on the model, and every later call outside failed ("Inference tensors do not track version
    counter"), an assistant model's too."""
    ref, paged = pair
    compiled = PagedConfig(compile=True)
    with torch.inference_mode():
        assert_same(ref, PROMPTS, via_generate(paged, PROMPTS, compiled))
        assert wait_compiled(paged, timeout=600)
        assert_same(ref, PROMPTS, via_generate(paged, PROMPTS, compiled))  # through the graph
    assert not any(t.is_inference() for t in [*paged.parameters(), *paged.buffers()])
    assert_same(ref, PROMPTS, via_generate(paged, PROMPTS, compiled))
    assert_same(ref, PROMPTS, via_generate_batch(paged, PROMPTS))
    assert_same(ref, PROMPTS, via_engine(paged, PROMPTS, compiled))
    prompt = PROMPTS[0]
    out = paged.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, assistant_model=paged,
                         paged_config=compiled)  # fmt: skip
    assert_same(ref, [prompt], [out[0, len(prompt) :].tolist()])


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.eval()
    return loss.detach(), grads


def test_a_training_step_between_calls(pair) -> None:
    """Loss and gradients of a training forward equal sdpa's after generating, and the next call follows the
    new weights (a prefix cached before the step is not served after it)."""
    ref, paged = pair
    assert_same(ref, PROMPTS, via_generate(paged, PROMPTS))
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    want_loss, want_grads = loss_and_grads(ref, ids)
    loss, grads = loss_and_grads(paged, ids)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for model in (ref, paged):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    for rows in every_call(paged).values():
        assert_same(ref, PROMPTS, rows)



@pytest.mark.parametrize("how", ["optimizer_step", "replaced_data", "load_state_dict_assign"])
def test_one_engine_follows_weights_changed_between_its_steps(pair, how) -> None:
    """An engine kept open while its model's weights change (an RL loop's): in place by an optimizer, or each
    parameter given new tensors (``p.data = ...`` as DeepSpeed ZeRO-3 gathers do, ``assign=True``), which no
    version counter sees. The next request equals sdpa on the new weights, and no prefix cached on the old
    weights is served to it."""
    ref, paged = pair
    config = PagedConfig(compile=False, enable_prefix_caching=True)
    with ContinuousBatchingEngine(paged, config) as engine:
        first = [o.output_ids for o in engine.generate(PROMPTS, max_new_tokens=NEW)]
        assert_same(ref, PROMPTS, first)
        torch.manual_seed(3)
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in ref.state_dict().items()}
        ref.load_state_dict(new)
        with torch.no_grad():
            if how == "optimizer_step":
                for name, p in paged.named_parameters():
                    p.add_(new[name] - p)
            elif how == "replaced_data":
                for name, p in paged.named_parameters():
                    p.data = new[name].clone()
            else:
                paged.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)
        out = engine.generate(PROMPTS, max_new_tokens=NEW)
        assert all(o.num_cached_tokens == 0 for o in out), [o.num_cached_tokens for o in out]
        assert_same(ref, PROMPTS, [o.output_ids for o in out])
        again = engine.generate(PROMPTS, max_new_tokens=NEW)  # unchanged since: the prefix cache serves again
        assert any(o.num_cached_tokens > 0 for o in again)

def test_save_pretrained_after_generating(pair, tmp_path) -> None:
    ref, paged = pair
    before = {k: v.clone() for k, v in paged.state_dict().items()}
    with torch.inference_mode():
        via_generate(paged, PROMPTS, PagedConfig(compile=True))
    via_generate_batch(paged, PROMPTS)
    paged.save_pretrained(tmp_path / "paged")
    ref.save_pretrained(tmp_path / "sdpa")
    after = paged.state_dict()
    assert after.keys() == before.keys() == ref.state_dict().keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    reloaded = load(str(tmp_path / "paged"))
    assert {k: v.shape for k, v in reloaded.state_dict().items()} == {k: v.shape for k, v in before.items()}
    assert all(torch.equal(reloaded.state_dict()[k], before[k]) for k in before)
    assert_same(ref, PROMPTS, via_generate(reloaded, PROMPTS))


def test_dtype_moves_between_calls(pair) -> None:
    ref, paged = pair
    assert_same(ref, PROMPTS, via_generate(paged, PROMPTS))
    ref.to(torch.bfloat16), paged.to(torch.bfloat16)
    for rows in every_call(paged).values():
        assert_same(ref, PROMPTS, rows)
    ref.to(torch.float32), paged.to(torch.float32)
    assert all(p.dtype == torch.float32 for p in paged.parameters())
    for rows in every_call(paged).values():
        assert_same(ref, PROMPTS, rows)


def test_two_models_in_two_threads(weights, tmp_path) -> None:
    other = save_random_model(tiny_llama_config(), tmp_path, seed=1)
    models = {name: (load(d, "sdpa"), load(d)) for name, d in (("a", weights), ("b", other))}
    got: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            got[name] = [via_generate(models[name][1], PROMPTS), via_generate_batch(models[name][1], PROMPTS)]
        except Exception as exc:  # reported below, with the thread's name
            got[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    for name, (ref, _) in models.items():
        assert not isinstance(got[name], Exception), got[name]
        for rows in got[name]:
            assert_same(ref, PROMPTS, rows)
    assert via_generate(models["a"][1], PROMPTS) != via_generate(models["b"][1], PROMPTS)  # two models indeed


def test_switching_attn_implementation_and_back(pair) -> None:
    ref, paged = pair
    ids, mask = left_padded(PROMPTS)
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    via_generate(paged, PROMPTS)
    paged.set_attn_implementation("sdpa")
    torch.testing.assert_close(paged(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
    assert torch.equal(paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False), want)
    paged.set_attn_implementation("paged")
    for rows in every_call(paged).values():
        assert_same(ref, PROMPTS, rows)


def test_the_models_generation_config_defaults(pair) -> None:
    """``max_new_tokens`` and ``eos_token_id`` from ``model.generation_config`` apply as in transformers."""
    ref, paged = pair
    prompt = PROMPTS[1]
    greedy = reference_greedy(ref, prompt, 6)
    end = next(i for i in range(1, 6) if greedy[i] not in greedy[:i])  # a token whose first use ends generation
    stop = greedy[end]
    for model in (ref, paged):
        model.generation_config.max_new_tokens = 6
        model.generation_config.eos_token_id = stop
        model.generation_config.do_sample = False
    want = ref.generate(torch.tensor([prompt]))[0].tolist()
    assert len(want) == len(prompt) + end + 1 and want[-1] == stop
    assert paged.generate(torch.tensor([prompt]))[0].tolist() == want
    out = paged.generate_batch([prompt])
    assert [o.generated_tokens for o in out.values()] == [want[len(prompt) :]]
    with ContinuousBatchingEngine(paged, EAGER) as engine:
        assert [o.output_ids for o in engine.generate([prompt])] == [want[len(prompt) :]]


class Boom(Exception):
    pass


class RaisingStreamer(BaseStreamer):
    def __init__(self, after: int) -> None:
        self.calls = 0
        self.after = after

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls > self.after:
            raise Boom("the streamer failed")

    def end(self) -> None:
        pass


class RaisingProcessor(LogitsProcessor):
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > len(PROMPTS[0]) + 2:
            raise Boom("the processor failed")
        return scores


def test_a_streamer_or_processor_that_raises_then_the_next_call(pair) -> None:
    ref, paged = pair
    prompt = PROMPTS[0]
    with pytest.raises(Boom):
        paged.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, streamer=RaisingStreamer(3))
    with pytest.raises(Boom):
        paged.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                       logits_processor=LogitsProcessorList([RaisingProcessor()]))  # fmt: skip
    assert paged.training is False
    for rows in every_call(paged).values():
        assert_same(ref, PROMPTS, rows)


@pytest.mark.parametrize("call", ["generate", "generate_batch", "engine", "compiled"])
def test_a_model_its_caller_drops_is_freed(weights, call) -> None:
    model = load(weights)
    if call == "compiled":
        via_generate(model, PROMPTS, PagedConfig(compile=True))
    else:
        {"generate": via_generate, "generate_batch": via_generate_batch, "engine": via_engine}[call](model, PROMPTS)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
