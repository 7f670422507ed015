"""mixed/offload, mixed/split: the tiny Llama with half its layers on ``cuda:0`` and half on the CPU,
sdpa and paged under the same map, greedy parity and pages checked layer by layer.

``offload``: ``from_pretrained(device_map=...)``, where accelerate runs the CPU half on the GPU and
streams its weights in; ``split``: ``dispatch_model(..., main_device="cpu")``, where the CPU half
runs on the CPU, so pages live on both devices and each forward moves the step's tensors to the CPU
once (``attention/forward.py``: one ``LayerInputs`` per (group, device), shared by that device's
layers). ``--device cpu`` maps both halves to the CPU: no second device, so it checks only the
plumbing (loading through both routes, the engine on a dispatched model, the per-forward inputs).
"""

from __future__ import annotations

import functools
import time
from collections import Counter, defaultdict

import torch

from ..base import Check, Context, Fail
from ..helpers import NEW_TOKENS, TIE_TOLERANCE, seconds_since


def mixed_device_map(num_layers: int, gpu: str) -> dict[str, str]:
    """The first half of the layers (and the embeddings) on ``gpu``, the rest (and the head) on the CPU."""
    half = num_layers // 2
    layers = {f"model.layers.{i}": gpu if i < half else "cpu" for i in range(num_layers)}
    return {"model.embed_tokens": gpu, "model.rotary_emb": gpu, **layers, "model.norm": "cpu", "lm_head": "cpu"}


def load_mixed(directory: str, attn: str, mode: str, gpu: str) -> torch.nn.Module:
    from accelerate import dispatch_model
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_paged_attn  # noqa: F401 - registers attn_implementation="paged"

    device_map = mixed_device_map(AutoConfig.from_pretrained(directory).num_hidden_layers, gpu)
    if mode == "offload":  # accelerate's meaning of "cpu" next to a GPU: weights there, execution on the GPU
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn, device_map=device_map)
    else:  # main_device="cpu": the "cpu" half really executes on the CPU
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn)
        skip = model._skip_keys_device_placement  # as from_pretrained passes it: hooks leave the cache alone
        model = dispatch_model(model, device_map=device_map, main_device="cpu", skip_keys=skip)
    return model.eval()


class InputsLog:
    """Every ``ForwardContext.inputs`` call of the block: per forward, the devices its layers asked
    for, and whether each (group, device) got one ``LayerInputs`` (made once, shared by its layers)."""

    def __init__(self) -> None:
        self.calls: dict[object, list[tuple[int, torch.device, object]]] = defaultdict(list)

    def __enter__(self) -> InputsLog:
        from hf_paged_attn.attention.forward import ForwardContext, LayerInputs

        self.owner, self.original = ForwardContext, ForwardContext.inputs
        log, original = self, self.original

        def inputs(context: ForwardContext, group: int, device: torch.device) -> LayerInputs:
            found = original(context, group, device)
            log.calls[context].append((group, device, found))  # keeps the context alive: no id reuse
            return found

        ForwardContext.inputs = inputs
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.owner.inputs = self.original

    def problems(self) -> list[str]:
        out = []
        for calls in self.calls.values():
            made: dict[tuple[int, torch.device], object] = {}
            for group, device, found in calls:
                if made.setdefault((group, device), found) is not found:
                    out.append(f"group {group} on {device}: a second LayerInputs in one forward")
        return out

    def other_devices(self, main: torch.device) -> set[tuple[str, ...]]:
        """Per forward, the devices besides ``main`` that its layers' inputs were moved to."""
        return {tuple(sorted({str(d) for _, d, _ in calls} - {str(main)})) for calls in self.calls.values()}


def mixed_parity(ctx: Context, mode: str, gpu: str) -> str:
    """Greedy parity of the paged engine against sdpa under the same half-GPU, half-CPU map; returns
    the detail line, raises ``Fail`` on a mismatch."""
    from hf_paged_attn import ContinuousBatchingEngine
    from hf_paged_attn.runtime.model.placement import input_device, layer_devices
    from hf_paged_attn_tools.testing import compare_greedy

    directory = ctx.tiny_llama()
    ref, paged = load_mixed(directory, "sdpa", mode, gpu), load_mixed(directory, "paged", mode, gpu)
    num_layers = paged.config.num_hidden_layers
    expected_devices = [torch.device(gpu)] * num_layers
    if mode == "split":  # (with gpu="cpu", the CPU dry run, every layer is on the CPU)
        expected_devices[num_layers // 2 :] = [torch.device("cpu")] * (num_layers - num_layers // 2)
    if layer_devices(paged) != expected_devices:
        raise Fail(f"layer_devices {layer_devices(paged)} != the map's {expected_devices}")

    gen = torch.Generator().manual_seed(2)
    lens, new = ((1, 17, 40), 8) if ctx.tiny else ((1, 5, 17, 33, 64, 120), NEW_TOKENS)
    prompts = [torch.randint(2, paged.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
    device = input_device(ref)
    expected = []
    for p in prompts:
        out = ref.generate(torch.tensor([p], device=device), max_new_tokens=new, do_sample=False)
        expected.append(out[0, len(p) :].tolist())

    engine = ContinuousBatchingEngine(paged)  # sized from memory: every device that holds layers is asked
    with InputsLog() as log:
        outputs = engine.generate(prompts, max_new_tokens=new)
    problems = compare_greedy(ref, prompts, expected, [o.output_ids for o in outputs], TIE_TOLERANCE[torch.float32])
    problems += log.problems()[:3]
    if problems:
        raise Fail("; ".join(problems))
    pages = [layer.keys.device for layer in engine.cache.layers]
    if pages != expected_devices:
        raise Fail(f"pages on {pages}, layers execute on {expected_devices}")
    moved = log.other_devices(engine.device)
    want = {tuple(sorted({str(d) for d in expected_devices} - {str(engine.device)}))}  # split on a GPU: {("cpu",)}
    if moved != want:
        raise Fail(f"step tensors moved to {moved} per forward, expected {want}")
    where = ", ".join(f"{n} layers on {d}" for d, n in sorted(Counter(map(str, pages)).items()))
    return (
        f"{len(prompts)} prompts x {new} tokens equal sdpa (tie tol {TIE_TOLERANCE[torch.float32]}); "
        f"pages: {where}; {engine.allocator.num_blocks} blocks, kernel {engine.config.kernel}, "
        f"{len(log.calls)} forwards"
    )


def run(ctx: Context, mode: str) -> str:
    start = time.perf_counter()
    return f"{mixed_parity(ctx, mode, 'cuda:0' if ctx.on_cuda else 'cpu')}, {seconds_since(start)}"


USES = (
    "hf_paged_attn.attention.forward:ForwardContext.inputs(group, device)",
    "hf_paged_attn.attention.cache:PagedAttentionCache.layers",
    "hf_paged_attn.attention.cache:PagedLayer.keys",
    "hf_paged_attn:ContinuousBatchingEngine.cache",
    "hf_paged_attn:ContinuousBatchingEngine.device",
    "hf_paged_attn:ContinuousBatchingEngine.allocator",
    "hf_paged_attn:ContinuousBatchingEngine.config",
    "hf_paged_attn.core.blocks:BlockAllocator.num_blocks",
    "hf_paged_attn.runtime.model.placement:layer_devices(model)",
    "hf_paged_attn.runtime.model.placement:input_device(model)",
)
CHECKS = [
    Check(f"mixed/{mode}", functools.partial(run, mode=mode), 90, cpu=True, uses=USES) for mode in ("offload", "split")
]
