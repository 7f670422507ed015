"""The native CPU attention kernels (``cpu_attention.c``): built on first use, called through ctypes.

Two entry points with the torch backend's semantics, each returning None whenever the kernel cannot take
the call (no C compiler, a dtype other than float32/bfloat16, a layout it does not read, a head dim above
512), and the backend then uses its torch ops:

* ``paged_decode``: one query per request, the new token appended in place; requests that share leading
  physical blocks (prefix caching, ``num_return_sequences`` forks) read those blocks once per group
  (``shared_prefix=True``, the default).
* ``paged_prefill``: packed queries against each request's keys in the pages, flash-attention style.

The instruction set is chosen per call from the CPU: AVX-512 BF16 pair dot products for bfloat16 where the
CPU has them, AVX-512 (fp32 arithmetic) where it has those, AVX2 with FMA (fp32 arithmetic) on x86-64 CPUs
without AVX-512, else portable C that the compiler vectorises for the machine. ``isa=`` (``portable``,
``avx2``, ``avx512``, ``avx512bf16``) caps it, for tests and comparisons; a cap above what the CPU has means
the best it has. Tests and benchmarks that compare with the torch ops put a ``library`` that returns None in
this module's place (``monkeypatch.setattr(cpu_native, "library", lambda: None)``).

The library is compiled once per source, compiler and CPU with the system compiler (``$CC``, else ``cc``)
at ``-O3 -march=native`` and cached in ``$HF_PAGED_ATTN_CACHE`` (default ``~/.cache/hf_paged_attn``); a
compiler without the AVX-512 intrinsics gets the portable kernels only. It needs no Python or torch
headers, so a build takes a second or two.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from .kv_dtype import to_pages, writable

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
# The first includes the others.
SOURCES = (SOURCE, SOURCE.with_name("cpu_attention_avx512.c"), SOURCE.with_name("cpu_attention_avx2.c"))
# -fno-trapping-math: without it GCC keeps the softmax's e^x loops scalar (their clamps are branches it may
# not turn into selects while floating-point exceptions count); with it the prefill ran 1.35x faster and the
# decode 1.15x on a Zen 1 EPYC (`benchmarks/cpu_attention.py`, docs/performance.md). The kernels never read the flags.
# -fopenmp: the kernels' threads are OpenMP's, the runtime torch loaded (libgomp.so.1, one soname), not a pool
# of their own competing for the cores with OpenMP's spinning workers: on the 30M model the native attention
# took 1.5 s a run with GOMP_SPINCOUNT=3000 and 2.5 s at 300,000 with a pool of its own.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fPIC", "-shared", "-std=c11")
PORTABLE_ONLY = "-DHF_PAGED_ATTN_PORTABLE_ONLY"  # the retry when the compiler lacks the x86 intrinsics
NO_OPENMP = "-fopenmp-simd"  # -fopenmp's stand-in when the compiler has no OpenMP (a pool of pthreads then)
ISAS = {"best": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4}  # Args.isa
MAX_HEAD_DIM = 512
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_PAGE_DTYPES = {torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}  # Args.page_dtype of one-byte pages (else 0)
# Multiply-adds of one call above which its tasks go to the kernel's thread pool (torch's thread count):
# waking a sleeping worker costs ~10-50 us, which a small call does not repay. What pays is time, so the
# bound follows the kernels' speed. AVX-512 (a 2-core Xeon of docs/performance.md): a second thread cost
# ~10% at 1M (~0.1 ms calls) and broke even at 4M. AVX2 (a 2-core Zen 1 EPYC), decode calls read from
# memory: 1.9M (1.37 ms) ran in 1.01 ms on two threads, 475K in 0.20 against 0.23 ms, 82K lost (0.115
# against 0.096 ms). AMD's AVX-512 (a 2-core Zen 4 EPYC, whose units split 512-bit ops in two): the bundled model's
# decode calls (64 requests, ~1.6M) took 0.5 ms on one thread, and passes of its 64 x 64 workload ran 5-18% faster
# with the AVX2 bound than with the Xeon's (``GOMP_SPINCOUNT=3000``; level under ``OMP_WAIT_POLICY=PASSIVE``; the 30M
# model's calls, larger, level). ``threaded_work()`` is the bound; a value set here (tests) overrides it.
_THREADED_WORK: int | None = None
_THREADED_WORK_BY_ISA = {"avx512": 1 << 21, "avx512bf16": 1 << 21}  # Intel's; else (AVX2, portable, AMD) 1 << 18


class _Args(ctypes.Structure):
    """``Args`` in cpu_attention.c, field for field."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("q", "out", "k_cache", "v_cache", "k_new", "v_new")),
        *((name, ctypes.c_void_p) for name in ("seqlens", "cu_q", "table", "sinks")),
        *((name, ctypes.c_int64) for name in ("batch", "heads", "kv_heads", "dim", "block_size", "width")),
        ("num_blocks", ctypes.c_int64),
        *((name, ctypes.c_int64) for name in ("q_s0", "q_s1", "o_s0", "o_s1", "new_sb", "new_sh", "window_left")),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        *((name, ctypes.c_int32) for name in ("dtype", "num_threads", "isa", "causal", "cascade", "num_groups")),
        ("new_v_sb", ctypes.c_int64),
        ("new_v_sh", ctypes.c_int64),
        ("page_dtype", ctypes.c_int32),
    ]


_library: ctypes.CDLL | None = None
_failed = False
_lock = threading.Lock()


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


def build(
    compiler: str | None = None,
    directory: Path | None = None,
    sources: Sequence[Path] = SOURCES,
    name: str = "cpu_attention",
) -> Path:
    """Compile ``sources[0]`` (which includes the others) or find it already compiled; returns the library's
    path. Raises RuntimeError with the compiler's message when it cannot be built."""
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (set CC to one)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [Path(s).read_text() for s in sources]
    key = hashlib.sha256(
        "\0".join([*texts, compiler, version, *FLAGS, _cpu_model(), platform.machine()]).encode()
    ).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"{name}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # then renamed: another process may race
        built = Path(tmp) / target.name
        command = [compiler, *FLAGS, "-o", str(built), str(sources[0]), "-lm", "-lpthread"]
        without_openmp = [NO_OPENMP if flag == "-fopenmp" else flag for flag in command]
        # Each until one builds: e.g. a compiler without the AVX-512 BF16 intrinsics, or without OpenMP.
        attempts = (command, [command[0], PORTABLE_ONLY, *command[1:]], without_openmp,
                    [without_openmp[0], PORTABLE_ONLY, *without_openmp[1:]])  # fmt: skip
        first = None
        for attempt in attempts:
            done = subprocess.run(attempt, capture_output=True, text=True, timeout=120)
            first = first or done
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{compiler} could not build {Path(sources[0]).name}: {first.stderr.strip()[-2000:]}")
        if attempt is not command:
            fallbacks = " ".join(f for f in attempt if f in (PORTABLE_ONLY, NO_OPENMP))
            logger.info("hf_paged_attn: the native CPU kernels were built with %s: %s", fallbacks, first.stderr[-500:])
        os.replace(built, target)
    return target


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` (from ``build``) with its entry points declared."""
    lib = ctypes.CDLL(str(path))
    lib.paged_decode.argtypes = [ctypes.POINTER(_Args)]
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_prefill.argtypes = [ctypes.POINTER(_Args), ctypes.c_int64]
    lib.paged_prefill.restype = ctypes.c_int
    lib.attention_best_isa.argtypes = []
    lib.attention_best_isa.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None (logged once) if they cannot be built."""
    global _library, _failed
    if _library is not None or _failed:
        return _library
    with _lock:
        if _library is None and not _failed:
            try:
                _library = load(build())
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _failed = True
                logger.warning("hf_paged_attn: the native CPU attention kernels are unavailable (torch ops): %s", exc)
    return _library


def best_isa() -> str | None:
    """The instruction set the kernels use on this CPU (a key of ``ISAS``), or None without the library."""
    lib = library()
    if lib is None:
        return None
    best = lib.attention_best_isa()
    return next(name for name, value in ISAS.items() if value == best)


@functools.cache
def _threaded_work_by_isa() -> int:
    if _cpu_vendor() == "AuthenticAMD":
        return 1 << 18
    return _THREADED_WORK_BY_ISA.get(best_isa() or "portable", 1 << 18)


def _cpu_vendor() -> str | None:
    """``/proc/cpuinfo``'s ``vendor_id`` (x86 Linux), else None."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def threaded_work() -> int:
    """Multiply-adds of a call above which the kernels run it on torch's thread count (see above)."""
    return _THREADED_WORK if _THREADED_WORK is not None else _threaded_work_by_isa()


# Where the native prefill loses to gathering the pages into SDPA, whose flash kernel multiplies in blocked
# GEMMs (``torch_backend.paged_prefill_attention`` then gathers): with the portable kernels (a CPU or a
# compiler without AVX2), for any request of some size. The 30M model's heads (8 / 2 KV, D 64), 2 threads,
# a Zen 1 EPYC with the kernels capped at ``portable`` (`benchmarks/cpu_attention.py`, docs/performance.md), gathered /
# native time: 0.74 on 6 prompts of 17-311 tokens, 0.74 on 4 x 128, 0.88 on 8 x 64, 0.85 on 64 queries over
# 128 keys, 0.38 on 16 over 1,024, 0.59 on one 512-token prompt, 0.35 on 2,048; native ahead on 32 prompts
# of 16 tokens (1.56). The AVX2 kernels beat SDPA on every one of these (1.03-2.5x: a twelfth-session rule
# that sent long rectangles there went with the vectorised softmax), and the AVX-512 ones are faster still.
SDPA_MIN_QUERIES = 16  # fewer queries a request: native (decode-like rows, speculative verification)
SDPA_MIN_WORK = 64 * 64  # queries x keys of a request below which SDPA's per-request cost dominates


def sdpa_prefill_wins(q_lens: list[int], k_lens: list[int], isa: str | None = None) -> bool:
    """Whether gathering into SDPA beats the native prefill for a call whose requests have ``q_lens``
    queries over ``k_lens`` visible keys (see above): when the kernels in use are the portable ones and the
    requests where SDPA wins hold most of the call's query x key work."""
    best = best_isa()
    if best is None:
        return False
    cap = _isa(isa)
    if min(cap or ISAS[best], ISAS[best]) > ISAS["portable"]:
        return False
    favoured = total = 0
    for q, k in zip(q_lens, k_lens):
        work = q * k
        total += work
        if q >= SDPA_MIN_QUERIES and work >= SDPA_MIN_WORK:
            favoured += work
    return 2 * favoured > total


def _isa(isa: str | None) -> int:
    name = isa or "best"
    if name not in ISAS:
        raise ValueError(f"isa must be one of {sorted(ISAS)}, got {name!r}")
    return ISAS[name]


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _readable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *index: torch.Tensor) -> bool:
    """Whether the C code reads these tensors as they are (else the caller falls back to torch ops). Plain
    ``and`` chains, no generators: this runs at every layer of every step."""
    ok = (
        (k_cache.dtype == q.dtype or k_cache.dtype in _PAGE_DTYPES)
        and v_cache.dtype == k_cache.dtype
        and q.stride(-1) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.shape[-1] <= MAX_HEAD_DIM
        and q.shape[-2] % k_cache.shape[2] == 0
    )
    for t in index:
        ok = ok and t.dtype == torch.int32 and t.is_contiguous()
    return ok


def _raise_for_decode_status(status: int) -> None:
    """The native decode's return code as the error it stands for (0: none)."""
    if status == 2:
        raise ValueError("paged decode: a request has no cache block for its new token (block_table too short)")
    if status != 0:
        raise MemoryError("paged decode: the native kernel could not allocate its scratch memory")


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
    *,
    shared_prefix: bool = True,
    isa: str | None = None,
    info: dict | None = None,
) -> torch.Tensor | None:
    """``paged_decode_attention`` (torch backend semantics, ``causal=True``) in native code, or None when it
    cannot take this call. q [B, 1, H, D] -> [B, 1, H, D]; k, v [B, 1, H_kv, D] appended at ``cache_seqlens``
    (or None: ``cache_seqlens`` keys are attended); ``max_len``: the longest request's tokens, appended one
    included (sizes the threading). ``shared_prefix``: requests whose leading blocks are the same physical
    blocks read them once per group (no effect with a window). ``isa``: cap on the instruction set (``ISAS``).
    ``info``: if given, ``info["groups"]`` is set to the number of shared-prefix groups formed."""
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
        or cache_seqlens.shape != (b,)
        or block_table.dim() != 2
        or block_table.shape[0] != b
        or (appended and (new[0].shape != (b, hk, d) or new[1].shape != (b, hk, d)))
    ):
        raise ValueError(
            f"paged decode: shapes do not agree: q {tuple(q.shape)}, pages {tuple(k_cache.shape)} / "
            f"{tuple(v_cache.shape)}, cache_seqlens {tuple(cache_seqlens.shape)}, block_table "
            f"{tuple(block_table.shape)}, new K/V {[tuple(t.shape) for t in new]}"
        )
    if not _readable(q, k_cache, v_cache, cache_seqlens, block_table) or (
        appended
        and (new[0].dtype != q.dtype or new[1].dtype != q.dtype or new[0].stride(-1) != 1 or new[1].stride(-1) != 1)
    ):
        return None
    page_dtype = _PAGE_DTYPES.get(k_cache.dtype, 0)
    if appended and page_dtype:  # the C code never rounds into fp8: the new K/V go in first, then are attended
        _append_fp8(k_cache, v_cache, new[0], new[1], cache_seqlens, block_table)
        cache_seqlens, new, appended = cache_seqlens + 1, [], False
    sinks = sinks.float().contiguous() if sinks is not None else None
    out = torch.empty(b, 1, h, d, dtype=q.dtype)
    threads = torch.get_num_threads() if b * h * max_len * d > threaded_work() else 1
    args = _Args(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        _pointer(new[0] if new else None), _pointer(new[1] if new else None),
        cache_seqlens.data_ptr(), None, block_table.data_ptr(), _pointer(sinks),
        b, h, hk, d, k_cache.shape[1], block_table.shape[1], k_cache.shape[0],
        q.stride(0), q.stride(2), out.stride(0), out.stride(2),
        new[0].stride(0) if new else 0, new[0].stride(1) if new else 0,
        window_left, softmax_scale, softcap, dtype, threads, _isa(isa), 1, int(shared_prefix), 0,
        new[1].stride(0) if new else 0, new[1].stride(1) if new else 0, page_dtype,
    )  # fmt: skip
    _raise_for_decode_status(lib.paged_decode(ctypes.byref(args)))
    if info is not None:
        info["groups"] = args.num_groups
    return out


def _append_fp8(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """k, v [B, H_kv, D] rounded into fp8 pages at position ``cache_seqlens[b]`` of each request."""
    block_size = k_cache.shape[1]
    pos = cache_seqlens.long()  # [B]
    blocks = block_table.gather(1, (pos // block_size).clamp_max(block_table.shape[1] - 1).unsqueeze(1))[:, 0]
    if bool(((pos // block_size >= block_table.shape[1]) | (blocks < 0)).any()):
        _raise_for_decode_status(2)
    slots = blocks.long() * block_size + pos % block_size  # [B]
    for cache, new in ((k_cache, k), (v_cache, v)):
        writable(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, to_pages(new, cache.dtype))


class DecodeLayers:
    """One decode step's native calls, layer after layer, for the compiled forward's attention op
    (``attention/function.py``): one ``_Args`` block holds what the step's layers share (lengths, block table,
    shapes, strides, scale, threads), set at the first layer (``make``); each call sets only its layer's
    pointers. ``paged_decode`` checks and reshapes every argument at every call: inside a step, where the
    matmuls between two layers leave the caches cold, that cost more than the kernel for a few requests
    (`benchmarks/lean_decode_ab.py`, docs/performance.md).

    Layouts are the model's own, nothing copied: query [1, H, M, D] and the new key / value [1, H_kv, M, D]
    (any strides with a unit last one: the layers' projections and rotary embeddings give views), of which
    the first B rows are the step's requests (M >= B: the rest are padding rows, never read); the output
    [1, M, H, D] contiguous, its padding rows zero. A layer whose tensors differ from the first's in shape,
    strides or dtype gets None (the caller takes the general path)."""

    __slots__ = ("args", "args_ref", "lib", "batch", "layout", "dtype", "scale")

    def __init__(
        self, lib: ctypes.CDLL, args: _Args, batch: int, layout: tuple, dtype: torch.dtype, scale: float
    ) -> None:
        self.lib, self.args, self.batch, self.layout, self.dtype, self.scale = lib, args, batch, layout, dtype, scale
        self.args_ref = ctypes.byref(args)  # made once: every call passes the same block

    @classmethod
    def make(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor,
        max_seqlen_k: int,
        softmax_scale: float,
        *,
        shared_prefix: bool = True,
        isa: str | None = None,
    ) -> DecodeLayers | None:
        """The step's calls shaped after this layer's tensors (the torch backend's ``decode_layers``); None
        where the kernel can't take them (off the CPU among others: then the general path decides).
        ``cache_seqlens`` int32 [B], ``block_table`` int32 [B, W], ``max_seqlen_k`` the longest request's keys,
        new token included."""
        dtype = _DTYPES.get(query.dtype)
        if dtype is None or query.device.type != "cpu" or query.dim() != 4 or (lib := library()) is None:
            return None
        _, h, m, d = query.shape
        b, hk = cache_seqlens.shape[0], k_cache.shape[2]
        if (
            query.shape[0] != 1 or key.shape != (1, hk, m, d) or value.shape != key.shape
            or k_cache.shape[3] != d or d > MAX_HEAD_DIM or h % hk != 0 or not 0 < b <= m
            or cache_seqlens.shape != (b,) or block_table.dim() != 2 or block_table.shape[0] != b
            or cache_seqlens.dtype != torch.int32 or block_table.dtype != torch.int32
            or not (cache_seqlens.is_contiguous() and block_table.is_contiguous())
            or query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1
        ):  # fmt: skip
            return None
        layout = (query.shape, query.stride(), key.stride(), value.stride(), k_cache.shape)
        threads = torch.get_num_threads() if b * h * max_seqlen_k * d > threaded_work() else 1
        args = _Args(
            0, 0, 0, 0, 0, 0, cache_seqlens.data_ptr(), None, block_table.data_ptr(), None,
            b, h, hk, d, k_cache.shape[1], block_table.shape[1], k_cache.shape[0],
            query.stride(2), query.stride(1), h * d, d, key.stride(2), key.stride(1),
            -1, softmax_scale, 0.0, dtype, threads, _isa(isa), 1, int(shared_prefix), 0,
            value.stride(2), value.stride(1),
        )  # fmt: skip
        return cls(lib, args, b, layout, query.dtype, softmax_scale)

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor | None:
        """This layer's attention output [1, M, H, D] (new K/V appended to its pages first), or None when its
        tensors or scale are not those ``make`` was given the like of (nothing done then)."""
        dtype = self.dtype
        if (
            softmax_scale != self.scale
            or (query.shape, query.stride(), key.stride(), value.stride(), k_cache.shape) != self.layout
            or query.dtype != dtype or key.dtype != dtype or value.dtype != dtype
            or k_cache.dtype != dtype or v_cache.dtype != dtype or v_cache.shape != k_cache.shape
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        ):  # fmt: skip
            return None  # (the layout, equal to ``make``'s, includes the unit last strides it checked)
        _, h, m, d = query.shape
        # [1, M, H, D]; the padding rows of the executor's bucket (M > B) zero, which the kernel never writes
        out = torch.empty(1, m, h, d, dtype=dtype) if m == self.batch else torch.zeros(1, m, h, d, dtype=dtype)
        args = self.args
        args.q, args.out, args.k_new, args.v_new = query.data_ptr(), out.data_ptr(), key.data_ptr(), value.data_ptr()
        args.k_cache, args.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        _raise_for_decode_status(self.lib.paged_decode(self.args_ref))
        return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    window_left: int,
    softcap: float,
    sinks: torch.Tensor | None,
    max_seqlen_q: int | None,
    *,
    causal: bool = True,
    isa: str | None = None,
) -> torch.Tensor | None:
    """``paged_prefill_attention`` (torch backend semantics) in native code, or None when it cannot take this
    call. q [total_q, H, D] packed by ``cu_seqlens_q`` int32 [B + 1]; request b attends to its first
    ``seqused_k[b]`` keys (int32 [B]) through ``block_table`` int32 [B, W], its queries aligned to the end
    of them (bottom-right causal; ``causal=False``: every key, the window still counted from the bottom-right
    position, i.e. flash-attn's ``window_size=(window_left, -1)``); rows of requests without keys are zeros.
    ``max_seqlen_q`` (None: unknown) sizes the threading only. Returns [total_q, H, D] in q.dtype."""
    dtype = _DTYPES.get(q.dtype)
    if dtype is None or q.device.type != "cpu" or (lib := library()) is None:
        return None
    total, h, d = q.shape
    batch = seqused_k.shape[0] if seqused_k.dim() == 1 else -1
    if (
        k_cache.shape != v_cache.shape
        or k_cache.shape[3] != d
        or tuple(cu_seqlens_q.shape) != (batch + 1,)
        or block_table.dim() != 2
        or block_table.shape[0] != batch
    ):
        raise ValueError(
            f"paged prefill: shapes do not agree: q {tuple(q.shape)}, pages {tuple(k_cache.shape)} / "
            f"{tuple(v_cache.shape)}, cu_seqlens_q {tuple(cu_seqlens_q.shape)}, seqused_k "
            f"{tuple(seqused_k.shape)}, block_table {tuple(block_table.shape)}"
        )
    if not _readable(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table):
        return None
    sinks = sinks.float().contiguous() if sinks is not None else None
    out = torch.empty(total, h, d, dtype=q.dtype)
    keys = max_seqlen_q if max_seqlen_q else total  # each query sees about its prompt's length of keys
    threads = torch.get_num_threads() if total * h * d * keys > threaded_work() else 1
    args = _Args(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), None, None,
        seqused_k.data_ptr(), cu_seqlens_q.data_ptr(), block_table.data_ptr(), _pointer(sinks),
        batch, h, k_cache.shape[2], d, k_cache.shape[1], block_table.shape[1], k_cache.shape[0],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), 0, 0,
        window_left, softmax_scale, softcap, dtype, threads, _isa(isa), int(causal), 0, 0,
        0, 0, _PAGE_DTYPES.get(k_cache.dtype, 0),
    )  # fmt: skip
    if lib.paged_prefill(ctypes.byref(args), total) != 0:
        raise MemoryError("paged prefill: the native kernel could not allocate its scratch memory")
    return out
