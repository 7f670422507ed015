"""The native CPU attention kernels (hf_paged_attn/kernels/cpu_native.py) next to what they replace, in one
process, calls interleaved round-robin so that the machine's load falls on every column alike:

* decode: the native kernels as they were at git revision ``--old-rev`` (``cpu_attention*.c`` there, built
  here) against the working tree's, and the working tree's capped to their portable kernels;
* prefill: ``cpu_native.paged_prefill`` against the torch backend's ``paged_prefill_attention`` with the
  native kernel off (every prefilling request's keys gathered from the pages, then SDPA), and "chosen":
  ``paged_prefill_attention`` as the engine calls it (native, or gathered where ``sdpa_prefill_wins``);
* shared-prefix decode: 64 requests on one 512-token prefix, 32-token tails each, with and without the
  grouping (and the torch backend's own cascade, native off, for reference).

    python benchmarks/cpu_attention.py [--threads N] [--reps R] [--old-rev REV] [--quick] [--cold] [--isa ISA]

``--cold``: a 64 MiB buffer is written before every decode call, so that the pages come from memory as in an
engine's step (each layer's pages are read once a step, and a step's layers together outgrow the caches).
``--isa``: the old and new decode kernels of that instruction set (``avx2``, ``avx512``, ...), not the best.

Shapes: the bundled demo model (H=4, H_kv=2, D=64), a 28M Llama (H=8, H_kv=4, D=64) and the 30M Llama of
``hf-paged-attn bench vllm`` (H=8, H_kv=2, D=64); block size 16.
Medians in ms per call (one layer); ratios are old / new (above 1: the new one is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn.kernels import cpu_native, torch_backend
from hf_paged_attn.kernels.base import AttentionOptions

BLOCK = 16
SHAPES = {"demo": (4, 2, 64), "llama28m": (8, 4, 64), "llama30m": (8, 2, 64)}  # H, H_kv, D


SOURCES = ("cpu_attention.c", "cpu_attention_avx2.c", "cpu_attention_avx512.c")


def old_kernels(rev: str) -> ctypes.CDLL | None:
    """The native kernels as they were at ``rev`` (git), built into a temporary directory; None if git cannot
    show them there."""
    repo = Path(__file__).resolve().parent.parent
    directory = Path(tempfile.mkdtemp())
    for name in SOURCES:
        shown = subprocess.run(["git", "show", f"{rev}:hf_paged_attn/kernels/{name}"], cwd=repo,
                               capture_output=True, text=True)  # fmt: skip
        if shown.returncode != 0:
            print(f"(no old kernels: {shown.stderr.strip()})")
            return None
        (directory / name).write_text(shown.stdout)
    return cpu_native.load(cpu_native.build(directory=directory, sources=[directory / n for n in SOURCES], name="old"))


def on(library: ctypes.CDLL, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with ``cpu_native``'s calls going to ``library``."""

    def call() -> object:
        current = cpu_native.library()
        cpu_native._library = library
        try:
            return fn()
        finally:
            cpu_native._library = current

    return call


@contextlib.contextmanager
def torch_ops_only() -> Iterator[None]:
    """The torch backend without its native kernels: it asks ``cpu_native.library()`` at every call."""
    library = cpu_native.library
    cpu_native.library = lambda: None
    try:
        yield
    finally:
        cpu_native.library = library


def compare(fns: dict[str, Callable[[], object]], reps: int, flush: torch.Tensor | None = None) -> dict[str, float]:
    """Median ms per call of each function, called round-robin after one warm-up call each; ``flush`` is
    written before each call (the caches then hold it, not what the call reads)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            if flush is not None:
                flush.add_(1)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def pages(batch: int, context: int, hk: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    per_seq = blocks_for(context, BLOCK)
    num_blocks = batch * per_seq
    table = torch.randperm(num_blocks).view(batch, per_seq).int()  # [B, blocks], shuffled pages
    k_cache = torch.randn(num_blocks, BLOCK, hk, d).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, hk, d).to(dtype)
    return k_cache, v_cache, table


def bench_decode(
    shape: str, dtype: torch.dtype, batch: int, context: int, old: ctypes.CDLL | None, reps: int,
    flush: torch.Tensor | None, isa: str | None = None,
) -> None:  # fmt: skip
    h, hk, d = SHAPES[shape]
    k_cache, v_cache, table = pages(batch, context, hk, d, dtype)
    q = torch.randn(batch, 1, h, d).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    scale = d**-0.5

    def new(isa: str | None = None) -> Callable[[], object]:
        return lambda: cpu_native.paged_decode(
            q, k_cache, v_cache, None, None, lens, table, scale, -1, 0.0, None, context, isa=isa
        )

    fns = {"new": new(isa), "portable": new("portable")}
    if old is not None:
        fns["old"] = on(old, new(isa))
    ms = compare(fns, reps, flush)
    ratio = f"{ms['old'] / ms['new']:5.2f}x" if "old" in ms else "  -  "
    old_ms = ms.get("old", float("nan"))
    print(f"decode  {shape:8s} {str(dtype)[6:]:8s} B={batch:3d} ctx={context:5d}  old {old_ms:8.3f}"
          f"  new {ms['new']:8.3f}  portable {ms['portable']:8.3f}  old/new {ratio}")  # fmt: skip


def bench_prefill(shape: str, dtype: torch.dtype, name: str, q_lens: list[int], k_lens: list[int], reps: int) -> None:
    h, hk, d = SHAPES[shape]
    batch = len(q_lens)
    k_cache, v_cache, table = pages(batch, max(k_lens), hk, d, dtype)
    q = torch.randn(sum(q_lens), h, d).to(dtype)  # [total_q, H, D]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    used = torch.tensor(k_lens, dtype=torch.int32)
    scale = d**-0.5
    memo: dict = {}

    def gathered() -> object:
        with torch_ops_only():
            return torch_backend.paged_prefill_attention(
                q, k_cache, v_cache, cu_q, used, table, max(q_lens),
                options=AttentionOptions(softmax_scale=scale), memo=memo
            )

    def native(isa: str | None = None) -> Callable[[], object]:
        return lambda: cpu_native.paged_prefill(
            q, k_cache, v_cache, cu_q, used, table, scale, -1, 0.0, None, max(q_lens), isa=isa
        )

    chosen_memo: dict = {}  # as the engine's layers share one step's plan (and the choice)

    def chosen() -> object:  # what the engine runs: native, or gathered where it loses (sdpa_prefill_wins)
        return torch_backend.paged_prefill_attention(q, k_cache, v_cache, cu_q, used, table, max(q_lens),
                                                     options=AttentionOptions(scale), memo=chosen_memo)  # fmt: skip

    fns = {"gather+SDPA": gathered, "native": native(), "portable": native("portable"), "chosen": chosen}
    ms = compare(fns, reps)
    print(f"prefill {shape:8s} {str(dtype)[6:]:8s} {name:28s} gather+SDPA {ms['gather+SDPA']:8.3f}"
          f"  native {ms['native']:8.3f}  portable {ms['portable']:8.3f}  chosen {ms['chosen']:8.3f}"
          f"  gather/native {ms['gather+SDPA'] / ms['native']:5.2f}x")  # fmt: skip


def bench_shared_prefix(shape: str, dtype: torch.dtype, reps: int, old: ctypes.CDLL | None) -> None:
    h, hk, d = SHAPES[shape]
    batch, prefix, tail = 64, 512, 32
    shared = prefix // BLOCK
    per_seq = blocks_for(prefix + tail, BLOCK)
    num_blocks = shared + batch * (per_seq - shared)
    own = torch.arange(shared, num_blocks).view(batch, per_seq - shared)  # [B, tail blocks]
    table = torch.cat([torch.arange(shared).expand(batch, shared), own], dim=1).int().contiguous()
    k_cache = torch.randn(num_blocks, BLOCK, hk, d).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, hk, d).to(dtype)
    q = torch.randn(batch, 1, h, d).to(dtype)
    lens = torch.full((batch,), prefix + tail, dtype=torch.int32)
    scale = d**-0.5
    info: dict = {}

    def new(shared_prefix: bool) -> Callable[[], object]:
        return lambda: cpu_native.paged_decode(
            q, k_cache, v_cache, None, None, lens, table, scale, -1, 0.0, None, prefix + tail,
            shared_prefix=shared_prefix, info=info,
        )  # fmt: skip

    memo: dict = {}

    def torch_cascade() -> object:
        with torch_ops_only():
            return torch_backend.paged_decode_attention(q, k_cache, v_cache, None, None, lens, table,
                                                        options=AttentionOptions(scale), memo=memo)  # fmt: skip

    fns = {"grouped": new(True), "ungrouped": new(False), "torch cascade": torch_cascade}
    if old is not None:
        fns["old"] = on(old, new(True))
    ms = compare(fns, reps)
    new(True)()
    print(
        f"shared  {shape:8s} {str(dtype)[6:]:8s} 64 x (512 shared + 32 own) groups={info['groups']}  "
        + "  ".join(f"{k} {v:8.3f}" for k, v in ms.items())
        + f"  ungrouped/grouped {ms['ungrouped'] / ms['grouped']:5.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--old-rev", default="HEAD", help="git revision of the kernels to compare with")
    parser.add_argument("--quick", action="store_true", help="the demo model's shapes only")
    parser.add_argument("--cold", action="store_true", help="decode: the pages come from memory, not the caches")
    parser.add_argument("--isa", default=None, help="decode: old and new kernels of this instruction set")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    old = old_kernels(opts.old_rev)
    flush = torch.empty(64 << 20, dtype=torch.uint8) if opts.cold else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, native ISA {cpu_native.best_isa()}, "
          f"block {BLOCK}, median ms per call of {opts.reps}")  # fmt: skip
    shapes = ["demo"] if opts.quick else list(SHAPES)
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            for batch in (1, 16, 64):
                for context in (128, 512, 2048):
                    bench_decode(shape, dtype, batch, context, old, opts.reps, flush, opts.isa)
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            bench_prefill(shape, dtype, "1 prompt x 512", [512], [512], opts.reps)
            bench_prefill(shape, dtype, "4 prompts x 128", [128] * 4, [128] * 4, opts.reps)
            bench_prefill(shape, dtype, "1 prompt x 2048", [2048], [2048], opts.reps)
            bench_prefill(shape, dtype, "256-token chunk, 1024 cached", [256], [1280], opts.reps)
            bench_prefill(shape, dtype, "128-token chunk, 896 cached", [128], [1024], opts.reps)
            bench_prefill(shape, dtype, "6 prompts of mixed lengths", [17, 60, 128, 200, 311, 90],
                          [17, 60, 128, 200, 311, 90], opts.reps)  # fmt: skip
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            bench_shared_prefix(shape, dtype, opts.reps, old)


if __name__ == "__main__":
    main()
