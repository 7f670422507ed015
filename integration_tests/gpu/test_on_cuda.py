"""What only a GPU can show: the model moved between devices between calls, and the CUDA kernels and graphs
against sdpa on the same weights. Skipped without CUDA (``conftest.py``); ``scripts/gpu_check.sh`` runs them."""

from __future__ import annotations

import pytest
import torch

from hf_paged_attn import PagedConfig
from hf_paged_attn_tools.testing import (
    compare_greedy,
    left_padded,
    load_pair,
    ragged_prompts,
    save_random_model,
    tiny_llama_config,
    unpadded_rows,
)

pytestmark = pytest.mark.gpu

NEW = 12
PROMPTS = ragged_prompts(6, 3, 40, seed=3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("gpu")))


def check(ref: torch.nn.Module, paged: torch.nn.Module, config: PagedConfig) -> None:
    ids, mask = left_padded(PROMPTS)
    device = next(paged.parameters()).device
    want = ref.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=NEW, do_sample=False)
    got = paged.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=NEW,
                         do_sample=False, paged_config=config)  # fmt: skip
    problems = compare_greedy(
        ref, PROMPTS, unpadded_rows(want.cpu(), ids.shape[1]), unpadded_rows(got.cpu(), ids.shape[1])
    )
    assert not problems, "\n".join(problems)


def test_device_moves_between_calls(pair) -> None:
    ref, paged = pair
    check(ref, paged, PagedConfig())
    ref.to("cuda"), paged.to("cuda")
    check(ref, paged, PagedConfig())
    ref.to("cpu"), paged.to("cpu")
    check(ref, paged, PagedConfig())


@pytest.mark.parametrize("kernel", ["torch", "triton", "flash"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_kernels_and_graphs_equal_sdpa(pair, kernel: str, graphs: bool) -> None:
    from hf_paged_attn.kernels import BACKENDS

    ref, paged = pair
    dtype = torch.float32 if kernel != "flash" else torch.bfloat16
    if not BACKENDS[kernel].suits(torch.device("cuda"), None, dtype, False):
        pytest.skip(f"{kernel} does not suit this GPU or dtype")
    if graphs and not BACKENDS[kernel].graph_safe:
        pytest.skip(f"{kernel} is not graph-safe")
    ref.to("cuda", dtype), paged.to("cuda", dtype)
    try:
        check(ref, paged, PagedConfig(kernel=kernel, cuda_graphs=graphs))
    finally:
        ref.to("cpu", torch.float32), paged.to("cpu", torch.float32)
