"""LoRA adapters per request: PEFT's LoRA layers, run by the engine one adapter group at a time.

A step packs many requests, each under its own adapter (``Request.adapter``, ``StepMetadata.adapters``;
None is the base model). While an engine runs, every LoRA layer of its model (PEFT's ``lora.Linear``,
from ``get_peft_model``, ``PeftModel.from_pretrained`` or transformers' ``model.load_adapter``) has its
``forward`` replaced, through the model's marks (``marks.py``), by the router's: the base layer on every
row, then for each adapter present one matmul pair ``scaling * B(A(x))`` on that adapter's rows (Punica's
SGMV as a loop over the step's adapters, in torch); on CUDA with triton, Punica's segmented kernel pair over
every adapter at once (``lora_kernels.py``). The layer's own weights and ``scaling`` are read at
every step, so PEFT's rank per adapter, ``lora_alpha``/``use_rslora`` scaling, ``rank_pattern`` and
target modules that differ between adapters hold as they do in PEFT; dropout is off, as at inference.

On a tensor-parallel model (``tp_plan="auto"``) PEFT already shards each adapter as its base weight is
sharded, and puts transformers' parallel forwards on ``lora_A`` / ``lora_B``: under a column-parallel base
(q/k/v, gate/up) B holds this rank's output rows; under a row-parallel base (o, down) A holds its input
columns and all-reduces ``A x`` ([rows, r]). Calling those modules, as the router does, runs each rank's
shard; every rank runs the same row groups (the step is broadcast) and so the same collectives in the
same order. A base layer of another tensor-parallel style is refused (``lora_layers``).

What PEFT can do and this can't is refused by name when the engine starts (``lora_layers``): other
tuners than LoRA, LoRA variants (DoRA, aLoRA, ...), LoRA on other layers than ``nn.Linear``, merged
adapters, ``modules_to_save`` and trainable tokens.

``peft`` is imported only where the caller's model may hold its layers: if it was never imported,
there are none.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator

import torch

from ...attention.step import StepMetadata
from . import lora_kernels, lora_rows
from .marks import ModelMarks, marks_for

BASE = "__base__"  # PEFT's name of "no adapter" in generate(adapter_names=)
# transformers' tensor-parallel styles whose LoRA layers PEFT shards (and we run): their output is this rank's
# slice of the features (colwise) or the all-reduced sum (rowwise), as the base layer's
TP_STYLES = ("colwise", "rowwise")

# What a row group is: an adapter's name and its rows of the packed step (a slice where they are one run).
Rows = slice | torch.Tensor


def _peft_loaded() -> bool:
    return "peft" in sys.modules


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model a ``PeftModel`` wraps (whose LoRA layers the engine runs), else ``model`` itself. A
    ``PeftModel`` of another kind of adapter than LoRA raises NotImplementedError naming it."""
    if not _peft_loaded():
        return model
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return model
    for name, config in model.peft_config.items():
        if config.peft_type != "LORA":  # PeftType is a str enum
            raise NotImplementedError(
                f"adapter {name!r} is a PEFT {config.peft_type} adapter: the paged engine runs LoRA adapters only"
            )
    return model.get_base_model()


def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s LoRA layers, each checked (NotImplementedError naming what the engine can't run)."""
    if not _peft_loaded():
        return []
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, AuxiliaryTrainingWrapper):
            raise NotImplementedError(
                f"{name} is a PEFT {kind} (modules_to_save or trainable_token_indices), which the paged engine's "
                "LoRA does not support: save the adapter without modules_to_save"
            )
        if isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLayer):
            raise NotImplementedError(f"{name} is a PEFT {kind} layer: the paged engine runs LoRA adapters only")
        if not isinstance(module, LoraLayer):
            continue
        if type(module) is not LoraLinear:
            raise NotImplementedError(
                f"{name} is a PEFT {type(module).__module__}.{kind}: the paged engine runs LoRA on nn.Linear only"
            )
        if module.merged:
            raise NotImplementedError(
                f"{name} has merged adapter(s) {module.merged_adapters}: unmerge_adapter() first, or "
                "merge_and_unload() and serve the merged model without adapters"
            )
        plan = getattr(module.get_base_layer(), "_hf_tp_plan", None)
        if getattr(module.get_base_layer(), "_hf_device_mesh", None) is not None and plan not in TP_STYLES:
            raise NotImplementedError(
                f"{name} is sharded with tp_plan {plan!r}: LoRA on a tensor-parallel model runs on layers of "
                f"the {' and '.join(TP_STYLES)} styles only"
            )
        for adapter, variant in module.lora_variant.items():
            raise NotImplementedError(
                f"adapter {adapter!r} is a LoRA variant ({type(variant).__name__}: DoRA, aLoRA, ...) at {name}, "
                "which the paged engine does not support: plain LoRA only"
            )
        layers.append(module)
    return layers


def load_adapter(model: torch.nn.Module, peft_model: torch.nn.Module | None, name: str, path: str) -> torch.nn.Module:
    """Load the PEFT LoRA adapter at ``path`` into ``model`` as ``name``: through ``peft_model`` (its
    ``PeftModel``), or a new ``PeftModel`` over ``model`` if it has none yet, which is returned. An adapter
    the engine can't run (``lora_layers``) is deleted again and its NotImplementedError raised."""
    from peft import PeftModel

    if peft_model is None:
        peft_model = PeftModel.from_pretrained(model, path, adapter_name=name)
    else:
        peft_model.load_adapter(path, adapter_name=name)
    peft_model.eval()
    try:
        lora_layers(model)
    except NotImplementedError:
        peft_model.delete_adapter(name)
        raise
    return peft_model


class LoraRouter:
    """The LoRA layers of one model and the row groups of the step running now (``step``)."""

    def __init__(self) -> None:
        self.layers: list[torch.nn.Module] = []
        self.groups: list[tuple[str, Rows]] | None = None  # None: no engine step is running
        # While the compiled forward traces: its ``adapter_index`` input [1, N] (``lora_rows.py``); else None.
        self.index: torch.Tensor | None = None
        self.kernels = lora_kernels.LoraKernels(lambda: self.adapters)  # the Triton path's stacks and step grouping

    @property
    def adapters(self) -> set[str]:
        """Every adapter some LoRA layer holds."""
        return {name for layer in self.layers for name in layer.lora_A.keys()}

    @property
    def slots(self) -> dict[str, int]:
        """Each adapter's number in the compiled forward's ``adapter_index`` (``lora_rows.adapter_slots``)."""
        return lora_rows.adapter_slots(self.adapters)

    @contextlib.contextmanager
    def step(self, step: StepMetadata) -> Iterator[None]:
        """The LoRA layers run ``step``'s row groups until the context ends."""
        self.groups = row_groups(step)
        self.kernels.new_step()
        try:
            yield
        finally:
            self.groups = None


def attach(model: torch.nn.Module, marks: ModelMarks) -> LoraRouter | None:
    """The router of ``model``'s LoRA layers, their forwards among its marks (installed while the marks
    are open), or None if it has none. A later engine on the same model gets the same router and forwards."""
    layers = lora_layers(model)
    if not layers:
        return None
    found = (marks.get(layer, "forward") for layer in layers)
    router = next((f.args[0] for f in found if isinstance(f, functools.partial) and f.func is _forward), None)
    router = router or LoraRouter()
    router.layers = layers
    for layer in layers:
        if marks.get(layer, "forward") is None:
            marks.put(layer, "forward", functools.partial(_forward, router, layer))
    return router


def attached(model: torch.nn.Module) -> LoraRouter | None:
    """The router an engine attached to ``model``'s LoRA layers (``attach``), or None."""
    marks = marks_for(model)
    for layer in lora_layers(model):
        found = marks.get(layer, "forward")
        if isinstance(found, functools.partial) and found.func is _forward:
            return found.args[0]
    return None


def row_groups(step: StepMetadata) -> list[tuple[str, Rows]]:
    """Each adapter present in ``step`` with its rows of the packed batch: the requests' token ranges
    (``cu_seq_lens_q``), joined; a slice where they are one run, else an index tensor."""
    if not step.adapters:
        return []
    bounds = step.cu_seq_lens_q.tolist()
    ranges: dict[str, list[tuple[int, int]]] = {}
    for i, adapter in enumerate(step.adapters):
        if adapter is None:
            continue
        runs = ranges.setdefault(adapter, [])
        if runs and runs[-1][1] == bounds[i]:  # next to the adapter's last request: one run
            runs[-1] = (runs[-1][0], bounds[i + 1])
        else:
            runs.append((bounds[i], bounds[i + 1]))
    device = step.input_ids.device
    groups: list[tuple[str, Rows]] = []
    for adapter, runs in ranges.items():
        if len(runs) == 1:
            groups.append((adapter, slice(*runs[0])))
        else:
            groups.append((adapter, torch.cat([torch.arange(a, b) for a, b in runs]).to(device)))
    return groups


def _forward(router: LoraRouter, layer: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA layer's forward inside the engine: the base layer, plus each adapter's ``scaling * B(A(x))``
    on its rows. Outside an engine step (a caller's own forward while an engine is open) PEFT's. While the
    compiled forward traces it, the graph's form, whose rows' adapters are a graph input (``lora_rows.py``)."""
    if torch.compiler.is_compiling() and router.index is not None:
        return lora_rows.masked_forward(layer, router.slots, router.index, x, *args, **kwargs)
    groups = router.groups
    if groups is None:
        return type(layer).forward(layer, x, *args, **kwargs)
    kwargs.pop("adapter_names", None)  # PEFT's generate(adapter_names=) hook: the step's rows carry their adapter
    result = layer.base_layer(x, *args, **kwargs)
    if not groups:
        return result
    flat_x = x.reshape(-1, x.shape[-1])  # [N, in]: the step's packed rows
    flat = result.view(-1, result.shape[-1])  # [N, out], a view: adding to it adds to result
    if lora_kernels.use_triton(flat_x.device) and lora_kernels.suits(layer, flat_x.device):
        router.kernels.add(layer, groups, flat_x, flat)
        return result
    for adapter, rows in groups:
        if adapter not in layer.lora_A:  # the adapter does not target this module
            continue
        lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
        # [rows, out] (a tensor-parallel rank: its slice of out where the base is column-parallel; see the docstring)
        delta = lora_b(lora_a(flat_x[rows].to(lora_a.weight.dtype))) * layer.scaling[adapter]
        if isinstance(rows, slice):
            flat[rows] += delta.to(flat.dtype)
        else:
            flat.index_add_(0, rows, delta.to(flat.dtype))
    return result


def generate_adapters(model: torch.nn.Module, num_rows: int, num_beams: int = 1) -> list[str | None] | None:
    """The adapter of each row of a ``generate`` batch on ``model``: those of PEFT's
    ``generate(adapter_names=)`` (the hook PEFT puts on every LoRA layer for the call, ``"__base__"``
    meaning none), else the active adapter (``set_adapter``; none inside ``disable_adapter()``). None
    when the model has no LoRA layer."""
    if not _peft_loaded():
        return None
    from peft.tuners.lora import LoraLayer

    layer = next((m for m in model.modules() if isinstance(m, LoraLayer)), None)
    if layer is None:
        return None
    names = _hooked_adapter_names(layer)
    if names is not None:
        names = list(names)
        if num_beams > 1 and len(names) == num_rows * num_beams:  # PEFT repeats each row's name per beam
            names = names[::num_beams]
        if len(names) != num_rows:
            raise ValueError(f"adapter_names has {len(names)} entries for a batch of {num_rows} rows")
        return [None if name == BASE else name for name in names]
    if layer.disable_adapters:
        return [None] * num_rows
    active = list(layer.active_adapters)
    if len(active) > 1:
        raise NotImplementedError(
            f"several active adapters at once ({active}) are not supported by the paged engine: set_adapter() one, "
            "or pass generate(adapter_names=[...]) per row"
        )
    return [active[0] if active else None] * num_rows


def _hooked_adapter_names(layer: torch.nn.Module) -> list[str] | None:
    """The ``adapter_names`` of PEFT's forward pre-hook on ``layer``, if a ``generate(adapter_names=)`` put one."""
    for hook in layer._forward_pre_hooks.values():
        func = getattr(hook, "func", None)
        if isinstance(hook, functools.partial) and getattr(func, "__name__", "") == "_adapter_names_pre_forward_hook":
            return hook.keywords.get("adapter_names")
    return None
