"""engine.load_weights / load_weights_from_dir: new weights in place, the prefix cache of the old ones dropped
(also for a request that began before the load and so holds the old K/V), greedy equal to sdpa on the new
weights; a bad name or shape loads nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.demo import DEMO_MODEL

PROMPT = list(range(3, 3 + 40))  # 40 ids: two full blocks of 16, cached after a first request


def perturbed(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` plus noise: other weights, same names and shapes."""
    g = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}


def greedy(engine: ContinuousBatchingEngine, ids: list[int], n: int) -> list[int]:
    return engine.generate([ids], max_new_tokens=n)[0].output_ids


def sdpa_greedy(weights: dict[str, torch.Tensor], ids: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


@pytest.fixture
def engine():
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=torch.float32).eval()
    config = PagedConfig(num_blocks=64, block_size=16, compile=False, enable_prefix_caching=True)
    with ContinuousBatchingEngine(model, config) as engine:
        yield engine


def test_load_weights_drops_the_old_prefix_cache_and_follows_the_new_weights(engine):
    before = greedy(engine, PROMPT, 8)
    assert engine.allocator.num_cached_blocks >= 2  # the prompt's full blocks are cached
    weights = perturbed(engine.model)
    assert engine.load_weights(weights) == len(weights)
    assert engine.allocator.num_cached_blocks == 0
    after = greedy(engine, PROMPT, 8)
    assert after == sdpa_greedy(weights, PROMPT, 8)
    assert after != before  # the check can fail: the new weights change the output


def test_a_request_whose_kv_began_before_a_reset_caches_nothing(engine):
    engine.add_request(PROMPT, max_new_tokens=40, request_id="old")
    for _ in range(3):
        engine.step()  # its prompt's blocks are computed, and cached
    assert engine.reset_prefix_cache() >= 2
    while engine.has_unfinished():
        engine.step()  # the blocks it fills now hold K/V that began before the reset: none joins the cache
    assert engine.allocator.num_cached_blocks == 0
    engine.allocator.check_invariants()


def test_what_a_request_recomputes_after_a_load_is_cached_under_the_new_weights(engine):
    engine.add_request(PROMPT, max_new_tokens=8, request_id="old")
    engine.step()
    weights = perturbed(engine.model, 1)
    engine.load_weights(weights)
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_cached_blocks >= 2  # its prompt, recomputed with the new weights
    assert greedy(engine, PROMPT, 8) == sdpa_greedy(weights, PROMPT, 8)


def test_load_weights_from_dir(engine, tmp_path):
    source = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    weights = perturbed(source, 2)
    source.load_state_dict(weights, strict=False)
    source.save_pretrained(tmp_path)
    greedy(engine, PROMPT, 4)
    assert engine.load_weights_from_dir(tmp_path) > 0
    assert greedy(engine, PROMPT, 8) == sdpa_greedy(weights, PROMPT, 8)


@pytest.mark.parametrize("bad", ["name", "shape"])
def test_a_bad_checkpoint_loads_nothing(engine, bad):
    name, param = next(iter(engine.model.named_parameters()))
    first = {name: param.detach() + 1}
    wrong = {"no.such.weight": param.detach()} if bad == "name" else {name: param.detach()[:1]}
    kept = param.detach().clone()
    with pytest.raises(ValueError, match="nothing was loaded"):
        engine.load_weights({**first, **wrong})
    assert torch.equal(param.detach(), kept)


def test_load_weights_from_a_directory_without_safetensors(engine, tmp_path):
    with pytest.raises(ValueError, match="no .safetensors"):
        engine.load_weights_from_dir(tmp_path)


def test_a_request_in_flight_recomputes_and_continues_on_the_new_weights(engine):
    engine.add_request(PROMPT, max_new_tokens=16, request_id="r")
    outputs = []
    for _ in range(4):
        outputs += engine.step()
    so_far = [t for out in outputs for t in out.new_ids]
    assert 0 < len(so_far) < 16
    weights = perturbed(engine.model, 3)
    engine.load_weights(weights)
    while engine.has_unfinished():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and len(final.output_ids) == 16 and final.output_ids[: len(so_far)] == so_far
    # every token after the load is new-weights greedy given the tokens before it (its K/V recomputed)
    rest = sdpa_greedy(weights, PROMPT + so_far, 16 - len(so_far))
    assert final.output_ids[len(so_far):] == rest
