"""The native CPU attention kernels of a git revision (its C sources and compiler flags) against the working
tree's, on the 30M model's heads (8 / 2 KV, D 64), calls alternating in one process, medians:

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_attention_ab.py [--rev 5620332] [--threads 1] [--reps 21]

Decode calls read random pages (``cpu_attention.pages``); prefill calls pack whole prompts. Prints each
call's milliseconds, the ratio and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cpu_attention import pages  # noqa: E402

from hf_paged_attn.kernels import cpu_native  # noqa: E402

H, H_KV, D = 8, 2, 64


def old_library(rev: str, directory: Path) -> object:
    """The kernels of ``rev``, built with that revision's ``FLAGS``, loaded beside the working tree's."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=HERE, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True,
                              check=True).stdout  # fmt: skip

    sources = []
    for source in cpu_native.SOURCES:
        target = directory / source.name
        target.write_text(show(f"hf_paged_attn/kernels/{source.name}"))
        sources.append(target)
    module = ast.parse(show("hf_paged_attn/kernels/cpu_native.py"))
    flags = next(ast.literal_eval(node.value) for node in module.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "FLAGS" for t in node.targets))  # fmt: skip
    current = cpu_native.FLAGS
    cpu_native.FLAGS = tuple(flags)
    try:
        return cpu_native.load(cpu_native.build(directory=directory, sources=sources, name="old"))
    finally:
        cpu_native.FLAGS = current


def decode_case(batch: int, context: int, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    k_cache, v_cache, table = pages(batch, context, H_KV, D, dtype)
    q = torch.randn(batch, 1, H, D).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return lambda: cpu_native.paged_decode(q, k_cache, v_cache, None, None, lens, table, D**-0.5, -1, 0.0, None,
                                           context)  # fmt: skip


def prefill_case(lengths: list[int], dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    k_cache, v_cache, table = pages(len(lengths), max(lengths), H_KV, D, dtype)
    q = torch.randn(sum(lengths), H, D).to(dtype)  # [total_q, H, D]
    cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    used = torch.tensor(lengths, dtype=torch.int32)
    return lambda: cpu_native.paged_prefill(q, k_cache, v_cache, cu_q, used, table, D**-0.5, -1, 0.0, None,
                                            max(lengths))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="5620332", help="the git revision to compare against")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, opts.dtype)
    new = cpu_native.library()
    if new is None:
        raise SystemExit("the native kernels are unavailable here")
    with tempfile.TemporaryDirectory() as tmp:
        old = old_library(opts.rev, Path(tmp))
    cases = {
        "decode 49 x 250": decode_case(49, 250, dtype),
        "decode 64 x 64": decode_case(64, 64, dtype),
        "decode 16 x 1024": decode_case(16, 1024, dtype),
        "prefill 4 x 128": prefill_case([128] * 4, dtype),
        "prefill 6 prompts, 17-311": prefill_case([17, 60, 120, 200, 250, 311], dtype),
        "prefill 1 x 2048": prefill_case([2048], dtype),
    }
    print(f"torch {torch.__version__}, {opts.threads} threads, {opts.dtype}, ISA {cpu_native.best_isa()}, "
          f"{opts.rev} against the working tree, median ms of {opts.reps}")  # fmt: skip
    libraries = {"old": old, "new": new}
    for name, call in cases.items():
        outputs = {}
        for key, lib in libraries.items():
            cpu_native._library = lib
            outputs[key] = call().float()
        times: dict[str, list[float]] = {key: [] for key in libraries}
        for _ in range(opts.reps):
            for key, lib in libraries.items():
                cpu_native._library = lib
                start = time.perf_counter()
                call()
                times[key].append(time.perf_counter() - start)
        cpu_native._library = new
        old_ms, new_ms = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
        diff = (outputs["old"] - outputs["new"]).abs().max().item()
        print(f"{name:28s} old {old_ms:8.3f}  new {new_ms:8.3f}  old/new {old_ms / new_ms:5.2f}x  max diff {diff:.1e}")


if __name__ == "__main__":
    main()
