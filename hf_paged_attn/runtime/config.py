"""PagedConfig: every knob of the paged cache and the continuous-batching engine, validated once."""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass, fields

import torch

from ..core.policy import POLICIES
from ..kernels import BACKENDS, KERNELS, resolve_kernel
from ..kernels.kv_dtype import KV_CACHE_DTYPES
from .cpu import compile_record, fp32_matmuls
from .model.placement import kernel_device, layer_devices, offloaded_to
from .speculative.config import SpeculativeConfig

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")

@dataclass(slots=True)
class PagedConfig:
    """Configuration of the paged KV cache and the scheduler.

    Attributes:
        block_size: tokens per KV block (page). ``None`` (the default) picks by kernel and device:
            256 for flash-attn (flash-attn 2 needs a multiple of 256), 16 for triton (its kernels'
            minimum) and for torch on CUDA, 8 for torch on CPU (it halves the KV memory left
            unfilled at the end of each request's last block at no measured speed cost;
            docs/performance.md).
        num_blocks: the memory of ``num_blocks`` blocks (``block_size`` tokens) in every layer, for
            every model. Models with per-group tables (``hybrid_kv``) carve it into smaller blocks of
            one attention group's layers, so the same memory lets at least as many requests in.
            ``None`` sizes the cache: ``model.generate`` sizes it to fit its batch exactly; the
            engine otherwise takes ``memory_fraction`` of the free memory.
        max_num_seqs: most requests running at once.
        max_batch_tokens: token budget of one step (decode tokens plus prefill chunks).
        kernel: ``"torch"``, ``"flash"``, ``"triton"`` or ``"auto"``: on CUDA flash-attn when it is
            installed and the block size (None, or a multiple of 256) and dtype (fp16/bf16) suit
            it, else triton on GPUs of compute capability 8.0 or newer (block size None or a power of two
            >= 16); torch elsewhere.
        enable_prefix_caching: share the KV blocks of identical prompt prefixes between requests.
        memory_fraction: share of free device memory the cache may take when ``num_blocks`` and
            ``kv_cache_memory_bytes`` are None.
        kv_cache_memory_bytes: the cache's size in bytes (vLLM's name), every layer's K and V pages
            together, when ``num_blocks`` is None; it replaces ``memory_fraction``. ``None``: sized
            from ``memory_fraction``.
        kv_cache_dtype: what the pages store (vLLM's names): ``"auto"`` (the default) the model's
            dtype; ``"fp8"`` / ``"fp8_e4m3"`` (4 exponent, 3 mantissa bits) or ``"fp8_e5m2"`` (5, 2):
            one byte per element, twice the tokens of a bf16 cache in the same memory, with per-layer
            ``k_scale``/``v_scale`` from the checkpoint (else 1.0). Opt-in: check the model first
            (docs/kv_cache.md). ``"int8"``: one byte per element plus a float16 scale per token and KV
            head (symmetric, max|x| / 127). fp8 pages are read by the torch and triton kernels, int8 pages
            by torch only; on CUDA ``kernel="auto"`` picks the first that reads them.
        progress_bar: show a tqdm bar; ``None`` shows it only in an interactive terminal and only
            for more than a handful of requests.
        seed: seed of the sampling generator; ``None`` draws it from torch's global RNG, so
            ``torch.manual_seed`` makes sampled output reproducible as with ``generate``.
        hybrid_kv: models that mix sliding-window and full-attention layers (Gemma 2/3, Cohere 2,
            GPT-OSS, ...) give each attention group its own block tables, so sliding layers hold only
            their window's blocks (``layers.py``); False keeps one table for every layer.
        scheduling_policy: ``"fcfs"`` (first come, first served) or ``"priority"`` (lower
            ``add_request(..., priority=)`` first, ties by arrival; the lowest priority is preempted
            first). See ``policy.py``.
        cuda_graphs: replay decode steps (every request feeds one token) from CUDA graphs captured
            per batch-size bucket (``cuda_graphs.py``): the GPU no longer waits for Python to launch
            every layer's kernels. ``None`` (the default): on for a model on one CUDA device with a
            graph-safe kernel (triton, flash), off elsewhere; ``True`` where graphs can't run raises
            ValueError; ``False``: every step runs eagerly. Tensor-parallel engines and models spread
            over several devices always run eagerly.
        compile: run the model's forward through ``torch.compile`` (inductor, ``compiled.py``): one
            graph for every step size, the paged attention an opaque op in it, weights prepacked for
            oneDNN on AMD CPUs (graph inputs on Intel ones, where inductor's disk cache then serves
            later processes). The first step of a model compiles (tens of seconds on a small CPU, logged;
            inductor's disk cache shortens later processes); every later engine on the same model
            reuses it. ``None`` (the default): on for a model on the CPU when a C++ compiler is
            found (where it was measured to win: docs/performance.md) and ``COMPILE_BY_DEFAULT`` is true,
            off elsewhere; at start-up (``"startup"``) for a model this machine compiled before, whose graphs
            inductor's disk cache holds (``cpu/compile_record.py``), else in the background; ``True`` on
            another device raises ValueError; ``False``: eager forwards; ``"startup"``: as ``True``, but
            the engine compiles while it is made (one eager warm-up step of a one-token request, then the
            compile, in the caller's thread: seconds with inductor's disk cache warm), so its first request
            already runs compiled; ``True`` / ``None`` compile in the background once the model has run
            ``compiled.COMPILE_AFTER_STEPS`` steps, the steps before running eagerly. A failed compile is
            logged and the engine runs eagerly.
        fp32_matmuls: a bfloat16 / float16 model's linear layers computed in float32 on float32
            copies of their weights (``fp32_matmuls.py``: the same rounding as a half-precision
            matmul, whose products are exact in float32; the copies take 4 bytes per weight and stay
            on the model), for CPUs that have no fast half-precision matmul (no AVX-512 BF16 / AMX:
            torch's fallback there is ~7x slower than its float32 sgemm). ``None`` (the default): on
            for a half-precision model on such a CPU; ``True``: on for any half-precision model on
            the CPU (``True`` on another device raises ValueError); ``False``: off (an earlier
            engine's copies are removed).
        adaptive_threads: each CPU step runs with 1 thread or all of torch's, whichever ran steps
            of its size faster, timed as the engine runs (``threads.py``: on a small model, or when
            another process holds a core, waking a second thread for every op costs more than it
            saves). ``None`` (the default): on for a model on the CPU, off elsewhere; ``True`` on another
            device raises ValueError; ``False``: every step uses torch's thread count. Nothing changes
            with one thread (``torch.get_num_threads() == 1``).
        keep_freed_memory: the process's C allocator keeps the memory a step frees for the next step
            (``cpu/host_memory.py``: glibc's mmap threshold at 32 MiB, its trim threshold at 256 MiB), where it
            handed it back to the kernel and every step faulted it in again. The thresholds are the
            process's and stay after the engine (glibc has no way back to its adaptive defaults). ``None``
            (the default): on for a model on the CPU; ``True`` on another device raises ValueError;
            ``False``: the allocator is left as it is. Nothing is set where malloc is not glibc's.
        speculative: speculative decoding for every request that can speculate
            (``SpeculativeConfig``: prompt lookup, or a draft model); None: only requests whose own
            generation config sets ``prompt_lookup_num_tokens`` speculate.
        logprobs_mode: the distribution of the log-probabilities ``add_request(logprobs=k)`` records (vLLM's
            names): ``"processed_logprobs"`` (the default) after the request's processors, penalties,
            temperature and truncation, the distribution its tokens are drawn from; ``"raw_logprobs"`` the
            model's own (``log_softmax`` of its logits). ``add_request(logprobs_mode=)`` overrides it.
    """

    block_size: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_batch_tokens: int = 512
    kernel: str = "auto"
    enable_prefix_caching: bool = True
    memory_fraction: float = 0.5
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    progress_bar: bool | None = None
    seed: int | None = None
    scheduling_policy: str = "fcfs"
    hybrid_kv: bool = True
    cuda_graphs: bool | None = None
    compile: bool | str | None = None
    fp32_matmuls: bool | None = None
    adaptive_threads: bool | None = None
    keep_freed_memory: bool | None = None
    speculative: SpeculativeConfig | None = None
    logprobs_mode: str = "processed_logprobs"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batch_tokens"):
            _require_positive_int(name, getattr(self, name))
        for name in ("block_size", "num_blocks"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        if not isinstance(self.hybrid_kv, bool):
            raise ValueError(f"PagedConfig.hybrid_kv must be a bool, got {self.hybrid_kv!r}")
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"PagedConfig.cuda_graphs must be None or a bool, got {self.cuda_graphs!r}")
        if not (self.compile is None or isinstance(self.compile, bool) or self.compile == COMPILE_AT_STARTUP):
            raise ValueError(
                f"PagedConfig.compile must be None, a bool or {COMPILE_AT_STARTUP!r}, got {self.compile!r}"
            )
        if self.fp32_matmuls is not None and not isinstance(self.fp32_matmuls, bool):
            raise ValueError(f"PagedConfig.fp32_matmuls must be None or a bool, got {self.fp32_matmuls!r}")
        if self.adaptive_threads is not None and not isinstance(self.adaptive_threads, bool):
            raise ValueError(f"PagedConfig.adaptive_threads must be None or a bool, got {self.adaptive_threads!r}")
        if self.keep_freed_memory is not None and not isinstance(self.keep_freed_memory, bool):
            raise ValueError(f"PagedConfig.keep_freed_memory must be None or a bool, got {self.keep_freed_memory!r}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(
                f"PagedConfig.scheduling_policy must be one of {tuple(POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.kernel not in KERNELS:
            raise ValueError(f"PagedConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"PagedConfig.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if isinstance(self.memory_fraction, bool) or not isinstance(self.memory_fraction, (int, float)) or not (
            0.0 < self.memory_fraction <= 1.0
        ):
            raise ValueError(f"PagedConfig.memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.kv_cache_memory_bytes is not None:
            _require_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"PagedConfig.kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.progress_bar is not None and not isinstance(self.progress_bar, bool):
            raise ValueError(f"PagedConfig.progress_bar must be None or a bool, got {self.progress_bar!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"PagedConfig.seed must be None or an int, got {self.seed!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"PagedConfig.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"PagedConfig.speculative must be None or a SpeculativeConfig, got {self.speculative!r}")

    def for_model(self, model: torch.nn.Module) -> PagedConfig:
        """``resolved`` for ``model``: its device, dtype, whether its attention has sinks and its pages' head dim,
        then ``placed`` where its layers sit. The launcher reads the answers."""
        sinks = any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters())
        # not model.device: "meta" when offloaded
        config = self.resolved(kernel_device(model), model.dtype, sinks, page_head_dim(model)).placed(model)
        if self.compile is None and config.compile is True and compile_record.recorded(model):
            # inductor holds this model's graphs: compiled in seconds before the first request, never beside steps
            config = config.replace(compile=COMPILE_AT_STARTUP)
        return config

    def placed(self, model: torch.nn.Module) -> PagedConfig:
        """This resolved config where ``model``'s layers sit: the one place that decides whether decode steps
        replay CUDA graphs (every layer on one CUDA device, no weights accelerate copies in at every forward
        from the host), the forward compiles (every layer on the CPU, none on disk) and steps choose their
        thread count (every layer on the CPU). A placement that can't run them leaves the steps eager, even
        where the config asked."""
        devices, offloaded = set(layer_devices(model)), offloaded_to(model)
        on_cpu = {d.type for d in devices} == {"cpu"}
        one_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
        return self.replace(
            cuda_graphs=bool(self.cuda_graphs) and one_cuda and not offloaded & {"cpu", "disk"},
            compile=self.compile if on_cpu and "disk" not in offloaded else False,  # keeps "startup"
            adaptive_threads=bool(self.adaptive_threads) and on_cpu,
        )

    def replace(self, **changes: object) -> PagedConfig:
        """A copy with ``changes`` applied (and validated)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise ValueError(f"PagedConfig has no field(s) {sorted(unknown)}")
        values.update(changes)
        return PagedConfig(**values)

    def resolved(
        self, device: torch.device, dtype: torch.dtype | None = None, sinks: bool = False, head_dim: int | None = None
    ) -> PagedConfig:
        """This config made concrete for a model on ``device`` in ``dtype`` (``sinks``: with attention
        sinks; ``head_dim``: its pages' width, None unknown): ``kernel="auto"`` becomes the backend
        that will run, then ``block_size=None`` that backend's size, then ``cuda_graphs=None`` whether
        graphs can run, ``compile=None`` whether the forward compiles, ``fp32_matmuls=None`` whether
        half-precision matmuls run in float32, ``adaptive_threads=None`` whether steps choose their
        thread count and ``keep_freed_memory=None`` whether the allocator keeps freed memory."""
        page_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype]
        kernel = resolve_kernel(self.kernel, device, self.block_size, dtype, sinks, head_dim, page_dtype)
        backend = BACKENDS[kernel]
        int8 = page_dtype == torch.int8
        if page_dtype is not None and not (backend.supports_int8_pages if int8 else backend.supports_fp8_pages):
            readers = [n for n, b in BACKENDS.items() if (b.supports_int8_pages if int8 else b.supports_fp8_pages)]
            raise ValueError(
                f"PagedConfig.kv_cache_dtype={self.kv_cache_dtype!r} needs a kernel that reads "
                f"{'int8' if int8 else 'fp8'} pages {readers}, got kernel={kernel!r}; use kernel='auto' or "
                "kv_cache_dtype='auto'"
            )
        block_size = self.block_size or backend.default_block_size(device)
        backend.check_block_size(block_size)
        graphs_can_run = device.type == "cuda" and backend.graph_safe
        if self.cuda_graphs and not graphs_can_run:
            safe = [name for name, b in BACKENDS.items() if b.graph_safe]
            raise ValueError(
                f"PagedConfig.cuda_graphs=True needs a CUDA device and a graph-safe kernel {safe}; the model "
                f"is on {device.type} with kernel={kernel!r}. Leave cuda_graphs=None to use graphs where they can run"
            )
        cuda_graphs = graphs_can_run if self.cuda_graphs is None else self.cuda_graphs
        if self.compile and device.type != "cpu":
            raise ValueError(
                f"PagedConfig.compile={self.compile!r} is for models on the CPU (where it is measured); the model "
                f"is on {device.type}. Leave compile=None to compile where it wins"
            )
        compile_ = self.compile if self.compile is not None else compile_by_default(device)
        if self.fp32_matmuls and device.type != "cpu":
            raise ValueError(
                f"PagedConfig.fp32_matmuls=True is for models on the CPU; the model is on {device.type}. "
                "Leave fp32_matmuls=None to use them where the CPU lacks half-precision matmuls"
            )
        fp32 = self.fp32_matmuls
        if fp32 is None:
            fp32 = device.type == "cpu" and fp32_matmuls.hardware_lacks(dtype)
        fp32 = fp32 and (dtype is None or dtype in fp32_matmuls.HALF)  # nothing to do for a float32 model
        if self.adaptive_threads and device.type != "cpu":
            raise ValueError(
                f"PagedConfig.adaptive_threads=True is for models on the CPU; the model is on {device.type}. "
                "Leave adaptive_threads=None to adapt them where it applies"
            )
        adaptive = device.type == "cpu" if self.adaptive_threads is None else self.adaptive_threads
        if self.keep_freed_memory and device.type != "cpu":
            raise ValueError(
                f"PagedConfig.keep_freed_memory=True is for models on the CPU; the model is on {device.type}. "
                "Leave keep_freed_memory=None to keep it where it applies"
            )
        keep = device.type == "cpu" if self.keep_freed_memory is None else self.keep_freed_memory
        return self.replace(kernel=kernel, block_size=block_size, cuda_graphs=cuda_graphs, compile=compile_,
                            fp32_matmuls=fp32, adaptive_threads=adaptive, keep_freed_memory=keep)  # fmt: skip


def page_head_dim(model: torch.nn.Module) -> int | None:
    """The widest head dim of ``model``'s attention modules (those with a ``layer_idx``), which is the
    pages' width (``PagedLayer.width``: the larger of the key and value head dims); None if none says."""
    names = ("head_dim", "qk_head_dim", "v_head_dim")  # the last two: latent attention (DeepSeek)
    dims = [
        value
        for module in model.modules()
        if hasattr(module, "layer_idx")
        for value in (getattr(module, name, None) for name in names)
        if isinstance(value, int) and not isinstance(value, bool)
    ]
    return max(dims, default=None)


COMPILE_AT_STARTUP = "startup"  # PagedConfig.compile: compile while the engine is made, not in the background

# What ``PagedConfig(compile=None)`` means where a compile can run. A process that wants every such engine eager
# (a test suite of tiny models, which compile for longer than they run) sets it to False once; one engine's
# choice is ``PagedConfig(compile=False)`` (``hf-paged-attn serve --no-compile``).
COMPILE_BY_DEFAULT = True


def compile_by_default(device: torch.device) -> bool:
    """What ``compile=None`` means on ``device``: on the CPU with a C++ compiler, while ``COMPILE_BY_DEFAULT``."""
    return device.type == "cpu" and COMPILE_BY_DEFAULT and cpp_compiler() is not None


@functools.cache
def cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU code needs (``$CXX``, else ``c++`` / ``g++`` / ``clang++`` on
    the PATH), or None."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((shutil.which(name) for name in names if shutil.which(name)), None)


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"PagedConfig.{name} must be a positive int, got {value!r}")
