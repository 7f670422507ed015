"""LoRA adapters on 2 CPU ranks (gloo) under ``torchrun``: each rank runs its shard of every adapter, split as
the base weight is (``runtime/model/lora.py``), with PEFT's tokens on sdpa in one process. A tiny Llama (every
projection sharded) and a GQA Llama with one K/V head (its K/V projections replicated on both ranks); the
adapters cover column-parallel (q/k/v/up) and row-parallel (o/down) layers.

One launch runs both models (``tp_lora_ranks.py``); every wait is bounded, the ranks killed on timeout.
"""

from __future__ import annotations

import contextlib
import json
import subprocess

import pytest
import torch

peft = pytest.importorskip("peft")

from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hf_paged_attn_tools.testing import (  # noqa: E402
    compare_greedy,
    left_padded,
    save_random_lora,
    save_random_model,
    tiny_llama_config,
)

from .test_tensor_parallel import ENV, ROOT, kill_tree, torchrun  # noqa: E402

TIMEOUT = 240
MODELS = {
    "llama": lambda: tiny_llama_config(),
    "gqa": lambda: tiny_llama_config(num_key_value_heads=1, attention_bias=True),  # K/V replicated on 2 ranks
}
ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], seed=1),
    "b": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"], seed=2),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """({model: (base dir, {adapter: dir})}, [rank 0's results, rank 1's results])."""
    tmp = tmp_path_factory.mktemp("tp_lora")
    dirs = {}
    for name, make in MODELS.items():
        base = save_random_model(make(), tmp / name)
        dirs[name] = (base, {a: save_random_lora(base, tmp / f"{name}_{a}", **cfg) for a, cfg in ADAPTERS.items()})
    models = [f"{name}={base},{ad['a']},{ad['b']}" for name, (base, ad) in dirs.items()]
    command = torchrun(str(ROOT / "integration_tests" / "parallel" / "tp_lora_ranks.py"), str(tmp), *models)
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT}s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return dirs, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@contextlib.contextmanager
def under(model: PeftModel, adapter: str):
    if adapter == "__base__":
        with model.disable_adapter():
            yield
        return
    model.set_adapter(adapter)
    yield


def problems(base: str, adapters: dict[str, str], rows, names, actual) -> list[str]:
    """Differences from PEFT's mixed batch on sdpa in one process (none, up to near-ties)."""
    ref = AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa", dtype=torch.float32)
    ref = PeftModel.from_pretrained(ref, adapters["a"], adapter_name="a")
    ref.load_adapter(adapters["b"], adapter_name="b")
    ref.eval()
    ids, mask = left_padded(rows)
    expected = ref.generate(ids, attention_mask=mask, adapter_names=names, max_new_tokens=8, do_sample=False)
    expected = expected[:, ids.shape[1] :].tolist()
    found = []
    for adapter in set(names):
        picked = [i for i, n in enumerate(names) if n == adapter]
        with under(ref, adapter):  # the near-tie gap under the row's own adapter
            found += compare_greedy(ref, [rows[i] for i in picked], [expected[i] for i in picked],
                                    [actual[i] for i in picked])  # fmt: skip
    return found


@pytest.mark.parametrize("name", list(MODELS))
def test_peft_mixed_batch_on_two_ranks_matches_peft_on_sdpa(run, name):
    dirs, ranks = run
    r0, r1 = ranks[0][name], ranks[1][name]
    assert r0["mixed"] == r1["mixed"]  # every rank returns rank 0's tokens
    assert not problems(*dirs[name], r0["rows"], r0["names"], r0["mixed"])


@pytest.mark.parametrize("name", list(MODELS))
def test_engine_requests_under_adapters_on_two_ranks_match_peft_on_sdpa(run, name):
    dirs, ranks = run
    r0, r1 = ranks[0][name], ranks[1][name]
    assert r1["worker"]["num_failed_steps"] == 0 and r1["worker"]["num_steps"] >= 8
    assert not problems(*dirs[name], r0["rows"], r0["names"], r0["engine"])
