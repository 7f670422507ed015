"""The C allocator's thresholds for a CPU engine: the buffers a step frees are kept for the next step.

A CPU step allocates its activations (a 512-token step of the benchmark's 30M Llama: float32 buffers of up to
6 MB, and many smaller ones) and frees them when it ends. glibc's malloc hands buffers of that size back to the
kernel when they are freed: it maps those above its mmap threshold on their own, and trims the free memory at
the top of its heap beyond its trim threshold (the first rises to the largest mapped buffer freed so far, the
second to twice that: a few MB). The next step asks for the same memory again and the kernel faults in and
zeroes every 4 KiB page of it: 103,000 to 198,000 page faults a pass of ``uniform``'s 64 requests on the 30M
Llama in float32, 4-7% of the pass's CPU time (docs/performance.md, "The allocator on the CPU"). vLLM's CPU
build preloads tcmalloc, which keeps freed memory, for the same reason.

``keep_freed_memory`` fixes glibc's mmap threshold at its largest value (``MMAP_THRESHOLD``: smaller buffers
come from the heap) and its trim threshold at ``TRIM_THRESHOLD`` (the heap keeps up to that much free memory
instead of handing it back): under 14,000 faults a pass. The thresholds are the process's: they stay when
the engine is gone (``mallopt`` has no way back to glibc's adaptive defaults), and the process may keep up to
``TRIM_THRESHOLD`` of freed memory per malloc arena. Where malloc is not glibc's (musl, macOS, Windows) nothing
is set; with another allocator preloaded (tcmalloc, jemalloc) glibc's settings are set and unused.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): buffers above it are mapped alone
TRIM_THRESHOLD = 256 << 20  # 64 MiB already kept the 30M Llama's faults at a few thousand a pass

_lock = threading.Lock()
_set: bool | None = None  # None: not asked yet; then whether the thresholds are set


def keep_freed_memory() -> bool:
    """Set glibc's malloc thresholds (once per process; later calls return the first answer). True when they
    are set, False where malloc is not glibc's or ``mallopt`` refused."""
    global _set
    with _lock:
        if _set is None:
            _set = _apply()
        return _set


def _apply() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"; musl has no such name
    except (ValueError, OSError):
        return False
    if not libc.startswith("glibc"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first: setting either fixes both (no adaptation)
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
