"""LoRA adapters per request: the engine and PEFT's own API on a paged base model, against PEFT on sdpa."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn_tools.testing import (  # noqa: E402
    compare_greedy,
    left_padded,
    ragged_prompts,
    reference_greedy,
    save_random_lora,
)

NEW = 8
ADAPTERS = {
    # rank, scaling and target modules differ; b's dropout is off at inference, its scale alpha/sqrt(r)
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=1),
    "b": dict(
        r=4, lora_alpha=8, use_rslora=True, lora_dropout=0.1, target_modules=["k_proj", "o_proj", "up_proj"], seed=2
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def adapter_dirs(llama_dir, tmp_path_factory) -> dict[str, str]:
    return {
        name: save_random_lora(llama_dir, tmp_path_factory.mktemp(f"lora_{name}"), **cfg)
        for name, cfg in ADAPTERS.items()
    }


def _peft(llama_dir: str, adapter_dirs: dict[str, str], attn: str) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation=attn, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dirs["a"], adapter_name="a")
    model.load_adapter(adapter_dirs["b"], adapter_name="b")
    return model.eval()


@pytest.fixture(scope="module")
def models(llama_dir, adapter_dirs) -> tuple[PeftModel, PeftModel]:
    """(PEFT on sdpa, PEFT on paged), both holding adapters "a" and "b"."""
    return _peft(llama_dir, adapter_dirs, "sdpa"), _peft(llama_dir, adapter_dirs, "paged")


@contextlib.contextmanager
def under(model: PeftModel, adapter: str | None):
    """``model`` running ``adapter`` alone (None: the base model)."""
    if adapter is None:
        with model.disable_adapter():
            yield model
        return
    previous = model.active_adapter
    model.set_adapter(adapter)
    try:
        yield model
    finally:
        model.set_adapter(previous)


def reference(model: PeftModel, prompt: list[int], adapter: str | None) -> list[int]:
    with under(model, adapter):
        return reference_greedy(model, prompt, NEW)


def check(model: PeftModel, prompts, adapters, expected, actual) -> None:
    """Greedy parity per row, the near-tie gap taken under the row's own adapter."""
    problems = []
    for adapter in set(adapters):
        rows = [i for i, a in enumerate(adapters) if a == adapter]
        with under(model, adapter):
            problems += compare_greedy(model, [prompts[i] for i in rows], [expected[i] for i in rows],
                                       [actual[i] for i in rows])  # fmt: skip
    assert not problems, problems


PROMPTS = ragged_prompts(6, 5, 19, seed=52)
NAMES = ["a", "b", "__base__", "b", "a", "__base__"]
ROW_ADAPTERS = [None if n == "__base__" else n for n in NAMES]


def test_peft_mixed_batch_matches_peft_on_sdpa(models):
    ref, paged = models
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(attention_mask=mask, adapter_names=NAMES, max_new_tokens=NEW, do_sample=False)
    want = ref.generate(input_ids=ids, **kwargs)[:, ids.shape[1] :].tolist()
    got = paged.generate(input_ids=ids, **kwargs)[:, ids.shape[1] :].tolist()
    check(ref, PROMPTS, ROW_ADAPTERS, want, got)


def test_adapters_change_the_tokens(models):
    """The adapters are not no-ops: each gives the same prompt other tokens (what makes parity mean something)."""
    ref, _ = models
    outputs = {adapter: tuple(reference(ref, PROMPTS[0], adapter)) for adapter in (None, "a", "b")}
    assert len(set(outputs.values())) == 3, outputs


def test_engine_requests_match_sdpa(models):
    ref, paged = models
    with ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=128)) as engine:
        ids = engine.add_all([dict(input_ids=p, max_new_tokens=NEW, adapter_name=a) for p, a in zip(PROMPTS, NAMES)])
        got = [o.output_ids for o in engine.collect(ids)]
        with pytest.raises(ValueError, match="unknown adapter 'c'"):
            engine.add_request(PROMPTS[0], max_new_tokens=2, adapter_name="c")
    want = [reference(ref, p, a) for p, a in zip(PROMPTS, ROW_ADAPTERS)]
    check(ref, PROMPTS, ROW_ADAPTERS, want, got)


def test_prefix_cache_is_keyed_by_adapter(models):
    """The same prompt under a, b and the base: no adapter reuses another's K/V, the same one does."""
    ref, paged = models
    prompt = ragged_prompts(1, 23, 23, seed=7)[0]  # 5 full blocks of 4
    config = PagedConfig(block_size=4, num_blocks=64, enable_prefix_caching=True)
    with ContinuousBatchingEngine(paged, config) as engine:
        runs = []
        for adapter in ("a", "b", None, "a", None):
            (out,) = engine.collect([engine.add_request(prompt, max_new_tokens=NEW, adapter_name=adapter)])
            runs.append((adapter, out))
    assert [out.num_cached_tokens for _, out in runs] == [0, 0, 0, 20, 20]
    for adapter, out in runs:
        assert out.output_ids == reference(ref, prompt, adapter), adapter


def test_set_adapter_then_generate(models):
    ref, paged = models
    ids, mask = left_padded(PROMPTS[:3])
    for adapter in ("b", None):
        with under(ref, adapter), under(paged, adapter):
            want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
            got = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        assert got.tolist() == want.tolist(), adapter


def test_model_left_as_found(models):
    """The LoRA layers' forwards are the engine's only while it runs."""
    _, paged = models
    layers = [m for m in paged.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    with ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=16)):
        assert all("forward" in layer.__dict__ for layer in layers)
    assert not any("forward" in layer.__dict__ for layer in layers)


@pytest.mark.parametrize(
    "extra, refused",
    [
        (dict(use_dora=True), "LoRA variant"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    ],
    ids=["dora", "modules_to_save"],
)
def test_unsupported_peft_features_are_refused(llama_dir, extra, refused):
    base = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], **extra)).eval()
    with pytest.raises(NotImplementedError, match=refused):
        ContinuousBatchingEngine(model, PagedConfig(block_size=4, num_blocks=16))


def test_merged_adapter_is_refused(llama_dir):
    base = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).eval()
    model.merge_adapter()
    with pytest.raises(NotImplementedError, match="unmerge_adapter"):
        ContinuousBatchingEngine(model, PagedConfig(block_size=4, num_blocks=16))


def test_engine_loads_and_unloads_adapters(llama_dir, adapter_dirs, models):
    """``engine.load_adapter`` on a model that had none (it gets a PeftModel), and ``unload_adapter``."""
    ref, _ = models
    base = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged", dtype=torch.float32).eval()
    prompt = PROMPTS[2]
    with ContinuousBatchingEngine(base, PagedConfig(block_size=4, num_blocks=64, enable_prefix_caching=True)) as engine:
        assert engine.adapters == set()
        engine.load_adapter("x", adapter_dirs["a"])
        assert engine.adapters == {"x"}
        (out,) = engine.collect([engine.add_request(prompt, max_new_tokens=NEW, adapter_name="x")])
        assert out.output_ids == reference(ref, prompt, "a")
        engine.add_request(prompt, max_new_tokens=NEW, adapter_name="x")
        with pytest.raises(RuntimeError, match="in flight"):
            engine.unload_adapter("x")
        list(engine.stream())
        engine.unload_adapter("x")
        assert engine.adapters == set()
        engine.load_adapter("x", adapter_dirs["b"])  # the same name, other weights: nothing cached under "x" serves
        (out,) = engine.collect([engine.add_request(prompt, max_new_tokens=NEW, adapter_name="x")])
        assert out.num_cached_tokens == 0 and out.output_ids == reference(ref, prompt, "b")


def test_an_adapter_unloaded_under_a_frozen_heap_is_freed(llama_dir, adapter_dirs):
    """``hf-paged-attn serve`` freezes its start-up heap (``_env.freeze_heap``): an adapter loaded before and
    unloaded after, once it has run, must be freed by reference counts alone (no cycle through the engine or PEFT
    holds it), or the server would keep its weights."""
    base = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged", dtype=torch.float32).eval()
    with ContinuousBatchingEngine(base, PagedConfig(block_size=4, num_blocks=64)) as engine:
        engine.load_adapter("x", adapter_dirs["a"])
        engine.collect([engine.add_request(PROMPTS[2], max_new_tokens=2, adapter_name="x")])
        weights = [weakref.ref(p) for name, p in base.named_parameters() if ".x." in name]
        gc.collect()
        gc.freeze()
        try:
            engine.unload_adapter("x")
            alive = sum(w() is not None for w in weights)
        finally:
            gc.unfreeze()
    assert len(weights) == 2 * base.config.num_hidden_layers * 2 and alive == 0  # q_proj, v_proj: A and B


def test_peft_mixed_batch_with_beam_search(models):
    """PEFT repeats each row's adapter per beam; every beam of a row runs its row's adapter."""
    ref, paged = models
    ids, mask = left_padded(PROMPTS[:3])
    kwargs = dict(attention_mask=mask, adapter_names=NAMES[:3], max_new_tokens=NEW, do_sample=False, num_beams=2)
    want = ref.generate(input_ids=ids, **kwargs)
    got = paged.generate(input_ids=ids, **kwargs)
    assert got.tolist() == want.tolist()


def test_prompt_lookup_speculation_under_adapters(models):
    """A verify step's draft rows belong to their request: they run its adapter."""
    from transformers import GenerationConfig

    ref, paged = models
    prompt = PROMPTS[3] * 3  # repeats: prompt lookup proposes
    spec = GenerationConfig(prompt_lookup_num_tokens=3, do_sample=False)
    with ContinuousBatchingEngine(paged, PagedConfig(block_size=4, num_blocks=128)) as engine:
        ids = [engine.add_request(prompt, max_new_tokens=NEW, generation_config=spec, adapter_name=a) for a in "ab"]
        got = [o.output_ids for o in engine.collect(ids)]
        assert engine.stats.num_draft_tokens > 0
    assert got == [reference(ref, prompt, "a"), reference(ref, prompt, "b")]


def test_other_peft_adapters_are_refused(llama_dir):
    from peft import IA3Config

    base = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged")
    model = get_peft_model(base, IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(NotImplementedError, match="IA3 adapter: the paged engine runs LoRA adapters only"):
        ContinuousBatchingEngine(model.eval(), PagedConfig(block_size=4, num_blocks=16))


def test_tensor_parallel_styles_other_than_colwise_and_rowwise_are_refused(llama_dir):
    """PEFT shards LoRA only under transformers' colwise and rowwise styles (the attributes its TP code reads)."""
    base = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).eval()
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj.get_base_layer()
    q_proj._hf_device_mesh, q_proj._hf_tp_plan = object(), "colwise_gather_output"
    with pytest.raises(NotImplementedError, match="sharded with tp_plan 'colwise_gather_output'"):
        ContinuousBatchingEngine(model, PagedConfig(block_size=4, num_blocks=16))


def test_engine_adapter_loads_are_refused_on_a_tensor_parallel_model(llama_dir, adapter_dirs, monkeypatch):
    """Rank 0's engine can't load an adapter on the other ranks: every rank loads it through PEFT instead."""
    base = AutoModelForCausalLM.from_pretrained(llama_dir, attn_implementation="paged").eval()
    with ContinuousBatchingEngine(base, PagedConfig(block_size=4, num_blocks=16)) as engine:
        with monkeypatch.context() as patch:  # the size from_pretrained(tp_plan="auto") gives; built in one process
            patch.setattr(type(base), "tp_size", property(lambda self: 2))
            with pytest.raises(NotImplementedError, match="engine.load_adapter on a tensor-parallel model"):
                engine.load_adapter("x", adapter_dirs["a"])
        assert engine.adapters == set()
