"""LoRA adapters on a tensor-parallel model (``runtime/model/lora.py``), in one ``torchrun`` launch: PEFT's
``generate(adapter_names=)`` and engine requests under adapters, on every rank. Each rank writes what it saw
to ``OUT/rank{r}.json``; ``test_tp_lora.py`` compares it with PEFT on sdpa in one process.

    torchrun --nproc-per-node 2 integration_tests/parallel/tp_lora_ranks.py OUT NAME=BASE,A,B ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import PeftModel
from transformers import AutoModelForCausalLM

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.parallel.tensor_parallel import run_worker
from hf_paged_attn_tools.testing import left_padded

NEW_TOKENS = 8
NAMES = ["a", "b", "__base__", "b", "a"]


def prompts(num: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (num,), generator=gen).tolist()
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]


def scenarios(base: str, path_a: str, path_b: str) -> dict:
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="paged", tp_plan="auto")
    model = PeftModel.from_pretrained(model, path_a, adapter_name="a")
    model.load_adapter(path_b, adapter_name="b")
    model.eval()
    rows = prompts(len(NAMES), seed=3)
    ids, mask = left_padded(rows)
    out = model.generate(ids, attention_mask=mask, adapter_names=NAMES, max_new_tokens=NEW_TOKENS, do_sample=False)
    seen: dict = {"rows": rows, "names": NAMES, "mixed": out[:, ids.shape[1] :].tolist()}
    if dist.get_rank() == 0:  # the engine on rank 0, each request under its adapter
        with ContinuousBatchingEngine(model, PagedConfig(max_num_seqs=4)) as engine:
            adapters = [None if n == "__base__" else n for n in NAMES]
            requests = [dict(input_ids=r, max_new_tokens=NEW_TOKENS, adapter_name=a) for r, a in zip(rows, adapters)]
            seen["engine"] = [o.output_ids for o in engine.collect(engine.add_all(requests))]
    else:
        report = run_worker(model)
        seen["worker"] = {"num_steps": report.num_steps, "num_failed_steps": report.num_failed_steps}
    return seen


def main() -> None:
    out_dir = Path(sys.argv[1])
    results = {}
    for arg in sys.argv[2:]:
        name, paths = arg.split("=", 1)
        results[name] = scenarios(*paths.split(","))
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
