"""engine.sleep / wake_up on the CPU: the KV pool's memory goes back to the OS (its pages leave memory),
requests are refused while asleep, and greedy after waking equals greedy before,
at both levels and whatever order the tags wake in; level 2 removes and restores the engine's fp32 copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged_attn import ContinuousBatchingEngine, PagedConfig
from hf_paged_attn.demo import DEMO_MODEL
from hf_paged_attn.runtime.cpu import fp32_matmuls

PROMPT = list(range(3, 3 + 40))
# The demo model's pages: 4 layers x (K, V) x [blocks, 16, 2 heads, 64] float32 = 64 KiB a block; 5120 blocks are
# 320 MiB, each page tensor 40 MiB: above glibc's largest mmap threshold (32 MiB), so freeing one unmaps it.
BIG_POOL = 5120


def resident(ranges: list[tuple[int, int]]) -> int:
    """Bytes of these (address, size) ranges backed by memory now: ``/proc/self/pagemap``'s present bit."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    with open("/proc/self/pagemap", "rb") as f:
        for address, size in ranges:
            first, last = address // page, (address + size - 1) // page
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
            total += int(np.count_nonzero(entries >> np.uint64(63))) * page
    return total


def greedy(engine: ContinuousBatchingEngine, ids: list[int], n: int = 8) -> list[int]:
    return engine.generate([ids], max_new_tokens=n)[0].output_ids


def make_engine(num_blocks: int, dtype: torch.dtype = torch.float32, **fields) -> ContinuousBatchingEngine:
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, attn_implementation="paged", dtype=dtype).eval()
    config = PagedConfig(num_blocks=num_blocks, block_size=16, compile=False, enable_prefix_caching=True, **fields)
    return ContinuousBatchingEngine(model, config)


def test_sleep_returns_the_kv_pool_to_the_os_and_wake_gives_the_same_greedy():
    """The pool's own pages are checked (``resident``), not the process's RSS, which counts what every thread
    allocates meanwhile."""
    with make_engine(BIG_POOL) as engine:
        before = greedy(engine, PROMPT)  # the first forward allocates (and zeroes) the pages
        pages = [t for layer in engine.cache.layers for t in (layer.keys, layer.values)]
        pool = sum(t.nbytes for t in pages)
        assert pool >= 300 * 2**20
        ranges = [(t.data_ptr(), t.nbytes) for t in pages]
        assert resident(ranges) >= 0.99 * pool
        freed_tensors = [weakref.ref(t) for t in pages]
        del pages
        freed = engine.sleep(level=1)
        assert freed == pool
        assert all(t() is None for t in freed_tensors)
        left = resident(ranges)
        assert left <= 0.01 * pool, f"{left / 2**20:.0f} MiB of the {pool / 2**20:.0f} MiB pool still in memory"
        assert engine.is_sleeping
        assert not any(layer.is_initialized for layer in engine.cache.layers)
        with pytest.raises(RuntimeError, match="asleep"):
            engine.add_request(PROMPT, max_new_tokens=2)
        assert engine.sleep(level=2) == 0  # asleep already: nothing changes
        engine.wake_up()
        assert not engine.is_sleeping
        assert all(layer.is_initialized for layer in engine.cache.layers)
        assert greedy(engine, PROMPT) == before
        assert greedy(engine, PROMPT) == before  # and from the prefix cache it fills again


# Run in a process of its own: glibc raises its mmap threshold to the size of a large block freed (up to 32 MiB),
# after which 30 MiB tensors come from the heap; freed below one kept, they leave ~570 MiB free inside the heap,
# where malloc then carves the 40 MiB page tensors. (Under ``make test`` a worker's history did the same: 40-80
# MiB of the pool stayed in memory after ``sleep`` until the engine trimmed the heap.)
FROM_THE_HEAP = """
import json, torch
from tests.runtime.model.test_sleep import BIG_POOL, PROMPT, greedy, make_engine, resident
big = torch.empty(31 * 2**20, dtype=torch.uint8)
del big
held = [torch.ones(30 * 2**20, dtype=torch.uint8) for _ in range(20)]
del held[:-1]
with open("/proc/self/maps") as f:
    heap = next([int(x, 16) for x in line.split()[0].split("-")] for line in f if line.rstrip().endswith("[heap]"))
with make_engine(BIG_POOL) as engine:
    greedy(engine, PROMPT)
    ranges = [(t.data_ptr(), t.nbytes) for layer in engine.cache.layers for t in (layer.keys, layer.values)]
    in_heap = sum(heap[0] <= address < heap[1] for address, _ in ranges)
    before = resident(ranges)
    engine.sleep(level=1)
    print(json.dumps([in_heap, len(ranges), before, resident(ranges), sum(n for _, n in ranges)]))
"""


def test_sleep_returns_page_tensors_that_malloc_carved_from_its_heap():
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", FROM_THE_HEAP], cwd=root, env=env, capture_output=True, text=True,
                         timeout=180)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    in_heap, num_pages, before, after, pool = json.loads(run.stdout.splitlines()[-1])
    assert in_heap == num_pages  # the case under test: every page tensor inside the heap
    assert before >= 0.99 * pool
    assert after <= 0.01 * pool, f"{after / 2**20:.0f} MiB of the {pool / 2**20:.0f} MiB pool still in memory"


@pytest.mark.parametrize("level", [1, 2])
def test_tags_wake_in_either_order_and_level_2_restores_the_fp32_copies(level):
    with make_engine(64, dtype=torch.bfloat16, fp32_matmuls=True) as engine:
        before = greedy(engine, PROMPT)
        assert fp32_matmuls.installed(engine.model)
        engine.sleep(level=level)
        assert bool(fp32_matmuls.installed(engine.model)) == (level == 1)  # level 2 frees the engine's copies
        engine.wake_up(tags=["weights"])
        assert fp32_matmuls.installed(engine.model)
        assert engine.is_sleeping  # the KV pool is still asleep
        engine.wake_up(tags=["kv_cache"])
        assert not engine.is_sleeping
        assert greedy(engine, PROMPT) == before


def test_sleep_refuses_unfinished_requests_and_bad_arguments():
    with make_engine(64) as engine:
        engine.add_request(PROMPT, max_new_tokens=2)
        with pytest.raises(RuntimeError, match="unfinished"):
            engine.sleep()
        list(engine.stream())
        with pytest.raises(ValueError, match="level"):
            engine.sleep(level=3)
        engine.sleep()
        with pytest.raises(ValueError, match="tag"):
            engine.wake_up(tags=["kv"])
        assert engine.is_sleeping
        engine.wake_up(tags=[])  # nothing asked: still asleep
        assert engine.is_sleeping
        engine.wake_up()
        assert not engine.is_sleeping
