"""Helpers for parity checks against transformers' own attention (used by tests and scripts).

Greedy parity means equal tokens; a difference is accepted only where the reference's top-2
logits at the first differing position are within ``tie_tolerance`` (a numerical near-tie, as
vLLM's ``check_logprobs_close`` allows). The gap is always computed, never assumed.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedConfig

from hf_paged_attn.core.blocks import blocks_for
from hf_paged_attn.kernels.base import AttentionBackend, AttentionOptions


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A 2-layer GQA Llama (vocab 256) whose random greedy tokens vary; no EOS by default."""
    values = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,  # larger weights than default so greedy tokens vary
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def left_padded(rows: list[list[int]], pad: int = 0, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``rows`` padded to the longest, as tokenizers do: on the left
    by default (what ``generate`` wants), on the right with ``side="right"``."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, cols] = torch.tensor(row, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def save_random_model(config: PreTrainedConfig, directory: str | Path | None = None, seed: int = 0) -> str:
    """Build a random-weight model from ``config``, ``save_pretrained`` it, return the directory."""
    directory = str(directory or tempfile.mkdtemp(prefix="hf_paged_attn_"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


def save_random_lora(
    base_directory: str, directory: str | Path | None = None, seed: int = 0, std: float = 0.1, **lora_config
) -> str:
    """A PEFT LoRA adapter of the model in ``base_directory`` (``LoraConfig(**lora_config)``; default rank 8
    on q_proj and v_proj), ``save_pretrained`` to ``directory``; returns it. PEFT starts B at zero, an
    adapter that changes nothing: B is drawn from N(0, ``std``) instead."""
    from peft import LoraConfig, get_peft_model

    directory = str(directory or tempfile.mkdtemp(prefix="hf_paged_attn_lora_"))
    base = AutoModelForCausalLM.from_pretrained(base_directory)
    options = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    options.update(lora_config)
    model = get_peft_model(base, LoraConfig(**options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(directory)
    return directory


def load_pair(directory: str, reference: str = "sdpa", dtype: torch.dtype = torch.float32):
    """(reference model, paged model) loaded from the same weights with ``from_pretrained``."""
    ref = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=reference, dtype=dtype).eval()
    paged = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="paged", dtype=dtype).eval()
    return ref, paged


def top2_gap(model: torch.nn.Module, prefix: list[int]) -> float:
    """Gap between the two largest next-token logits of ``model`` after ``prefix``."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare_greedy(
    reference_model: torch.nn.Module,
    prompts: list[list[int]],
    expected: list[list[int]],
    actual: list[list[int]],
    tie_tolerance: float = 1e-4,
) -> list[str]:
    """Problems found comparing generated token lists; empty when they agree (up to near-ties)."""
    problems = []
    for i, (prompt, exp, act) in enumerate(zip(prompts, expected, actual)):
        if exp == act:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(exp, act)) if a != b), min(len(exp), len(act)))
        if pos == min(len(exp), len(act)):
            problems.append(f"row {i}: lengths differ ({len(exp)} expected, {len(act)} got)")
            continue
        gap = top2_gap(reference_model, prompt + exp[:pos])
        if gap > tie_tolerance:
            problems.append(
                f"row {i}: first difference at new token {pos}: expected {exp[pos]}, got {act[pos]} "
                f"(reference top-2 gap {gap:.3g} > {tie_tolerance})"
            )
    return problems


def unpadded_rows(sequences: torch.Tensor, input_len: int) -> list[list[int]]:
    return [row[input_len:].tolist() for row in sequences]


def shuffled_block_table(
    lens: list[int], block_size: int, gen: torch.Generator, spare: int = 0
) -> tuple[torch.Tensor, int]:
    """A block table giving request b room for lens[b] tokens in shuffled blocks, -1 past each
    request's blocks and in one trailing column; returns (table int32 [B, max_blocks + 1], num_blocks
    including ``spare`` blocks nobody owns)."""
    per = [blocks_for(n, block_size) for n in lens]  # blocks per request
    num_blocks = sum(per) + spare
    order = torch.randperm(num_blocks, generator=gen).int()
    table = torch.full((len(lens), max(per) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per):
        table[b, :n] = order[used : used + n]
        used += n
    return table, num_blocks


VOCAB = 256  # tiny_llama_config's vocabulary


def ragged_prompts(num: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (num,), generator=gen).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------------------------
# CUDA graphs on the CPU: a stand-in that freezes what a graph freezes
# ----------------------------------------------------------------------------------------------


class FrozenGraph:
    """One graph of ``FrozenGraphs``: ``replay`` runs the recorded ops into ``out``; ``replays`` counts."""

    def __init__(self, module: torch.fx.GraphModule, out: torch.Tensor) -> None:
        self.module, self.out, self.replays = module, out, 0

    def replay(self) -> None:
        with torch.inference_mode():
            self.out.copy_(self.module())
        self.replays += 1


class FrozenGraphs:
    """Stand-in for ``runtime.cuda_graphs.CudaGraphFactory`` on the CPU, failing where a CUDA graph fails.

    Capture traces ``fn`` with ``make_fx`` (which runs it once, as the real warm-up does): every aten op
    is recorded with the tensors it touches held by reference (static buffers, pages, weights), and every
    host-side value of that run (Python numbers, shapes, slice bounds, a kernel's scalar arguments) is
    baked into the graph. Replay runs the recorded ops, never ``fn``'s Python, as a GPU replays a graph's
    kernels. Reading a tensor's value on the host during capture raises, as a device sync does while a
    CUDA stream captures. Kernels that are not aten ops (Triton's interpreter, the native C kernel) are
    invisible to the trace: give the graphs' backend to ``LaunchedDecode``, which makes its decode call
    one recorded launch. ``captured`` lists every graph made.
    """

    def __init__(self) -> None:
        self.captured: list[FrozenGraph] = []

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[FrozenGraph, torch.Tensor]:
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        def capture() -> torch.Tensor:
            with _NoHostReads():
                return fn()

        # One fake mode for the shapes the trace records of every value (else it makes one per value, each
        # with its stack trace: most of a capture's time).
        with tracing(TracingContext(FakeTensorMode())):
            module = make_fx(capture, tracing_mode="real")()
        (result,) = (node.args[0] for node in module.graph.nodes if node.op == "output")
        shape = result.meta["val"]  # a fake tensor: the output's shape and dtype
        graph = FrozenGraph(module, torch.empty(shape.shape, dtype=shape.dtype, device=shape.device))
        self.captured.append(graph)
        return graph, graph.out


class _NoHostReads(torch.overrides.TorchFunctionMode):
    """Raises where a capture would read a tensor's value on the host: on a GPU every tensor a step's
    forward reads is on the device, and a device-to-host sync is not permitted while a stream captures."""

    READS = frozenset(
        getattr(torch.Tensor, name)
        for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in self.READS:
            raise RuntimeError(f"Tensor.{func.__name__}: a host read of a device tensor, not permitted while a "
                               "stream is capturing")  # fmt: skip
        return func(*args, **(kwargs or {}))


class LaunchedDecode:
    """``backend`` whose decode call is one kernel launch to a trace (the ``launch_decode`` op): a graph
    records it as one node, whose tensor arguments are read at every replay and whose Python arguments
    (``max_seqlen_k`` and the ``options``: scale, window, ``softcap``) are those of the capture, as a CUDA
    kernel's launch parameters are. ``memo`` is dropped: it is Python state of one forward, which no
    launch can carry (backends that run as one launch ignore it, ``kernels/base.py``). Every other entry
    point is ``backend``'s."""

    def __init__(self, backend: AttentionBackend) -> None:
        # One launch that reads its tables at replay is what a graph-safe backend's decode is; any other's
        # would plan on the host at every replay, which no graph does.
        assert backend.graph_safe, f"{backend.name}: only a graph-safe backend's decode is one launch"
        self.backend = backend
        _LAUNCHED[id(backend)] = backend

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.backend, name)

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache_seqlens: torch.Tensor,
        block_table: torch.Tensor,
        max_seqlen_k: int | None = None,
        *,
        options: AttentionOptions,
        memo: dict | None = None,
    ) -> torch.Tensor:
        assert options.k_scales is None, "a graph-safe backend reads no int8 pages"
        left, right = options.window_size
        return launch_decode(q, k_cache, v_cache, k, v, cache_seqlens, block_table, max_seqlen_k, id(self.backend),
                             options.softmax_scale, options.causal, left, right, options.softcap,
                             options.sinks)  # fmt: skip


_LAUNCHED: dict[int, AttentionBackend] = {}  # the backends LaunchedDecode wraps, by id (an op takes no objects)


@torch.library.custom_op("hf_paged_attn_tools::launch_decode", mutates_args=("k_cache", "v_cache"))
def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_k: int | None,
    backend: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``paged_decode_attention`` of the backend ``LaunchedDecode`` registered as ``backend``, after checking
    ``max_seqlen_k`` as a kernel that sizes its launch by it would need it (an upper bound of the keys any
    request attends, ``kernels/base.py``): below that, such a kernel skips keys."""
    if max_seqlen_k is not None and cache_seqlens.numel():
        keys = cache_seqlens.long() + int(k is not None)  # [B] keys each query attends, its own included
        if window_left >= 0:
            keys = keys.clamp(max=window_left + 1)
        if int(keys.max()) > max_seqlen_k:
            raise ValueError(f"max_seqlen_k={max_seqlen_k}, but a request attends {int(keys.max())} keys: a kernel "
                             "that sizes its launch by max_seqlen_k would skip some")  # fmt: skip
    out = _LAUNCHED[backend].paged_decode_attention(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, max_seqlen_k,
        options=AttentionOptions(softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                                 softcap=softcap, sinks=sinks),
    )  # fmt: skip
    return out  # fresh memory (an op's output may not alias its inputs)
