import pytest

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


def test_block_size_none_is_resolved_by_device_and_kernel():
    assert PagedConfig().block_size is None
    assert PagedConfig().resolved("cpu").block_size == 8
    assert PagedConfig().resolved("cuda").block_size == 16  # the Triton kernels' minimum
    assert PagedConfig(kernel="flash").resolved("cuda").block_size == 256  # flash-attn 2's multiple
    assert PagedConfig(block_size=32).resolved("cuda").block_size == 32  # an explicit size stays
