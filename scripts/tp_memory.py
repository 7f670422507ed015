"""KV-cache bytes on each rank under tensor parallelism, against one process, for the same num_blocks.

    torchrun --nproc-per-node 2 scripts/tp_memory.py                 # CPU, gloo
    torchrun --nproc-per-node 4 scripts/tp_memory.py --kv-heads 8,2  # 4 GPUs

For each K/V head count, rank 0 saves a random Llama (8 query heads) and every rank loads it with
``tp_plan="auto"``. The engine on rank 0 (the other ranks run ``run_worker``) generates a few
tokens so that every layer's pages exist; then each rank's page bytes are gathered and printed next
to those of one process's engine with the same ``num_blocks``. Expected: 1/N of one process per
rank when the K/V heads divide by the N ranks, the whole of it when there are fewer K/V heads than
ranks (each rank then holds the one head its query heads read).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hf_paged_attn  # noqa: F401  registers "paged"
from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.parallel.tensor_parallel import run_worker
from hf_paged_attn_tools.testing import save_random_model, tiny_llama_config


def kv_bytes(engine: ContinuousBatchingEngine) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in engine.cache.layers if layer.is_initialized)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--kv-heads", default="8,4,1", help="K/V head counts to try (8 query heads)")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # transformers keeps a process group that is already there
    rank, world = dist.get_rank(), dist.get_world_size()
    config = PagedConfig(num_blocks=args.num_blocks, block_size=16, kernel="torch")
    prompt = list(range(1, 20))
    rows = []
    for heads in (int(h) for h in args.kv_heads.split(",")):
        box = [tempfile.mkdtemp(prefix="tp_memory_") if rank == 0 else None]
        if rank == 0:
            model_config = tiny_llama_config(hidden_size=256, num_attention_heads=8, num_key_value_heads=heads)
            save_random_model(model_config, box[0])
        dist.broadcast_object_list(box, src=0)
        model = AutoModelForCausalLM.from_pretrained(box[0], attn_implementation="paged", tp_plan="auto").eval()
        if rank == 0:
            with ContinuousBatchingEngine(model, config) as engine:
                engine.generate([prompt], max_new_tokens=2)
                mine = kv_bytes(engine)
        else:
            mine = run_worker(model).kv_bytes
        per_rank: list[int | None] = [None] * world
        dist.all_gather_object(per_rank, mine)
        if rank == 0:
            alone = AutoModelForCausalLM.from_pretrained(box[0], attn_implementation="paged").eval()
            single = ContinuousBatchingEngine(alone, config)
            single.generate([prompt], max_new_tokens=2)
            rows.append((heads, kv_bytes(single), per_rank))
    if rank == 0:
        print(f"KV pages, {args.num_blocks} blocks of 16 tokens, 2 layers x head_dim 32, fp32, {world} ranks")
        print(f"{'K/V heads':>9} {'one process':>12} " + " ".join(f"{'rank ' + str(r):>10}" for r in range(world))
              + f" {'rank / one':>10}")  # fmt: skip
        for heads, single, per_rank in rows:
            cells = " ".join(f"{b:>10,}" for b in per_rank)
            print(f"{heads:>9} {single:>12,} {cells} {per_rank[0] / single:>10.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
