"""The native CPU decode kernel (``cpu_decode.c``): built on first use, called through ctypes.

The torch backend's decode calls ``paged_decode`` first on the CPU; it returns None whenever the
kernel cannot take the call (no C compiler, a dtype other than float32/bfloat16, a layout it does not
read, ``HF_PAGED_ATTN_NATIVE=0`` in the environment), and the backend then gathers pages as before.

The library is compiled once per source, compiler and CPU with the system compiler (``$CC``, else
``cc``), at ``-O3 -march=native`` (the dot products vectorise for the machine it runs on), and cached
in ``$HF_PAGED_ATTN_CACHE`` (default ``~/.cache/hf_paged_attn``). It needs no Python or torch headers,
so a build takes well under a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Multiply-adds of one call above which its (request, kv head) tasks are split over torch's
# threads: starting a thread costs tens of microseconds, a small decode step takes about as much.
# The bundled model's decode at 64 requests (~2M) ran 1.5 -> 1.34 s end to end with 2 threads on
# an idle 2-core machine (on a loaded one, threads that wait to be scheduled cost more than that).
_THREADED_WORK = 1 << 19


class _Args(ctypes.Structure):
    """``DecodeArgs`` in cpu_decode.c, field for field."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("q", "out", "k_cache", "v_cache", "k_new", "v_new")),
        ("seqlens", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("sinks", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in ("batch", "heads", "kv_heads", "dim", "block_size", "width")),
        ("num_blocks", ctypes.c_int64),
        *((name, ctypes.c_int64) for name in ("q_sb", "q_sh", "new_sb", "new_sh", "window_left")),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("dtype", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


_library: ctypes.CDLL | None = None
_failed = False
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("HF_PAGED_ATTN_NATIVE", "1") not in ("0", "false", "False", "")


def cache_dir() -> Path:
    return Path(os.environ.get("HF_PAGED_ATTN_CACHE") or Path.home() / ".cache" / "hf_paged_attn")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(compiler: str | None = None, directory: Path | None = None) -> Path:
    """Compile the kernel (or find it already compiled); returns the library's path. Raises
    RuntimeError with the compiler's message when it cannot be built."""
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC to one)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), compiler, version, *FLAGS, _cpu_model(), platform.machine()]).encode()
    ).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"cpu_decode-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # then renamed: another process may race
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm", "-lpthread"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None (logged once) if it cannot be built or is disabled."""
    global _library, _failed
    if _library is not None or _failed or not enabled():
        return _library if enabled() else None
    with _lock:
        if _library is None and not _failed:
            try:
                lib = ctypes.CDLL(str(build()))
                lib.paged_decode.argtypes = [ctypes.POINTER(_Args)]
                lib.paged_decode.restype = ctypes.c_int
                _library = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _failed = True
                logger.warning("hf_paged_attn: the native CPU decode kernel is unavailable, using torch ops: %s", exc)
    return _library


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    window_left: int,
    softcap: float,
    sinks: torch.Tensor | None,
    max_len: int,
) -> torch.Tensor | None:
    """``paged_decode_attention`` (torch backend semantics, ``causal=True``) in native code, or None
    when it cannot take this call. ``max_len``: the longest request's tokens, appended one included
    (sizes the threading). q [B, 1, H, D] -> [B, 1, H, D]."""
    dtype = _DTYPES.get(q.dtype)
    if dtype is None or q.device.type != "cpu" or (lib := library()) is None:
        return None
    b, _, h, d = q.shape
    hk = k_cache.shape[2]
    appended = k is not None and v is not None
    new = [k[:, 0], v[:, 0]] if appended else []  # [B, H_kv, D]
    # The C code trusts these shapes: a mismatch would read past a tensor, so it is refused here.
    if (
        k_cache.shape != v_cache.shape
        or k_cache.shape[3] != d
        or tuple(cache_seqlens.shape) != (b,)
        or block_table.dim() != 2
        or block_table.shape[0] != b
        or any(tuple(t.shape) != (b, hk, d) for t in new)
    ):
        raise ValueError(
            f"paged decode: shapes do not agree: q {tuple(q.shape)}, pages {tuple(k_cache.shape)} / "
            f"{tuple(v_cache.shape)}, cache_seqlens {tuple(cache_seqlens.shape)}, block_table "
            f"{tuple(block_table.shape)}, new K/V {[tuple(t.shape) for t in new]}"
        )
    if (
        any(t.dtype != q.dtype or t.stride(-1) != 1 for t in (k_cache, v_cache, *new))
        or q.stride(-1) != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or (appended and new[0].stride() != new[1].stride())
        or h % hk
        or cache_seqlens.dtype != torch.int32
        or block_table.dtype != torch.int32
        or not (cache_seqlens.is_contiguous() and block_table.is_contiguous())
    ):
        return None
    sinks = sinks.float().contiguous() if sinks is not None else None
    out = torch.empty(b, 1, h, d, dtype=q.dtype)
    threads = torch.get_num_threads() if b * h * max_len * d > _THREADED_WORK else 1
    args = _Args(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        _pointer(new[0] if new else None), _pointer(new[1] if new else None),
        cache_seqlens.data_ptr(), block_table.data_ptr(), _pointer(sinks),
        b, h, hk, d, k_cache.shape[1], block_table.shape[1], k_cache.shape[0],
        q.stride(0), q.stride(2), new[0].stride(0) if new else 0, new[0].stride(1) if new else 0,
        window_left, softmax_scale, softcap, dtype, threads,
    )  # fmt: skip
    status = lib.paged_decode(ctypes.byref(args))
    if status == 2:
        raise ValueError("paged decode: a request has no cache block for its new token (block_table too short)")
    if status != 0:
        raise MemoryError("paged decode: the native kernel could not allocate its scratch memory")
    return out
