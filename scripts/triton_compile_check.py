"""Compile the Triton backend's kernels (``hf_paged_attn/kernels/triton_ops.py``) and the LoRA kernels
(``lora_triton.py``) for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) runs kernels that real Triton rejects (tl.dot shapes, dtype
mixes) and says nothing of registers. This script compiles each kernel the way its host wrapper
launches it (same argument specialization: strides equal to 1, 16-byte alignment), through a stand-in
driver and the JIT's ``warmup`` instead of a launch, with the ptxas bundled in the triton wheel, and
prints registers, spill stack and shared memory per kernel. Nothing runs: it checks compilation and
resources, not results.

    PYTHONPATH=$PWD .venv/bin/python scripts/triton_compile_check.py [--quick]

Relies on Triton internals (``driver.set_active``, ``JITFunction.run(warmup=True)``; written against
triton 3.9); exits 1 if a kernel fails to compile, 2 if the stand-in cannot be set up.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: real kernels
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tempfile.gettempdir(), "hf_paged_attn_sm90_cache"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
COMPILED: list[tuple[str, tuple, object, float]] = []


class _Driver:
    """Just enough of a CUDA driver for the JIT to pick the target and compile."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _compile_instead_of_launch(self, grid):
    def launch(*args, **kwargs):
        start = time.perf_counter()
        kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, grid, kernel, time.perf_counter() - start))

    return launch


def _usage(kernel) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    meta = kernel.metadata
    return (
        f"regs={regs.group(1) if regs else '?'} stack={stack.group(1) if stack else '?'} "
        f"smem={meta.shared} warps={meta.num_warps} stages={meta.num_stages}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bf16, the engine's default shapes only")
    args = parser.parse_args()
    try:
        driver.set_active(_Driver())
        JITFunction.__getitem__ = _compile_instead_of_launch
        from hf_paged_attn.kernels import lora_triton
        from hf_paged_attn.kernels import triton_ops as ops
        from hf_paged_attn.kernels.base import AttentionOptions

        ops._num_sms = lambda device: 132  # an H100/H200's split-K choices
    except Exception as exc:
        print(f"cannot set up the stand-in driver: {type(exc).__name__}: {exc}")
        return 2

    def decode(dtype, batch, heads, kv_heads, dim, block_size, ctx, **options):
        q = torch.zeros(batch, 1, heads, dim, dtype=dtype)
        pages = torch.zeros(64, block_size, kv_heads, dim, dtype=dtype)
        new = torch.zeros(batch, 1, kv_heads, dim, dtype=dtype)
        table = torch.zeros(batch, ctx // block_size, dtype=torch.int32)
        lens = torch.zeros(batch, dtype=torch.int32)
        ops.paged_decode_attention(q, pages, pages, new, new, lens, table, options=AttentionOptions(0.1, **options))

    def prefill(dtype, tokens, heads, kv_heads, dim, block_size, **options):
        q = torch.zeros(tokens, heads, dim, dtype=dtype)
        pages = torch.zeros(64, block_size, kv_heads, dim, dtype=dtype)
        cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
        used = torch.full((2,), tokens, dtype=torch.int32)
        table = torch.zeros(2, 16, dtype=torch.int32)
        ops.paged_prefill_attention(q, pages, pages, cu, used, table, tokens // 2,
                                    options=AttentionOptions(0.1, **options))
        new = torch.zeros(tokens, kv_heads, dim, dtype=dtype)
        ops.write_kv(new, new, pages, pages, torch.zeros(tokens, dtype=torch.int64))

    def lora(x_dtype, w_dtype, rows, num_in, num_out, rank):
        segments = lora_triton.lora_segments(torch.zeros(rows, dtype=torch.long), 3)
        x = torch.zeros(rows, num_in, dtype=x_dtype)
        t = lora_triton.lora_shrink(x, torch.zeros(3, rank, num_in, dtype=w_dtype), segments)
        b = torch.zeros(3, num_out, rank, dtype=w_dtype)
        lora_triton.lora_expand(torch.zeros(rows, num_out, dtype=x_dtype), t, b, torch.ones(3), segments)

    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16, torch.float32]
    shapes = [(32, 8, 128)] if args.quick else [(32, 8, 128), (14, 2, 64), (8, 1, 256), (32, 32, 128)]
    cases = []
    for dtype in dtypes:
        for heads, kv_heads, dim in shapes:
            for bs in (16, 256):
                name = f"{str(dtype)[6:]} H={heads}/{kv_heads} D={dim} block={bs}"
                cases.append((f"decode {name} B=1 ctx=32K", decode, (dtype, 1, heads, kv_heads, dim, bs, 32768)))
                cases.append((f"decode {name} B=64 ctx=2K", decode, (dtype, 64, heads, kv_heads, dim, bs, 2048)))
                cases.append((f"prefill {name}", prefill, (dtype, 512, heads, kv_heads, dim, bs)))
    options = dict(softcap=30.0, window_size=(127, 0), sinks=torch.zeros(8))
    cases.append(
        ("decode bf16 softcap+window+sinks", lambda: decode(torch.bfloat16, 4, 8, 1, 256, 16, 512, **options), ())
    )
    cases.append(
        ("prefill bf16 softcap+window+sinks", lambda: prefill(torch.bfloat16, 512, 8, 2, 128, 16, **options), ())
    )
    lora_dtypes = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
    if not args.quick:
        lora_dtypes += [(torch.float16, torch.float16), (torch.float32, torch.float32)]
    for x_dtype, w_dtype in lora_dtypes:
        for rank in (16, 64) if args.quick else (8, 16, 64, 128):
            name = f"lora x={str(x_dtype)[6:]} w={str(w_dtype)[6:]} rank={rank}"
            cases.append((name, lora, (x_dtype, w_dtype, 256, 4096, 4096, rank)))
    failed = 0
    for label, fn, fn_args in cases:
        try:
            fn(*fn_args)
        except Exception as exc:
            failed += 1
            COMPILED.clear()
            lines = str(exc).strip().splitlines()
            print(f"[FAIL] {label}: {type(exc).__name__}: {' | '.join(lines[-6:])[:800]}", flush=True)
            continue
        for name, grid, kernel, seconds in COMPILED:
            print(f"[OK] {label}: {name} grid={grid} {_usage(kernel)} ({seconds:.1f}s)", flush=True)
        COMPILED.clear()
    print(f"{len(cases) - failed} cases compiled for sm_90, {failed} failed (triton {triton.__version__})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
