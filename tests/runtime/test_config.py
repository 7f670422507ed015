import pytest
import torch

from hf_paged_attn import PagedConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 0),
        ("block_size", -4),
        ("block_size", 2.5),
        ("block_size", True),
        ("num_blocks", 0),
        ("max_num_seqs", 0),
        ("max_batch_tokens", -1),
        ("kernel", "cuda"),
        ("enable_prefix_caching", "yes"),
        ("memory_fraction", 0.0),
        ("memory_fraction", 1.5),
        ("progress_bar", "auto"),
        ("seed", 1.5),
        ("logprobs_mode", "raw"),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        PagedConfig(**{field: value})
    assert repr(value) in str(info.value)


def test_defaults_and_replace():
    config = PagedConfig()
    assert config.kernel == "auto" and config.num_blocks is None
    assert config.replace(block_size=32).block_size == 32
    with pytest.raises(ValueError, match="no field"):
        config.replace(nope=1)
    with pytest.raises(ValueError, match="block_size"):
        config.replace(block_size=0)


def test_resolved_picks_the_kernel_then_its_block_size(monkeypatch):
    import hf_paged_attn.kernels as kernels

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # only inspected, never allocated on
    assert PagedConfig().block_size is None
    config = PagedConfig().resolved(cpu)
    assert (config.kernel, config.block_size) == ("torch", 8)
    monkeypatch.setattr(kernels.BACKENDS["flash"], "is_available", lambda device: device.type == "cuda")
    monkeypatch.setattr(kernels.BACKENDS["triton"], "is_available", lambda device: device.type == "cuda")
    config = PagedConfig().resolved(cuda, torch.bfloat16)
    assert (config.kernel, config.block_size) == ("flash", 256)  # flash-attn 2's paged multiple
    config = PagedConfig().resolved(cuda, torch.float32)  # flash-attn has no fp32
    assert (config.kernel, config.block_size) == ("triton", 16)  # the Triton kernels' minimum
    config = PagedConfig(block_size=32).resolved(cuda, torch.bfloat16)  # an explicit size stays
    assert (config.kernel, config.block_size) == ("triton", 32)
    config = PagedConfig(kernel="torch").resolved(cuda)
    assert (config.kernel, config.block_size) == ("torch", 16)
    config = PagedConfig().resolved(cuda, torch.bfloat16, sinks=True)  # flash-attn 2 has no sinks
    assert (config.kernel, config.block_size) == ("triton", 16)


def test_for_model_sees_attention_sinks_and_the_head_dim(monkeypatch):
    from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig

    import hf_paged_attn.kernels as kernels

    seen = []
    monkeypatch.setattr(kernels, "resolve_kernel", lambda *args: seen.append(args[4:6]) or "torch")  # sinks, head dim
    monkeypatch.setattr("hf_paged_attn.runtime.config.resolve_kernel", kernels.resolve_kernel)
    config = GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    PagedConfig().for_model(AutoModelForCausalLM.from_config(config))
    llama = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)
    PagedConfig().for_model(AutoModelForCausalLM.from_config(llama))
    assert seen == [(True, 8), (False, 8)]
