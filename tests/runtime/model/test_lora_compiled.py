"""LoRA adapters in the compiled CPU forward (``runtime/model/lora_rows.py``): steps that mix adapters run one
graph whose rows' adapters are an input, with PEFT's tokens on sdpa; a loaded adapter compiles again.

Compiling takes tens of seconds here, so one module-scoped PEFT model compiles once for the adapters it
holds, and every test but the last reuses that graph."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig  # noqa: E402
from hf_paged_attn.runtime.cpu.compiled import CompiledExecutor  # noqa: E402
from hf_paged_attn_tools.testing import left_padded  # noqa: E402

from . import test_lora  # noqa: E402
from .test_lora import NAMES, NEW, PROMPTS, ROW_ADAPTERS, _peft, check, reference  # noqa: E402

adapter_dirs = test_lora.adapter_dirs  # the fixture: the same two random adapters

COMPILED = PagedConfig(block_size=4, num_blocks=128, compile="startup")


@pytest.fixture(scope="module")
def models(llama_dir, adapter_dirs) -> tuple[peft.PeftModel, peft.PeftModel]:
    """(PEFT on sdpa, PEFT on paged), both holding adapters "a" and "b"."""
    return _peft(llama_dir, adapter_dirs, "sdpa"), _peft(llama_dir, adapter_dirs, "paged")


def compiled_executor(engine: ContinuousBatchingEngine) -> CompiledExecutor:
    executor = getattr(engine.executor, "inner", engine.executor)  # under adaptive threads
    assert isinstance(executor, CompiledExecutor) and executor.graph_ready, executor.failed
    return executor


def peft_mixed_batch(model: peft.PeftModel, names: list[str], **kwargs) -> list[list[int]]:
    ids, mask = left_padded(PROMPTS)
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, max_new_tokens=NEW,
                         do_sample=False, **kwargs)  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def test_compiled_steps_of_mixed_adapters_match_peft_on_sdpa(models):
    """Every step mixes a, b and the base; a second round gives each prompt another adapter. One graph runs
    both rounds: the rows' adapters are its input, not frozen into it."""
    ref, paged = models
    rotated = NAMES[2:] + NAMES[:2]
    with ContinuousBatchingEngine(paged, COMPILED) as engine:
        executor = compiled_executor(engine)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        rounds = []
        for names in (NAMES, rotated):
            rows = [dict(input_ids=p, max_new_tokens=NEW, adapter_name=a) for p, a in zip(PROMPTS, names)]
            ids = engine.add_all(rows)
            rounds.append([o.output_ids for o in engine.collect(ids)])
        assert executor.num_compiled_steps >= 2 * NEW and executor.compiled.num_compiles == 1
        assert executor.compiled.slots == {"a": 1, "b": 2}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no graph traced for a new mix
    for names, got in zip((NAMES, rotated), rounds):
        adapters = [None if n == "__base__" else n for n in names]
        check(ref, PROMPTS, adapters, peft_mixed_batch(ref, names), got)


def test_peft_generate_with_adapter_names_runs_compiled(models):
    """PEFT's own ``generate(adapter_names=)`` on the paged model, compiled: PEFT's mixed batch on sdpa."""
    ref, paged = models
    got = peft_mixed_batch(paged, NAMES, paged_config=COMPILED)
    check(ref, PROMPTS, ROW_ADAPTERS, peft_mixed_batch(ref, NAMES), got)


def test_loading_an_adapter_compiles_again_for_it(models, adapter_dirs):
    """``engine.load_adapter`` retires the graph of a and b: until the new one (a, b, c) is compiled steps run
    eagerly, then through it; c (a's weights under another name) gives a's tokens."""
    ref, paged = models
    prompt = PROMPTS[1]
    with ContinuousBatchingEngine(paged, COMPILED) as engine:
        before = compiled_executor(engine).compiled
        engine.load_adapter("c", adapter_dirs["a"])
        try:
            (eager,) = engine.collect([engine.add_request(prompt, max_new_tokens=NEW, adapter_name="c")])
            executor = getattr(engine.executor, "inner", engine.executor)
            assert executor.compiled is not before and executor.compiled.slots == {"a": 1, "b": 2, "c": 3}
            assert executor.wait(timeout=900) and executor.failed is None
            steps = executor.num_compiled_steps
            ids = [engine.add_request(prompt, max_new_tokens=NEW, adapter_name=a) for a in ("c", "b", None)]
            got = [o.output_ids for o in engine.collect(ids)]
            assert executor.num_compiled_steps - steps >= NEW
        finally:
            engine.unload_adapter("c")
    assert eager.output_ids == got[0] == reference(ref, prompt, "a")
    assert got[1:] == [reference(ref, prompt, "b"), reference(ref, prompt, None)]
