"""``PagedConfig(kv_cache_dtype=...)``: fp8 and int8 pages through the whole engine, their scales, and the cache
sized in bytes (``kv_cache_memory_bytes``)."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.runtime.model.kv_scales import read_kv_scales
from hf_paged_attn.runtime.model.sleep import pool_bytes
from hf_paged_attn.runtime.speculative.config import SpeculativeConfig
from hf_paged_attn_tools.testing import ragged_prompts

MIB = 1 << 20


def finals(engine: ContinuousBatchingEngine) -> dict:
    return {o.request_id: o for o in engine.stream() if o.finished}


def run(engine: ContinuousBatchingEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    ids = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    out = finals(engine)
    assert engine.allocator.num_used_blocks == 0
    return [out[i].output_ids for i in ids]


def looping(num: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so that prompt lookup proposes (and speculation runs)."""
    return [p * 3 for p in ragged_prompts(num, 5, 9, seed=seed)]


# ----------------------------------------------------------------------------------- config
@pytest.mark.parametrize("value", ["fp16", "int4", "FP8", None])
def test_a_bad_dtype_names_the_accepted_ones(value):
    with pytest.raises(ValueError, match="kv_cache_dtype") as info:
        PagedConfig(kv_cache_dtype=value)
    assert "'fp8_e4m3'" in str(info.value) and "'int8'" in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_byte_budget_is_refused(value):
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        PagedConfig(kv_cache_memory_bytes=value)


def test_quantized_pages_are_opt_in_and_go_to_the_kernels_that_read_them(monkeypatch):
    """fp8: Triton (compute capability 8.9+ for e4m3) or torch; int8: torch only; flash neither."""
    import hf_paged_attn.kernels as kernels

    assert PagedConfig().kv_cache_dtype == "auto"
    for name in ("flash", "triton"):
        monkeypatch.setattr(kernels.BACKENDS[name], "is_available", lambda device: device.type == "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")  # only inspected
    assert PagedConfig().resolved(cuda, torch.bfloat16).kernel == "flash"
    assert PagedConfig(kv_cache_dtype="fp8").resolved(cuda, torch.bfloat16).kernel == "triton"
    assert PagedConfig(kv_cache_dtype="fp8", kernel="torch").resolved(cuda, torch.bfloat16).kernel == "torch"
    with pytest.raises(ValueError, match="fp8 pages"):
        PagedConfig(kv_cache_dtype="fp8_e5m2", kernel="flash").resolved(cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert PagedConfig(kv_cache_dtype="fp8").resolved(cuda, torch.bfloat16).kernel == "torch"
    assert PagedConfig(kv_cache_dtype="fp8_e5m2").resolved(cuda, torch.bfloat16).kernel == "triton"
    assert PagedConfig(kv_cache_dtype="int8").resolved(cuda, torch.bfloat16).kernel == "torch"
    for name in ("flash", "triton"):
        with pytest.raises(ValueError, match="int8 pages"):
            PagedConfig(kv_cache_dtype="int8", kernel=name).resolved(cuda, torch.bfloat16)


# ----------------------------------------------------------------------------------- sizing
def test_fp8_holds_twice_bf16_and_four_times_fp32_in_the_same_bytes(demo):
    from hf_paged_attn.demo import DEMO_MODEL

    _, fp32, _ = demo
    bf16 = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=torch.bfloat16)

    def capacity(model, dtype: str) -> int:
        config = PagedConfig(kv_cache_memory_bytes=64 * MIB, kv_cache_dtype=dtype, max_num_seqs=1024)
        stats = ContinuousBatchingEngine(model, config).stats
        named = {"auto": str(model.dtype).removeprefix("torch."), "fp8": "float8_e4m3fn", "int8": "int8"}
        assert stats.kv_cache_dtype == named[dtype]
        return stats.token_capacity_per_group[0]

    fp8 = capacity(fp32, "fp8")
    assert fp8 >= 1.9 * capacity(bf16, "auto") and fp8 >= 3.8 * capacity(fp32, "auto")
    assert capacity(bf16, "fp8") == fp8  # pages of one byte whatever the model computes in
    # 4 layers x 2 (K, V) x 2 KV heads x 64 dims x 1 byte a token
    assert fp8 == 64 * MIB // (4 * 2 * 2 * 64) // 8 * 8
    # int8: the same bytes plus a float16 scale per token and KV head, counted in the budget
    int8 = capacity(fp32, "int8")
    assert int8 == 64 * MIB // (4 * 2 * 2 * (64 + 2)) // 8 * 8 and int8 >= 1.9 * capacity(bf16, "auto")
    engine = ContinuousBatchingEngine(fp32, PagedConfig(kv_cache_memory_bytes=64 * MIB, kv_cache_dtype="int8"))
    engine.generate([[5, 6, 7]], max_new_tokens=1)  # pages and scales are made at the first write
    assert pool_bytes(engine.cache) <= 64 * MIB


# ----------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("dtype", ["fp8", "fp8_e5m2", "int8"])
def test_prefix_hits_preemption_and_speculation_keep_the_tokens(llama_pair, dtype):
    """Under fp8 or int8 pages, what the engine does around the pages (prefix hits, preemption, speculation)
    gives the tokens of a plain fp8 run."""
    _, paged = llama_pair
    prompts, new = looping(5, seed=4), 16
    plain = PagedConfig(kv_cache_dtype=dtype, block_size=4, num_blocks=200, enable_prefix_caching=False)
    want = run(ContinuousBatchingEngine(paged, plain), prompts, new)
    cached = ContinuousBatchingEngine(paged, plain.replace(enable_prefix_caching=True))
    assert run(cached, prompts, new) == want
    assert run(cached, prompts, new) == want and cached.stats.num_cached_tokens > 0
    tight = ContinuousBatchingEngine(paged, plain.replace(num_blocks=12, max_batch_tokens=16))
    assert run(tight, prompts, new) == want and tight.stats.num_preemptions > 0
    spec = plain.replace(speculative=SpeculativeConfig(num_speculative_tokens=3))
    speculating = ContinuousBatchingEngine(paged, spec)
    assert run(speculating, prompts, new) == want and speculating.stats.num_draft_tokens > 0


def test_generate_and_beams_run_on_fp8(llama_pair):
    _, paged = llama_pair
    prompt = ragged_prompts(1, 12, 12, seed=2)[0]
    out = paged.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                         paged_config=PagedConfig(kv_cache_dtype="fp8"))  # fmt: skip
    assert out.shape == (1, 20)
    beams = paged.generate(torch.tensor([prompt]), max_new_tokens=6, num_beams=3, num_return_sequences=2,
                           do_sample=False, paged_config=PagedConfig(kv_cache_dtype="fp8"))  # fmt: skip
    assert beams.shape == (2, 18)


def test_beams_on_int8_fork_blocks_with_their_scales(llama_pair):
    """Beams fork a request's last, partly filled block (``copy_blocks``). int8 rounds each token alone, so the
    block size changes nothing stored: beams over blocks of 4 and of 64 (where the copied block holds the
    whole prompt) give the same sequences, which they would not if a copied block lost its scales."""
    _, paged = llama_pair
    prompt = torch.tensor([ragged_prompts(1, 12, 12, seed=2)[0]])

    def beams(block_size: int) -> torch.Tensor:
        config = PagedConfig(kv_cache_dtype="int8", block_size=block_size, enable_prefix_caching=False)
        return paged.generate(prompt, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                              paged_config=config)  # fmt: skip

    small = beams(4)
    assert small.shape == (3, 18) and torch.equal(small, beams(64))


def test_hybrid_group_tables_on_fp8(tmp_path):
    """Sliding-window layers with their own block tables read the same fp8 pages as one shared table."""
    from hf_paged_attn_tools.testing import save_random_model
    from hf_paged_attn_tools.tiny_configs import tiny_config

    config = tiny_config("gemma2")
    paged = AutoModelForCausalLM.from_pretrained(save_random_model(config, tmp_path), attn_implementation="paged")
    prompts, new = ragged_prompts(3, 20, 40, seed=1), 10
    base = PagedConfig(kv_cache_dtype="fp8", block_size=4, num_blocks=120)
    grouped = ContinuousBatchingEngine(paged, base)
    assert len(grouped.layers.groups) > 1
    assert run(grouped, prompts, new) == run(ContinuousBatchingEngine(paged, base.replace(hybrid_kv=False)), prompts,
                                             new)  # fmt: skip


# ----------------------------------------------------------------------------------- scales
def test_scales_are_read_folded_in_and_logged(llama_pair, caplog):
    """Scales of a power of two commute with fp8's rounding, so pages scaled by 2 and 1/2 give the
    tokens of unscaled ones: the scales are divided out on the write and folded back in on the read."""
    _, paged = llama_pair
    prompts, new = ragged_prompts(3, 6, 20, seed=9), 12
    config = PagedConfig(kv_cache_dtype="fp8", block_size=4, num_blocks=100)
    want = run(ContinuousBatchingEngine(paged, config), prompts, new)
    attention = [layer.self_attn for layer in paged.model.layers]
    try:
        for module in attention:
            module.register_buffer("k_scale", torch.tensor(2.0))
            module.register_buffer("v_scale", torch.tensor(0.5))
        with caplog.at_level(logging.INFO, logger="hf_paged_attn.runtime.model.kv_scales"):
            engine = ContinuousBatchingEngine(paged, config)
        assert "model's parameters" in caplog.text and "kv_cache_dtype='fp8'" in caplog.text
        assert [(layer.k_scale, layer.v_scale) for layer in engine.cache.layers] == [(2.0, 0.5)] * len(attention)
        assert run(engine, prompts, new) == want
    finally:
        for module in attention:
            del module.k_scale, module.v_scale


def test_scales_from_a_checkpoints_safetensors(llama_dir, tmp_path):
    import shutil

    for file in ("config.json", "model.safetensors"):
        shutil.copy(f"{llama_dir}/{file}", tmp_path / file)
    save_file({"model.layers.1.self_attn.k_proj.k_scale": torch.tensor([0.25]),
               "model.layers.0.self_attn.v_proj.output_scale": torch.tensor([0.5, 3.0])},  # per head: the largest
              str(tmp_path / "scales.safetensors"))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="paged")
    layers = model.config.num_hidden_layers
    scales, source = read_kv_scales(model, layers)
    assert scales[:2] == [(1.0, 3.0), (0.25, 1.0)] and scales[2:] == [(1.0, 1.0)] * (layers - 2)
    assert "safetensors" in source and "2 of" in source


def test_int8_scales_sleep_and_wake_with_their_pages(llama_pair):
    """sleep() frees the scales with the pages (counted in what it frees) and wake_up() makes both again."""
    _, paged = llama_pair
    prompts, new = ragged_prompts(2, 6, 12, seed=3), 8
    engine = ContinuousBatchingEngine(paged, PagedConfig(kv_cache_dtype="int8", block_size=4, num_blocks=60))
    want = run(engine, prompts, new)
    held = pool_bytes(engine.cache)
    layer = engine.cache.layers[0]
    assert held == sum(t.nbytes for t in (layer.keys, layer.values, layer.k_scales, layer.v_scales)) * len(
        engine.cache.layers)
    assert engine.sleep(level=1) >= held and layer.k_scales is None
    engine.wake_up()
    assert layer.k_scales is not None and layer.k_scales.shape == layer.keys.shape[:3]
    assert run(engine, prompts, new) == want
