"""A grammar's token bitmask added to float32 logits on the CPU in native code (``cpu_bitmask.c``).

Structured outputs mask every constrained row each step (``runtime/generation/structured.py``,
``apply_bitmask``). numpy's way takes four passes over a ``[rows, vocab]`` float32 temporary (the bits unpacked,
a 0 / -inf bias made, then added); the C loop reads each word once and adds the bias in place: 32 rows of 4,096
tokens in 0.032-0.035 ms against numpy's 0.092-0.098 and torch's 0.14-0.15, of 128,256 in 0.75-0.80 ms against
3.6-3.7 and 11.7-12.1 (``python benchmarks/mask_apply_cpu.py``, two runs). In the engine (the list workload of
``benchmarks/structured_serve.py``, 32 rows a step) it took 0.06 ms a step where numpy took 0.18 and torch 0.26.
Built on first use like the attention kernels (``cpu_native.build``: the system C compiler, cached); without a
compiler ``apply`` returns False and the caller uses numpy.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from . import cpu_native

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_bitmask.c")


@functools.cache  # (two threads at once may both build: cpu_native.build renames its result into place)
def library() -> ctypes.CDLL | None:
    """The loaded function, built on first use; None (logged once) if it cannot be built."""
    try:
        lib = ctypes.CDLL(str(cpu_native.build(sources=[SOURCE], name="cpu_bitmask")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.info("hf_paged_attn: the native bitmask application is unavailable (numpy): %s", exc)
        return None
    lib.apply_bitmask_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]  # fmt: skip
    lib.apply_bitmask_f32.restype = None
    return lib


def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None) -> bool:
    """``logits[rows[i], t] += -inf`` wherever bit ``t`` of ``bitmask[i]`` is clear, in place; False (nothing
    done) where the library is unavailable or the tensors are not as it reads them. ``logits``: float32 CPU
    ``[num_rows, vocab]``, unit stride along the vocabulary; ``bitmask``: int32 CPU ``[n, words]``, contiguous,
    ``words * 32 >= vocab``; ``rows``: ``n`` distinct indices in ``[0, num_rows)`` (None: ``n == num_rows``)."""
    lib = library()
    if (
        lib is None
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.stride(1) != 1
        or bitmask.dtype != torch.int32
        or bitmask.device.type != "cpu"
        or bitmask.dim() != 2
        or not bitmask.is_contiguous()
        or bitmask.shape[1] * 32 < logits.shape[1]
    ):
        return False
    num_rows, vocab = logits.shape
    n = bitmask.shape[0]
    index = None
    if rows is None:
        if n != num_rows:
            raise ValueError(f"{n} bitmask rows for {num_rows} logits rows")
    else:
        if len(rows) != n:
            raise ValueError(f"{n} bitmask rows for {len(rows)} logits rows")
        if n and (min(rows) < 0 or max(rows) >= num_rows):
            raise IndexError(f"rows must lie in [0, {num_rows}), got {min(rows)} .. {max(rows)}")
        index = (ctypes.c_int64 * n)(*rows)
    lib.apply_bitmask_f32(logits.data_ptr(), logits.stride(0), vocab, bitmask.data_ptr(), bitmask.shape[1], index, n)
    return True
