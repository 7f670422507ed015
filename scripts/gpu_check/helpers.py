"""What several checks share: tolerances, the tiny models they build, the sdpa references they compare
against, timing with CUDA events and graphs (a host timer on the CPU), random paged problems, and
the stand-in CUDA-graph capture of the CPU dry runs.

Every import of the package is inside a function, so importing this module (``--list``, the registry)
costs nothing and never imports triton before ``--device cpu`` has set ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from .base import Fail

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, Qwen2Config

    from hf_paged_attn.runtime.cuda_graphs import CudaGraphExecutor
    from hf_paged_attn.runtime.launcher import LocalLauncher

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max abs error vs the float64 reference
# Greedy parity: tokens must equal sdpa's up to the first step whose top-2 logits are within this of
# each other. There two correct implementations may pick different tokens through rounding alone
# (bf16 logits carry ~3 significant digits), and every later token depends on that pick, so the
# comparison stops there; a mismatch before it is a FAIL. Lines say how many steps were compared,
# so a pass that compared little is visible (vLLM's check_logprobs_close, in spirit).
TIE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.05}
NEW_TOKENS = 32
# Peak HBM bandwidth by device-name substring, most specific first (bytes/s, vendor figures).
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
)
KERNEL_CALLS = 50  # calls per timed CUDA graph (or per queued burst)


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) < 300 else text[:297] + "..."


def seconds_since(start: float) -> str:
    return f"{time.perf_counter() - start:.1f}s"


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    """``owner.name = value`` inside the block, the old value back after it (even on a FAIL)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


# ---------------------------------------------------------------------------------------- models
def tiny_llama_dir(directory: str, num_layers: int = 4) -> str:
    """A random Llama of ``num_layers`` layers (vocab 128, GQA 8/2 heads of 32) saved into ``directory``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024,
        # The default init (0.02) keeps the top-2 logit gaps ~10x the bf16 noise (median gap ~0.13 vs
        # <= 0.011 between bf16 and fp32 logits, measured on CPU); wider inits amplify the noise
        # faster than the gaps. A small vocabulary widens the gaps (fewer near-ties to stop at).
        initializer_range=0.02,
        bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def load_model(directory: str, attn: str, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``from_pretrained`` with ``attn_implementation=attn``, on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    import hf_paged_attn  # noqa: F401 - registers attn_implementation="paged"

    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn, **kwargs)
    return model.to(device).eval()


# Qwen2.5-0.5B's shape (494M parameters). Random weights: initializer_range 0.05 (default 0.02) makes
# greedy tokens vary (16 distinct of 16 over two prompts, measured on CPU in fp32, 2 and 24 layers;
# at 0.02 a 2-layer model repeats 4 tokens).
QWEN2_SIZES = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=151936)  # fmt: skip
TINY_QWEN2_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=512)  # fmt: skip


def qwen2_config(tiny: bool, num_layers: int | None = None) -> Qwen2Config:
    """Qwen2.5-0.5B's shape (``tiny``: a 2-layer toy of the same architecture), no EOS."""
    from transformers import Qwen2Config

    sizes = dict(TINY_QWEN2_SIZES if tiny else QWEN2_SIZES)
    if num_layers is not None:
        sizes["num_hidden_layers"] = num_layers
    return Qwen2Config(
        **sizes, tie_word_embeddings=True, initializer_range=0.05, max_position_embeddings=4096,
        rope_theta=1e6, use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


def save_random(config: PreTrainedConfig, device: torch.device, dtype: torch.dtype, directory: str) -> str:
    """Random weights made on ``device`` (fast on a GPU), saved with save_pretrained in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    del model
    return directory


# ------------------------------------------------------------------------------------ references
def sdpa_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """Transformers' own greedy tokens for one unpadded prompt, and the gap between the top-2 logits
    at every step ([new] float32, on the CPU)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values  # [steps, 2]
    return out.sequences[0, len(prompt) :].tolist(), (top2[:, 0] - top2[:, 1]).cpu()


def tie_limit(gaps: torch.Tensor, tol: float) -> int:
    """Steps before the first near-tie (top-2 gap below ``tol``): those must match exactly."""
    ties = (gaps < tol).nonzero()
    return int(ties[0]) if len(ties) else len(gaps)


def compare_up_to_tie(label: str, got: list[int], want: list[int], gaps: torch.Tensor, tol: float) -> int:
    """Raises ``Fail`` unless ``got`` equals ``want`` up to the first near-tie; returns the steps compared."""
    limit = tie_limit(gaps, tol)
    for step in range(limit):
        if step >= len(got) or got[step] != want[step]:
            token = got[step] if step < len(got) else "nothing"
            raise Fail(
                f"{label}: token {step} is {token}, sdpa gives {want[step]} with a top-2 gap of "
                f"{float(gaps[step]):.3g} (> tie tolerance {tol})"
            )
    return limit


# ---------------------------------------------------------------------------------------- timing
def peak_bandwidth(name: str) -> float | None:
    for key, peak in PEAK_BANDWIDTH:
        if key.lower() in name.lower():
            return peak
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cuda (none here)"
    return device.type


def time_host(fn: Callable[[], object], iters: int = 3, warmup: int = 1) -> float:
    """Median seconds of ``fn`` by the host's clock: the CPU dry runs' timer (their figures only show
    that the code runs)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_cuda(fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``iters`` CUDA-event-timed calls (host launches included)."""
    if device.type != "cuda":
        return time_host(fn)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_kernel(
    fn: Callable[[], object], device: torch.device, graph: bool = True, calls: int = KERNEL_CALLS, reps: int = 5
) -> tuple[float, str]:
    """(seconds per call of ``fn``'s device work without host launch overhead, how it was timed).

    ``time_cuda`` times one call between two events: on an idle GPU the end event waits for the host
    to launch every kernel, so for a 30 us kernel it mostly measures Python and launch latency. Here
    ``calls`` calls are captured in one CUDA graph and the median replay over ``reps`` is divided by
    ``calls``. ``graph=False`` (a backend that syncs with the host, which a graph cannot hold) queues
    the calls back to back instead: a lower bound on throughput only if the host keeps ahead. On
    the CPU: the host timer.
    """
    if device.type != "cuda":
        return time_host(fn), "the host timer (CPU)"
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graphs recommends
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for _ in range(calls):
                fn()
        run, how = cuda_graph.replay, f"a graph of {calls} calls"
    else:

        def run() -> None:
            for _ in range(calls):
                fn()

        how = f"{calls} queued calls"
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times), how


# ------------------------------------------------------------------------------------ paged data
def random_pages(
    lens: list[int], block_size: int, h_kv: int, d: int, dtype: torch.dtype, gen: torch.Generator,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random pages [num_blocks, block_size, h_kv, d] (K, V) with room for lens[b] tokens under a
    shuffled block table (int32 [B, max_blocks + 1], -1 past each request), on ``device``."""
    from hf_paged_attn_tools.testing import shuffled_block_table

    table, num_blocks = shuffled_block_table(lens, block_size, gen, spare=2)
    shape = (num_blocks, block_size, h_kv, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return k_cache.to(device), v_cache.to(device), table.to(device)


def decode_problem(
    batch: int, ctx: int, block_size: int, h_kv: int, group: int, d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """bf16 pages holding ``ctx`` tokens per request under a shuffled block table, a query per request,
    and the K/V bytes one decode call reads: (q, k_cache, v_cache, seqlens, table, bytes)."""
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = batch * ctx // block_size
    k_cache = torch.randn(blocks, block_size, h_kv, d, generator=gen, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks, generator=gen, device=device).int().view(batch, ctx // block_size)
    q = torch.randn(batch, 1, h_kv * group, d, generator=gen, device=device, dtype=torch.bfloat16)
    seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=device)  # k/v None: no append
    moved = 2 * batch * ctx * h_kv * d * k_cache.element_size()  # K and V bytes read
    return q, k_cache, v_cache, seqlens, table, moved


# -------------------------------------------------------------------------- CUDA graphs on a CPU
class _Replay:
    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def stand_in_capture(fn: Callable[[], torch.Tensor]) -> tuple[_Replay, torch.Tensor]:
    """``CudaGraphFactory``'s stand-in on the CPU: "capture" runs ``fn`` once, "replay" re-runs it
    into the captured output. ``fn`` reads only the executor's static buffers, so a step whose data
    did not reach them gives wrong tokens here as a real graph would."""
    graph = _Replay(fn, fn())
    return graph, graph.out


def graph_launcher(device: torch.device) -> LocalLauncher | None:
    """The launcher that makes an engine replay decode steps from CUDA graphs: None on a GPU
    (``PagedConfig(cuda_graphs=True)`` does it), on the CPU a ``LocalLauncher`` that always builds a
    ``CudaGraphExecutor`` over ``stand_in_capture``."""
    if device.type == "cuda":
        return None
    from hf_paged_attn import PagedConfig
    from hf_paged_attn.runtime.launcher import CacheSize, LocalLauncher

    class StandInGraphLauncher(LocalLauncher):
        # graphs wherever the model sits: the config says whether they run, and on the CPU it says no
        def cache_size(self, model: torch.nn.Module, config: PagedConfig, *args: object) -> CacheSize:
            return super().cache_size(model, config.replace(cuda_graphs=True), *args)

        def executor(self, model: torch.nn.Module, cache: object, backend: object, config: PagedConfig,
                     *args: object) -> CudaGraphExecutor:  # fmt: skip
            executor = super().executor(model, cache, backend, config.replace(cuda_graphs=True), *args)
            executor.graph_factory = stand_in_capture
            return executor

    return StandInGraphLauncher()
