"""The bundled model's compile is clean: inductor generates every kernel without an error on the way.

Inductor logs ``Error in codegen for ComputedBuffer(...)`` (``torch._inductor.scheduler``, CRITICAL) when a
node's code generation raises; a compile that recovers from it still logs it, and the vs-vLLM benchmark once
showed it while the bundled model compiled. These tests compile the model from nothing (inductor's and AOT
autograd's caches off: a cached graph generates no code) in float32 and in bfloat16 with float32 matmuls (the
path of CPUs without bf16 matmuls) and fail on any error logged by inductor's scheduler. ``slow``: a cold
compile takes 30-120 s on 2 cores.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_paged_attn  # noqa: F401  (registers "paged")
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.demo import DEMO_MODEL


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "settings"), [(torch.float32, {}), (torch.bfloat16, {"fp32_matmuls": True})], ids=["fp32", "bf16"]
)
def test_the_demo_model_compiles_without_a_codegen_error(dtype: torch.dtype, settings: dict) -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=dtype).eval()
    prompts = [tokenizer(t)["input_ids"] for t in ("The cat sat on the", "Once upon a time, there", "A")]
    # The handler sits on the logger itself: torch's loggers need not propagate to the root.
    records, logger = Records(), logging.getLogger("torch._inductor.scheduler")
    logger.addHandler(records)
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            with ContinuousBatchingEngine(model, PagedConfig(compile="startup", **settings)) as engine:
                assert engine.executor.failed is None
                engine.generate(prompts, max_new_tokens=24)  # steps of several sizes: no recompile may err either
                assert engine.executor.num_compiled_steps > 10
    finally:
        logger.removeHandler(records)
    assert not [r.getMessage()[:300] for r in records.records]
