"""``hf-paged-attn bench vllm``'s plumbing without vLLM: its ``--smoke`` row against a stand-in ``vllm`` package
(transformers' greedy ``generate`` behind vLLM's ``LLM.generate`` signature), each in its own process, as the
real comparison runs. Checks that ours reports its passes right after start beside those after its compile,
and vLLM its passes after its start-up."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest

from hf_paged_attn_tools.bench import vs_vllm

FAKE_VLLM = '''
"""A stand-in for vLLM's offline API, enough for vs_vllm_worker.run_vllm: greedy, EOS off."""
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos, detokenize):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, dtype, **kwargs):
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype),
                                                          attn_implementation="sdpa").eval()

    def generate(self, prompts, params, use_tqdm=False):
        outs = []
        for prompt, p in zip(prompts, params):
            ids = torch.tensor([prompt["prompt_token_ids"]])
            greedy = GenerationConfig(max_new_tokens=p.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            # The mask given: the prompts begin with BOS, id 0, which generate would take for padding.
            seq = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy)
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=seq[0, ids.shape[1]:].tolist())]))
        return outs
'''
FAKE_INPUTS = '''
def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_vllm")
    package = root / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (package / "inputs.py").write_text(textwrap.dedent(FAKE_INPUTS))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(root))  # the workers' processes find the stand-in
        patch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        out = root / "report.json"
        # Eager (compile=False): the plumbing, not the compile, is under test; 1 thread on a shared CI machine.
        entries = vs_vllm.main(["--smoke", "--rows", "demo-float32", "--rounds", "1", "--reps", "2", "--threads", "1",
                                "--vllm-python", sys.executable, "--ours-config", '{"compile": false}',
                                "--work-dir", str(root / "work"), "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(entries))
    return entries


def test_both_phases_of_ours_beside_vllm(report):
    (entry,) = report
    assert entry["row"] == "demo-float32" and entry["new_tokens"] == 6 * 8
    ours, vllm = entry["ours"], entry["vllm"]
    for phase in (ours["start"], ours, vllm):  # ours' compiled phase and vLLM's are the systems' top level
        (passes,) = phase["passes"]  # one process each, 2 timed passes
        assert len(passes) == 2 and all(0 < p < math.inf for p in passes)
        assert math.isclose(phase["tokens_per_second"], sorted(passes)[0] / 2 + sorted(passes)[1] / 2)
        assert math.isclose(phase["slowest_tokens_per_second"], min(passes))
        assert phase["cpu_seconds"] > 0
    assert vllm["start"] is None  # vLLM compiles in its start-up: it has no other phase
    assert math.isclose(ours["start_ratio"], ours["start"]["tokens_per_second"] / ours["tokens_per_second"])
    assert math.isclose(entry["ratio"], ours["tokens_per_second"] / vllm["tokens_per_second"])
    assert math.isclose(entry["start_ratio"], ours["start"]["tokens_per_second"] / vllm["tokens_per_second"])
    assert 0 < ours["ready"] <= ours["compiled_at"]


def test_same_greedy_tokens_as_the_reference(report):
    (entry,) = report
    assert entry["num_requests"] == 6 and entry["same_tokens"] == 6


def test_a_variant_sets_module_constants(monkeypatch):
    """``--variant NAME:HF_PAGED_ATTN_BENCH_SET=MODULE.NAME=VALUE``: the worker sets the constants (Python
    literals) before ours runs; a name the module lacks is an error naming it, not a silent no-op."""
    from hf_paged_attn.runtime.generation import argmax
    from hf_paged_attn_tools.bench import vs_vllm_worker

    monkeypatch.setattr(argmax, "NUMPY_MAX", argmax.NUMPY_MAX)  # put back after the test
    monkeypatch.setattr(argmax, "CHUNK", argmax.CHUNK)
    vs_vllm_worker.apply_settings("hf_paged_attn.runtime.generation.argmax.NUMPY_MAX=0; "
                                  "hf_paged_attn.runtime.generation.argmax.CHUNK=64")  # fmt: skip
    assert argmax.NUMPY_MAX == 0 and argmax.CHUNK == 64
    with pytest.raises(AttributeError, match="NOPE"):
        vs_vllm_worker.apply_settings("hf_paged_attn.runtime.generation.argmax.NOPE=1")
