"""Every tensor-parallel scenario of ``test_tensor_parallel.py`` in one ``torchrun`` launch (each launch
pays the torch import and the model loads). Each rank writes what it saw to ``OUT/rank{r}.json``;
the test compares the ranks with each other and with one process.

    torchrun --nproc-per-node 2 integration_tests/parallel/tp_ranks.py OUT llama=DIR gqa=DIR moe=DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GenerationConfig

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.attention import cache
from hf_paged_attn.parallel.tensor_parallel import rank_blocks, run_worker
from hf_paged_attn.runtime.model import memory
from hf_paged_attn_tools.testing import left_padded

NEW_TOKENS = 8


def prompts(num: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (num,), generator=gen).tolist()
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]


def generated(model, rows: list[list[int]], **kwargs) -> list[list[int]]:
    ids, mask = left_padded(rows)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **kwargs)
    return out[:, ids.shape[1] :].tolist()


def engine_session(model, rank: int, body) -> dict:
    """``body(engine)`` on rank 0 (its result recorded), the worker loop elsewhere (its report recorded)."""
    if rank != 0:
        report = run_worker(model)
        return {"worker": {"num_blocks": report.num_blocks, "num_steps": report.num_steps,
                           "num_failed_steps": report.num_failed_steps, "kv_bytes": report.kv_bytes}}  # fmt: skip
    with ContinuousBatchingEngine(model, PagedConfig(max_num_seqs=4)) as engine:
        result = body(engine)
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in engine.cache.layers if layer.is_initialized)
        return {**result, "num_blocks": engine.stats.num_blocks, "kv_bytes": kv_bytes,
                "executor": type(engine.executor).__name__}  # fmt: skip


def llama_scenarios(model, rank: int) -> dict:
    seen: dict = {}
    rows = prompts(6, seed=1)
    seen["scenario_rows"] = rows
    # sampled: the ranks' own random states differ; rank 0 samples for all
    torch.manual_seed(1234 + rank)
    seen["sampled"] = generated(model, rows[:3], do_sample=True, temperature=1.5, top_k=0)
    seen["rng_after"] = torch.rand(()).item()
    # transformers' generate_batch: rank 0's engine, every rank gets the outputs
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)
    outputs = model.generate_batch(rows[:3], generation_config=config)
    seen["generate_batch"] = [o.generated_tokens for o in outputs.values()]

    # rank 1 sees little free memory: the cache is what rank 1 holds, small enough to preempt
    free = memory.free_memory_bytes
    if rank == 1:
        # 6 blocks: 2 layers x 8 tokens x 1 K/V head (of 2) x 16 dims x 4 bytes x (K, V), memory_fraction 0.5
        memory.free_memory_bytes = lambda device: 6 * 4096
    seen["own_fit"] = rank_blocks(model, PagedConfig(max_num_seqs=4).for_model(model))

    def preempting(engine):
        outs = engine.generate(rows, max_new_tokens=NEW_TOKENS)
        return {"outputs": [o.output_ids for o in outs], "preemptions": engine.stats.num_preemptions}

    seen["tiny_cache"] = engine_session(model, rank, preempting)
    memory.free_memory_bytes = free

    def abort_and_prefix(engine):
        keep = engine.add_request(rows[0], max_new_tokens=NEW_TOKENS)
        drop = engine.add_request(rows[1], max_new_tokens=NEW_TOKENS)
        finished = {}
        for step in range(100):
            if step == 2:
                engine.abort(drop)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = (out.finish_reason, out.output_ids)
            if not engine.has_unfinished():
                break
        shared = rows[2] + rows[3] + rows[4]  # a prefix of 2+ blocks, then two different tails
        first = engine.generate([shared + [7, 8]], max_new_tokens=NEW_TOKENS)[0]
        cached_before = engine.stats.num_cached_tokens
        second = engine.generate([shared + [9]], max_new_tokens=NEW_TOKENS)[0]
        return {
            "kept": finished[keep], "dropped": finished[drop], "shared": shared,
            "prefix_outputs": [first.output_ids, second.output_ids],
            "cached_tokens": engine.stats.num_cached_tokens - cached_before,
        }  # fmt: skip

    seen["abort_prefix"] = engine_session(model, rank, abort_and_prefix)

    # an exception on rank 1 while it prepares a step (its block copies)
    copy_blocks = cache.PagedAttentionCache.copy_blocks
    if rank == 1:

        def failing_once(self, pairs):
            cache.PagedAttentionCache.copy_blocks = copy_blocks
            raise RuntimeError("injected on rank 1")

        cache.PagedAttentionCache.copy_blocks = failing_once

    def failing(engine):
        first = engine.generate([rows[0]], max_new_tokens=NEW_TOKENS)[0]
        second = engine.generate([rows[0]], max_new_tokens=NEW_TOKENS)[0]
        return {"first": [first.finish_reason, first.error], "second": second.output_ids}

    seen["injected_prepare"] = engine_session(model, rank, failing)

    # an exception on rank 1 after the forward's last collective (lm_head's gather): generate raises
    # the same error on both ranks, and the next generate works
    def raise_once(module, args, output):
        handle.remove()
        raise RuntimeError("injected after the forward on rank 1")

    if rank == 1:
        handle = model.lm_head.register_forward_hook(raise_once)
    try:
        generated(model, rows[:2])
        seen["injected_forward"] = "no error"
    except RuntimeError as exc:
        seen["injected_forward"] = str(exc)
    seen["after_injection"] = generated(model, rows[:2])
    return seen


def main() -> None:
    out_dir = Path(sys.argv[1])
    models = dict(arg.split("=", 1) for arg in sys.argv[2:])
    results: dict = {}
    for name, path in models.items():
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", tp_plan="auto").eval()
        rank = dist.get_rank()
        rows = prompts(5, seed=0)
        results[name] = {"rows": rows, "greedy": generated(model, rows, do_sample=False)}
        one = rows[:1]  # a short session: each rank's pages, for the memory check
        results[name]["kv_session"] = engine_session(
            model, rank, lambda e, one=one: {"outputs": [o.output_ids for o in e.generate(one, max_new_tokens=2)]}
        )
        if name == "llama":
            results[name].update(llama_scenarios(model, rank))
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
